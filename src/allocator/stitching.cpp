// Stitching, the paging policy's last resort: when no segment has a free run
// for a request, a new address range is mapped onto the free physical
// handles of this stream's segments (lent, each whole: CUDA maps a handle
// from its start only, so a handle some of whose pages are in use cannot be
// lent), plus fresh memory for the rest. A stitched block is never split;
// when it is freed and cached memory is released, it is dissolved and its
// handles go back to their lenders.
#include <fmt/format.h>

#include <algorithm>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::Segment;
using detail::VmState;

Block* CachingAllocator::Impl::block_at(Segment& seg, DevicePtr addr) {
  Block* b = seg.head;
  while (b != nullptr && b->ptr + b->size <= addr) b = b->next;
  return b;
}

bool CachingAllocator::Impl::stitch_block(AllocParams& p) {
  const std::size_t page = std::max<std::size_t>(device_.granularity(), 1);
  const std::size_t needed = (p.size + page - 1) / page;
  // Free handles of this stream's paging segments, each whole (all its pages
  // inside a free block), in address order.
  struct Span {
    Segment* seg;
    std::size_t first;
    std::size_t end;
  };
  std::vector<Span> spans;
  std::size_t have = 0;
  std::vector<StreamId> other_streams;
  // This stream's pages first; then other streams' pages, which are safe to
  // reuse once their stream is synchronized.
  for (int pass = 0; pass < 2 && have < needed; ++pass) {
    for (auto& [base, segp] : segments_) {
      Segment& seg = *segp;
      if (have >= needed) break;
      if (!seg.vm || !seg.vm->paging || seg.vm->stitched || seg.vm->page != page ||
          (seg.stream == p.stream) != (pass == 0)) {
        continue;
      }
      const VmState& vm = *seg.vm;
      const std::size_t before = have;
      for (Block* b = seg.head; b != nullptr && have < needed; b = b->next) {
        if (!b->is_free()) continue;
        auto [i, end] = inner_pages(seg, b);
        while (i < end && have < needed) {
          const auto& h = vm.handles[vm.at(i)];
          const std::size_t e = h.first_page + h.pages;
          if (h.first_page == i && e <= end) {
            spans.push_back({&seg, i, e});
            have += e - i;
          }
          i = e;
        }
      }
      if (pass == 1 && have > before &&
          std::find(other_streams.begin(), other_streams.end(), seg.stream) ==
              other_streams.end()) {
        other_streams.push_back(seg.stream);
      }
    }
  }
  if (spans.empty()) return false;
  // The last handle may hold more pages than the request still needed.
  const std::size_t fresh_pages = needed > have ? needed - have : 0;
  const std::size_t total = needed > have ? needed : have;
  if (set_fraction_ && total_reserved_ + fresh_pages * page > allowed_memory_maximum_) {
    return false;
  }
  for (StreamId other : other_streams) {
    const Status sync = device_.synchronize_stream(other);
    if (sync != Status::ok) {
      throw DeviceError(CallKind::synchronize_stream, sync,
                        fmt::format("synchronizing stream {} to borrow its free pages", other));
    }
  }
  const std::size_t bytes = total * page;
  DevicePtr va = 0;
  const Status reserved = device_.reserve(bytes, 0, &va);
  if (reserved == Status::out_of_memory) return false;
  if (reserved != Status::ok) {
    throw DeviceError(CallKind::reserve, reserved,
                      fmt::format("reserving {} bytes to stitch free pages", bytes));
  }
  std::vector<VmState::Piece> pieces;
  PhysicalHandle fresh = 0;
  bool have_fresh = false;
  auto undo = [&]() RESERVOIR_REQUIRES(mutex_) {
    bool clean = true;
    for (const VmState::Piece& pc : pieces) {
      if (device_.unmap(pc.va, pc.bytes) != Status::ok) {
        stuck_mappings_.emplace_back(pc.va, pc.bytes);
        clean = false;
      }
    }
    if (have_fresh && device_.release_physical(fresh) != Status::ok) {
      keep_unreleased(fresh, fresh_pages * page, stat_index(*p.pool));
    }
    if (!clean || device_.unreserve(va, bytes) != Status::ok) {
      stuck_reservations_.emplace_back(va, bytes);
    }
  };
  // Fresh memory first: running out of it must not need any unmapping.
  if (fresh_pages > 0) {
    const Status st = device_.create_physical(fresh_pages * page, &fresh);
    if (st != Status::ok) {
      undo();
      if (st == Status::out_of_memory) return false;
      throw DeviceError(
          CallKind::create_physical, st,
          fmt::format("creating {} bytes to complete a stitched range", fresh_pages * page));
    }
    have_fresh = true;
  }
  std::size_t cursor = 0;
  for (const Span& span : spans) {
    const VmState& vm = *span.seg->vm;
    const auto& h = vm.handles[vm.at(span.first)];
    const VmState::Piece pc{va + cursor * page, (span.end - span.first) * page, h.handle, 0, false};
    const Status st = device_.map(pc.va, pc.bytes, pc.handle, pc.offset);
    if (st != Status::ok) {
      undo();
      throw DeviceError(CallKind::map, st,
                        fmt::format("stitching {} free bytes at {:#x}", pc.bytes, pc.va));
    }
    pieces.push_back(pc);
    cursor += span.end - span.first;
  }
  if (fresh_pages > 0) {
    const VmState::Piece pc{va + cursor * page, fresh_pages * page, fresh, 0, true};
    const Status mapped = device_.map(pc.va, pc.bytes, fresh, 0);
    if (mapped != Status::ok) {
      undo();
      throw DeviceError(CallKind::map, mapped,
                        fmt::format("mapping {} fresh bytes at {:#x}", pc.bytes, pc.va));
    }
    pieces.push_back(pc);
  }
  const Status access = device_.set_access(va, bytes);
  if (access != Status::ok) {
    undo();
    throw DeviceError(CallKind::set_access, access,
                      fmt::format("setting access to a stitched range at {:#x}", va));
  }

  auto vm = std::make_unique<VmState>();
  vm->paging = true;
  vm->stitched = true;
  vm->page = page;
  vm->pages = total;
  vm->pieces = std::move(pieces);
  for (const Span& span : spans) {
    const DevicePtr start = span.seg->base + span.first * page;
    Block* lender = carve(block_at(*span.seg, start), start, (span.end - span.first) * page);
    lender->lent = true;
    vm->lent.push_back(lender);
  }
  Block* b = add_segment(va, bytes, p.stream, p.pool, std::move(vm))->head;
  total_reserved_ += fresh_pages * page;
  add_stats(stats_.reserved_bytes, stat_index(*p.pool), fresh_pages * page);
  ++stats_.num_device_alloc;
  trace(TraceAction::segment_map, va, bytes, p.stream);
  p.pool->insert(b);
  p.block = b;
  p.block_in_pool = true;
  return true;
}

