// Saver::Impl: the saver's state and members (reservoir/saver.hpp), spread
// over saver_impl.cpp (regions, allocation, observation), pause_resume.cpp
// and saver.cpp (the public class).
//
// Each tag (a name and a cpu_backup flag) is a TagState: a CachingAllocator on
// a TagDevice. The state's shared mutex is held shared by allocations and
// frees into the tag, exclusively by pause and resume, so those never run
// beside the tag's allocator. While paused, frees are checked against the
// blocks that were live at pause and queued; resume applies them.
#pragma once

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "backup.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/detail/shared_spin_mutex.hpp"
#include "reservoir/detail/thread_safety.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "reservoir/saver.hpp"
#include "tag_device.hpp"

namespace reservoir {

namespace detail {

// One tag: its device, its allocator and its pause state.
struct TagState {
  TagState(std::string name, bool backup, BackupStorage backup_storage, Device& base,
           RangeIndex& index, const std::atomic<std::size_t>* margin, const AllocatorConfig& config,
           int device_index)
      : tag(std::move(name)),
        cpu_backup(backup),
        storage(backup_storage),
        device(base, index, this, margin),
        allocator(device, config, device_index) {}

  const std::string tag;
  const bool cpu_backup;
  const BackupStorage storage;  // where the backup goes (cpu_backup only)
  TagDevice device;
  CachingAllocator allocator;
  // Shared: allocations and frees; exclusive: pause and resume.
  mutable detail::SharedSpinMutex mutex;
  bool paused RESERVOIR_GUARDED_BY(mutex) = false;
  // While paused: the blocks live at pause that
  // were not freed since, and the frees to apply on resume.
  detail::Mutex pending_mutex;
  std::unordered_set<DevicePtr> live_at_pause RESERVOIR_GUARDED_BY(pending_mutex);
  std::vector<void*> pending_frees RESERVOIR_GUARDED_BY(pending_mutex);
  // The backup taken at pause (cpu_backup only), kept after resume while
  // the saver retains backups.
  std::unique_ptr<HostStore> backup RESERVOIR_GUARDED_BY(mutex);
  std::vector<BackupPiece> pieces RESERVOIR_GUARDED_BY(mutex);
  // Paused with PauseContents::zero: `backup` is a store of zeros, no
  // backup of the contents (read_backup finds none), dropped on resume.
  bool zeroed RESERVOIR_GUARDED_BY(mutex) = false;
  PauseRecord record RESERVOIR_GUARDED_BY(mutex);
};

}  // namespace detail

class Saver::Impl {
 public:
  using TagState = detail::TagState;

  Impl(Device& device, SaverOptions options)
      : device_(device),
        options_(std::move(options)),
        tag_base_(options_.tag_device != nullptr ? *options_.tag_device : device),
        pinned_(options_.pinned_source != nullptr ? *options_.pinned_source : own_pinned_),
        host_cache_(pinned_, tag_base_),
        untagged_(device, options_.config, options_.device_index) {
    if (const char* v = std::getenv("RESERVOIR_VALIDATE");
        v != nullptr && *v != '\0' && std::string_view(v) != "0") {
      validate_each_call_.store(true, std::memory_order_relaxed);
    }
    retain_backup_.store(options_.retain_backup, std::memory_order_relaxed);
    {
      detail::LockGuard lock(disk_mutex_);
      disk_directory_ = options_.disk_directory;
    }
    if (options_.initial_region) {
      initial_state_ = &tag_state(options_.initial_region->tag, options_.initial_region->options);
    }
  }

  ~Impl() {
    tags_.clear();  // allocators first: they give their segments back
    for (StreamId s : streams_) {
      if (s != 0) (void)tag_base_.destroy_stream(s);
    }
  }

  // ---- regions ----
  TagState& tag_state(std::string_view tag, const RegionOptions& options);
  std::shared_ptr<CombinedStats> combined() const;
  std::uint64_t push(TagState* state);
  void pop(std::uint64_t token);
  TagState* current() const noexcept;
  // Names this saver in per-thread records (an address may be reused).
  const std::uint64_t id_ = next_id();
  // SaverOptions::initial_region's tag (null without one): where a thread
  // that opened no region allocates. Set once, in the constructor.
  TagState* initial_state_ = nullptr;
  static std::uint64_t next_id() noexcept;

