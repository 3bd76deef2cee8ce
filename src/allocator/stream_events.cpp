// Stream events: a block freed after use on other streams (record_stream)
// is reused only once the events recorded on those streams complete.
#include <fmt/format.h>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::PrivatePool;
using detail::Segment;

EventId CachingAllocator::Impl::take_event() {
  if (!idle_events_.empty()) {
    EventId e = idle_events_.back();
    idle_events_.pop_back();
    return e;
  }
  EventId e = 0;
  const Status status = device_.create_event(&e);
  if (status != Status::ok) {
    throw DeviceError(CallKind::create_event, status, "creating an event for a deferred free");
  }
  return e;
}

void CachingAllocator::Impl::insert_events(Block* block) {
  // All or nothing: on failure the events taken go back and the block is untouched.
  std::vector<EventId> events;
  events.reserve(block->stream_uses.size());
  try {
    for (StreamId s : block->stream_uses) {
      events.push_back(take_event());
      const Status status = device_.record_event(events.back(), s);
      if (status != Status::ok) {
        throw DeviceError(
            CallKind::record_event, status,
            fmt::format("recording an event on stream {} for the block at {:#x}", s, block->ptr));
      }
    }
  } catch (...) {
    idle_events_.insert(idle_events_.end(), events.begin(), events.end());
    throw;
  }
  for (std::size_t i = 0; i < events.size(); ++i) {
    pending_events_[block->stream_uses[i]].push_back(PendingEvent{events[i], block});
  }
  block->event_count += static_cast<int>(events.size());
  block->stream_uses.clear();
}

void CachingAllocator::Impl::insert_deferred_events() {
  while (!deferred_event_blocks_.empty()) {
    Block* block = deferred_event_blocks_.back();
    insert_events(block);
    deferred_event_blocks_.pop_back();
    capture_markers_.erase(block);
    if (block->event_count == 0) free_block(block);
  }
}

void CachingAllocator::Impl::retire_front(std::deque<PendingEvent>& queue) {
  Block* block = queue.front().block;
  idle_events_.push_back(queue.front().event);
  queue.pop_front();
  if (--block->event_count == 0) free_block(block);
}

void CachingAllocator::Impl::process_events() {
  insert_deferred_events();
  for (auto it = pending_events_.begin(); it != pending_events_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      PendingEvent& e = queue.front();
      const Status status = device_.query_event(e.event);
      if (status == Status::not_ready) break;
      if (status != Status::ok) {
        throw DeviceError(
            CallKind::query_event, status,
            fmt::format("querying the event of a deferred free at {:#x}", e.block->ptr));
      }
      retire_front(queue);
    }
    it = queue.empty() ? pending_events_.erase(it) : std::next(it);
  }
}

void CachingAllocator::Impl::synchronize_and_free_events() {
  ++stats_.num_sync_all_streams;
  insert_deferred_events();
  for (auto it = pending_events_.begin(); it != pending_events_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      PendingEvent& e = queue.front();
      const Status status = device_.synchronize_event(e.event);
      if (status != Status::ok) {
        throw DeviceError(
            CallKind::synchronize_event, status,
            fmt::format("synchronizing the event of a deferred free at {:#x}", e.block->ptr));
      }
      retire_front(queue);
    }
    it = pending_events_.erase(it);
  }
}

}  // namespace reservoir
