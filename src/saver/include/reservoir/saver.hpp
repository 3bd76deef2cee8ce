// Saver: tagged regions of device memory whose physical memory can be
// released and restored at the same virtual addresses (pause and resume),
// with an optional backup of the contents in host memory.
//
//   reservoir::Saver saver(device);
//   {
//     auto weights = saver.region("weights", {.cpu_backup = true});
//     w = saver.allocate(bytes);          // served by the "weights" tag
//   }
//   saver.pause("weights");               // contents copied to host, memory released
//   saver.resume("weights");              // same addresses, same bytes
//
// Every tag has its own caching allocator (the saver's config, any policy:
// native, expandable, paging) on a view of the device that keeps every
// segment in reserved virtual address space, so tags never share segments or
// cached blocks, and pausing a tag releases all of its physical memory, its
// cached free blocks included. Allocations outside every region go to the
// untagged allocator on the device itself, exactly as a plain
// CachingAllocator would serve them.
//
// Regions are per thread and nest; untagged() opens a region that allocates
// outside every tag. A tag entered with cpu_backup and without it names two
// pools that pause and resume together.
//
// Thread safety: every member may be called from any thread. A tag's
// allocations and frees run concurrently with each other; pause and resume
// of that tag wait for them and they wait for pause and resume.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/config.hpp"
#include "reservoir/device.hpp"
#include "reservoir/history.hpp"
#include "reservoir/snapshot.hpp"
#include "reservoir/stats.hpp"

