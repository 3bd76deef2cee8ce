#include <algorithm>
#include <optional>

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

std::string_view to_string(TraceAction action) noexcept {
  switch (action) {
    case TraceAction::alloc: return "alloc";
    case TraceAction::free_requested: return "free_requested";
    case TraceAction::free_completed: return "free_completed";
    case TraceAction::segment_alloc: return "segment_alloc";
    case TraceAction::segment_free: return "segment_free";
    case TraceAction::segment_map: return "segment_map";
    case TraceAction::segment_unmap: return "segment_unmap";
    case TraceAction::snapshot: return "snapshot";
    case TraceAction::oom: return "oom";
    case TraceAction::empty_cache: return "empty_cache";
    case TraceAction::annotate: return "annotate";
  }
  return "unknown";
}

std::string context_key(const Context& c) {
  std::string key;
  for (const Frame& f : c.frames) {
    key += f.filename;
    key += '\x1f';
    key += std::to_string(f.line);
    key += '\x1f';
    key += f.name;
    key += '\x1e';
  }
  key += '\x1d';
  for (const std::string& a : c.annotations) {
    key += a;
    key += '\x1e';
  }
  return key;
}

std::vector<std::pair<DevicePtr, std::size_t>> CachingAllocator::Impl::live_allocations() const {
  detail::LockGuard lock(mutex_);
  std::vector<std::pair<DevicePtr, std::size_t>> out;
  for (const auto& [base, segment] : segments_) {
    for (const detail::Block* b = segment->head; b != nullptr; b = b->next) {
      if (b->allocated) out.emplace_back(b->ptr, b->requested_size);
    }
  }
  return out;
}

Snapshot CachingAllocator::Impl::snapshot() const {
  detail::LockGuard lock(mutex_);
  Snapshot out;
  const bool with_history = history_ && history_->on();
  // Contexts are exported even with history off: live blocks may carry one.
  std::optional<detail::EventHistory::Exporter> contexts;
  if (history_) contexts.emplace(*history_, out.contexts);
  if (with_history) history_->record(TraceAction::snapshot, 0, 0, 0);
  out.segments.reserve(segments_.size());
  auto state_of = [](const detail::Block* b) {
    if (b->allocated) return BlockState::active_allocated;
    if (b->event_count > 0 || !b->stream_uses.empty()) return BlockState::active_pending_free;
    return BlockState::inactive;
  };
  for (const auto& [base, segment] : segments_) {
    // A classic segment is one entry; a virtual-memory segment gives one
    // entry per contiguous mapped range, as PyTorch reports expandable ones.
    const detail::Block* b = segment->head;
    while (b != nullptr) {
      if (!b->mapped) {
        b = b->next;
        continue;
      }
      SegmentInfo info;
      info.device = device_index_;
      info.address = b->ptr;
      info.stream = segment->stream;
      info.is_large = !segment->pool->is_small;
      info.is_expandable = segment->vm != nullptr;
      if (segment->pool->owner != nullptr) info.pool_id = segment->pool->owner->id;
      for (; b != nullptr && b->mapped; b = b->next) {
        BlockInfo block;
        block.address = b->ptr;
        block.size = b->size;
        block.requested_size = b->requested_size;
        block.state = state_of(b);
        if (contexts && block.state != BlockState::inactive) block.context = (*contexts)(b->context);
        info.total_size += b->size;
        if (b->allocated) info.allocated_size += b->size;
        if (block.state != BlockState::inactive) {
          info.active_size += b->size;
          info.requested_size += b->requested_size;
        }
        info.blocks.push_back(block);
      }
      if (segment->paged) {
        out.backed_bytes[info.address] =
            std::min(info.total_size, segment->paged->mapped_pages * segment->paged->page);
      }
      out.segments.push_back(std::move(info));
    }
  }
  if (with_history) history_->append_events(out.history, *contexts);
  return out;
}

}  // namespace reservoir