void CachingAllocator::Impl::dissolve_cached_stitched() {
  std::vector<Block*> stitched;
  for (auto& [base, seg] : segments_) {
    if (seg->vm && seg->vm->stitched && seg->head->is_free()) stitched.push_back(seg->head);
  }
  for (Block* b : stitched) dissolve_stitched(b);
}

void CachingAllocator::Impl::dissolve_stitched(Block* block) {
  Segment& seg = *block->segment;
  VmState& vm = *seg.vm;
  synchronize_segment_stream(seg, "unstitching", seg.base);
  for (std::size_t k = 0; k < vm.pieces.size(); ++k) {
    const VmState::Piece& pc = vm.pieces[k];
    const Status st = device_.unmap(pc.va, pc.bytes);
    if (st != Status::ok) {
      // Put back what was unmapped so the stitched block stays whole.
      for (std::size_t j = 0; j < k; ++j) {
        const VmState::Piece& back = vm.pieces[j];
        (void)device_.map(back.va, back.bytes, back.handle, back.offset);
      }
      if (k > 0) (void)device_.set_access(seg.base, seg.size);
      throw DeviceError(CallKind::unmap, st,
                        fmt::format("unmapping a stitched range at {:#x}", pc.va));
    }
  }
  std::size_t fresh_bytes = 0;
  for (const VmState::Piece& pc : vm.pieces) {
    if (!pc.fresh) continue;
    fresh_bytes += pc.bytes;
    if (device_.release_physical(pc.handle) != Status::ok) {
      keep_unreleased(pc.handle, pc.bytes, stat_index(*block->pool));
    }
  }
  unreserve_or_retry(seg.base, seg.size);
  block->pool->erase(block);
  for (Block* lender : vm.lent) {
    lender->lent = false;
    recache(lender);
  }
  total_reserved_ -= fresh_bytes;
  sub_stats(stats_.reserved_bytes, stat_index(*block->pool), fresh_bytes);
  ++stats_.num_device_free;
  trace(TraceAction::segment_unmap, seg.base, seg.size, seg.stream);
  const DevicePtr base = seg.base;
  arena_.recycle(block);
  segments_.erase(base);
}

}  // namespace reservoir
