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

// get_free_block's candidate when the best fit lies in a VM segment.
bool CachingAllocator::Impl::vm_candidate(const AllocParams& p, detail::BlockSet::iterator& it) {
  const BlockPool& pool = *p.pool;
  if (vm_on()) {
    // A cached block followed by unmapped space counts, for best fit, as
    // the size it can grow to (PyTorch's rule).
    auto growable = [](const Block* b) {
      return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
    };
    auto next = std::next(it);
    while ((*it)->segment->vm && next != pool.blocks.end() && (*next)->stream == p.stream &&
           growable(*next) < growable(*it)) {
      it = next++;
    }
  } else {
    // Virtual memory was switched off: only classic segments serve requests.
    do {
      ++it;
    } while (it != pool.blocks.end() && (*it)->segment->vm && (*it)->stream == p.stream);
    if (it == pool.blocks.end() || (*it)->stream != p.stream) return false;
  }
  // A stitched block is never split: it serves only requests that use all its pages.
  while (in_stitched(*it) && (*it)->size - p.size >= (*it)->segment->vm->page) {
    if (++it == pool.blocks.end() || (*it)->stream != p.stream) return false;
  }
  return true;
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

std::size_t CachingAllocator::Impl::cached_bytes() const {
  const auto allocated = static_cast<std::size_t>(stats_.allocated_bytes[0].current);
  return total_reserved_ > allocated ? total_reserved_ - allocated : 0;
}

void CachingAllocator::Impl::release_above_threshold() {
  const std::size_t cached = cached_bytes();
  if (cached <= config_.paging_release_threshold) {
    release_floor_ = 0;
    return;
  }
  // Cached memory in pieces of handles that still hold live blocks cannot
  // go: look again only once more has been freed since a fruitless look.
  if (cached <= release_floor_) return;
  bool released = false;
  try {
    released = release_free_handles(cached - config_.paging_release_threshold, nullptr);
  } catch (const DeviceError&) {
    // A handle that would not go stays cached (and counted); the next free,
    // empty_cache() or shortage tries again. The caller's free succeeded.
  }
  if (!released) release_floor_ = cached;
}

std::vector<CachingAllocator::Impl::FreeHandle> CachingAllocator::Impl::whole_free_handles(
    const Block* skip, const Block* skip_too) {
  std::vector<FreeHandle> found;
  for (auto& [base, seg] : segments_) {
    if (!seg->vm || !seg->vm->paging || seg->vm->stitched) continue;
    const VmState& vm = *seg->vm;
    for (Block* b = seg->head; b != nullptr; b = b->next) {
      if (!b->is_free() || b == skip || b == skip_too) continue;
      auto [i, end] = inner_pages(*seg, b);
      while (i < end) {
        const auto& h = vm.handles[vm.at(i)];
        if (h.first_page >= i && h.first_page + h.pages <= end) {
          found.push_back({seg.get(), h.first_page, h.first_page + h.pages});
        }
        i = h.first_page + h.pages;
      }
    }
  }
  // Largest first; among equals the highest address, so low addresses stay.
  std::sort(found.begin(), found.end(), [](const FreeHandle& a, const FreeHandle& b) {
    if (a.end - a.first != b.end - b.first) return a.end - a.first > b.end - b.first;
    return a.seg->base + a.first * a.seg->vm->page > b.seg->base + b.first * b.seg->vm->page;
  });
  return found;
}

bool CachingAllocator::Impl::release_free_handles(std::size_t bytes, const Block* keep) {
  dissolve_cached_stitched();  // their pages go back to the lenders first
  const std::vector<FreeHandle> victims = whole_free_handles(keep, nullptr);
  // Unmapping one handle may split its block: find the block again by address.
  std::size_t released = 0;
  for (const FreeHandle& v : victims) {
    if (released >= bytes) break;
    Segment& seg = *v.seg;
    Block* b = block_at(seg, seg.base + v.first * seg.vm->page);
    if (b == nullptr || !b->is_free()) continue;
    unmap_pages(b, v.first, v.end);
    released += (v.end - v.first) * seg.vm->page;
  }
  return released > 0;
}

std::vector<CachingAllocator::Impl::Recycled> CachingAllocator::Impl::recycle_free_handles(
    const Block* to_map, std::size_t bytes) {
  // Whole handles lying in cached blocks of paging arenas, this stream's and
  // the others' (their pages are safe to reuse once their stream has
  // synchronized, which unmapping does): mapped where the arena grows, they
  // serve it with no new memory. Under pressure, as many as it takes (up to
  // kMaxRecycledHandles). Otherwise one, and only a handle as large as the
  // mapping planned and at most twice it: moving it costs the same three
  // calls as creating one (unmap, map, set access), so no workload pays in
  // calls for the memory it saves, and caches are not stripped for small
  // needs. The blocks next to `to_map` stay (their unmapping would merge
  // into it).
  std::vector<Recycled> taken;
  // Outside pressure a handle must hold `bytes`: with less cached, none does
  // (and the scan of every arena is spared on each growth).
  if (bytes == 0 || (!recycling_ && cached_bytes() < bytes)) return taken;
  const std::size_t room = std::min(to_map->size, recycling_ ? bytes : 2 * bytes);
  const std::size_t most = recycling_ ? kMaxRecycledHandles : 1;
  const std::size_t page = to_map->segment->vm->page;
  const std::vector<FreeHandle> victims = whole_free_handles(to_map->prev, to_map->next);
  if (victims.empty()) return taken;
  // Fewest handles: the largest first that fits the room.
  std::size_t covered = 0;
  for (const FreeHandle& v : victims) {
    if (covered >= bytes || taken.size() >= most) break;
    const std::size_t size = (v.end - v.first) * page;
    if (covered + size > room || (!recycling_ && size < bytes)) continue;
    Segment& seg = *v.seg;
    // Unmapping a handle may have split its block: find it again by address.
    Block* b = block_at(seg, seg.base + v.first * page);
    if (b == nullptr || !b->is_free()) continue;
    const std::size_t before = taken.size();
    try {
      unmap_pages(b, v.first, v.end, &taken);
    } catch (...) {
      for (const Recycled& r : taken) {
        if (device_.release_physical(r.handle) != Status::ok) unreleased_.push_back(r.handle);
      }
      throw;
    }
    for (std::size_t k = before; k < taken.size(); ++k) covered += taken[k].bytes;
  }
  return taken;
}

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
  if (vm.paging) pieces = recycle_free_handles(to_map, mapped_bytes);
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
      if (device_.release_physical(r.handle) != Status::ok) unreleased_.push_back(r.handle);
    }
  };
  if (vm.paging && set_fraction_ && total_reserved_ + mapped_bytes > allowed_memory_maximum_) {
    undo();  // the taken handles go back to the device: the ladder carries on
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
  for (const Recycled& r : pieces) {
    vm.add(r.handle, page_at, r.bytes / page);
    page_at += r.bytes / page;
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
  for (const std::size_t t : stat_types(pool)) add_stat(stats_.reserved_bytes[t], mapped_bytes);
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
      unreleased_.push_back(h.handle);
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
    for (const std::size_t t : stat_types(pool)) sub_stat(stats_.reserved_bytes[t], usize);
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
  auto cached = [&](DevicePtr ptr, std::size_t size, Block* prev, Block* next) RESERVOIR_REQUIRES(mutex_) {
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
    it = device_.release_physical(*it) == Status::ok ? unreleased_.erase(it) : std::next(it);
  }
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
  --vm_segments_;
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
