// Virtual-memory segments (vm_policy.cpp): mapping pages under a block and
// unmapping whole free pages, carving and re-caching blocks, and releasing
// a segment's reservation.
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

bool CachingAllocator::Impl::map_block(Block* to_map, std::size_t bytes) {
  Segment& seg = *to_map->segment;
  VmState& vm = *seg.vm;
  BlockPool& pool = *to_map->pool;
  const std::size_t page = vm.page;
  const std::size_t first = (to_map->ptr - seg.base) / page;
  std::size_t end = (to_map->ptr - seg.base + bytes + page - 1) / page;
  std::size_t mapped_bytes = (end - first) * page;
  const DevicePtr va = seg.base + first * page;
  // The pieces mapped in order from va: whole free handles taken from
  // elsewhere first (paging), then fresh memory for the rest (paging: one
  // handle; expandable segments: one per page).
  std::vector<Recycled> pieces;
  if (vm.paging) {
    ++growths_;
    pieces = recycle_free_handles(to_map, mapped_bytes);
  }
  const std::size_t moved = pieces.size();
  std::size_t recycled_bytes = 0;
  for (const Recycled& r : pieces) recycled_bytes += r.bytes;
  mapped_bytes = std::max(mapped_bytes, recycled_bytes);
  end = first + mapped_bytes / page;
  const std::size_t fresh_pages = end - first - recycled_bytes / page;
  const std::size_t pages_per_handle = vm.paging ? fresh_pages : 1;
  const std::size_t handle_bytes = pages_per_handle * page;
  const std::size_t count = pages_per_handle == 0 ? 0 : fresh_pages / pages_per_handle;

  // Undo: unmap what was mapped, release what was created or taken (taken
  // handles were already counted out of reserved memory where they were).
  // Failures here are kept for a later release attempt rather than hidden.
  std::size_t mapped_count = 0;
  auto undo = [&]() RESERVOIR_REQUIRES(mutex_) {
    DevicePtr at = va;
    for (std::size_t k = 0; k < mapped_count; ++k) {
      if (device_.unmap(at, pieces[k].bytes) != Status::ok) {
        stuck_mappings_.emplace_back(at, pieces[k].bytes);
      }
      at += pieces[k].bytes;
    }
    for (const Recycled& r : pieces) {
      if (device_.release_physical(r.handle) != Status::ok) {
        keep_unreleased(r.handle, r.bytes, stat_index(pool));
      }
    }
  };
  if (vm.paging && set_fraction_ && total_reserved_ + mapped_bytes > allowed_memory_maximum_) {
    undo();  // the taken handles go back to the device: the ladder carries on
    return false;
  }
  // Many fresh pages (an expandable segment takes one handle each): when the
  // device has not the memory for them, creating them one by one until it
  // says so (as PyTorch does) ends the same way, and takes time in
  // proportion to the request. Asked only where that time would show.
  if (count > kHeadroomCheckHandles && fresh_pages * page > mapping_headroom()) {
    undo();
    return false;
  }
  for (std::size_t k = 0; k < count; ++k) {
    PhysicalHandle h = 0;
    const Status st = device_.create_physical(handle_bytes, &h);
    if (st != Status::ok) {
      undo();
      if (st == Status::out_of_memory) return false;
      throw DeviceError(CallKind::create_physical, st,
                        fmt::format("creating {} bytes of physical memory for {:#x}", handle_bytes,
                                    va + recycled_bytes + k * handle_bytes));
    }
    pieces.push_back({h, handle_bytes});
  }
  DevicePtr at = va;
  for (const Recycled& r : pieces) {
    const Status st = device_.map(at, r.bytes, r.handle, 0);
    if (st != Status::ok) {
      undo();
      throw DeviceError(CallKind::map, st, fmt::format("mapping {} bytes at {:#x}", r.bytes, at));
    }
    ++mapped_count;
    at += r.bytes;
  }
  const Status access = device_.set_access(va, mapped_bytes);
  if (access != Status::ok) {
    undo();
    throw DeviceError(CallKind::set_access, access,
                      fmt::format("setting access to {} bytes at {:#x}", mapped_bytes, va));
  }
  std::size_t page_at = first;
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    const std::uint32_t slot = vm.add(pieces[k].handle, page_at, pieces[k].bytes / page);
    if (k < moved) vm.handles[slot].moved_at = growths_;
    page_at += pieces[k].bytes / page;
  }

  pool.unmapped.erase(to_map);
  to_map->mapped = true;
  if (mapped_bytes < to_map->size) {
    // to_map -> remaining (still unmapped) -> next
    Block* remaining = make_block(to_map->ptr + mapped_bytes, to_map->size - mapped_bytes,
                                  to_map->stream, &pool, &seg);
    remaining->mapped = false;
    remaining->prev = to_map;
    remaining->next = to_map->next;
    if (to_map->next != nullptr) to_map->next->prev = remaining;
    to_map->next = remaining;
    to_map->size = mapped_bytes;
    pool.unmapped.insert(remaining);
  }
  recache(to_map);  // merged with cached neighbours, into the pool

  total_reserved_ += mapped_bytes;
  add_stats(stats_.reserved_bytes, stat_index(pool), mapped_bytes);
  if (pool.owner != nullptr) {
    StatArray& reserved = pool_reserved_[pool.owner->id];
    reserved[0].increase(mapped_bytes);
    reserved[stat_index(pool)].increase(mapped_bytes);
  }
  ++stats_.num_device_alloc;
  trace(TraceAction::segment_map, va, mapped_bytes, seg.stream);
  return true;
}

