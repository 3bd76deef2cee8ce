/* The C API from C: every call, exact figures on a simulated device, and the
 * errors bad input gets. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reservoir/reservoir.h"

static int failures = 0;
#define CHECK(cond)                                                    \
  do {                                                                 \
    if (!(cond)) {                                                     \
      fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, #cond, \
              reservoir_last_error());                                 \
      ++failures;                                                      \
    }                                                                  \
  } while (0)

static int64_t stat_of(reservoir_allocator* a, const char* key) {
  int64_t v = -1;
  CHECK(reservoir_stat(a, key, &v) == RESERVOIR_OK);
  return v;
}

int main(void) {
  reservoir_device* dev = NULL;
  reservoir_allocator* a = NULL;
  CHECK(reservoir_device_open("sim", 0, (size_t)64 << 20, &dev) == RESERVOIR_OK);
  CHECK(reservoir_allocator_create(dev, "max_split_size_mb:32", 0, &a) == RESERVOIR_OK);

  char* text = NULL;
  CHECK(reservoir_get_config(a, &text) == RESERVOIR_OK);
  CHECK(strcmp(text, "max_split_size_mb:32") == 0);
  reservoir_string_free(text);

  /* Allocation, stats, free. */
  void* p = NULL;
  void* q = NULL;
  CHECK(reservoir_malloc(a, 1000, 0, &p) == RESERVOIR_OK && p != NULL);
  CHECK(reservoir_malloc(a, (size_t)30 << 20, 1, &q) == RESERVOIR_OK && q != NULL);
  CHECK(stat_of(a, "allocated_bytes.all.current") == 1024 + (30 << 20));
  CHECK(stat_of(a, "reserved_bytes.all.current") == (2 << 20) + (30 << 20));
  CHECK(stat_of(a, "requested_bytes.small_pool.current") == 1000);
  CHECK(stat_of(a, "segment.all.current") == 2);
  CHECK(reservoir_record_stream(a, q, 2) == RESERVOIR_OK);
  CHECK(reservoir_free(a, q) == RESERVOIR_OK);
  CHECK(reservoir_malloc(a, 0, 0, &q) == RESERVOIR_OK && q == NULL);
  CHECK(reservoir_free(a, NULL) == RESERVOIR_OK);

  /* Errors: a pointer not ours, a double free, a bad key, a bad config, out of memory. */
  CHECK(reservoir_free(a, (char*)p + 512) == RESERVOIR_ERROR_INVALID_POINTER);
  CHECK(strstr(reservoir_last_error(), "deallocate") != NULL);
  CHECK(reservoir_free(a, p) == RESERVOIR_OK);
  CHECK(reservoir_free(a, p) == RESERVOIR_ERROR_INVALID_POINTER);
  int64_t v = 0;
  CHECK(reservoir_stat(a, "allocated_bytes.everything", &v) == RESERVOIR_ERROR_INVALID_ARGUMENT);
  CHECK(strcmp(reservoir_last_error(),
               "reservoir_stat: no stat 'allocated_bytes.everything' (keys as "
               "torch.cuda.memory_stats)") == 0);
  CHECK(reservoir_set_config(a, "max_split_size_mb:abc") == RESERVOIR_ERROR_CONFIG);
  CHECK(strstr(reservoir_last_error(), "max_split_size_mb") != NULL);
  CHECK(reservoir_malloc(a, (size_t)1 << 30, 0, &q) == RESERVOIR_ERROR_OUT_OF_MEMORY && q == NULL);
  CHECK(strstr(reservoir_last_error(), "out of memory") != NULL ||
        strstr(reservoir_last_error(), "Tried to allocate") != NULL);
  CHECK(stat_of(a, "num_ooms") == 1);
  CHECK(reservoir_malloc(NULL, 1, 0, &q) == RESERVOIR_ERROR_INVALID_ARGUMENT);
  CHECK(strcmp(reservoir_last_error(), "reservoir_malloc: allocator and out must not be NULL") == 0);
  reservoir_device* nodev = NULL;
  CHECK(reservoir_device_open("tpu", 0, 0, &nodev) == RESERVOIR_ERROR_USAGE && nodev == NULL);
  CHECK(strcmp(reservoir_last_error(),
               "reservoir_device_open: unknown device kind 'tpu' (sim, host, cuda-runtime, cuda-vmm)") == 0);
  CHECK(reservoir_pop_annotation() == RESERVOIR_ERROR_USAGE);

  /* Summary, stats JSON, history, snapshots. */
  CHECK(reservoir_record_history(a, 1, 1000, 0) == RESERVOIR_OK);
  CHECK(reservoir_push_annotation("phase") == RESERVOIR_OK);
  CHECK(reservoir_malloc(a, 4096, 0, &p) == RESERVOIR_OK);
  CHECK(reservoir_pop_annotation() == RESERVOIR_OK);
  CHECK(reservoir_memory_summary(a, 1, &text) == RESERVOIR_OK);
  CHECK(strstr(text, "PyTorch CUDA memory summary, device ID 0") != NULL);
  reservoir_string_free(text);
  CHECK(reservoir_stats_json(a, &text) == RESERVOIR_OK);
  CHECK(strstr(text, "\"allocated_bytes.all.current\":4096") != NULL);
  reservoir_string_free(text);
  size_t size = 0;
  CHECK(reservoir_snapshot_pickle(a, &text, &size) == RESERVOIR_OK);
  CHECK(size > 100 && (unsigned char)text[0] == 0x80 && text[1] == 4 && text[size - 1] == '.');
  reservoir_string_free(text);
  CHECK(reservoir_snapshot_json(a, &text) == RESERVOIR_OK);
  CHECK(strstr(text, "\"annotations\": [\n    \"phase\"\n   ]") != NULL);
  CHECK(strstr(text, "\"action\": \"alloc\"") != NULL);
  reservoir_string_free(text);
  CHECK(reservoir_free(a, p) == RESERVOIR_OK);
  CHECK(reservoir_empty_cache(a) == RESERVOIR_OK);
  CHECK(stat_of(a, "reserved_bytes.all.current") == 0);
  CHECK(reservoir_reset_peak_stats(a) == RESERVOIR_OK);
  CHECK(reservoir_reset_accumulated_stats(a) == RESERVOIR_OK);
  CHECK(stat_of(a, "reserved_bytes.all.peak") == 0);
  CHECK(reservoir_set_memory_fraction(a, 1.5) != RESERVOIR_OK);

  reservoir_allocator_destroy(a);
  reservoir_device_close(dev);
  CHECK(strcmp(reservoir_status_name(RESERVOIR_ERROR_CONFIG), "config error") == 0);

  /* Pause and resume on real host memory. */
  reservoir_device* host = NULL;
  CHECK(reservoir_device_open("host", 0, 0, &host) == RESERVOIR_OK);
  reservoir_saver* saver = NULL;
  CHECK(reservoir_saver_create(host, "expandable_segments:True", "disk", &saver) ==
        RESERVOIR_ERROR_INVALID_ARGUMENT);
  CHECK(strcmp(reservoir_last_error(), "reservoir_saver_create: storage 'disk' is not pinned or mmap") == 0);
  CHECK(reservoir_saver_create(host, "expandable_segments:True", NULL, &saver) == RESERVOIR_OK);
  uint64_t token = 0;
  CHECK(reservoir_saver_region_push(saver, "weights", 1, &token) == RESERVOIR_OK);
  void* w = NULL;
  CHECK(reservoir_saver_malloc(saver, 3u << 20, 0, &w) == RESERVOIR_OK);
  CHECK(reservoir_saver_region_pop(saver, token) == RESERVOIR_OK);
  for (size_t i = 0; i < (3u << 20); ++i) ((unsigned char*)w)[i] = (unsigned char)(i * 5);
  CHECK(reservoir_saver_pause(saver, "weights") == RESERVOIR_OK);
  int paused = 0;
  CHECK(reservoir_saver_is_paused(saver, "weights", &paused) == RESERVOIR_OK && paused == 1);
  CHECK(reservoir_saver_pause(saver, "weights") == RESERVOIR_ERROR_USAGE);
  CHECK(strcmp(reservoir_last_error(), "pause: tag 'weights' is paused already") == 0);
  CHECK(reservoir_saver_resume(saver, "kv") == RESERVOIR_ERROR_USAGE);
  CHECK(strcmp(reservoir_last_error(), "resume: unknown tag 'kv' (known tags: 'weights')") == 0);
  CHECK(reservoir_saver_region_push(saver, "weights", 1, &token) == RESERVOIR_OK);
  void* refused = NULL;
  CHECK(reservoir_saver_malloc(saver, 100, 0, &refused) == RESERVOIR_ERROR_USAGE && refused == NULL);
  CHECK(reservoir_saver_region_pop(saver, token) == RESERVOIR_OK);
  CHECK(reservoir_saver_tags_json(saver, &text) == RESERVOIR_OK);
  CHECK(strstr(text, "\"paused\":true") != NULL && strstr(text, "\"physical_bytes\":0") != NULL);
  CHECK(strstr(text, "\"pauses\":1") != NULL && strstr(text, "\"last_released_bytes\":") != NULL);
  reservoir_string_free(text);
  CHECK(reservoir_saver_resume(saver, NULL) == RESERVOIR_OK);
  int same = 1;
  for (size_t i = 0; i < (3u << 20); ++i) same &= ((unsigned char*)w)[i] == (unsigned char)(i * 5);
  CHECK(same);
  /* What a pause keeps, chosen at the pause. */
  CHECK(reservoir_saver_pause_keeping(saver, "weights", "sideways") == RESERVOIR_ERROR_INVALID_ARGUMENT);
  CHECK(strcmp(reservoir_last_error(), "reservoir_saver_pause_keeping: contents: 'sideways' is not a way to "
                                       "pause (as_regions, discard or zero)") == 0);
  CHECK(reservoir_saver_is_paused(saver, "weights", &paused) == RESERVOIR_OK && paused == 0);
  CHECK(reservoir_saver_pause_keeping(saver, NULL, "zero") == RESERVOIR_ERROR_INVALID_ARGUMENT);
  CHECK(strcmp(reservoir_last_error(), "reservoir_saver_pause_keeping: saver and tag must not be NULL") == 0);
  CHECK(reservoir_saver_pause_keeping(saver, "weights", "zero") == RESERVOIR_OK);
  CHECK(reservoir_saver_tags_json(saver, &text) == RESERVOIR_OK);
  CHECK(strstr(text, "\"paused\":true") != NULL && strstr(text, "\"backup_bytes\":0") != NULL);
  reservoir_string_free(text);
  CHECK(reservoir_saver_resume(saver, "weights") == RESERVOIR_OK);
  int zero = 1;
  for (size_t i = 0; i < (3u << 20); ++i) zero &= ((unsigned char*)w)[i] == 0;
  CHECK(zero);
  for (size_t i = 0; i < (3u << 20); ++i) ((unsigned char*)w)[i] = (unsigned char)(i * 7);
  CHECK(reservoir_saver_pause_keeping(saver, "weights", "discard") == RESERVOIR_OK);
  CHECK(reservoir_saver_resume(saver, "weights") == RESERVOIR_OK);
  for (size_t i = 0; i < (3u << 20); ++i) ((unsigned char*)w)[i] = (unsigned char)(i * 3);
  CHECK(reservoir_saver_pause_keeping(saver, "weights", NULL) == RESERVOIR_OK); /* its region's backup */
  CHECK(reservoir_saver_pause_keeping(saver, "weights", "as_regions") == RESERVOIR_ERROR_USAGE);
  CHECK(strcmp(reservoir_last_error(), "pause: tag 'weights' is paused already") == 0);
  CHECK(reservoir_saver_resume(saver, "weights") == RESERVOIR_OK);
  same = 1;
  for (size_t i = 0; i < (3u << 20); ++i) same &= ((unsigned char*)w)[i] == (unsigned char)(i * 3);
  CHECK(same);
  CHECK(reservoir_saver_pause_keeping(saver, "weights", "as_regions") == RESERVOIR_OK);
  CHECK(reservoir_saver_resume(saver, "weights") == RESERVOIR_OK);
  same = 1;
  for (size_t i = 0; i < (3u << 20); ++i) same &= ((unsigned char*)w)[i] == (unsigned char)(i * 3);
  CHECK(same);
  CHECK(reservoir_saver_free(saver, w) == RESERVOIR_OK);
  CHECK(reservoir_saver_free(saver, w) == RESERVOIR_ERROR_INVALID_POINTER);
  reservoir_saver_destroy(saver);
  reservoir_device_close(host);
  if (failures != 0) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  puts("C API: all checks passed");
  return 0;
}
