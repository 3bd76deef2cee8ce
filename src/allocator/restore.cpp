// Restoring a recorded segment layout into an empty allocator.
#include <fmt/format.h>

#include <algorithm>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::Segment;

void CachingAllocator::Impl::restore(const Snapshot& layout,
                                     const std::vector<ExpandableReservation>& reservations) {
  detail::LockGuard lock(mutex_);
  if (!segments_.empty() || allocated_.size() != 0) {
    throw UsageError("restore: the allocator already holds memory; restore needs an empty one");
  }
  try {
    restore_locked(layout);
    restore_vm_locked(layout, reservations);
  } catch (...) {
    drop_all_locked();
    throw;
  }
}

void CachingAllocator::Impl::drop_all_locked() noexcept {
  for (auto& [base, seg] : segments_) {
    if (seg->vm) {
      drop_vm_segment_locked(*seg);
    } else {
      try {
        free_classic_segment(*seg);
      } catch (...) {  // NOLINT(bugprone-empty-catch): dropping everything; nothing to report to
      }
    }
    for (Block* b = seg->head; b != nullptr;) {
      Block* next = b->next;
      arena_.recycle(b);
      b = next;
    }
  }
  segments_.clear();
  allocated_.clear();
  large_.blocks.clear();
  small_.blocks.clear();
  large_.unmapped.clear();
  small_.unmapped.clear();
  total_reserved_ = 0;
  // Everything counted goes (from a combined sum too: it is owned here).
  const std::int64_t max_split = stats_.max_split_size;
  stats_ = DeviceStats{};
  stats_.max_split_size = max_split;
  accumulated_base_ = {};
  own_peaks_ = DeviceStats{};
  if (combined_.load(std::memory_order_relaxed) != nullptr) took_sum();
}

void CachingAllocator::Impl::restore_locked(const Snapshot& layout) {
  DevicePtr previous_end = 0;
  for (const SegmentInfo& info : layout.segments) {
    const std::string where = fmt::format("restore: segment at {:#x}", info.address);
    if (info.address < previous_end) throw UsageError(where + " overlaps the one before it");
    if (info.pool_id != PoolId{0, 0}) throw UsageError(where + " belongs to a private pool");
    if (info.is_expandable) continue;  // restore_vm_locked's
    if (info.blocks.empty()) throw UsageError(where + " has no blocks");
    BlockPool& pool = info.is_large ? large_ : small_;
    DevicePtr got = 0;
    const Status status = device_.allocate_segment(info.total_size, &got);
    if (status != Status::ok) {
      throw DeviceError(CallKind::allocate_segment, status,
                        fmt::format("{}: asking the device for {} bytes", where, info.total_size));
    }
    if (got != info.address) {
      (void)device_.free_segment(got);
      throw UsageError(fmt::format("{}: the device gave address {:#x}", where, got));
    }
    Segment* seg = add_segment(got, info.total_size, info.stream, &pool, nullptr, false);
    count_segment_alloc(pool, info.total_size);

    const bool split = info.blocks.size() > 1;
    DevicePtr cursor = info.address;
    Block* prev = nullptr;
    for (const BlockInfo& bi : info.blocks) {
      if (bi.address != cursor || bi.size == 0 || bi.size % kMinBlockSize != 0) {
        throw UsageError(
            fmt::format("{}: block at {:#x} of {} bytes does not tile the segment "
                        "(expected a multiple of 512 bytes at {:#x})",
                        where, bi.address, bi.size, cursor));
      }
      if (bi.state == BlockState::active_pending_free) {
        throw UsageError(
            fmt::format("{}: block at {:#x} is pending free; restore takes "
                        "allocated or inactive blocks",
                        where, bi.address));
      }
      if (bi.requested_size > bi.size) {
        throw UsageError(fmt::format("{}: block at {:#x} of {} bytes was requested as {} bytes",
                                     where, bi.address, bi.size, bi.requested_size));
      }
      Block* b = make_block(bi.address, bi.size, info.stream, &pool, seg);
      b->prev = prev;
      if (prev != nullptr) {
        prev->next = b;
      } else {
        seg->head = b;
      }
      prev = b;
      cursor += bi.size;
      if (bi.state == BlockState::active_allocated) {
        count_allocation(b, bi.requested_size);
      } else {
        if (b->prev != nullptr && b->prev->is_free()) {
          throw UsageError(
              fmt::format("{}: free blocks at {:#x} and {:#x} are neighbours (they "
                          "would have merged)",
                          where, b->prev->ptr, b->ptr));
        }
        pool.insert(b);
        if (split) {
          add_stats(stats_.inactive_split, stat_index(pool), 1);
          add_stats(stats_.inactive_split_bytes, stat_index(pool), b->size);
        }
      }
    }
    if (cursor != info.address + info.total_size) {
      throw UsageError(fmt::format("{}: blocks cover {} of {} bytes", where, cursor - info.address,
                                   info.total_size));
    }
    previous_end = info.address + info.total_size;
  }
}

