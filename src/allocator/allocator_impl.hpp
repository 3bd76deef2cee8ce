// The state and the private operations of CachingAllocator.
//
// Lock discipline: mutex_ guards every member below (GUARDED_BY), and the
// private operations expect it held (REQUIRES); clang's -Wthread-safety
// checks both at compile time. The entry points take it. The lock is dropped on purpose in two
// places, both marked "LOCK RELEASED": around free-memory callbacks (they may free memory through
// this allocator) and around out-of-memory observers.
#pragma once

#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "address_arena.hpp"
#include "block.hpp"
#include "event_history.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/detail/debug_assert.hpp"
#include "reservoir/detail/thread_safety.hpp"
#include "reservoir/errors.hpp"
#include "segment_source.hpp"
#include "spin_mutex.hpp"

namespace reservoir {

class CachingAllocator::Impl final : private CombinedStats::Member {
 public:
  Impl(Device& device, AllocatorConfig config, int device_index);
  ~Impl();

  // ---- entry points (take the lock) ----
  // allocate and deallocate: inlined into CachingAllocator's (native_policy.cpp).
  inline void* allocate(std::size_t size, StreamId stream);
  inline void deallocate(void* ptr);
  // deallocate for a held pointer; false (nothing changed) otherwise.
  inline bool deallocate_held(void* ptr);
  void record_stream(void* ptr, StreamId stream);
  void empty_cache();
  std::size_t release_unmapped_segments();
  void process_completed_frees();
  void collect_garbage(std::size_t bytes);
  void set_memory_fraction(double fraction);
  void set_stream_reserve_class(StreamId stream, const std::string& reserve_class);
  void clear_memory_fraction();
  void set_config(const AllocatorConfig& config);
  AllocatorConfig config() const;
  DeviceStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  void combine_stats(std::shared_ptr<CombinedStats> combined, bool carry_peaks);
  Snapshot snapshot() const;
  std::size_t largest_cached_block() const;
  std::size_t block_size(DevicePtr ptr) const;
  std::vector<std::pair<DevicePtr, std::size_t>> live_allocations() const;
  void attach_oom_observer(OomObserver observer);
  void set_oom_explainer(OomExplainer explainer);
  void add_free_memory_callback(FreeMemoryCallback callback);
  void attach_trace_tracker(TraceTracker tracker);
  void record_history(const HistoryOptions& options);
  void begin_allocate_to_pool(PoolId id, PoolFilter filter);
  void end_allocate_to_pool(PoolId id);
  void release_pool(PoolId id);
  void set_pool_use_on_oom(PoolId id, bool use_on_oom);
  void set_pool_no_split(PoolId id);
  void set_pool_allocator(PoolId id, std::shared_ptr<PoolSegmentAllocator> allocator);
  void empty_pool_cache(PoolId id);
  std::map<PoolId, StatArray> private_pool_reserved() const;
  PoolCheckpoint checkpoint_pool(PoolId id);
  PoolRestore restore_pool(const PoolCheckpoint& checkpoint);

  void validate() const;
  void restore(const Snapshot& layout, const std::vector<ExpandableReservation>& reservations);

  // Calls the entry point op; in validation mode, then validate(), also
  // when op threw. A member function, not a lambda: stacks captured for
  // history cut the allocator's frames by name, and a lambda's frame has
  // none where debug information is minimal.
  template <typename Op, typename... Args>
  auto checked(Op op, Args&&... args) -> decltype((this->*op)(std::forward<Args>(args)...)) {
    using Result = decltype((this->*op)(std::forward<Args>(args)...));
    if (!validate_each_call_.load(std::memory_order_relaxed)) {
      return (this->*op)(std::forward<Args>(args)...);
    }
    try {
      if constexpr (std::is_void_v<Result>) {
        (this->*op)(std::forward<Args>(args)...);
        validate();
      } else {
        Result result = (this->*op)(std::forward<Args>(args)...);
        validate();
        return result;
      }
    } catch (const InvariantError&) {
      throw;
    } catch (...) {
      validate();  // an error leaves the allocator consistent
      throw;
    }
  }
  std::atomic<bool> validate_each_call_{false};
  mutable std::atomic<std::uint64_t> validations_{0};

  const int device_index_;

  // Pure size rules, exposed for tests.
  static std::size_t round_size(std::size_t size, const AllocatorConfig& config);
  static std::size_t allocation_size(std::size_t size, const AllocatorConfig& config);

