// The allocator's construction, teardown and controls: memory fraction,
// configuration, statistics, observers and history.
#include <fmt/format.h>

#include <cstdlib>
#include <string_view>
#include <utility>

#include <algorithm>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::PrivatePool;
using detail::Segment;

// ---------------------------------------------------------------------------
// Construction

CachingAllocator::Impl::Impl(Device& device, AllocatorConfig config, int device_index)
    : device_index_(device_index),
      device_(device),
      config_(std::move(config)),
      large_(false, nullptr, &node_resource_),
      small_(true, nullptr, &node_resource_) {
  check_supported(config_);
  stats_.max_split_size = static_cast<std::int64_t>(config_.max_split_size);
  {
    detail::LockGuard lock(mutex_);
    choose_source();
    apply_block_order();
  }
  if (config_.per_process_memory_fraction != 1.0) {
    set_memory_fraction(config_.per_process_memory_fraction);
  }
  if (const char* v = std::getenv("RESERVOIR_VALIDATE");
      v != nullptr && *v != '\0' && std::string_view(v) != "0") {
    validate_each_call_.store(true, std::memory_order_relaxed);
  }
}

CachingAllocator::Impl::~Impl() {
  // Its current values stay in a combined sum.
  if (CombinedStats* c = combined_.load(std::memory_order_acquire)) c->leave(*this);
  // Return everything to the device; failures cannot be reported from here.
  for (auto& [stream, queue] : pending_events_) {
    for (PendingEvent& e : queue) (void)device_.destroy_event(e.event);
  }
  for (EventId e : idle_events_) (void)device_.destroy_event(e);
  retry_stuck();  // stuck mappings go before their address space
  for (auto& [base, segment] : segments_) {
    if (segment->vm) {
      drop_vm_segment_locked(*segment);
    } else if (segment->paged) {
      drop_paged_segment_locked(*segment);
    } else {
      try {
        free_classic_segment(*segment);
      } catch (...) {  // NOLINT(bugprone-empty-catch): failures cannot be reported from here
      }
    }
  }
  if (address_arena_.active()) {
    stuck_reservations_.emplace_back(address_arena_.base(), address_arena_.bytes());
  }
  retry_stuck();
}

// ---------------------------------------------------------------------------
// Control

std::size_t CachingAllocator::Impl::release_unmapped_segments() {
  detail::LockGuard lock(mutex_);
  std::size_t released = 0;
  for (BlockPool* pool : {&large_, &small_}) {
    std::vector<Block*> bare;  // released after the walk: it edits the pool
    for (Block* b : pool->blocks) {
      if (b->segment->paged && b->segment->paged->mapped_pages == 0 && !b->is_split()) {
        bare.push_back(b);
      }
    }
    for (Block* b : bare) release_paged_segment(b, /*in_pool=*/true);
    released += bare.size();
  }
  if (released != 0) release_idle_address_arena();
  return released;
}

void CachingAllocator::Impl::empty_cache() {
  detail::LockGuard lock(mutex_);
  if (!routes_.empty() && config_.empty_cache_spares_default_pools_while_routed()) {
    for (auto it = freeable_pools_.begin(); it != freeable_pools_.end();) it = release_freeable_pool(it);
    return;
  }
  release_cached_blocks();
  release_idle_address_arena();
  if (traits_.observes) source_->cache_emptied();
  if (!unreleased_.empty()) {
    // Not emptied: the device keeps memory it would not take back. The
    // statistics count it as reserved; the next release tries again.
    throw DeviceError(CallKind::release_physical, Status::device_error,
                      fmt::format("emptying the cache: the device would not release {} "
                                  "handle{} ({} bytes); still counted as reserved, they are "
                                  "released again at the next empty_cache or retry",
                                  unreleased_.size(), unreleased_.size() == 1 ? "" : "s",
                                  unreleased_bytes()));
  }
}

void CachingAllocator::Impl::process_completed_frees() {
  detail::LockGuard lock(mutex_);
  process_events();
}

void CachingAllocator::Impl::collect_garbage(std::size_t bytes) {
  detail::LockGuard lock(mutex_);
  if (bytes > 0) collect_garbage_locked(bytes);
}

void CachingAllocator::Impl::set_stream_reserve_class(StreamId stream, const std::string& reserve_class) {
  detail::LockGuard lock(mutex_);
  if (reserve_class.empty()) {
    reserve_classes_.erase(stream);
  } else {
    reserve_classes_[stream] = reserve_class;
  }
}