namespace reservoir {

class PinnedMemorySource;

enum class BackupStorage : std::uint8_t {
  // Pinned host buffers from a caching allocator, kept for the next pause
  // (fastest; the host memory stays with the process until trim_backup()).
  pinned,
  // A file mapping (in mmap_directory, or anonymous shared memory when it is
  // empty), staged through pinned buffers. After the copy the pages leave the
  // process (madvise DONTNEED: they live on in the page cache or the file),
  // and after resume the mapping is unmapped and the file deleted.
  mmap,
  // A file in the disk backup directory (SaverOptions::disk_directory,
  // Saver::set_disk_backup_dir), written through pinned staging and read
  // back on resume; pausing without a directory set is a UsageError. For
  // backups larger than host memory; the directory should be a real disk,
  // not tmpfs (whose pages are host memory).
  disk,
};

// "pinned", "mmap" or "disk"; parse_backup_storage throws UsageError naming
// `what` for anything else.
std::string_view to_string(BackupStorage storage) noexcept;
BackupStorage parse_backup_storage(std::string_view text, std::string_view what);

// What one pause keeps of a tag's contents, chosen at each pause (vLLM's
// sleep levels; the restore modes of TensorRT-LLM): what the tag's regions
// say (their cpu_backup: copied to host memory and back), nothing (discard:
// a resumed block holds whatever its new memory holds), or zeros (nothing
// copied: resume maps the memory and zeroes every allocation live at the
// pause, at the same speed a backup comes back).
enum class PauseContents : std::uint8_t { as_regions, discard, zero };

// "as_regions", "discard" or "zero"; parse_pause_contents throws UsageError
// naming `what` for anything else.
std::string_view to_string(PauseContents contents) noexcept;
PauseContents parse_pause_contents(std::string_view text, std::string_view what);

struct RegionOptions {
  // Copy the contents of the tag's live allocations to host memory on pause
  // and back on resume. Without it, pause discards them (a resumed block
  // holds whatever the new physical memory holds).
  bool cpu_backup = false;
  // Where the backup goes (cpu_backup only; UsageError without it): the
  // saver's SaverOptions::storage when unset. A tag entered with different
  // backups names one pool per backup; they pause and resume together.
  std::optional<BackupStorage> storage = std::nullopt;
};

struct SaverOptions {
  AllocatorConfig config{};  // the caller's (AllocatorConfig::from_env() where wanted)
  BackupStorage storage = BackupStorage::pinned;
  std::string mmap_directory;
  // Where BackupStorage::disk writes its files (created when missing).
  std::string disk_directory;
  // Keep a tag's backup after resume (Saver::set_retain_backup).
  bool retain_backup = false;
  // Copies are cut into pieces of at most chunk_bytes (a power of two of at
  // least 64 KiB), spread round robin over copy_streams streams (1..64;
  // stream 0 alone when the device cannot create streams).
  std::size_t chunk_bytes = std::size_t{32} << 20;
  int copy_streams = 4;
  // Where pinned buffers come from (not owned; default: page-aligned host
  // memory; give CudaPinnedMemory on a GPU).
  PinnedMemorySource* pinned_source = nullptr;
  // Device for tagged memory when the main device has no virtual memory
  // (not owned; default: the main device). Both must be the same GPU.
  Device* tag_device = nullptr;
  int device_index = 0;
  // Once a tag exists, stats() reports the peaks of the sum of every
  // allocator (CombinedStats: owned by one allocator at a time, claimed by
  // another when it takes its lock; see docs/pause_resume.md); false skips
  // that, and stats()'s peaks are then the sum of each allocator's peak, an
  // upper bound.
  bool exact_peaks = true;
  // A thread that opened no region of this saver allocates into this tag
  // (torch_memory_saver's TMS_INIT_ENABLE: every allocation is tagged from
  // the start); regions, untagged ones included, nest inside it as usual.
  // Created with the saver (UsageError then when it cannot be).
  struct InitialRegion {
    std::string tag = "default";
    RegionOptions options;
  };
  std::optional<InitialRegion> initial_region;
};

// The initial region torch_memory_saver's environment asks for, from the
// variables' values (null when unset): TMS_INIT_ENABLE (on: "1", "true",
// "yes", "on", any case), TMS_INIT_ENABLE_CPU_BACKUP (a backup in
// `backend`: TMS_INIT_CPU_BACKUP_BACKEND, "pinned" when unset, or "mmap"),
// TMS_INIT_ENABLE_DISK_BACKUP (a backup on disk). Null when not enabled;
// UsageError naming the variable for a value it cannot read.
std::optional<SaverOptions::InitialRegion> initial_region_from_tms_env(const char* enable,
                                                                       const char* cpu_backup,
                                                                       const char* disk_backup,
                                                                       const char* backend);

// The options the integrations (the interposer, the PyTorch plug-in) take
// from the environment, read here and nowhere else: RESERVOIR_BACKUP_STORAGE,
// RESERVOIR_BACKUP_DIR (mmap files), RESERVOIR_DISK_BACKUP_DIR, else
// TMS_DISK_BACKUP_DIR; torch_memory_saver's TMS_INIT_* (initial_region_from_tms_env)
// and TMS_DISK_BACKUP_CHUNK_MB (chunk_bytes: the largest power of two of at
// most that many MiB). UsageError naming the variable for a bad value.
void read_saver_environment(SaverOptions& options);

// What a tag's pauses and resumes did: counts, and the last of each.
struct PauseRecord {
  std::uint64_t pauses = 0;
  std::uint64_t resumes = 0;
  double last_pause_seconds = 0;
  double last_resume_seconds = 0;
  std::size_t last_pause_copied = 0;    // bytes copied to the host
  std::size_t last_resume_copied = 0;   // bytes copied back
  std::size_t last_released_bytes = 0;  // physical bytes released by the last pause
};

// What one tag holds now, and its pause record.
struct TagInfo : PauseRecord {
  std::string tag;
  bool cpu_backup = false;
  std::string backup_storage;  // "pinned", "mmap" or "disk"; "" without cpu_backup
  bool paused = false;
  std::size_t allocated_bytes = 0;  // live allocations (freed-while-paused ones included)
  std::size_t reserved_bytes = 0;   // segments, mapped or not
  std::size_t physical_bytes = 0;   // physical memory held now (0 while paused)
  std::size_t backup_bytes = 0;     // bytes held in host memory for this tag now
  std::size_t pending_frees = 0;    // blocks freed while paused, applied on resume