  // ---- segment sources (segment_source.hpp): what a policy may use of the core ----
  using AllocParams = detail::AllocParams;
  // The lock a source is called with.
  const auto& source_lock() const noexcept RESERVOIR_RETURN_CAPABILITY(mutex_) { return mutex_; }
  const AllocatorConfig& current_config() const noexcept RESERVOIR_REQUIRES(mutex_) {
    return config_;
  }
  // A classic segment of p.alloc_size bytes from the device, its head block
  // in p.block; false when the device is out of memory.
  bool new_segment(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // The same from the pool's own allocator (MemPool(allocator=...)).
  bool new_pool_segment(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // Gives a classic segment back to where it came from: the device, or its
  // pool's allocator. Throws DeviceError (or the pool allocator's error).
  void free_classic_segment(const detail::Segment& segment) RESERVOIR_REQUIRES(mutex_);
  // PyTorch's try_allocate_expandable_block: map pages until a free run of
  // p.size bytes exists in a VM segment of the source's kind; leaves it in
  // p.block. With `recycling` (paging under pressure), whole free handles
  // from elsewhere are mapped there before fresh memory is created.
  bool try_alloc_vm_block(AllocParams& p, bool recycling = false) RESERVOIR_REQUIRES(mutex_);
  // The free range of a VM segment of the source's kind that p grows into
  // (a new segment when none has room); nullptr when no address space is left.
  detail::Block* find_vm_candidate(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // Paging: unmaps whole free handles, largest first, until `bytes` are
  // released; leaves `keep` alone. Cached stitched blocks give their pages
  // back to the blocks that lent them first, which then merge with their
  // free neighbours; not when `keep` is a block about to be handed out
  // (`keep_served`), which must stay as it is. True when anything was released.
  bool release_free_handles(std::size_t bytes, const detail::Block* keep,
                            bool keep_served = false) RESERVOIR_REQUIRES(mutex_);
  // Paging's last resort: a new range mapped onto free pages of this
  // stream's segments (plus fresh memory for the rest).
  bool stitch_block(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // Reserved memory not allocated: cached blocks, and pages lent or pending.
  std::size_t cached_bytes() const RESERVOIR_REQUIRES(mutex_);
  // Reserved memory of the default pools (all but private pools').
  std::size_t default_reserved() const RESERVOIR_REQUIRES(mutex_);
  // What more may be mapped now: the device's free memory, within the memory fraction if set.
  std::size_t mapping_headroom() RESERVOIR_REQUIRES(mutex_);
  // native_paged: a classic segment of p.alloc_size bytes of address space,
  // no memory behind it yet, its head block in p.block, the pages p needs
  // mapped (back_block); false when the device has no memory for them.
  bool new_paged_segment(AllocParams& p) RESERVOIR_REQUIRES(mutex_);

 private:
  struct PendingEvent {
    EventId event;
    detail::Block* block;
  };

  // mutex_'s type. With combined statistics (combine_stats), taking it
  // first makes this allocator the owner of the sum (CombinedStats::claim),
  // so that every locked section may change its statistics.
  // Its own members are not analysed: they touch the statistics mutex_
  // guards, which the analysis cannot tie to *this.
  class RESERVOIR_CAPABILITY("mutex") ClaimingMutex {
   public:
    explicit ClaimingMutex(Impl& impl) noexcept : impl_(impl) {}
    void lock() noexcept RESERVOIR_ACQUIRE() {
      for (;;) {
        spin_.lock();
        if (owns_sum()) [[likely]]
          return;
        spin_.unlock();
        // Another member owns the sum: take it, then the lock.
        impl_.combined_.load(std::memory_order_relaxed)->claim(impl_);
      }
    }
    void unlock() noexcept RESERVOIR_RELEASE() { spin_.unlock(); }
    // The lock, owning the sum or not: for a look that may change nothing
    // (owns_sum() says whether a change may follow), and for CombinedStats.
    void lock_unclaimed() noexcept RESERVOIR_ACQUIRE() { spin_.lock(); }
    bool owns_sum() const noexcept {
      const CombinedStats* c = impl_.combined_.load(std::memory_order_relaxed);
      return c == nullptr || c->owned_by(impl_);
    }

   private:
    Impl& impl_;
    detail::SpinMutex spin_;
  };

  // ---- all below: mutex_ held (checked by clang's -Wthread-safety) ----
  // Every change of a Stat goes through these. A Stat's peak in stats_ is
  // the value whose crossing needs a look (peak_crossed): its own peak, or
  // with combined statistics the lower of that and the sum's threshold.
  void add_stat(Stat& s, std::uint64_t amount) noexcept RESERVOIR_REQUIRES(mutex_) {
    s.current += static_cast<std::int64_t>(amount);
    s.allocated += static_cast<std::int64_t>(amount);
    if (s.current > s.peak) [[unlikely]]
      peak_crossed(s, s.current);
  }
  void sub_stat(Stat& s, std::uint64_t amount) noexcept RESERVOIR_REQUIRES(mutex_) {
    s.decrease(amount);
  }
  // `trigger`, a Stat of stats_ (or an "all" entry, for the value `value`),
  // rose past its peak field.
  [[gnu::always_inline]] void peak_crossed(Stat& trigger, std::int64_t value) noexcept
      RESERVOIR_REQUIRES(mutex_) {
    if (combined_.load(std::memory_order_relaxed) == nullptr) [[likely]] {
      trigger.peak = value;
    } else {
      combined_peak_crossed(trigger, value);
    }
  }
  [[gnu::cold]] void combined_peak_crossed(Stat& trigger, std::int64_t value) noexcept
      RESERVOIR_REQUIRES(mutex_);
  // A change of one of the nine per-pool statistics in pool kind k
  // (stat_index). stats_ keeps their "all" entry ([0]) as a peak alone: its
  // current value and totals are small's plus large's, added up when read
  // (folded_stats), so a change costs one entry and one comparison.
  // Several changes of one direction may be given together:
  // add_stats(k, {{stats_.allocation, 1}, {...}}).
  struct StatChange {
    StatArray& stat;
    std::uint64_t amount;
  };
  template <std::size_t N>
  [[gnu::always_inline]] void add_stats(std::size_t k, const StatChange (&changes)[N]) noexcept
      RESERVOIR_REQUIRES(mutex_) {
    change_stats<true>(k, changes, std::make_index_sequence<N>{});
  }
  template <std::size_t N>
  [[gnu::always_inline]] void sub_stats(std::size_t k, const StatChange (&changes)[N]) noexcept
      RESERVOIR_REQUIRES(mutex_) {
    change_stats<false>(k, changes, std::make_index_sequence<N>{});
  }
  void add_stats(StatArray& a, std::size_t k, std::uint64_t amount) noexcept
      RESERVOIR_REQUIRES(mutex_) {
    add_stats(k, {{a, amount}});
  }
  void sub_stats(StatArray& a, std::size_t k, std::uint64_t amount) noexcept
      RESERVOIR_REQUIRES(mutex_) {
    sub_stats(k, {{a, amount}});
  }
  template <bool kUp, std::size_t N, std::size_t... I>
  [[gnu::always_inline]] void change_stats(std::size_t k, const StatChange (&changes)[N],
                                           std::index_sequence<I...>) noexcept
      RESERVOIR_REQUIRES(mutex_) {
    if constexpr (kUp) {
      (raise(changes[I].stat, k, changes[I].amount), ...);
    } else {
      (changes[I].stat[k].decrease(changes[I].amount), ...);
    }
  }
  // A rise leaves the total of increases ("allocated") alone: it is freed +
  // current - the current value at the last reset, worked out when read.
  [[gnu::always_inline]] void raise(StatArray& a, std::size_t k, std::uint64_t amount) noexcept
      RESERVOIR_REQUIRES(mutex_) {
    Stat& s = a[k];
    s.current += static_cast<std::int64_t>(amount);
    if (s.current > s.peak) [[unlikely]]
      peak_crossed(s, s.current);
    const std::int64_t all = a[1].current + a[2].current;
    if (all > a[0].peak) [[unlikely]]
      peak_crossed(a[0], all);
  }
  // stats_ as PyTorch reports it: the "all" entries added up, the totals of
  // increases worked out.
  DeviceStats folded_stats() const RESERVOIR_REQUIRES(mutex_);
  // The current value of a per-pool statistic over both pools.
  static std::int64_t all_current(const StatArray& a) noexcept {
    return a[1].current + a[2].current;
  }
  // The pool a request goes to: a private pool while one is routed to,
  // else the default small or large pool.
  detail::BlockPool& pool_for(std::size_t size, StreamId stream) RESERVOIR_REQUIRES(mutex_) {
    if (!routes_.empty()) [[unlikely]] {
      if (detail::BlockPool* routed = routed_pool(size, stream)) return *routed;
    }
    // A policy without a small pool (paging) keeps one arena per stream:
    // small requests share pages with large ones.
    return size <= kSmallSize && traits_.small_pool ? small_ : large_;
  }
  // pool_for for a new request: while a route is open, the blocks a
  // capture has made safe to reuse on this stream are freed first
  // (graph_capture_record_stream_reuse), on the branch routes already take.
  detail::BlockPool& request_pool(std::size_t size, StreamId stream) RESERVOIR_REQUIRES(mutex_) {
    if (!routes_.empty()) [[unlikely]] {
      if (config_.graph_capture_record_stream_reuse) reuse_freed_in_capture(stream);
      if (detail::BlockPool* routed = routed_pool(size, stream)) return *routed;
    }
    return size <= kSmallSize && traits_.small_pool ? small_ : large_;
  }
  // The private pool a route sends the request to, or nullptr.
  detail::BlockPool* routed_pool(std::size_t size, StreamId stream) RESERVOIR_REQUIRES(mutex_);
  // Rounds a request as round_size does, without looking up divisions when
  // roundup_power2_divisions is not set.
  std::size_t rounded(std::size_t size) const noexcept RESERVOIR_REQUIRES(mutex_) {
    return uses_divisions_ ? round_size(size, config_) : round_to_block(size);
  }
  // round_size without divisions: a multiple of kMinBlockSize, at least one.
  static std::size_t round_to_block(std::size_t size) noexcept {
    return size < kMinBlockSize ? kMinBlockSize
                                : kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
  }
  // The hot path's steps, defined (and inlined) in native_policy.cpp alone.
  inline bool get_free_block(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // The last resort before running out of memory: a free block of a
  // use_on_oom pool. False when none serves the request.
  bool borrow_from_use_on_oom_pools(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  bool alloc_block(AllocParams& p, bool is_retry) RESERVOIR_REQUIRES(mutex_);
  inline detail::Block* alloc_found_block(AllocParams& p, std::size_t requested)
      RESERVOIR_REQUIRES(mutex_);
  // The same, with the split decided by the caller (restore_pool), and the
  // stream the history records the request on when it is not the block's
  // (the caller's: a block lent by another stream's segment, native_paged's
  // rescue, keeps that stream). A constant null folds away where inlined.
  inline detail::Block* alloc_found_block(AllocParams& p, std::size_t requested, bool split,
                                          const StreamId* caller = nullptr) RESERVOIR_REQUIRES(mutex_);
  // The live pool `id` (UsageError naming `operation` otherwise).
  detail::PrivatePool& live_pool(PoolId id, const char* operation) RESERVOIR_REQUIRES(mutex_);
  // restore_pool's steps on the free path (native_policy.cpp): frees the
  // allocations at `ptrs` as deallocate does; allocates a segment's blocks as
  // the checkpoint lays them out, then frees the ones it has free.
  void free_allocations(const std::vector<DevicePtr>& ptrs) RESERVOIR_REQUIRES(mutex_);
  void lay_out_segment(detail::Segment& seg, const PoolCheckpoint::SegmentState& state,
                       PoolRestore& out) RESERVOIR_REQUIRES(mutex_);
  // The segments of a private pool, in address order.
  std::vector<detail::Segment*> pool_segments(const detail::PrivatePool& pool)
      RESERVOIR_REQUIRES(mutex_);
  bool should_split(const detail::Block* block, std::size_t size) const RESERVOIR_REQUIRES(mutex_) {
    if (block->pool->owner != nullptr && block->pool->owner->no_split) return false;
    const std::size_t remaining = block->size - size;
    if (in_stitched(block)) return false;  // one block, kept whole
    if (block->pool->is_small || vm_on()) return remaining >= kMinBlockSize;
    return size < config_.max_split_size && remaining > kSmallSize;
  }
  // Returns a block no longer in use to its pool, merged with free neighbours
  // (cache_block: the same, inlined in native_policy.cpp).
  void free_block(detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  inline void cache_block(detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  // deallocate's work under the lock: false when ptr is not allocated here.
  inline bool deallocate_locked(DevicePtr ptr) RESERVOIR_REQUIRES(mutex_);
  void garbage_collect_cached_blocks() RESERVOIR_REQUIRES(mutex_);
  void collect_garbage_locked(std::size_t target) RESERVOIR_REQUIRES(mutex_);
  bool release_available_cached_blocks(const AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  bool release_cached_blocks() RESERVOIR_REQUIRES(mutex_);
  bool search_after_release(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  std::string process_memory_sentences() RESERVOIR_REQUIRES(mutex_);
  void release_blocks(detail::BlockPool& pool) RESERVOIR_REQUIRES(mutex_);
  // Gives a released pool's cached segments back, and forgets the pool once
  // it holds none; returns the iterator after `it` in freeable_pools_.
  std::vector<PoolId>::iterator release_freeable_pool(std::vector<PoolId>::iterator it)
      RESERVOIR_REQUIRES(mutex_);
  void release_block(detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  // allocate's path past a plain cache hit, out of line so that the hit
  // stays short: a native_paged block's pages (`found`: p.block is a cached
  // block), then PyTorch's retry ladder. `lock` holds mutex_ (it is let go
  // around callbacks and observers).
  // Requests of 1 EiB and more are out of memory on every device, refused
  // before any arithmetic on their size (PyTorch's own limit).
  static constexpr std::size_t kLargestRequest = std::size_t{1} << 60;
  // map_block asks the device's free memory before creating more handles
  // than this (2 GiB of 2 MiB pages) for one request.
  static constexpr std::size_t kHeadroomCheckHandles = 1024;
  [[noreturn, gnu::noinline, gnu::cold]] void refuse_impossible(std::size_t requested);
  [[gnu::noinline]] void* allocate_slow(AllocParams& p, std::size_t requested, bool found,
                                        detail::UniqueLock<ClaimingMutex>& lock)
      RESERVOIR_REQUIRES(mutex_, lock);
  // native_paged segments (native_paged.cpp). Pages under the block p
  // serves mapped (the whole block when it is not split); false when the
  // device has no memory for them, even after free pages went back.
  bool back_block(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // native_paged where the native policy's choice found no memory: among the
  // free blocks that could serve p, the one whose pages are mapped the most.
  bool rescue_paged(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // The bytes at the front of p.block that serving p hands its caller to
  // touch: the request, not the rounding or an unsplit rest after it.
  std::size_t served_bytes(const AllocParams& p, const detail::Block* b) const
      RESERVOIR_REQUIRES(mutex_);
  // The handles of a native_paged segment over pages [first, end) of a block
  // being served that reach beyond it, where only free blocks lie under them,
  // unmapped and released (after the segment's stream synchronizes).
  void shed_handles(detail::Segment& seg, std::size_t first, std::size_t end)
      RESERVOIR_REQUIRES(mutex_);
  // The device's capacity, asked once.
  std::size_t total_capacity() RESERVOIR_REQUIRES(mutex_);
  // native_paged: whether mapping `bytes` more leaves memory plentiful (at
  // most 1/kPlentifulShare of what is free). The device is asked for what
  // is free at most once every kHeadroomReadingUses answers, and whenever
  // the reading, less what this allocator mapped since, says no.
  bool plentiful(std::size_t bytes) RESERVOIR_REQUIRES(mutex_);
  // Address space for a native_paged segment: `bytes` (whole pages) from
  // the address arena, reserved with the first segment; a reservation of its
  // own where the arena has no room or the device would not make one
  // (`in_arena` says which). 0 when the device has no address space left.
  DevicePtr paged_segment_space(std::size_t bytes, bool& in_arena) RESERVOIR_REQUIRES(mutex_);
  // empty_cache's: the address arena back to the device once no segment
  // lies in it (kept to retry when the device will not take it).
  void release_idle_address_arena() RESERVOIR_REQUIRES(mutex_);
  // Per page of a native_paged segment: whether a block in use (or waiting
  // on a stream) lies on it, or part of [keep_from, keep_to).
  // The pages of a native_paged segment in use (blocks not free, and
  // [keep_from, keep_to)), as sorted, disjoint runs [first, end): their
  // cost follows the segment's blocks, not its page count.
  using PageRuns = std::vector<std::pair<std::size_t, std::size_t>>;
  static void pages_in_use(const detail::Segment& seg, DevicePtr keep_from, DevicePtr keep_to,
                           PageRuns& busy);
  // Waits for the work queued on a segment's stream before its pages are
  // unmapped; DeviceError "synchronizing stream S before <doing> <at>"
  // otherwise (the message made only then: unmapping is a frequent path).
  void synchronize_segment_stream(const detail::Segment& seg, std::string_view doing, DevicePtr at)
      RESERVOIR_REQUIRES(mutex_);
  // One run of pages of a native_paged segment mapped with a handle of its
  // own; false when the device (or the memory fraction) has no room.
  bool map_paged_run(detail::Segment& seg, std::size_t first, std::size_t pages)
      RESERVOIR_REQUIRES(mutex_);
  // Unmaps and releases handles of native_paged segments whose pages hold
  // no block in use and nothing of [keep_from, keep_to) (after synchronizing
  // the segment's stream), until `bytes` are released (all of them with
  // SIZE_MAX); returns the bytes released.
  std::size_t release_free_pages(std::size_t bytes, DevicePtr keep_from = 0,
                                 DevicePtr keep_to = 0) RESERVOIR_REQUIRES(mutex_);
  // A free native_paged segment (its one block, in its pool when `in_pool`):
  // its handles and address space back to the device.
  void release_paged_segment(detail::Block* block, bool in_pool) RESERVOIR_REQUIRES(mutex_);
  // Unmaps and releases one handle of a native_paged segment (no sync).
  void release_paged_handle(detail::Segment& seg, std::uint32_t slot) RESERVOIR_REQUIRES(mutex_);
  // The destructor's: everything of a native_paged segment back, failures ignored.
  void drop_paged_segment_locked(detail::Segment& seg) noexcept RESERVOIR_REQUIRES(mutex_);
  void insert_events(detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  void insert_deferred_events() RESERVOIR_REQUIRES(mutex_);
  // graph_capture_record_stream_reuse (capture_reuse.cpp), PyTorch 2.9's:
  // a block freed during a capture after use on other streams is marked
  // with the nodes its streams' work ends at (when every one of them
  // captures; else it waits for the capture's end, as without the setting),
  // before anything changes; a request on a capturing stream first frees
  // the marked blocks of that stream whose every marker the stream's work
  // now comes after. end_capture_reuse forgets a pool's capture.
  void mark_capture_free(const detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  [[gnu::noinline]] void reuse_freed_in_capture(StreamId stream) RESERVOIR_REQUIRES(mutex_);
  void end_capture_reuse(PoolId id) RESERVOIR_REQUIRES(mutex_);
  CaptureFrontier frontier_of(StreamId stream) RESERVOIR_REQUIRES(mutex_);
  // The front event of a queue completed: keep the event, free the block if it was the last.
  void retire_front(std::deque<PendingEvent>& queue) RESERVOIR_REQUIRES(mutex_);
  void process_events() RESERVOIR_REQUIRES(mutex_);
  bool events_pending() const noexcept RESERVOIR_REQUIRES(mutex_) {
    return !pending_events_.empty() || !deferred_event_blocks_.empty();
  }
  void synchronize_and_free_events() RESERVOIR_REQUIRES(mutex_);
  EventId take_event() RESERVOIR_REQUIRES(mutex_);
  // The out-of-memory error for p, and what the observers are told (they run
  // with the lock released).
  struct Oom {
    OutOfMemoryError error;
    std::vector<OomObserver> observers;
    std::size_t limit;
    std::size_t free;
    OomExplainer explainer;
  };
  // The error of oom, with the explainer's answer appended where it gives one.
  static OutOfMemoryError explained(Oom& oom);
  Oom out_of_memory(const AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  [[noreturn]] void throw_invalid_pointer(DevicePtr ptr, const char* operation) const
      RESERVOIR_REQUIRES(mutex_);
  // Reports an event to the trackers and the history; returns the context
  // the history recorded it in (0 when none).
  std::uint32_t trace(TraceAction action, DevicePtr addr, std::size_t size, StreamId stream)
      RESERVOIR_REQUIRES(mutex_) {
    return observed_ ? emit(TraceEvent{action, addr, size, stream}) : 0;
  }
  std::uint32_t emit(const TraceEvent& entry) RESERVOIR_REQUIRES(mutex_);
  // observed_ as trackers, history and the source ask.
  void update_observed() noexcept RESERVOIR_REQUIRES(mutex_) {
    observed_ = !trackers_.empty() || (history_ && history_->on()) || traits_.observes;
  }
  // The statistics entry of a pool's kind: 1 small, 2 large.
  static std::size_t stat_index(const detail::BlockPool& pool) { return pool.is_small ? 1 : 2; }
  void check_supported(const AllocatorConfig& config) const;  // reads config and device_ only

  // ---- virtual-memory segments (vm_policy.cpp) ----
  // The source the configuration names (made anew when the policy changes),
  // and its traits.
  void choose_source() RESERVOIR_REQUIRES(mutex_);
  bool vm_on() const noexcept RESERVOIR_REQUIRES(mutex_) { return traits_.virtual_memory; }
  // Whether a block lies in a VM segment (noted in the block when it is
  // made: a segment's vm is set before its blocks are made, and kept).
  static bool in_vm(const detail::Block* b) noexcept { return b->in_vm; }
  bool in_stitched(const detail::Block* b) const noexcept RESERVOIR_REQUIRES(mutex_) {
    return in_vm(b) && b->segment->vm->stitched;
  }
  // How the release being modelled orders cached blocks of equal size.
  detail::TieOrder tie_order() const RESERVOIR_REQUIRES(mutex_) {
    if (config_.oldest_segment_first()) return detail::TieOrder::segment_age;
    if (config_.oldest_block_first()) return detail::TieOrder::block_age;
    return detail::TieOrder::address;
  }
  // A fresh, unlinked, mapped and free block, aged by the release's rule
  // (Block::order). Blocks made before the rule changes at run time keep
  // the age they had.
  detail::Block* make_block(DevicePtr ptr, std::size_t size, StreamId stream,
                            detail::BlockPool* pool, detail::Segment* segment)
      RESERVOIR_REQUIRES(mutex_) {
    detail::Block* b = arena_.make(ptr, size, stream, pool, segment, segment != nullptr ? segment->order : 0);
    if (block_age_) [[unlikely]] b->order = ++blocks_made_;
    return b;
  }
  bool block_age_ RESERVOIR_GUARDED_BY(mutex_) = false;       // PyTorch 2.12's rule in force
  std::uint64_t blocks_made_ RESERVOIR_GUARDED_BY(mutex_) = 0;  // under it
  // A new segment in segments_ (a VM segment with vm), with a head block
  // spanning it unless the caller lays out its blocks (restore).
  detail::Segment* add_segment(DevicePtr base, std::size_t size, StreamId stream,
                               detail::BlockPool* pool,
                               std::unique_ptr<detail::VmState> vm = nullptr, bool with_head = true)
      RESERVOIR_REQUIRES(mutex_);
  // The statistics of a segment obtained from the device (allocate_segment).
  void count_segment_alloc(const detail::BlockPool& pool, std::size_t size)
      RESERVOIR_REQUIRES(mutex_);
  // Marks a block allocated for `requested` bytes, with its statistics.
  [[gnu::always_inline]] void count_allocation(detail::Block* block, std::size_t requested)
      RESERVOIR_REQUIRES(mutex_) {
    RESERVOIR_DEBUG_ASSERT(!block->allocated && block->mapped);
    RESERVOIR_DEBUG_ASSERT(block->size >= requested);
    block->allocated = true;
    block->requested_size = requested;
    allocated_.insert(block->ptr, block);
    const std::size_t k = stat_index(*block->pool);
    add_stats(k, {{stats_.allocation, 1},
                  {stats_.allocated_bytes, block->size},
                  {stats_.active, 1},
                  {stats_.active_bytes, block->size},
                  {stats_.requested_bytes, requested}});
    if (block->size >= config_.max_split_size) add_stat(stats_.oversize_allocations, 1);
  }
  // Pages of a VM segment lying wholly inside a block: [first, end).
  static std::pair<std::size_t, std::size_t> inner_pages(const detail::Segment& seg,
                                                         const detail::Block* b);
  // Unmapped bytes among the first `size` available bytes from b, or
  // SIZE_MAX when fewer than `size` available bytes follow.
  static std::size_t unmapped_within(const detail::Block* b, std::size_t size);
  // Moves `it`, the best fit in a VM segment, to the block that serves p
  // under the VM rules (growable size, stitched blocks whole, none while VM
  // is off); false when no block of p's stream does.
  inline bool vm_candidate(const AllocParams& p, detail::BlockSet::iterator& it)
      RESERVOIR_REQUIRES(mutex_);
  detail::Block* new_vm_segment(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // try_alloc_vm_block's work, with recycling_ set as asked.
  bool grow_vm_block(AllocParams& p) RESERVOIR_REQUIRES(mutex_);
  // Maps the pages under the first `bytes` of an unmapped block; false on
  // out of memory (nothing changed). Throws DeviceError on other failures,
  // after undoing what it did.
  bool map_block(detail::Block* to_map, std::size_t bytes) RESERVOIR_REQUIRES(mutex_);
  // Unmaps the fully free pages (paging: the fully free handles) of a cached
  // block, after synchronizing its stream.
  void unmap_block(detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  // A whole handle of a paging arena lying in a cached block: pages [first, end).
  struct FreeHandle {
    detail::Segment* seg;
    std::size_t first;
    std::size_t end;
  };
  // Every such handle outside the blocks `skip` and `skip_too`, largest first
  // (among equals the highest address).
  std::vector<FreeHandle> whole_free_handles(const detail::Block* skip,
                                             const detail::Block* skip_too)
      RESERVOIR_REQUIRES(mutex_);
  // A physical handle unmapped to be mapped again elsewhere.
  struct Recycled {
    PhysicalHandle handle;
    std::size_t bytes;
  };
  // Unmaps pages [first, end) of a cached block (whole handles); their
  // handles are released, or appended to `kept` when given.
  void unmap_pages(detail::Block* block, std::size_t first, std::size_t end,
                   std::vector<Recycled>* kept = nullptr) RESERVOIR_REQUIRES(mutex_);
  // Paging: unmaps whole free handles of paging arenas for map_block to map
  // at to_map instead of creating memory: under pressure, the largest first
  // (at most kMaxRecycledHandles) until `bytes` are covered; otherwise one
  // handle of `bytes` to twice that, if there is one.
  std::vector<Recycled> recycle_free_handles(const detail::Block* to_map, std::size_t bytes)
      RESERVOIR_REQUIRES(mutex_);
  static constexpr std::size_t kMaxRecycledHandles = 4;
  void dissolve_stitched(detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  void dissolve_cached_stitched() RESERVOIR_REQUIRES(mutex_);
  // Keeps a handle the device would not release and adds its bytes to
  // reserved memory (callers that counted them take them out as for any
  // release; so the device's holdings and the statistics agree either way).
  void keep_unreleased(PhysicalHandle handle, std::size_t bytes, std::size_t index)
      RESERVOIR_REQUIRES(mutex_);
  // Bytes held in handles the device would not release (0 normally).
  std::size_t unreleased_bytes() const RESERVOIR_REQUIRES(mutex_);
  void retry_stuck() noexcept RESERVOIR_REQUIRES(mutex_);
  // Address space back to the device, or kept to retry (retry_stuck) when
  // the device will not take it.
  void unreserve_or_retry(DevicePtr va, std::size_t bytes) RESERVOIR_REQUIRES(mutex_);
  // Splits [start, start + bytes) out of a cached block, which leaves the pool;
  // the pieces before and after stay cached. Returns the middle block.
  detail::Block* carve(detail::Block* block, DevicePtr start, std::size_t bytes)
      RESERVOIR_REQUIRES(mutex_);
  // Puts a block back in its pool, merged with cached neighbours.
  void recache(detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  static detail::Block* block_at(detail::Segment& seg, DevicePtr addr);
  void release_vm_segment(detail::Block* block) RESERVOIR_REQUIRES(mutex_);
  // empty_cache's part for cached VM blocks: stitched ones dissolved, the
  // others' pages unmapped and segments left empty given back.
  void release_vm_blocks(const std::vector<detail::Block*>& blocks) RESERVOIR_REQUIRES(mutex_);
  // Merges neighbour src into dst when both are available and equally mapped.
  void merge_unmapped(detail::Block* dst, detail::Block* src) RESERVOIR_REQUIRES(mutex_);
  void unmap_handles(detail::Segment& seg, std::size_t first, std::size_t end)
      RESERVOIR_REQUIRES(mutex_);
  void drop_vm_segment_locked(detail::Segment& seg) noexcept RESERVOIR_REQUIRES(mutex_);
  void validate_paged_segment(const detail::Segment& seg) const RESERVOIR_REQUIRES(mutex_);
  // The address arena's free ranges against the segments carved from it.
  void validate_address_arena() const RESERVOIR_REQUIRES(mutex_);
  // Each page's handle of a VM or native_paged segment covers it; returns
  // the pages with a handle. `kind` names the segment in a breach.
  std::size_t validate_page_table(const detail::Segment& seg, const detail::VmState& pages,
                                  std::string_view kind) const RESERVOIR_REQUIRES(mutex_);
  void validate_vm_segment(const detail::Segment& seg) const RESERVOIR_REQUIRES(mutex_);
  void restore_locked(const Snapshot& layout) RESERVOIR_REQUIRES(mutex_);
  void restore_vm_locked(const Snapshot& layout,
                         const std::vector<ExpandableReservation>& reservations)
      RESERVOIR_REQUIRES(mutex_);
  void drop_all_locked() noexcept RESERVOIR_REQUIRES(mutex_);

  Device& device_;
  mutable ClaimingMutex mutex_{*this};
  AllocatorConfig config_ RESERVOIR_GUARDED_BY(mutex_);
  DeviceStats stats_ RESERVOIR_GUARDED_BY(mutex_);
  // For each of kPerPoolStats, small's and large's current values at the last
  // reset of accumulated statistics (allocated = freed + current - this).
  std::array<std::array<std::int64_t, kStatTypes>, kPerPoolStats.size()> accumulated_base_
      RESERVOIR_GUARDED_BY(mutex_){};
  // The combined statistics this allocator is a member of (combine_stats),
  // set once under mutex_, read by mutex_ itself before it is held; and its
  // own peaks while it is a member (stats_'s peaks hold the thresholds).
  std::atomic<CombinedStats*> combined_{nullptr};
  std::shared_ptr<CombinedStats> combined_keep_;  // keeps it alive
  DeviceStats own_peaks_ RESERVOIR_GUARDED_BY(mutex_);
  // CombinedStats::Member: called by the sum, under its mutex.
  void lock_member() noexcept override RESERVOIR_NO_THREAD_SAFETY_ANALYSIS {
    mutex_.lock_unclaimed();
  }
  void unlock_member() noexcept override RESERVOIR_NO_THREAD_SAFETY_ANALYSIS { mutex_.unlock(); }
  // The Stat of `in` that `s` is in stats_ (the same place in a DeviceStats;
  // only stats_'s address is used).
  Stat& same_stat(DeviceStats& in,
                  const Stat& s) const noexcept RESERVOIR_NO_THREAD_SAFETY_ANALYSIS {
    const auto offset = reinterpret_cast<const char*>(&s) - reinterpret_cast<const char*>(&stats_);
    return *reinterpret_cast<Stat*>(reinterpret_cast<char*>(&in) + offset);
  }
  DeviceStats member_values() const noexcept override RESERVOIR_NO_THREAD_SAFETY_ANALYSIS;
  void joined(CombinedStats& sum) noexcept override RESERVOIR_NO_THREAD_SAFETY_ANALYSIS;
  void took_sum() noexcept override RESERVOIR_NO_THREAD_SAFETY_ANALYSIS;
  detail::NodeRecycler node_resource_ RESERVOIR_GUARDED_BY(mutex_);  // set nodes of every pool
  detail::BlockArena arena_ RESERVOIR_GUARDED_BY(mutex_);
  detail::BlockPool large_ RESERVOIR_GUARDED_BY(mutex_);
  detail::BlockPool small_ RESERVOIR_GUARDED_BY(mutex_);
  detail::AddressMap<detail::Block*> allocated_
      RESERVOIR_GUARDED_BY(mutex_);  // allocated blocks by address
  std::map<DevicePtr, std::unique_ptr<detail::Segment>> segments_ RESERVOIR_GUARDED_BY(mutex_);
  std::map<PoolId, std::unique_ptr<detail::PrivatePool>> private_pools_
      RESERVOIR_GUARDED_BY(mutex_);
  std::vector<PoolId> freeable_pools_ RESERVOIR_GUARDED_BY(mutex_);
  std::vector<PoolId> use_on_oom_pools_ RESERVOIR_GUARDED_BY(mutex_);  // in the order marked
  // Each stream's expandable-segment reserve class (set_stream_reserve_class).
  std::unordered_map<StreamId, std::string> reserve_classes_ RESERVOIR_GUARDED_BY(mutex_);
  // The reserve (expandable_segments_reserve) that no new segment for the
  // request in hand could exceed, and its stream's class: the out-of-memory
  // message names them (0: none refused it). Reset as a request misses the cache.
  std::size_t refused_reserve_ RESERVOIR_GUARDED_BY(mutex_) = 0;
  std::string refused_reserve_class_ RESERVOIR_GUARDED_BY(mutex_);
  std::vector<PoolId> no_split_pools_ RESERVOIR_GUARDED_BY(mutex_);
  // MemPool(allocator=...) set before the pool's first route.
  std::map<PoolId, std::shared_ptr<PoolSegmentAllocator>> pool_allocators_ RESERVOIR_GUARDED_BY(mutex_);
  // Bytes reserved per private pool, from its first segment on (PyTorch
  // 2.13's reserved_bytes_by_private_pools and later).
  std::map<PoolId, StatArray> pool_reserved_ RESERVOIR_GUARDED_BY(mutex_);
  std::vector<std::pair<PoolId, PoolFilter>> routes_
      RESERVOIR_GUARDED_BY(mutex_);  // PyTorch's captures_underway
  std::vector<detail::Block*> deferred_event_blocks_ RESERVOIR_GUARDED_BY(mutex_);
  // Of those, the ones freed with markers (mark_capture_free), and for each
  // capture (by id) the nodes each stream's requests came after so far
  // (PyTorch's graph_reuse_context); the capture each pool's route met.
  std::unordered_map<const detail::Block*, std::vector<GraphNode>> capture_markers_
      RESERVOIR_GUARDED_BY(mutex_);
  std::map<std::uint64_t, std::map<StreamId, std::unordered_set<GraphNode>>> capture_visited_
      RESERVOIR_GUARDED_BY(mutex_);
  std::map<PoolId, std::uint64_t> pool_capture_ RESERVOIR_GUARDED_BY(mutex_);
  std::map<StreamId, std::deque<PendingEvent>> pending_events_ RESERVOIR_GUARDED_BY(mutex_);
  std::vector<EventId> idle_events_ RESERVOIR_GUARDED_BY(mutex_);
  std::size_t total_reserved_ RESERVOIR_GUARDED_BY(mutex_) = 0;
  std::unique_ptr<detail::SegmentSource> source_ RESERVOIR_GUARDED_BY(mutex_);
  detail::VmSegments* vm_source_ RESERVOIR_GUARDED_BY(mutex_) = nullptr;  // source_, if VM
  detail::SourceTraits traits_ RESERVOIR_GUARDED_BY(mutex_);
  std::uint64_t segments_made_ RESERVOIR_GUARDED_BY(mutex_) = 0;  // Segment::order of the newest
  // Orders every pool's cached blocks as config_ says (pytorch_version),
  // and notes whether its rounding uses divisions (uses_divisions_).
  void apply_block_order() RESERVOIR_REQUIRES(mutex_);
  // Undo steps that failed themselves, retried on each release pass and at
  // destruction: handles whose release failed, mappings that would not go,
  // and address space that could not be returned.
  // Physical memory the device would not take back (release_physical
  // failed): still the device's, so still counted as reserved (in the pool
  // kind it came from) until a retry releases it.
  struct Unreleased {
    PhysicalHandle handle = 0;
    std::size_t bytes = 0;
    std::size_t index = 0;  // stat_index of its pool
  };
  std::vector<Unreleased> unreleased_ RESERVOIR_GUARDED_BY(mutex_);
  std::vector<std::pair<DevicePtr, std::size_t>> stuck_mappings_ RESERVOIR_GUARDED_BY(mutex_);
  std::vector<std::pair<DevicePtr, std::size_t>> stuck_reservations_ RESERVOIR_GUARDED_BY(mutex_);
  std::size_t total_capacity_ RESERVOIR_GUARDED_BY(mutex_) = 0;  // total_capacity()'s
  // native_paged's segments are carved from one reservation of this many
  // times the device's capacity (paged_segment_space); refused: the device
  // would not reserve it, so each segment reserves its own.
  static constexpr std::size_t kAddressArenaShare = 4;
  static constexpr std::size_t kAddressArenaMost = std::size_t{1} << 52;  // 4 PiB at most
  detail::AddressArena address_arena_ RESERVOIR_GUARDED_BY(mutex_);
  // plentiful()'s last reading of the device's free memory (mapping_headroom),
  // what was reserved then, and how many answers it may still give.
  static constexpr int kHeadroomReadingUses = 16;
  std::size_t headroom_reading_ RESERVOIR_GUARDED_BY(mutex_) = 0;
  std::size_t reserved_at_reading_ RESERVOIR_GUARDED_BY(mutex_) = 0;
  int headroom_reads_left_ RESERVOIR_GUARDED_BY(mutex_) = 0;
  bool address_arena_refused_ RESERVOIR_GUARDED_BY(mutex_) = false;
  std::size_t allowed_memory_maximum_ RESERVOIR_GUARDED_BY(mutex_) = 0;
  bool set_fraction_ RESERVOIR_GUARDED_BY(mutex_) = false;
  // config_ sets roundup_power2_divisions (any interval above 1).
  bool uses_divisions_ RESERVOIR_GUARDED_BY(mutex_) = true;
  bool recycling_ RESERVOIR_GUARDED_BY(mutex_) =
      false;  // paging growth under pressure: move all it takes
  // Paging arena growths so far (map_block calls), counting from 1: when a
  // moved handle may move again outside pressure (kMoveCooldown).
  std::uint64_t growths_ RESERVOIR_GUARDED_BY(mutex_) = 0;
  bool max_split_changed_ RESERVOIR_GUARDED_BY(mutex_) =
      false;  // oversize stats are not recountable after a change
  std::vector<OomObserver> oom_observers_ RESERVOIR_GUARDED_BY(mutex_);
  OomExplainer oom_explainer_ RESERVOIR_GUARDED_BY(mutex_);
  std::vector<FreeMemoryCallback> free_memory_callbacks_ RESERVOIR_GUARDED_BY(mutex_);
  std::vector<TraceTracker> trackers_ RESERVOIR_GUARDED_BY(mutex_);
  std::unique_ptr<detail::EventHistory> history_
      RESERVOIR_GUARDED_BY(mutex_);                     // created when first turned on
  bool observed_ RESERVOIR_GUARDED_BY(mutex_) = false;  // trackers attached or history on
};

}  // namespace reservoir
