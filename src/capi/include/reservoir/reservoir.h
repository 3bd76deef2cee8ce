/* reservoir's C API: devices, the caching allocator, its config, stats,
 * memory summary, history and snapshots.
 *
 * Every function returns a reservoir_status; on failure,
 * reservoir_last_error() gives the calling thread's message for it (what was
 * wrong and where, as the C++ exceptions say). Nothing here aborts on bad
 * input. Strings returned through `char**` are allocated by reservoir and
 * released with reservoir_string_free. Thread safety: as the C++ API (every
 * allocator call from any thread).
 */
#ifndef RESERVOIR_H
#define RESERVOIR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum reservoir_status {
  RESERVOIR_OK = 0,
  RESERVOIR_ERROR_OUT_OF_MEMORY = 1,    /* the retry ladder could not find memory */
  RESERVOIR_ERROR_INVALID_POINTER = 2,  /* not a live allocation of this allocator */
  RESERVOIR_ERROR_CONFIG = 3,           /* a malformed or unsupported config string */
  RESERVOIR_ERROR_USAGE = 4,            /* a call that makes no sense now */
  RESERVOIR_ERROR_DEVICE = 5,           /* a device call failed */
  RESERVOIR_ERROR_UNAVAILABLE = 6,      /* the backend cannot run here (no GPU, no driver) */
  RESERVOIR_ERROR_INVALID_ARGUMENT = 7, /* a null output pointer, an unknown name */
  RESERVOIR_ERROR_INTERNAL = 8          /* an invariant broke; please report */
} reservoir_status;

typedef struct reservoir_device reservoir_device;
typedef struct reservoir_allocator reservoir_allocator;

/* The calling thread's message for its last failed call ("" when none). */
const char* reservoir_last_error(void);
const char* reservoir_status_name(reservoir_status status);
void reservoir_string_free(char* s);

/* kind: "sim" (simulated, capacity bytes; 0 = 80 GiB), "host" (real host
 * memory, capacity bytes; 0 = 8 GiB), "cuda-runtime" or "cuda-vmm" (GPU
 * `index`; capacity ignored). */
reservoir_status reservoir_device_open(const char* kind, int index, size_t capacity,
                                       reservoir_device** out);
void reservoir_device_close(reservoir_device* device);

/* config: PYTORCH_CUDA_ALLOC_CONF syntax; NULL reads RESERVOIR_ALLOC_CONF,
 * then PYTORCH_CUDA_ALLOC_CONF. The device must outlive the allocator. */
reservoir_status reservoir_allocator_create(reservoir_device* device, const char* config,
                                            int device_index, reservoir_allocator** out);
void reservoir_allocator_destroy(reservoir_allocator* allocator);

/* size 0 gives NULL. */
reservoir_status reservoir_malloc(reservoir_allocator* a, size_t size, uint64_t stream, void** out);
/* NULL is a no-op. */
reservoir_status reservoir_free(reservoir_allocator* a, void* ptr);
reservoir_status reservoir_record_stream(reservoir_allocator* a, void* ptr, uint64_t stream);
reservoir_status reservoir_empty_cache(reservoir_allocator* a);
reservoir_status reservoir_set_memory_fraction(reservoir_allocator* a, double fraction);
reservoir_status reservoir_set_config(reservoir_allocator* a, const char* config);
/* The canonical config string ("" for the defaults). */
reservoir_status reservoir_get_config(reservoir_allocator* a, char** out);

/* One torch.cuda.memory_stats() key ("allocated_bytes.all.current", ...). */
reservoir_status reservoir_stat(reservoir_allocator* a, const char* key, int64_t* value);
/* Every key, as a JSON object. */
reservoir_status reservoir_stats_json(reservoir_allocator* a, char** out);
reservoir_status reservoir_reset_peak_stats(reservoir_allocator* a);
reservoir_status reservoir_reset_accumulated_stats(reservoir_allocator* a);
reservoir_status reservoir_memory_summary(reservoir_allocator* a, int abbreviated, char** out);

/* History (max_entries > 0; stacks: capture native stacks). */
reservoir_status reservoir_record_history(reservoir_allocator* a, int enabled, size_t max_entries,
                                          int stacks);
reservoir_status reservoir_push_annotation(const char* name);
reservoir_status reservoir_pop_annotation(void);

/* The snapshot as a PyTorch pickle (bytes, *size long; for memory_viz) or as
 * JSON (a string). */
reservoir_status reservoir_snapshot_pickle(reservoir_allocator* a, char** out, size_t* size);
reservoir_status reservoir_snapshot_json(reservoir_allocator* a, char** out);

/* ---- tagged memory: pause and resume (docs/pause_resume.md) ---- */
typedef struct reservoir_saver reservoir_saver;

/* config as for reservoir_allocator_create; storage "pinned" (NULL) or "mmap". */
reservoir_status reservoir_saver_create(reservoir_device* device, const char* config,
                                        const char* storage, reservoir_saver** out);
void reservoir_saver_destroy(reservoir_saver* saver);
/* Regions of the calling thread, closed innermost first. tag NULL opens a
 * region outside every tag. */
reservoir_status reservoir_saver_region_push(reservoir_saver* saver, const char* tag, int cpu_backup,
                                             uint64_t* token);
reservoir_status reservoir_saver_region_pop(reservoir_saver* saver, uint64_t token);
reservoir_status reservoir_saver_malloc(reservoir_saver* saver, size_t size, uint64_t stream,
                                        void** out);
reservoir_status reservoir_saver_free(reservoir_saver* saver, void* ptr);
/* tag NULL: every tag. */
reservoir_status reservoir_saver_pause(reservoir_saver* saver, const char* tag);
/* Pauses one tag keeping of its contents what `contents` says, whatever its
   regions asked for: "as_regions" (NULL: what reservoir_saver_pause keeps, a
   copy in host memory of what its regions' cpu_backup covers), "discard"
   (nothing: a resumed block holds whatever its new memory holds) or "zero"
   (nothing copied; resume maps the memory and zeroes every allocation live at
   the pause). An unknown name is RESERVOIR_ERROR_INVALID_ARGUMENT, with
   nothing paused; tag must not be NULL. */
reservoir_status reservoir_saver_pause_keeping(reservoir_saver* saver, const char* tag,
                                               const char* contents);
reservoir_status reservoir_saver_resume(reservoir_saver* saver, const char* tag);
reservoir_status reservoir_saver_is_paused(reservoir_saver* saver, const char* tag, int* paused);
/* Every tag's state as a JSON array of objects with TagInfo's fields
   (reservoir/saver.hpp), free with reservoir_string_free. */
reservoir_status reservoir_saver_tags_json(reservoir_saver* saver, char** out);

#ifdef __cplusplus
}
#endif

#endif /* RESERVOIR_H */
