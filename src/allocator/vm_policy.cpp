// Virtual-memory segments: PyTorch's expandable segments, and reservoir's
// paging policy built on the same structure.
//
// A VM segment is one address reservation per (stream, pool), sized from the
// device's capacity (1 1/8 of it, as PyTorch). Its blocks tile the
// reservation; address space without memory behind it is an unmapped block
// kept in pool.unmapped. Memory is mapped in pages below a free run at the
// lowest address that fits, and only whole free pages are unmapped, after
// synchronizing the segment's stream.
//
// expandable (PyTorch's): pages of 2 MiB (small pool) or 20 MiB (large pool),
//   one physical handle per page; the candidate is the lowest-address
//   unmapped range (with the cached block before it) that has room.
// paging (reservoir's): pages of the device granularity in both pools; the
//   pages mapped together for one request share one physical handle (one
//   create, one map, one set_access however many pages), and a handle is
//   released only when all its pages are free; the candidate is the one that
//   needs the fewest new pages. Cached pages stay mapped (no unmapping on
//   free), so a loop that reuses its memory makes no device calls at all.
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "allocator_impl.hpp"
#include "reservoir/detail/debug_assert.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::Segment;
using detail::VmState;

void CachingAllocator::Impl::check_supported(const AllocatorConfig& config) const {
  if (config.policy != Policy::native && config.expandable_segments) {
    throw UsageError(fmt::format(
        "allocator config \"{}\": policy:{} and expandable_segments:True exclude each other; "
        "choose one",
        config.to_string(), to_string(config.policy)));
  }
  if (detail::segment_source(detail::configured_policy(config)).info.needs_virtual_memory &&
      !device_.supports_virtual_memory()) {
    throw UsageError(
        fmt::format("allocator config \"{}\": the {} device has no virtual-memory support, which "
                    "expandable segments and policy:paging need",
                    config.to_string(), device_.name()));
  }
}

void CachingAllocator::Impl::choose_source() {
  const Policy policy = detail::configured_policy(config_);
  if (source_ == nullptr || source_->policy() != policy) {
    source_ = detail::segment_source(policy).make(*this);
    vm_source_ = source_->as_vm();
  }
  traits_ = source_->traits(config_);
  source_->configure(config_);
  update_observed();
}

std::size_t CachingAllocator::Impl::default_reserved() const {
  std::size_t in_private = 0;
  for (const auto& [id, reserved] : pool_reserved_) {
    in_private += static_cast<std::size_t>(reserved[0].current);
  }
  return total_reserved_ > in_private ? total_reserved_ - in_private : 0;
}

std::size_t CachingAllocator::Impl::mapping_headroom() {
  MemoryInfo info;
  if (device_.memory_info(&info) != Status::ok) return 0;
  std::size_t headroom = info.free;
  if (set_fraction_) {
    const std::size_t allowed =
        allowed_memory_maximum_ > total_reserved_ ? allowed_memory_maximum_ - total_reserved_ : 0;
    headroom = std::min(headroom, allowed);
  }
  return headroom;
}

Block* CachingAllocator::Impl::new_vm_segment(AllocParams& p) {
  RESERVOIR_DEBUG_ASSERT(vm_source_ != nullptr);
  const std::size_t granularity = std::max<std::size_t>(device_.granularity(), 1);
  std::size_t page = vm_source_->page_size(*p.pool, granularity, config_);
  page = (page + granularity - 1) / granularity * granularity;
  MemoryInfo info;
  const Status info_status = device_.memory_info(&info);
  if (info_status != Status::ok) {
    throw DeviceError(CallKind::memory_info, info_status, "sizing a virtual-memory segment");
  }
  // 1 1/8 of the device, as PyTorch: room to map pages beyond a hole; for
  // PyTorch's expandable segments the stream's reserve where one is set
  // (2.15's expandable_segments_reserve, at most that much). No segment of
  // it can hold a larger request: none is made, and the request goes down
  // the ladder to its out-of-memory error, which says why.
  // (The message names the reserve only where the setting is why: a request
  // larger than 9/8 of the device fits no segment anyway.)
  const std::size_t full = info.total + info.total / 8;
  std::size_t space = full;
  std::string reserve_class;
  if (vm_source_->lowest_fit()) {
    if (const auto it = reserve_classes_.find(p.stream); it != reserve_classes_.end()) reserve_class = it->second;
    space = config_.segment_reserve(reserve_class, info.total);
  }
  const auto pages_of = [page](std::size_t bytes) { return std::max<std::size_t>((bytes + page - 1) / page, 1); };
  const std::size_t pages = pages_of(space);
  if (pages * page < p.size) {
    if (pages_of(full) * page >= p.size) {
      refused_reserve_ = space;
      refused_reserve_class_ = reserve_class;
    }
    return nullptr;
  }
  DevicePtr va = 0;
  const Status status = device_.reserve(pages * page, 0, &va);
  if (status == Status::out_of_memory) return nullptr;
  if (status != Status::ok) {
    throw DeviceError(CallKind::reserve, status,
                      fmt::format("reserving {} bytes of address space", pages * page));
  }
  auto vm = std::make_unique<VmState>();
  vm->paging = vm_source_->shares_handles();
  vm->page = page;
  vm->pages = pages;
  Block* b = add_segment(va, pages * page, p.stream, p.pool, std::move(vm))->head;
  b->mapped = false;
  p.pool->unmapped.insert(b);
  return b;
}