void CachingAllocator::Impl::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw UsageError(
        fmt::format("set_memory_fraction: invalid fraction {}; accepted: 0.0 to 1.0", fraction));
  }
  MemoryInfo info;
  const Status status = device_.memory_info(&info);
  if (status != Status::ok) {
    throw DeviceError(CallKind::memory_info, status, "set_memory_fraction");
  }
  detail::LockGuard lock(mutex_);
  allowed_memory_maximum_ = static_cast<std::size_t>(fraction * static_cast<double>(info.total));
  set_fraction_ = true;
}

void CachingAllocator::Impl::clear_memory_fraction() {
  detail::LockGuard lock(mutex_);
  allowed_memory_maximum_ = 0;
  set_fraction_ = false;
}

void CachingAllocator::Impl::set_config(const AllocatorConfig& config) {
  check_supported(config);
  // per_process_memory_fraction, as PyTorch applies it: the fraction is set
  // when the key is (a config without it leaves the current one).
  bool new_fraction = false;
  {
    detail::LockGuard lock(mutex_);
    new_fraction = config.per_process_memory_fraction != 1.0 &&
                   config.per_process_memory_fraction != config_.per_process_memory_fraction;
  }
  if (new_fraction) set_memory_fraction(config.per_process_memory_fraction);
  detail::LockGuard lock(mutex_);
  if (config.max_split_size != config_.max_split_size) max_split_changed_ = true;
  config_ = config;
  choose_source();
  // stats_.max_split_size stays as the allocator was made: PyTorch's
  // statistic is its allocator's at construction, though a split limit
  // changed at run time (_set_allocator_settings) applies to what follows.
  apply_block_order();
}

void CachingAllocator::Impl::apply_block_order() {
  uses_divisions_ =
      std::any_of(config_.roundup_power2_divisions.begin(), config_.roundup_power2_divisions.end(),
                  [](std::size_t d) { return d > 1; });
  const detail::TieOrder ties = tie_order();
  block_age_ = ties == detail::TieOrder::block_age;
  const bool by_age = ties != detail::TieOrder::address;
  large_.set_order(by_age);
  small_.set_order(by_age);
  for (auto& [id, pool] : private_pools_) {
    pool->large.set_order(by_age);
    pool->small.set_order(by_age);
  }
}

AllocatorConfig CachingAllocator::Impl::config() const {
  detail::LockGuard lock(mutex_);
  return config_;
}

DeviceStats CachingAllocator::Impl::folded_stats() const {
  DeviceStats folded = stats_;
  if (combined_.load(std::memory_order_relaxed) != nullptr) {
    // stats_'s peaks are thresholds; the peaks are kept apart.
    folded.for_each_stat_pair(own_peaks_, [](Stat& s, const Stat& own) { s.peak = own.peak; });
  }
  for (std::size_t i = 0; i < kPerPoolStats.size(); ++i) {
    StatArray& s = folded.*kPerPoolStats[i];
    for (std::size_t k = 1; k < kStatTypes; ++k) {
      s[k].allocated = s[k].freed + s[k].current - accumulated_base_[i][k];
    }
    s[0].current = s[1].current + s[2].current;
    s[0].allocated = s[1].allocated + s[2].allocated;
    s[0].freed = s[1].freed + s[2].freed;
  }
  return folded;
}

DeviceStats CachingAllocator::Impl::stats() const {
  detail::LockGuard lock(mutex_);
  return folded_stats();
}

void CachingAllocator::Impl::reset_peak_stats() {
  detail::LockGuard lock(mutex_);
  // Every peak falls to its current value (the "all" entries' to the sum).
  DeviceStats folded = folded_stats();
  if (combined_.load(std::memory_order_relaxed) != nullptr) {
    own_peaks_.for_each_stat_pair(folded, [](Stat& s, const Stat& f) { s.peak = f.current; });
    took_sum();
  } else {
    stats_.for_each_stat_pair(folded, [](Stat& s, const Stat& f) { s.peak = f.current; });
  }
  for (auto& [id, reserved] : pool_reserved_) {
    for (Stat& s : reserved) s.reset_peak();
  }
}

void CachingAllocator::Impl::combine_stats(std::shared_ptr<CombinedStats> combined,
                                           bool carry_peaks) {
  if (!combined) throw UsageError("combine_stats: no combined statistics given");
  CombinedStats& sum = *combined;
  {
    detail::LockGuard lock(mutex_);
    if (combined_.load(std::memory_order_relaxed) != nullptr || combined_keep_) {
      throw UsageError("combine_stats: this allocator's statistics are combined already");
    }
    combined_keep_ = std::move(combined);  // claimed: a second call fails
  }
  sum.join(*this, carry_peaks);  // takes the sum's mutex, then mutex_
}

