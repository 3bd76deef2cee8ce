// CachingAllocator: one device's caching allocator.
//
// With the native policy (the default) it makes the decisions PyTorch's
// CUDACachingAllocator makes: 512-byte rounding (or power-of-two divisions),
// small (<= 1 MiB) and large pools, 2 MiB / 20 MiB / 2 MiB-multiple segments,
// best fit by (stream, size, address), the split rules, max_split_size_mb and
// max_non_split_rounding_mb, merging with free neighbours, the retry ladder
// (free-memory callbacks, garbage collection by block age, device allocation,
// release of oversize cached blocks, release of all cached blocks after
// synchronizing, retry, out-of-memory), memory fraction, record_stream with
// event-deferred frees, and private pools. A recorded PyTorch trace replayed on
// it makes the same device requests and gets the same addresses.
//
// Thread safety: every public member may be called from any thread; one mutex
// serializes them. Free-memory callbacks and out-of-memory observers run with
// that mutex released; trace trackers run with it held and must not call back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "reservoir/config.hpp"
#include "reservoir/device.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"
#include "reservoir/snapshot.hpp"
#include "reservoir/stats.hpp"

namespace reservoir {

// PyTorch's size constants.
inline constexpr std::size_t kMinBlockSize = 512;        // every size rounds to 512 bytes
inline constexpr std::size_t kSmallSize = 1048576;       // largest small request: 1 MiB
inline constexpr std::size_t kSmallBuffer = 2097152;     // small segments: 2 MiB
inline constexpr std::size_t kLargeBuffer = 20971520;    // 1..10 MiB requests share 20 MiB
inline constexpr std::size_t kMinLargeAlloc = 10485760;  // from 10 MiB, a segment of its own
inline constexpr std::size_t kRoundLarge = 2097152;      // large segments round to 2 MiB

// The address-space reservation of an expandable segment, for restore: its
// base, and the stream and pool (large or small) whose segment it is.
struct ExpandableReservation {
  DevicePtr base = 0;
  StreamId stream = 0;
  bool is_large = true;
};

// Called when an allocation is about to fail: (device, bytes tried, bytes
// allowed or device total, device free bytes).
using OomObserver = std::function<void(int, std::size_t, std::size_t, std::size_t)>;
// Asked, after the observers and with the allocator unlocked, why an
// allocation ran out of memory: what it returns is appended to the error's
// message on a line of its own ("" adds nothing). The allocator is whole
// and usable when it is called (snapshot(), stats()); an exception it throws
// is dropped, and the error is thrown as it was.
using OomExplainer = std::function<std::string(const OutOfMemoryError&)>;
// Asked to free memory before the allocator goes to the device; returns true
// when it freed something worth searching the cache again for.
using FreeMemoryCallback = std::function<bool()>;
using TraceTracker = std::function<void(const TraceEvent&)>;
// Chooses whether an allocation on this stream goes to a private pool.
using PoolFilter = std::function<bool(StreamId)>;

// Where a private pool's segments come from instead of the device: PyTorch's
// MemPool(allocator=...) (NCCL's ncclMemAlloc for registered user buffers, a
// program's own allocator). The pool's blocks are cached, split and merged
// as any pool's; only new segments and their release go through it. It is
// called with the allocator's lock held (as PyTorch's allocator calls a
// pool's allocator): it must not call this allocator back.
class PoolSegmentAllocator {
 public:
  virtual ~PoolSegmentAllocator() = default;
  // A segment of `size` bytes for a request on `stream`, or 0 when it has no
  // memory to give (the allocator's retry ladder follows, as after the
  // device's out-of-memory). Any other failure throws (DeviceError, or the
  // allocator's own error), leaving nothing allocated.
  virtual DevicePtr allocate(std::size_t size, StreamId stream) = 0;
  // Gives back a segment allocate() returned. Throws on failure; the
  // segment then stays the pool's.
  virtual void free(DevicePtr ptr, std::size_t size, StreamId stream) = 0;
};

// A private pool's layout, as PyTorch's CUDA graph trees checkpoint it
// (getCheckpointState): each of its segments (in address order) as its blocks
// in address order, each block allocated or free.
struct PoolCheckpoint {
  struct BlockState {
    DevicePtr ptr = 0;
    std::size_t size = 0;
    StreamId stream = 0;
    bool allocated = false;
    // False for address space with no memory behind it (an expandable
    // segment's unmapped pages: the end of its reservation).
    bool mapped = true;
  };
  struct SegmentState {
    std::vector<BlockState> blocks;
    bool is_small = false;
  };
  PoolId pool{0, 0};
  std::vector<SegmentState> segments;
};

// What restoring a checkpoint changed: the allocations it freed (every
// allocation the pool held, in address order) and the ones it made (the
// checkpoint's allocated blocks, in its order). A pointer may be in both.
struct PoolRestore {
  std::vector<DevicePtr> freed;
  std::vector<DevicePtr> allocated;
};

class CachingAllocator {
 public:
  // Throws ConfigError or UsageError for a configuration it cannot serve.
  // The configuration is the caller's: the environment is read where a
  // program meets reservoir (AllocatorConfig::from_env() in the C API, the
  // interposer, the PyTorch integration), never here.
  explicit CachingAllocator(Device& device, AllocatorConfig config = AllocatorConfig{},
                            int device_index = 0);
  // Returns every segment to the device, including ones with live blocks.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Returns memory usable on `stream`, or nullptr for size 0.
  // Throws OutOfMemoryError after the retry ladder, DeviceError on device failure.
  void* allocate(std::size_t size, StreamId stream = 0);
  // Returns a block to the cache (after the events of streams recorded with
  // record_stream complete). Throws InvalidPointerError for a pointer this
  // allocator does not hold (unknown, interior or already freed); nullptr is a no-op.
  void deallocate(void* ptr);
  // As deallocate, but returns false (and changes nothing) for a pointer this
  // allocator does not hold, without building an error.
  bool try_deallocate(void* ptr);
  // Marks the block as used on `stream`, so its memory is not reused before
  // the work queued there at deallocation completes.
  void record_stream(void* ptr, StreamId stream);
  // Returns to the cache the blocks freed after record_stream whose streams'
  // work has completed. Every allocation does this first; a replay that knows
  // when a completion was seen calls it then.
  void process_completed_frees();
  // Returns every unused cached segment to the device (after synchronizing
  // the events of pending frees).
  void empty_cache();
  // policy:native_paged: gives back the address space of cached segments
  // with no memory mapped (what empty_cache() does for them: no device
  // memory moves, so a recording shows nothing of it). Returns how many
  // went. verify replays it where a recording shows such a segment gone.
  std::size_t release_unmapped_segments();
  // Garbage collection with an explicit target: releases unsplit cached
  // large blocks at least as old as the average (in cache misses since they
  // were freed), in whole passes, until `bytes` or more are released or none
  // is left. The allocator runs it itself on a cache miss when a memory
  // fraction and garbage_collection_threshold are set.
  void collect_garbage(std::size_t bytes);
  // Limits the memory this allocator reserves to fraction * device total.
  void set_memory_fraction(double fraction);
  // No limit of the process's own: as before any set_memory_fraction (what
  // PyTorch's setMemoryFraction(1.0) does from 2.10: no "allowed" in the
  // out-of-memory message, no garbage collection by threshold).
  void clear_memory_fraction();