std::pair<std::size_t, std::size_t> CachingAllocator::Impl::inner_pages(const Segment& seg,
                                                                        const Block* b) {
  const std::size_t page = seg.vm->page;
  const std::size_t offset = b->ptr - seg.base;
  return {(offset + page - 1) / page, (offset + b->size) / page};
}

std::size_t CachingAllocator::Impl::unmapped_within(const Block* b, std::size_t size) {
  std::size_t bytes = 0;
  std::size_t unmapped = 0;
  while (bytes < size && b != nullptr && b->is_available()) {
    if (!b->mapped) unmapped += std::min(b->size, size - bytes);
    bytes += b->size;
    b = b->next;
  }
  return bytes >= size ? unmapped : std::numeric_limits<std::size_t>::max();
}

Block* CachingAllocator::Impl::find_vm_candidate(AllocParams& p) {
  BlockPool& pool = *p.pool;
  constexpr std::size_t kNoRoom = std::numeric_limits<std::size_t>::max();
  RESERVOIR_DEBUG_ASSERT(vm_source_ != nullptr);
  const bool shares = vm_source_->shares_handles();
  const bool lowest_fit = vm_source_->lowest_fit();
  Block key;
  key.stream = p.stream;
  Block* best = nullptr;
  std::size_t best_new = kNoRoom;
  for (auto it = pool.unmapped.lower_bound(&key);
       it != pool.unmapped.end() && (*it)->stream == p.stream; ++it) {
    Block* c = *it;
    if (c->segment->vm->paging != shares) continue;  // segments of the source's kind
    // The cached block right before the unmapped range can be used too.
    if (c->prev != nullptr && c->prev->is_available()) c = c->prev;
    const std::size_t need = unmapped_within(c, p.size);
    if (need == kNoRoom) continue;
    if (lowest_fit) return c;  // PyTorch's expandable segments
    if (need < best_new) {
      best = c;
      best_new = need;
    }
  }
  if (best != nullptr) return best;
  return new_vm_segment(p);
}

bool CachingAllocator::Impl::try_alloc_vm_block(AllocParams& p, bool recycling) {
  // recycling_ is read by recycle_free_handles, which map_block calls.
  recycling_ = recycling;
  try {
    const bool found = grow_vm_block(p);
    recycling_ = false;
    return found;
  } catch (...) {
    recycling_ = false;
    throw;
  }
}

bool CachingAllocator::Impl::grow_vm_block(AllocParams& p) {
  Block* candidate = find_vm_candidate(p);
  if (candidate == nullptr) return false;
  // The candidate is one of: unmapped -> *, or cached -> unmapped -> *.
  if (!candidate->mapped &&
      !map_block(candidate,
                 vm_source_->map_bytes(candidate, std::min(candidate->size, p.size), p.size))) {
    return false;
  }
  while (candidate->size < p.size) {
    // cached -> unmapped -> *: map part of the unmapped block; it merges.
    Block* next = candidate->next;
    if (!map_block(next,
                   vm_source_->map_bytes(next, std::min(p.size - candidate->size, next->size), p.size))) {
      return false;
    }
    candidate = next;
  }
  p.block = candidate;
  p.block_in_pool = true;
  return true;
}

}  // namespace reservoir