DeviceStats CachingAllocator::Impl::member_values() const noexcept {
  return folded_stats();
}

void CachingAllocator::Impl::joined(CombinedStats& sum) noexcept {
  own_peaks_ = folded_stats();  // its peaks, from now on kept here
  combined_.store(&sum, std::memory_order_release);
}

void CachingAllocator::Impl::took_sum() noexcept {
  // Each Stat's peak field becomes the lower of its own peak and the value
  // above which the sum (the others' values plus this one) passes its peak.
  DeviceStats& others = combined_.load(std::memory_order_relaxed)->sum_for_owner();
  stats_.for_each_stat_pair(own_peaks_, [&](Stat& s, const Stat& own) {
    const Stat& o = same_stat(others, s);
    s.peak = std::min(own.peak, o.peak - o.current);
  });
}

void CachingAllocator::Impl::combined_peak_crossed(Stat& trigger, std::int64_t value) noexcept {
  Stat& own = same_stat(own_peaks_, trigger);
  Stat& sum = same_stat(combined_.load(std::memory_order_relaxed)->sum_for_owner(), trigger);
  if (value > own.peak) own.peak = value;
  if (sum.current + value > sum.peak) sum.peak = sum.current + value;
  trigger.peak = std::min(own.peak, sum.peak - sum.current);
}

void CachingAllocator::Impl::reset_accumulated_stats() {
  detail::LockGuard lock(mutex_);
  stats_.for_each_stat([](Stat& s) { s.reset_accumulated(); });
  for (std::size_t i = 0; i < kPerPoolStats.size(); ++i) {
    for (std::size_t k = 0; k < kStatTypes; ++k) {
      accumulated_base_[i][k] = (stats_.*kPerPoolStats[i])[k].current;
    }
  }
  stats_.num_alloc_retries = 0;
  stats_.num_ooms = 0;
  stats_.num_sync_all_streams = 0;
  stats_.num_device_alloc = 0;
  stats_.num_device_free = 0;
  for (auto& [id, reserved] : pool_reserved_) {
    for (Stat& s : reserved) s.reset_accumulated();
  }
}

std::size_t CachingAllocator::Impl::block_size(DevicePtr ptr) const {
  if (ptr == 0) return 0;  // the pointer map's empty key
  detail::LockGuard lock(mutex_);
  const Block* const* found = allocated_.find(ptr);
  return found == nullptr ? 0 : (*found)->size;
}

std::size_t CachingAllocator::Impl::largest_cached_block() const {
  detail::LockGuard lock(mutex_);
  std::size_t largest = 0;
  auto scan = [&largest](const BlockPool& pool) {
    for (const Block* b : pool.blocks) largest = std::max(largest, b->size);
  };
  scan(large_);
  scan(small_);
  for (auto& [id, pool] : private_pools_) {
    scan(pool->large);
    scan(pool->small);
  }
  return largest;
}

void CachingAllocator::Impl::attach_oom_observer(OomObserver observer) {
  detail::LockGuard lock(mutex_);
  oom_observers_.push_back(std::move(observer));
}

void CachingAllocator::Impl::set_oom_explainer(OomExplainer explainer) {
  detail::LockGuard lock(mutex_);
  oom_explainer_ = std::move(explainer);
}

void CachingAllocator::Impl::add_free_memory_callback(FreeMemoryCallback callback) {
  detail::LockGuard lock(mutex_);
  free_memory_callbacks_.push_back(std::move(callback));
}

void CachingAllocator::Impl::attach_trace_tracker(TraceTracker tracker) {
  detail::LockGuard lock(mutex_);
  trackers_.push_back(std::move(tracker));
  update_observed();
}

void CachingAllocator::Impl::record_history(const HistoryOptions& options) {
  detail::LockGuard lock(mutex_);
  if (!history_) {
    if (!options.enabled) return;
    history_ = std::make_unique<detail::EventHistory>();
  }
  history_->configure(options);
  update_observed();
}

std::uint32_t CachingAllocator::Impl::emit(const TraceEvent& entry) {
  if (traits_.observes) {
    switch (entry.action) {
      case TraceAction::alloc: {
        Block* const* b = allocated_.find(entry.addr);
        source_->observe(entry, b != nullptr && (*b)->pool->owner == nullptr);
        break;
      }
      case TraceAction::free_requested:
      case TraceAction::oom: source_->observe(entry, true); break;
      default: break;
    }
  }
  for (const auto& tracker : trackers_) tracker(entry);
  if (history_ && history_->on()) {
    return history_->record(entry.action, entry.addr, entry.size, entry.stream);
  }
  return 0;
}

}  // namespace reservoir