void CachingAllocator::Impl::merge_unmapped(Block* dst, Block* src) {
  if (src == nullptr || src->mapped) return;
  BlockPool& pool = *dst->pool;
  pool.unmapped.erase(src);
  if (dst->prev == src) {
    // src is not null here (returned above); clang's analyzer loses that.
    dst->ptr = src->ptr;  // NOLINT(clang-analyzer-core.NullDereference)
    dst->prev = src->prev;
    if (dst->prev != nullptr) {
      dst->prev->next = dst;
    } else {
      dst->segment->head = dst;
    }
  } else {
    dst->next = src->next;
    if (dst->next != nullptr) dst->next->prev = dst;
  }
  dst->size += src->size;
  arena_.recycle(src);
}

void CachingAllocator::Impl::unmap_block(Block* block) {
  if (block->segment->vm->stitched) {
    dissolve_stitched(block);
    return;
  }
  Segment& seg = *block->segment;
  VmState& vm = *seg.vm;
  auto [first, end] = inner_pages(seg, block);
  // Whole handles only: a handle shared with a neighbour stays.
  while (first < end && vm.handles[vm.at(first)].first_page < first) {
    const auto& h = vm.handles[vm.at(first)];
    first = h.first_page + h.pages;
  }
  while (end > first) {
    const auto& h = vm.handles[vm.at(end - 1)];
    if (h.first_page + h.pages <= end) break;
    end = h.first_page;
  }
  if (first >= end) return;
  unmap_pages(block, first, end);
}

void CachingAllocator::Impl::unmap_pages(Block* block, std::size_t first, std::size_t end,
                                         std::vector<Recycled>* kept) {
  Segment& seg = *block->segment;
  VmState& vm = *seg.vm;
  const std::size_t page = vm.page;
  const Status sync = device_.synchronize_stream(seg.stream);
  if (sync != Status::ok) {
    throw DeviceError(CallKind::synchronize_stream, sync,
                      fmt::format("synchronizing stream {} before unmapping at {:#x}", seg.stream,
                                  seg.base + first * page));
  }
  // Unmap handle by handle; a failure stops the walk, and the pages already
  // unmapped are accounted before the error is raised.
  Status failed = Status::ok;
  CallKind failed_call = CallKind::unmap;
  std::size_t done = first;
  while (done < end) {
    const std::uint32_t slot = vm.at(done);
    const VmState::Handle h = vm.handles[slot];
    const Status st = device_.unmap(seg.base + h.first_page * page, h.pages * page);
    if (st != Status::ok) {
      failed = st;
      break;
    }
    vm.remove(slot);
    done = h.first_page + h.pages;
    if (kept != nullptr) {
      kept->push_back({h.handle, h.pages * page});  // mapped again elsewhere
      continue;
    }
    const Status rel = device_.release_physical(h.handle);
    if (rel != Status::ok) {
      keep_unreleased(h.handle, h.pages * page, stat_index(*block->pool));
      failed = rel;
      failed_call = CallKind::release_physical;
      break;
    }
  }
  if (done > first) {
    const DevicePtr uptr = seg.base + first * page;
    const std::size_t usize = (done - first) * page;
    BlockPool& pool = *block->pool;
    block = carve(block, uptr, usize);
    block->mapped = false;
    merge_unmapped(block, block->prev);
    merge_unmapped(block, block->next);
    pool.unmapped.insert(block);
    total_reserved_ -= usize;
    sub_stats(stats_.reserved_bytes, stat_index(pool), usize);
    if (pool.owner != nullptr) {
      StatArray& reserved = pool_reserved_[pool.owner->id];
      reserved[0].decrease(usize);
      reserved[stat_index(pool)].decrease(usize);
      // PyTorch's count of a private pool's device allocations falls by one
      // per unmapping (it rose by one per request served by mapping).
      if (pool.owner->device_alloc_count > 0) --pool.owner->device_alloc_count;
    }
    ++stats_.num_device_free;
    trace(TraceAction::segment_unmap, uptr, usize, seg.stream);
  }
  if (failed != Status::ok) {
    throw DeviceError(failed_call, failed,
                      fmt::format("unmapping the free pages of the block at {:#x}", block->ptr));
  }
}

