// Virtual-memory segments (vm_policy.cpp): giving cached memory back under
// the paging policy. A physical handle goes only when all its pages are
// free; free handles are released above the release threshold, or taken
// apart and their pages recycled into a request that needs them.
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

namespace {
// Arena growths after a move before the same handle moves again outside
// pressure: long enough that up to eight streams taking turns each keep
// memory of their own, short enough that memory still follows a workload
// from one stream to another between its phases (measured at 4, 8 and 16:
// docs/benchmarks.md).
constexpr std::uint64_t kMoveCooldown = 8;
}  // namespace

std::size_t CachingAllocator::Impl::cached_bytes() const {
  const auto allocated = static_cast<std::size_t>(all_current(stats_.allocated_bytes));
  return total_reserved_ > allocated ? total_reserved_ - allocated : 0;
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

bool CachingAllocator::Impl::release_free_handles(std::size_t bytes, const Block* keep,
                                                  bool keep_served) {
  // Stitched blocks' pages go back to the lenders first; that merges the
  // lenders with their free neighbours, which a block being served may be.
  if (!keep_served) dissolve_cached_stitched();
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
  // needs; nor is a handle moved within the last kMoveCooldown growths:
  // streams that take turns would otherwise move one handle back and forth
  // on every request (sync, unmap, map, set access each time), where
  // memory of each stream's own, created once, costs no call after. The
  // blocks next to `to_map` stay (their unmapping would merge into it).
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
    if (!recycling_) {
      const std::uint64_t moved_at = seg.vm->handles[seg.vm->at(v.first)].moved_at;
      if (moved_at != 0 && growths_ - moved_at < kMoveCooldown) continue;
    }
    // Unmapping a handle may have split its block: find it again by address.
    Block* b = block_at(seg, seg.base + v.first * page);
    if (b == nullptr || !b->is_free()) continue;
    const std::size_t before = taken.size();
    try {
      unmap_pages(b, v.first, v.end, &taken);
    } catch (...) {
      for (const Recycled& r : taken) {
        if (device_.release_physical(r.handle) != Status::ok) {
          keep_unreleased(r.handle, r.bytes, stat_index(*seg.pool));
        }
      }
      throw;
    }
    for (std::size_t k = before; k < taken.size(); ++k) covered += taken[k].bytes;
  }
  return taken;
}

}  // namespace reservoir
