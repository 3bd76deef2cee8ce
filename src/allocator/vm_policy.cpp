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
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::Segment;
using detail::VmState;

void CachingAllocator::Impl::check_supported(const AllocatorConfig& config) const {
  if (config.policy == Policy::paging && config.expandable_segments) {
    throw UsageError(fmt::format(
        "allocator config \"{}\": policy:paging and expandable_segments:True exclude each other; "
        "choose one",
        config.to_string()));
  }
  if (vm_mode(config) != VmMode::none && !device_.supports_virtual_memory()) {
    throw UsageError(
        fmt::format("allocator config \"{}\": the {} device has no virtual-memory support, which "
                    "expandable segments and policy:paging need",
                    config.to_string(), device_.name()));
  }
}

Block* CachingAllocator::Impl::new_vm_segment(const AllocParams& p) {
  const bool paging = vm_mode_ == VmMode::paging;
  const std::size_t granularity = std::max<std::size_t>(device_.granularity(), 1);
  std::size_t page =
      paging ? granularity : (p.pool->is_small ? kSmallBuffer : config_.large_segment_size);
  page = (page + granularity - 1) / granularity * granularity;
  MemoryInfo info;
  const Status info_status = device_.memory_info(&info);
  if (info_status != Status::ok) {
    throw DeviceError(CallKind::memory_info, info_status, "sizing a virtual-memory segment");
  }
  // 1 1/8 of the device, as PyTorch: room to map pages beyond a hole.
  const std::size_t space = info.total + info.total / 8;
  const std::size_t pages = std::max<std::size_t>((space + page - 1) / page, 1);
  DevicePtr va = 0;
  const Status status = device_.reserve(pages * page, 0, &va);
  if (status == Status::out_of_memory) return nullptr;
  if (status != Status::ok) {
    throw DeviceError(CallKind::reserve, status,
                      fmt::format("reserving {} bytes of address space", pages * page));
  }
  auto vm = std::make_unique<VmState>();
  vm->paging = paging;
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

Block* CachingAllocator::Impl::find_vm_candidate(const AllocParams& p) {
  BlockPool& pool = *p.pool;
  constexpr std::size_t kNoRoom = std::numeric_limits<std::size_t>::max();
  Block key;
  key.stream = p.stream;
  Block* best = nullptr;
  std::size_t best_new = kNoRoom;
  for (auto it = pool.unmapped.lower_bound(&key);
       it != pool.unmapped.end() && (*it)->stream == p.stream; ++it) {
    Block* c = *it;
    if (c->segment->vm->paging != (vm_mode_ == VmMode::paging)) continue;
    // The cached block right before the unmapped range can be used too.
    if (c->prev != nullptr && c->prev->is_available()) c = c->prev;
    const std::size_t need = unmapped_within(c, p.size);
    if (need == kNoRoom) continue;
    if (vm_mode_ == VmMode::expandable) return c;  // PyTorch: the lowest address that fits
    if (need < best_new) {
      best = c;
      best_new = need;
    }
  }
  if (best != nullptr) return best;
  return new_vm_segment(p);
}

bool CachingAllocator::Impl::alloc_vm_block(AllocParams& p) {
  if (try_alloc_vm_block(p)) return true;
  if (vm_mode_ != VmMode::paging) return false;
  // Paging under pressure: map whole free handles from elsewhere (any
  // stream's, once it has synchronized) where the arena grows; then give
  // back just enough of them (largest first) and try once more; the retry
  // ladder follows if not.
  recycling_ = true;
  bool moved = false;
  try {
    moved = try_alloc_vm_block(p);
  } catch (...) {
    recycling_ = false;
    throw;
  }
  recycling_ = false;
  if (moved) return true;
  Block* candidate = find_vm_candidate(p);
  if (candidate == nullptr) return false;
  // Ask for the whole unmapped blocks the request reaches into.
  std::size_t need = 0;
  for (const Block* b = candidate; b != nullptr && need < p.size; b = b->next) {
    if (!b->mapped) need += b->size;
    if (b->ptr + b->size >= candidate->ptr + p.size) break;
  }
  if (release_free_handles(need, candidate) && try_alloc_vm_block(p)) return true;
  // Still no contiguous run: stitch scattered free pages into a new range.
  return stitch_block(p);
}

std::size_t CachingAllocator::Impl::map_ahead_bytes(const Block* to_map, std::size_t bytes,
                                                    std::size_t request) {
  // Paging maps ahead of the request while memory is plentiful, so that a
  // growing workload makes few mappings (each is three driver calls: create,
  // map, set access). The chunk follows what the stream's arena has shown it
  // needs: a sixteenth of what it maps already, from 20 MiB (the segment
  // PyTorch gives a mid-sized request) up to 160 MiB, so that what is left
  // unused when the workload peaks stays within what the native policy loses
  // to fragmentation; a request of 128 MiB or more brings room for half
  // another like it, as large tensors come in groups. Near the limit it maps
  // only what is asked. PyTorch's expandable segments never map ahead.
  if (!to_map->segment->vm->paging) return bytes;
  const VmState& vm = *to_map->segment->vm;
  std::size_t wanted =
      std::clamp(vm.mapped_pages * vm.page / kMapAheadDivisor, kMapAheadMin, kMapAheadMax);
  if (request >= kLargeRequest) wanted = std::max(wanted, request + request / 2);
  if (bytes >= wanted) return bytes;
  MemoryInfo info;
  if (device_.memory_info(&info) != Status::ok) return bytes;
  std::size_t headroom = info.free;
  if (set_fraction_) {
    const std::size_t allowed =
        allowed_memory_maximum_ > total_reserved_ ? allowed_memory_maximum_ - total_reserved_ : 0;
    headroom = std::min(headroom, allowed);
  }
  if (headroom <= bytes) return bytes;
  const std::size_t extra = std::min(wanted - bytes, (headroom - bytes) / 8);
  return std::min(to_map->size, bytes + extra);
}

bool CachingAllocator::Impl::try_alloc_vm_block(AllocParams& p) {
  Block* candidate = find_vm_candidate(p);
  if (candidate == nullptr) return false;
  // The candidate is one of: unmapped -> *, or cached -> unmapped -> *.
  if (!candidate->mapped &&
      !map_block(candidate,
                 map_ahead_bytes(candidate, std::min(candidate->size, p.size), p.size))) {
    return false;
  }
  while (candidate->size < p.size) {
    // cached -> unmapped -> *: map part of the unmapped block; it merges.
    Block* next = candidate->next;
    if (!map_block(next,
                   map_ahead_bytes(next, std::min(p.size - candidate->size, next->size), p.size))) {
      return false;
    }
    candidate = next;
  }
  p.block = candidate;
  p.block_in_pool = true;
  return true;
}

}  // namespace reservoir