Block* CachingAllocator::Impl::carve(Block* block, DevicePtr start, std::size_t bytes) {
  BlockPool& pool = *block->pool;
  Segment& seg = *block->segment;
  pool.erase(block);
  const std::size_t before = start - block->ptr;
  const std::size_t after = block->size - before - bytes;
  // A cached block for [ptr, ptr + size), linked between prev and next.
  auto cached = [&](DevicePtr ptr, std::size_t size, Block* prev, Block* next)
                    RESERVOIR_REQUIRES(mutex_) {
                      Block* b = make_block(ptr, size, block->stream, &pool, &seg);
                      b->prev = prev;
                      b->next = next;
                      if (prev != nullptr) {
                        prev->next = b;
                      } else {
                        seg.head = b;
                      }
                      if (next != nullptr) next->prev = b;
                      pool.insert(b);
                    };
  if (before > 0) cached(block->ptr, before, block->prev, block);
  if (after > 0) cached(start + bytes, after, block, block->next);
  block->ptr = start;
  block->size = bytes;
  return block;
}

void CachingAllocator::Impl::recache(Block* b) {
  BlockPool& pool = *b->pool;
  if (Block* prev = b->prev; prev != nullptr && prev->is_free()) {
    pool.erase(prev);
    b->ptr = prev->ptr;
    b->size += prev->size;
    b->prev = prev->prev;
    if (b->prev != nullptr) {
      b->prev->next = b;
    } else {
      b->segment->head = b;
    }
    arena_.recycle(prev);
  }
  if (Block* next = b->next; next != nullptr && next->is_free()) {
    pool.erase(next);
    b->size += next->size;
    b->next = next->next;
    if (b->next != nullptr) b->next->prev = b;
    arena_.recycle(next);
  }
  pool.insert(b);
}

void CachingAllocator::Impl::retry_stuck() noexcept {
  // Unmappings, then address space, then handles: each needs the one before.
  for (auto it = stuck_mappings_.begin(); it != stuck_mappings_.end();) {
    it = device_.unmap(it->first, it->second) == Status::ok ? stuck_mappings_.erase(it)
                                                            : std::next(it);
  }
  for (auto it = stuck_reservations_.begin(); it != stuck_reservations_.end();) {
    it = device_.unreserve(it->first, it->second) == Status::ok ? stuck_reservations_.erase(it)
                                                                : std::next(it);
  }
  for (auto it = unreleased_.begin(); it != unreleased_.end();) {
    if (device_.release_physical(it->handle) != Status::ok) {
      ++it;
      continue;
    }
    total_reserved_ -= it->bytes;
    sub_stats(stats_.reserved_bytes, it->index, it->bytes);
    it = unreleased_.erase(it);
  }
}

void CachingAllocator::Impl::keep_unreleased(PhysicalHandle handle, std::size_t bytes,
                                             std::size_t index) {
  unreleased_.push_back({handle, bytes, index});
  total_reserved_ += bytes;
  add_stats(stats_.reserved_bytes, index, bytes);
}

std::size_t CachingAllocator::Impl::unreleased_bytes() const {
  std::size_t bytes = 0;
  for (const Unreleased& u : unreleased_) bytes += u.bytes;
  return bytes;
}

void CachingAllocator::Impl::unreserve_or_retry(DevicePtr va, std::size_t bytes) {
  if (device_.unreserve(va, bytes) != Status::ok) stuck_reservations_.emplace_back(va, bytes);
}

void CachingAllocator::Impl::release_vm_blocks(const std::vector<Block*>& blocks) {
  for (Block* b : blocks) {
    if (b->segment->vm->stitched) {
      dissolve_stitched(b);
      continue;
    }
    unmap_block(b);
    if (!b->mapped && !b->is_split()) release_vm_segment(b);
  }
}

void CachingAllocator::Impl::release_vm_segment(Block* block) {
  Segment& seg = *block->segment;
  const Status st = device_.unreserve(seg.base, seg.size);
  if (st != Status::ok) {
    throw DeviceError(
        CallKind::unreserve, st,
        fmt::format("returning the address space at {:#x} ({} bytes)", seg.base, seg.size));
  }
  block->pool->unmapped.erase(block);
  const DevicePtr base = seg.base;
  arena_.recycle(block);
  segments_.erase(base);
}

void CachingAllocator::Impl::drop_vm_segment_locked(Segment& seg) noexcept {
  VmState& vm = *seg.vm;
  for (const VmState::Piece& pc : vm.pieces) {
    (void)device_.unmap(pc.va, pc.bytes);
    if (pc.fresh) (void)device_.release_physical(pc.handle);
  }
  for (std::size_t i = 0; i < vm.page_handle.size();) {
    if (vm.at(i) == VmState::kNone) {
      ++i;
      continue;
    }
    const VmState::Handle h = vm.handles[vm.at(i)];
    (void)device_.unmap(seg.base + h.first_page * vm.page, h.pages * vm.page);
    (void)device_.release_physical(h.handle);
    vm.remove(vm.at(i));
    i = h.first_page + h.pages;
  }
  (void)device_.unreserve(seg.base, seg.size);
}

}  // namespace reservoir
