// CachingAllocator, the public class: each member forwards to Impl
// (allocator_impl.hpp), whose members are spread over the allocator's files
// by concern (docs/architecture.md). Calls that change the allocator run
// through Impl::checked: with validation on, the validator runs after each,
// whether it returned or threw.
#include "reservoir/caching_allocator.hpp"

#include <thread>
#include <utility>

#include "allocator_impl.hpp"

namespace reservoir {

CachingAllocator::CachingAllocator(Device& device, AllocatorConfig config, int device_index)
    : impl_(std::make_unique<Impl>(device, std::move(config), device_index)) {}
CachingAllocator::~CachingAllocator() = default;
// allocate and deallocate: native_policy.cpp, beside the hot path they run.
void CachingAllocator::record_stream(void* ptr, StreamId stream) {
  impl_->checked(&Impl::record_stream, ptr, stream);
}
void CachingAllocator::process_completed_frees() {
  impl_->checked(&Impl::process_completed_frees);
}

void CachingAllocator::empty_cache() {
  impl_->checked(&Impl::empty_cache);
}
std::size_t CachingAllocator::release_unmapped_segments() {
  return impl_->checked(&Impl::release_unmapped_segments);
}

void CachingAllocator::collect_garbage(std::size_t bytes) {
  impl_->checked(&Impl::collect_garbage, bytes);
}
void CachingAllocator::clear_memory_fraction() { impl_->checked(&Impl::clear_memory_fraction); }

void CachingAllocator::set_memory_fraction(double fraction) {
  impl_->checked(&Impl::set_memory_fraction, fraction);
}
void CachingAllocator::set_stream_reserve_class(StreamId stream, const std::string& reserve_class) {
  impl_->checked(&Impl::set_stream_reserve_class, stream, reserve_class);
}
void CachingAllocator::set_config(const AllocatorConfig& config) {
  impl_->checked(&Impl::set_config, config);
}
AllocatorConfig CachingAllocator::config() const {
  return impl_->config();
}
int CachingAllocator::device_index() const noexcept {
  return impl_->device_index_;
}
DeviceStats CachingAllocator::stats() const {
  return impl_->stats();
}
std::map<std::string, std::int64_t> CachingAllocator::stats_map() const {
  std::map<std::string, std::int64_t> out = to_map(impl_->stats());
  if (reports_private_pools(impl_->config().pytorch_version)) put_private_pools(out, private_pool_reserved());
  return out;
}
std::map<PoolId, StatArray> CachingAllocator::private_pool_reserved() const {
  return impl_->private_pool_reserved();
}
void CachingAllocator::reset_peak_stats() {
  impl_->checked(&Impl::reset_peak_stats);
}
void CachingAllocator::reset_accumulated_stats() {
  impl_->checked(&Impl::reset_accumulated_stats);
}
void CachingAllocator::combine_stats(std::shared_ptr<CombinedStats> combined, bool carry_peaks) {
  impl_->checked(&Impl::combine_stats, std::move(combined), carry_peaks);
}
std::string CachingAllocator::memory_summary(bool abbreviated) const {
  return reservoir::memory_summary(stats_map(), impl_->device_index_, abbreviated);
}
Snapshot CachingAllocator::snapshot() const {
  return impl_->snapshot();
}
std::vector<std::pair<DevicePtr, std::size_t>> CachingAllocator::live_allocations() const {
  return impl_->live_allocations();
}
std::size_t CachingAllocator::largest_cached_block() const {
  return impl_->largest_cached_block();
}
std::size_t CachingAllocator::block_size(const void* ptr) const {
  return impl_->block_size(reinterpret_cast<DevicePtr>(ptr));
}
void CachingAllocator::attach_oom_observer(OomObserver observer) {
  impl_->attach_oom_observer(std::move(observer));
}

void CachingAllocator::set_oom_explainer(OomExplainer explainer) {
  impl_->set_oom_explainer(std::move(explainer));
}
void CachingAllocator::add_free_memory_callback(FreeMemoryCallback callback) {
  impl_->add_free_memory_callback(std::move(callback));
}
void CachingAllocator::attach_trace_tracker(TraceTracker tracker) {
  impl_->attach_trace_tracker(std::move(tracker));
}

void CachingAllocator::record_history(const HistoryOptions& options) {
  impl_->checked(&Impl::record_history, options);
}
void CachingAllocator::begin_allocate_to_pool(PoolId id, PoolFilter filter) {
  impl_->checked(&Impl::begin_allocate_to_pool, id, std::move(filter));
}
void CachingAllocator::begin_allocate_current_thread_to_pool(PoolId id) {
  const std::thread::id owner = std::this_thread::get_id();
  impl_->checked(&Impl::begin_allocate_to_pool, id,
                 PoolFilter([owner](StreamId) { return std::this_thread::get_id() == owner; }));
}
void CachingAllocator::end_allocate_to_pool(PoolId id) {
  impl_->checked(&Impl::end_allocate_to_pool, id);
}
void CachingAllocator::release_pool(PoolId id) {
  impl_->checked(&Impl::release_pool, id);
}
void CachingAllocator::empty_pool_cache(PoolId id) {
  impl_->checked(&Impl::empty_pool_cache, id);
}
void CachingAllocator::set_pool_use_on_oom(PoolId id, bool use_on_oom) {
  impl_->checked(&Impl::set_pool_use_on_oom, id, use_on_oom);
}
void CachingAllocator::set_pool_no_split(PoolId id) {
  impl_->checked(&Impl::set_pool_no_split, id);
}
void CachingAllocator::set_pool_allocator(PoolId id, std::shared_ptr<PoolSegmentAllocator> allocator) {
  impl_->checked(&Impl::set_pool_allocator, id, std::move(allocator));
}
PoolCheckpoint CachingAllocator::checkpoint_pool(PoolId id) {
  return impl_->checked(&Impl::checkpoint_pool, id);
}
PoolRestore CachingAllocator::restore_pool(const PoolCheckpoint& checkpoint) {
  return impl_->checked(&Impl::restore_pool, checkpoint);
}
void CachingAllocator::validate() const {
  impl_->validate();
}
std::uint64_t CachingAllocator::validations() const noexcept {
  return impl_->validations_.load(std::memory_order_relaxed);
}
void CachingAllocator::set_validate_each_call(bool on) {
  impl_->validate_each_call_ = on;
}
std::size_t CachingAllocator::round_size(std::size_t size, const AllocatorConfig& config) {
  return Impl::round_size(size, config);
}
std::size_t CachingAllocator::allocation_size(std::size_t rounded, const AllocatorConfig& config) {
  return Impl::allocation_size(rounded, config);
}
void CachingAllocator::restore(const Snapshot& layout,
                               const std::vector<ExpandableReservation>& reservations) {
  impl_->checked(&Impl::restore, layout, reservations);
}

}  // namespace reservoir
