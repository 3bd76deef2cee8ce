// Restoring a recorded segment layout into an empty allocator.
#include <fmt/format.h>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::Segment;

void CachingAllocator::Impl::restore(const Snapshot& layout) {
  detail::LockGuard lock(mutex_);
  if (!segments_.empty() || allocated_.size() != 0) {
    throw UsageError("restore: the allocator already holds memory; restore needs an empty one");
  }
  try {
    restore_locked(layout);
  } catch (...) {
    drop_all_locked();
    throw;
  }
}

namespace {

// Notes every current value of `stats` as withdrawn from the combined sum.
void withdraw_all(DeviceStats& stats, CombinedStats::Section& section) {
  stats.for_each_stat([&](Stat& s) {
    if (s.current != 0) section.note(stats, s, -s.current);
  });
}

}  // namespace

void CachingAllocator::Impl::drop_all_locked() noexcept {
  for (auto& [base, seg] : segments_) {
    (void)device_.free_segment(base);
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
  total_reserved_ = 0;
  if (combined_) {
    withdraw_all(stats_, section_);
  }
  const std::int64_t max_split = stats_.max_split_size;
  stats_ = DeviceStats{};
  stats_.max_split_size = max_split;
}

void CachingAllocator::Impl::restore_locked(const Snapshot& layout) {
  DevicePtr previous_end = 0;
  for (const SegmentInfo& info : layout.segments) {
    const std::string where = fmt::format("restore: segment at {:#x}", info.address);
    if (info.address < previous_end) throw UsageError(where + " overlaps the one before it");
    if (info.pool_id != PoolId{0, 0}) throw UsageError(where + " belongs to a private pool");
    if (info.is_expandable) throw UsageError(where + " is an expandable segment");
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
          for (const std::size_t t : stat_types(pool)) {
            add_stat(stats_.inactive_split[t], 1);
            add_stat(stats_.inactive_split_bytes[t], b->size);
          }
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

}  // namespace reservoir