  // Visits every field as f(name, value), in this order: the one list the
  // C API's JSON and the Python module's dicts are made from.
  template <typename F>
  void for_each_field(F&& f) const {
    f("tag", tag);
    f("cpu_backup", cpu_backup);
    f("backup_storage", backup_storage);
    f("paused", paused);
    f("allocated_bytes", allocated_bytes);
    f("reserved_bytes", reserved_bytes);
    f("physical_bytes", physical_bytes);
    f("backup_bytes", backup_bytes);
    f("pending_frees", pending_frees);
    f("pauses", pauses);
    f("resumes", resumes);
    f("last_pause_seconds", last_pause_seconds);
    f("last_resume_seconds", last_resume_seconds);
    f("last_pause_copied", last_pause_copied);
    f("last_resume_copied", last_resume_copied);
    f("last_released_bytes", last_released_bytes);
  }
};

class Saver {
 public:
  // Throws UsageError for bad options (the message names the option).
  explicit Saver(Device& device, SaverOptions options = {});
  // Returns all memory to the device, paused tags included. Regions opened
  // with this saver must be closed before.
  ~Saver();
  Saver(const Saver&) = delete;
  Saver& operator=(const Saver&) = delete;

  // RAII scope of a region on the calling thread.
  class Region {
   public:
    Region(Region&& other) noexcept;
    Region& operator=(Region&&) = delete;
    Region(const Region&) = delete;
    ~Region();  // closes the region (regions close innermost first)

   private:
    friend class Saver;
    Region(Saver* saver, std::uint64_t token) : saver_(saver), token_(token) {}
    Saver* saver_;
    std::uint64_t token_;
  };
  // Throws UsageError for an empty tag, or when the tag's device has no
  // virtual memory.
  [[nodiscard]] Region region(std::string_view tag, RegionOptions options = {});
  [[nodiscard]] Region untagged();
  // The same as explicit calls (for bindings): push returns a token that
  // pop_region must get back, innermost first, else UsageError.
  std::uint64_t push_region(std::string_view tag, RegionOptions options = {});
  std::uint64_t push_untagged();
  void pop_region(std::uint64_t token);
  // The calling thread's current tag ("" outside every tag).
  std::string current_tag() const;

  // Served by the calling thread's current region. Throws UsageError when
  // that tag is paused, OutOfMemoryError or DeviceError as CachingAllocator.
  void* allocate(std::size_t size, StreamId stream = 0);
  // Frees into whichever allocator owns ptr. A block of a paused tag is
  // freed on resume. InvalidPointerError for unknown or already freed ptr.
  void deallocate(void* ptr);
  // True when ptr lies in a tag's memory (any tag, paused or running).
  bool tagged(const void* ptr) const;
  // The size of the live block starting at ptr, tagged or not (0: none).
  std::size_t block_size(const void* ptr) const;
  void record_stream(void* ptr, StreamId stream);
  // Private pools (PyTorch's MemPool and CUDA-graph pools), as
  // CachingAllocator's, for every allocator of the saver: a route begun
  // outside a region serves allocations outside regions from the untagged
  // allocator's pool `id`, and allocations its filter passes inside a
  // region from the same pool id in that tag, so that memory a graph
  // captures inside a region pauses and resumes with the tag. Ending the
  // route ends it everywhere; releasing the pool releases each allocator's
  // use of it. UsageError as CachingAllocator's.
  void begin_allocate_to_pool(PoolId id, PoolFilter filter);
  void end_allocate_to_pool(PoolId id);
  void release_pool(PoolId id);
  // PyTorch's MemPool(allocator=...), as CachingAllocator::set_pool_allocator,
  // for every allocator of the saver: inside a region too, the pool's
  // segments come from `allocator` (its memory is that allocator's: pausing
  // the tag keeps those segments, and their contents, where they are).
  void set_pool_allocator(PoolId id, std::shared_ptr<PoolSegmentAllocator> allocator);
  // Empties the cache of the untagged allocator and of every tag (of a paused
  // tag: its cached segments are given up and not restored on resume).
  void empty_cache();