  // PyTorch 2.15's setExpandableSegmentReserveClassForStream: the expandable
  // segments made for `stream` from now on reserve what
  // expandable_segments_reserve_by_class gives `reserve_class` ("" clears it:
  // the stream takes expandable_segments_reserve, else 9/8 of the device).
  void set_stream_reserve_class(StreamId stream, const std::string& reserve_class);

  void set_config(const AllocatorConfig& config);
  AllocatorConfig config() const;
  int device_index() const noexcept;

  DeviceStats stats() const;
  // torch.cuda.memory_stats keys; from PyTorch 2.15's rules (pytorch_version)
  // also each private pool's reserved bytes, as that release reports them.
  std::map<std::string, std::int64_t> stats_map() const;
  // The bytes reserved in each private pool that ever held a segment: kept
  // after the pool is gone (current 0), reset with the other statistics.
  std::map<PoolId, StatArray> private_pool_reserved() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // From now on, publishes every change of this allocator's statistics into
  // `combined` (shared by allocators whose sum needs exact peaks, as a
  // Saver's do), after adding its current values, and with carry_peaks its
  // peaks. Once per allocator: UsageError if already combined or null.
  void combine_stats(std::shared_ptr<CombinedStats> combined, bool carry_peaks);
  std::string memory_summary(bool abbreviated = false) const;
  // Segments and blocks; with history on, also the recorded events and the
  // contexts of events and live blocks (and a snapshot event is recorded).
  Snapshot snapshot() const;
  // Size of the largest cached free block.
  std::size_t largest_cached_block() const;
  // The size of the live block starting at ptr (the request rounded as it
  // was allocated): what PyTorch's allocator reports to its profiler. 0 when
  // ptr starts no live allocation of this allocator.
  std::size_t block_size(const void* ptr) const;
  // Address and requested size of every live allocation, in address order
  // (what snapshot() reports as active_allocated, without building one).
  std::vector<std::pair<DevicePtr, std::size_t>> live_allocations() const;