void CachingAllocator::Impl::restore_vm_locked(
    const Snapshot& layout, const std::vector<ExpandableReservation>& reservations) {
  const bool any = std::any_of(layout.segments.begin(), layout.segments.end(),
                               [](const SegmentInfo& s) { return s.is_expandable; });
  if (!any && reservations.empty()) return;
  if (source_->policy() != Policy::expandable) {
    throw UsageError(
        "restore: expandable segments need an allocator with expandable_segments:True");
  }
  std::vector<bool> placed(layout.segments.size(), false);
  // A range belongs to the reservation with the greatest base at or below it.
  auto owner = [&](DevicePtr a) {
    DevicePtr best = 0;
    for (const ExpandableReservation& r : reservations) {
      if (r.base <= a && r.base >= best) best = r.base;
    }
    return best;
  };
  for (const ExpandableReservation& r : reservations) {
    const std::string where = fmt::format("restore: expandable segment at {:#x}", r.base);
    AllocParams p{};
    p.stream = r.stream;
    p.pool = r.is_large ? &large_ : &small_;
    Block* head = new_vm_segment(p);
    if (head == nullptr) throw UsageError(where + ": the device has no address space for it");
    Segment& seg = *head->segment;
    if (seg.base != r.base) {
      throw UsageError(fmt::format("{}: the device reserved {:#x}", where, seg.base));
    }
    const std::size_t page = seg.vm->page;
    for (std::size_t k = 0; k < layout.segments.size(); ++k) {
      const SegmentInfo& info = layout.segments[k];
      if (!info.is_expandable || info.address < seg.base || info.address >= seg.base + seg.size ||
          owner(info.address) != seg.base) {
        continue;
      }
      const std::string range =
          fmt::format("{}: mapped range at {:#x} ({} bytes)", where, info.address, info.total_size);
      if (info.stream != r.stream || info.is_large != r.is_large) {
        throw UsageError(range + " is of another stream or pool");
      }
      if ((info.address - seg.base) % page != 0 || info.total_size % page != 0 ||
          info.total_size == 0 || info.address + info.total_size > seg.base + seg.size) {
        throw UsageError(
            fmt::format("{} is not whole {}-byte pages of the reservation", range, page));
      }
      // The unmapped block holding the range; the pages before it stay unmapped.
      Block* u = seg.head;
      while (u != nullptr && u->ptr + u->size <= info.address) u = u->next;
      if (u == nullptr || u->mapped || u->ptr + u->size < info.address + info.total_size) {
        throw UsageError(range + " overlaps another");
      }
      if (u->ptr < info.address) {
        BlockPool& pool = *u->pool;
        pool.unmapped.erase(u);
        Block* rest =
            make_block(info.address, u->ptr + u->size - info.address, u->stream, &pool, &seg);
        rest->mapped = false;
        rest->prev = u;
        rest->next = u->next;
        if (u->next != nullptr) u->next->prev = rest;
        u->next = rest;
        u->size = info.address - u->ptr;
        pool.unmapped.insert(u);
        pool.unmapped.insert(rest);
        u = rest;
      }
      if (!map_block(u, info.total_size)) {
        throw DeviceError(CallKind::create_physical, Status::out_of_memory,
                          range + ": mapping its pages");
      }
      // Carve the recorded blocks out of the mapped (free) range.
      DevicePtr cursor = info.address;
      for (const BlockInfo& bi : info.blocks) {
        if (bi.address != cursor || bi.size == 0 || bi.size % kMinBlockSize != 0 ||
            bi.address + bi.size > info.address + info.total_size) {
          throw UsageError(fmt::format("{}: block at {:#x} of {} bytes does not tile it", range,
                                       bi.address, bi.size));
        }
        cursor += bi.size;
        if (bi.state == BlockState::inactive) continue;
        if (bi.state == BlockState::active_pending_free) {
          throw UsageError(fmt::format("{}: block at {:#x} is pending free", range, bi.address));
        }
        if (bi.requested_size > bi.size) {
          throw UsageError(fmt::format("{}: block at {:#x} of {} bytes was requested as {} bytes",
                                       range, bi.address, bi.size, bi.requested_size));
        }
        Block* f = seg.head;
        while (f->ptr + f->size <= bi.address) f = f->next;
        Block* b = carve(f, bi.address, bi.size);
        count_allocation(b, bi.requested_size);
      }
      if (cursor != info.address + info.total_size) {
        throw UsageError(
            fmt::format("{}: its blocks cover {} bytes", range, cursor - info.address));
      }
      placed[k] = true;
    }
  }
  for (std::size_t k = 0; k < layout.segments.size(); ++k) {
    if (layout.segments[k].is_expandable && !placed[k]) {
      throw UsageError(fmt::format("restore: expandable segment at {:#x} lies in no reservation",
                                   layout.segments[k].address));
    }
  }
}

}  // namespace reservoir
