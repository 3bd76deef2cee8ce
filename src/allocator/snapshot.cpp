#include <algorithm>

#include "allocator_impl.hpp"

namespace reservoir {

std::string_view to_string(BlockState state) noexcept {
  switch (state) {
    case BlockState::active_allocated: return "active_allocated";
    case BlockState::active_pending_free: return "active_pending_free";
    case BlockState::inactive: return "inactive";
  }
  return "unknown";
}

Snapshot CachingAllocator::Impl::snapshot() const {
  std::lock_guard lock(mutex_);
  Snapshot out;
  out.segments.reserve(segments_.size());
  for (const auto& [base, segment] : segments_) {
    SegmentInfo info;
    info.device = device_index_;
    info.address = base;
    info.stream = segment->stream;
    info.is_large = !segment->pool->is_small;
    info.is_expandable = false;
    if (segment->pool->owner != nullptr) info.pool_id = segment->pool->owner->id;
    for (const detail::Block* b = segment->head; b != nullptr; b = b->next) {
      BlockInfo block;
      block.address = b->ptr;
      block.size = b->size;
      block.requested_size = b->requested_size;
      const bool active = b->allocated || b->event_count > 0 || !b->stream_uses.empty();
      block.state = b->allocated ? BlockState::active_allocated
                    : active     ? BlockState::active_pending_free
                                 : BlockState::inactive;
      info.total_size += b->size;
      if (b->allocated) info.allocated_size += b->size;
      if (active) {
        info.active_size += b->size;
        info.requested_size += b->requested_size;
      }
      info.blocks.push_back(block);
    }
    out.segments.push_back(std::move(info));
  }
  return out;
}

}  // namespace reservoir