  void attach_oom_observer(OomObserver observer);
  // The one explainer (reservoir/explain.hpp sets one); an empty function removes it.
  void set_oom_explainer(OomExplainer explainer);
  void add_free_memory_callback(FreeMemoryCallback callback);
  void attach_trace_tracker(TraceTracker tracker);
  // Records events in a ring buffer of the latest options.max_entries, with
  // their context (reservoir/history.hpp); snapshot() returns them. Takes
  // effect at once; enabled = false stops recording and drops the events.
  // Throws UsageError for max_entries 0 or max_frames above 64.
  void record_history(const HistoryOptions& options);

  // Private pools (PyTorch's MemPool / graph pools). While a route is active,
  // allocations whose stream passes `filter` are served from pool `id`.
  void begin_allocate_to_pool(PoolId id, PoolFilter filter);
  // Routes the calling thread's allocations (any stream) to pool `id`.
  void begin_allocate_current_thread_to_pool(PoolId id);
  void end_allocate_to_pool(PoolId id);
  // Drops one use of the pool; at zero its cached segments become releasable
  // (and its options below are forgotten).
  void release_pool(PoolId id);
  // PyTorch's emptyCache(pool): a released pool's cached segments go back to
  // the device now (after waiting for pending stream events); a pool still
  // in use, or one unknown, keeps what it has.
  void empty_pool_cache(PoolId id);
  // PyTorch's MemPool(use_on_oom=True): when the device cannot give an
  // allocation outside every private pool a new segment, a cached free block
  // of this pool (on the request's stream) serves it, before any cached
  // memory is freed; pools asked in the order they were marked.
  void set_pool_use_on_oom(PoolId id, bool use_on_oom);
  // PyTorch's MemPool(no_split=True): this pool's blocks are never split; a
  // request takes a whole block.
  void set_pool_no_split(PoolId id);
  // PyTorch's MemPool(allocator=...): pool `id`'s new segments come from
  // `allocator` (never from the policy's virtual memory, as under PyTorch),
  // and go back to it when released. Set before the pool's first segment;
  // each segment keeps its allocator alive until it is released, after the
  // pool and its last user are gone too. Throws UsageError for a null
  // allocator, or a pool that holds segments already.
  void set_pool_allocator(PoolId id, std::shared_ptr<PoolSegmentAllocator> allocator);

  // PyTorch's getCheckpointState: the layout of private pool `id`. Stream
  // uses freed earlier get their events first; throws UsageError for an
  // unknown or released pool, or a block whose stream events are pending
  // (synchronize first).
  PoolCheckpoint checkpoint_pool(PoolId id);
  // PyTorch's setCheckpointPoolState: frees every allocation of the pool,
  // then lays each checkpointed segment out again (every block allocated,
  // then the checkpoint's free ones freed), with the statistics and history
  // PyTorch's allocator writes for it. The checkpoint is checked against the
  // pool first: a segment gone or reshaped, or a block that could not be
  // freed at once (pending stream uses), gives UsageError and changes nothing.
  PoolRestore restore_pool(const PoolCheckpoint& checkpoint);

  // Recreates a recorded layout in an empty allocator: each segment is asked
  // of the device (whose address source must give the recorded address), then
  // carved into the recorded blocks; active_allocated blocks become live
  // allocations with their requested sizes. With expandable segments on, the
  // layout's expandable segments (mapped ranges) are rebuilt inside
  // `reservations` (whose address space the device must give at their bases):
  // each range's pages are mapped, then carved into its blocks. All or
  // nothing: throws UsageError (and holds nothing) if the allocator is not
  // empty or the layout is invalid.
  void restore(const Snapshot& layout, const std::vector<ExpandableReservation>& reservations = {});

  // Checks every invariant (blocks tile segments, free blocks in exactly one
  // pool, no two free neighbours, stats equal a recount, pointer map and
  // event queues consistent). Throws InvariantError naming the first breach.
  void validate() const;
  // Validation mode: validate() after every call that changes the allocator,
  // whether it returned or threw (the error then is the breach, if any).
  // Costs a walk of every block per call: for tests and debugging. On from
  // construction when RESERVOIR_VALIDATE is set (to anything but 0).
  void set_validate_each_call(bool on);
  // validate() runs so far (in validation mode or called directly).
  std::uint64_t validations() const noexcept;

  // The size a request is rounded to, and the device allocation a request of
  // that rounded size would make (PyTorch's round_size / get_allocation_size).
  static std::size_t round_size(std::size_t size, const AllocatorConfig& config);
  static std::size_t allocation_size(std::size_t rounded, const AllocatorConfig& config = {});

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace reservoir