  // Pauses one tag: synchronizes the device, copies live allocations to host
  // memory when the tag has cpu_backup, unmaps and releases all of its
  // physical memory. UsageError for an unknown or paused tag. DeviceError
  // when a copy or an unmap fails: the tag is left running, untouched.
  void pause(std::string_view tag);
  // The same, keeping of its contents what `contents` says, whatever its
  // regions asked for (a region without cpu_backup is never copied).
  void pause(std::string_view tag, PauseContents contents);
  // Pauses every running tag (none running: nothing to do).
  void pause();
  // Recreates and maps the tag's physical memory at the same addresses,
  // restores the backup, then applies the frees made while paused.
  // UsageError for an unknown or running tag. OutOfMemoryError or
  // DeviceError when it cannot: the tag stays paused with its backup.
  void resume(std::string_view tag);
  // Resumes every paused tag; on a failure the tags resumed before stay
  // resumed and the error names the tag that failed.
  void resume();
  bool is_paused(std::string_view tag) const;
  // Returns cached pinned backup buffers to the host.
  void trim_backup();

  // The directory BackupStorage::disk writes to from the next pause on
  // (created when missing; UsageError naming it when it cannot be).
  void set_disk_backup_dir(const std::string& path);
  std::string disk_backup_dir() const;
  // With retain on, a tag keeps its backup after resume (its host memory
  // stays held) so that read_backup still finds it; the next pause takes a
  // new one. Turning it off drops the backups of running tags.
  void set_retain_backup(bool on);
  bool retain_backup() const noexcept;
  // Tagged allocations that would leave less than `bytes` of device memory
  // free fail as out of memory (after the allocator's retry ladder), so a
  // co-located process keeps that margin. Resume is not limited. 0: off.
  void set_memory_margin(std::size_t bytes) noexcept;
  std::size_t memory_margin() const noexcept;
  // Copies the backed-up contents of [ptr, ptr + bytes) into `out`: the
  // bytes as they were at the tag's last pause. False when no backup holds
  // ptr (its tag is running without a retained backup, has no cpu_backup, or
  // ptr is not in a tag). UsageError when the range runs past the
  // allocation it starts in.
  bool read_backup(const void* ptr, std::size_t bytes, void* out) const;

  std::vector<TagInfo> tags() const;
  TagInfo tag_info(std::string_view tag) const;  // UsageError when unknown
  // Statistics of everything, or of one tag. stats() adds up every
  // allocator's; its peaks are the peaks of the sum (CombinedStats), not the
  // sum of the peaks, unless SaverOptions::exact_peaks is off. A tag opened
  // both with and without cpu_backup is two allocators: stats(tag) adds
  // their peaks.
  DeviceStats stats() const;
  DeviceStats stats(std::string_view tag) const;
  // Peaks fall to the current values, for every allocator and the sum.
  void reset_peak_stats();
  // Allocated and freed totals and the counters fall to zero.
  void reset_accumulated_stats();
  std::map<std::string, std::int64_t> stats_map() const;  // torch.cuda.memory_stats keys
  // The untagged allocator's summary, then each tag's with its state.
  std::string memory_summary(bool abbreviated = false) const;
  // History of every allocator, tags created later included (see
  // CachingAllocator::record_history; UsageError for bad options).
  void record_history(const HistoryOptions& options);
  // The explainer of every allocator's out-of-memory errors, tags created
  // later included (CachingAllocator::set_oom_explainer).
  void set_oom_explainer(const OomExplainer& explainer);
  // Segments of every allocator in address order, and the history of all of
  // them in time order; a tag's blocks and events carry the annotation
  // "reservoir.tag=<tag>" first in their context.
  Snapshot snapshot() const;

  CachingAllocator& untagged_allocator();
  // Checks every allocator's invariants and the saver's own bookkeeping.
  void validate() const;
  // Validation mode: every allocator validates after each call that changes
  // it (CachingAllocator::set_validate_each_call), and the saver after each
  // pause and resume, returned or thrown. On from construction when
  // RESERVOIR_VALIDATE is set (to anything but 0).
  void set_validate_each_call(bool on);

  class Impl;

 private:
  template <typename Call>
  void checked(Call&& call);

  std::unique_ptr<Impl> impl_;
};

}  // namespace reservoir