  // ---- allocation ----
  void* allocate(std::size_t size, StreamId stream);
  TagState* owner_of(const void* ptr) const;
  void deallocate(void* ptr);
  void record_stream(void* ptr, StreamId stream);
  void empty_cache();
  void begin_allocate_to_pool(PoolId id, PoolFilter filter);
  void end_allocate_to_pool(PoolId id);
  void release_pool(PoolId id);
  void set_pool_allocator(PoolId id, std::shared_ptr<PoolSegmentAllocator> allocator);
  // Begins, in the tag's allocator, the routes whose filter passes `stream`
  // (a route begun outside the region).
  void route_into(TagState& state, StreamId stream);

  // ---- pause and resume ----
  std::vector<TagState*> all_tags() const;
  std::vector<TagState*> tags_named(std::string_view tag, const char* operation) const;
  static bool paused_now(TagState* state);
  const std::vector<StreamId>& copy_streams();
  void pause_tag(TagState& state, PauseContents contents = PauseContents::as_regions);
  void resume_tag(TagState& state);
  // resume_tag; when it runs out of memory, the other allocators' cached
  // memory goes back to the device (reclaim) and it tries once more.
  void resume_or_reclaim(TagState& state);
  // Empties the caches of the untagged allocator and of every running tag
  // but `except`; returns the bytes of segments released.
  std::int64_t reclaim(const TagState& except);
  void pause(std::string_view tag, PauseContents contents = PauseContents::as_regions);
  void resume(std::string_view tag);
  void pause_all();
  void resume_all();
  std::string disk_backup_dir() const {
    detail::LockGuard lock(disk_mutex_);
    return disk_directory_;
  }
  void set_retain_backup(bool on);
  bool read_backup(const void* ptr, std::size_t bytes, void* out) const;

  // ---- observation ----
  TagInfo info(TagState& state) const;
  void record_history(const HistoryOptions& options);
  void set_oom_explainer(const OomExplainer& explainer);
  Snapshot snapshot() const;

  // ---- validation mode: the saver's and every allocator's ----
  void set_validate_each_call(bool on);
  std::atomic<bool> validate_each_call_{false};

  // ---- private pools routed across the saver's allocators ----
  struct Route {
    PoolId id;
    PoolFilter filter;
    std::vector<CachingAllocator*> begun;  // tag allocators it was begun in
  };
  std::atomic<int> active_routes_{0};
  mutable detail::Mutex routes_mutex_;
  std::vector<Route> routes_ RESERVOIR_GUARDED_BY(routes_mutex_);
  // Per pool, the tags whose allocators hold a use of it (one per begin there).
  std::map<PoolId, std::vector<TagState*>> tag_pool_uses_ RESERVOIR_GUARDED_BY(routes_mutex_);
  // Pools over another allocator, given to each tag's allocator with the route.
  std::map<PoolId, std::shared_ptr<PoolSegmentAllocator>> pool_allocators_ RESERVOIR_GUARDED_BY(routes_mutex_);

  // ---- backup and margin settings ----
  std::atomic<bool> retain_backup_{false};
  std::atomic<std::size_t> memory_margin_{0};
  mutable detail::Mutex disk_mutex_;
  std::string disk_directory_ RESERVOIR_GUARDED_BY(disk_mutex_);

  // ---- state ----
  Device& device_;
  SaverOptions options_;
  Device& tag_base_;
  HostPinnedMemory own_pinned_;
  PinnedMemorySource& pinned_;
  HostCachingAllocator host_cache_;
  CachingAllocator untagged_;
  detail::RangeIndex index_;
  detail::Mutex streams_mutex_;
  std::vector<StreamId> streams_ RESERVOIR_GUARDED_BY(streams_mutex_);
  mutable detail::SharedMutex tags_mutex_;
  std::optional<HistoryOptions> history_ RESERVOIR_GUARDED_BY(tags_mutex_);
  OomExplainer oom_explainer_ RESERVOIR_GUARDED_BY(tags_mutex_);
  // Current values and peaks of all allocators together, from the first tag
  // on (before it the untagged allocator's are the saver's); guarded by
  // tags_mutex_.
  std::shared_ptr<CombinedStats> combined_ RESERVOIR_GUARDED_BY(tags_mutex_);
  // Declared last: destroyed first, while the index and the host cache live.
  // By tag, then backup (none first, then by storage).
  std::map<std::pair<std::string, int>, std::unique_ptr<TagState>> tags_
      RESERVOIR_GUARDED_BY(tags_mutex_);
};

}  // namespace reservoir
