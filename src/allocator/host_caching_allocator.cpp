#include "reservoir/host_caching_allocator.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <bit>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"

namespace reservoir {

HostCachingAllocator::HostCachingAllocator(PinnedMemorySource& source, Device& device)
    : source_(source), device_(device) {}

HostCachingAllocator::~HostCachingAllocator() {
  std::lock_guard lock(mutex_);
  for (const auto& [event, block] : pending_) {
    (void)device_.synchronize_event(event);
    (void)device_.destroy_event(event);
  }
  pending_.clear();
  for (const EventId e : idle_events_) (void)device_.destroy_event(e);
  for (const auto& [ptr, block] : blocks_) (void)source_.free(ptr);
}

std::size_t HostCachingAllocator::size_class(std::size_t bytes) noexcept {
  return std::max<std::size_t>(512, std::bit_ceil(bytes));
}

void HostCachingAllocator::process_events_locked() {
  // Events complete in the order they were recorded on each stream, but
  // not across streams: look at every pending one.
  for (auto it = pending_.begin(); it != pending_.end();) {
    const Status s = device_.query_event(it->first);
    if (s == Status::not_ready) {
      ++it;
      continue;
    }
    if (s != Status::ok) throw DeviceError(CallKind::query_event, s, "host cache: query_event");
    Block* b = it->second;
    idle_events_.push_back(it->first);
    it = pending_.erase(it);
    if (--b->pending_events == 0) {
      --stats_.pending_blocks;
      free_[b->size].push_back(b);
    }
  }
}

void HostCachingAllocator::release_free_locked() {
  for (auto& [size, list] : free_) {
    for (Block* b : list) {
      if (source_.free(b->ptr) == Status::ok) {
        stats_.reserved_bytes -= static_cast<std::int64_t>(b->size);
        ++stats_.source_frees;
        blocks_.erase(b->ptr);
      }
    }
    list.clear();
  }
}

void* HostCachingAllocator::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  const std::size_t size = size_class(bytes);
  std::lock_guard lock(mutex_);
  process_events_locked();
  Block* block = nullptr;
  if (auto it = free_.find(size); it != free_.end() && !it->second.empty()) {
    block = it->second.back();
    it->second.pop_back();
    ++stats_.cache_hits;
  } else {
    void* p = nullptr;
    Status s = source_.allocate(size, &p);
    if (s == Status::out_of_memory) {
      // Wait for what is pending, give the cache back, and try once more.
      for (const auto& [event, b] : pending_) (void)device_.synchronize_event(event);
      process_events_locked();
      release_free_locked();
      s = source_.allocate(size, &p);
    }
    if (s != Status::ok) {
      throw OutOfMemoryError(
          fmt::format("host cache: cannot get {} of pinned host memory ({} reserved, {} "
                      "allocated): {}",
                      format_size(size),
                      format_size(static_cast<std::uint64_t>(stats_.reserved_bytes)),
                      format_size(static_cast<std::uint64_t>(stats_.allocated_bytes)),
                      to_string(s)),
          size, 0, 0);
    }
    auto owned = std::make_unique<Block>();
    owned->ptr = p;
    owned->size = size;
    block = owned.get();
    blocks_.emplace(p, std::move(owned));
    ++stats_.source_allocs;
    stats_.reserved_bytes += static_cast<std::int64_t>(size);
    stats_.reserved_bytes_peak = std::max(stats_.reserved_bytes_peak, stats_.reserved_bytes);
  }
  block->allocated = true;
  ++stats_.allocations;
  stats_.allocated_bytes += static_cast<std::int64_t>(size);
  stats_.allocated_bytes_peak = std::max(stats_.allocated_bytes_peak, stats_.allocated_bytes);
  return block->ptr;
}

void HostCachingAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard lock(mutex_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || !it->second->allocated) {
    throw InvalidPointerError(fmt::format(
        "host cache: deallocate of {}, which is not a live pinned block (never allocated here, "
        "or freed already)", ptr));
  }
  free_block_locked(it->second.get());
}

void HostCachingAllocator::free_block_locked(Block* b) {
  // Events first: if one cannot be recorded the block stays allocated.
  std::vector<EventId> recorded;
  for (const StreamId s : b->streams) {
    EventId e = 0;
    Status st = Status::ok;
    if (!idle_events_.empty()) {
      e = idle_events_.back();
      idle_events_.pop_back();
    } else {
      st = device_.create_event(&e);
    }
    if (st == Status::ok) st = device_.record_event(e, s);
    if (st != Status::ok) {
      if (e != 0) idle_events_.push_back(e);
      for (const EventId r : recorded) idle_events_.push_back(r);
      throw DeviceError(CallKind::record_event, st, "host cache: deallocate");
    }
    recorded.push_back(e);
  }
  b->allocated = false;
  stats_.allocated_bytes -= static_cast<std::int64_t>(b->size);
  b->streams.clear();
  if (recorded.empty()) {
    free_[b->size].push_back(b);
    return;
  }
  b->pending_events = static_cast<int>(recorded.size());
  ++stats_.pending_blocks;
  for (const EventId e : recorded) pending_.emplace_back(e, b);
}

void HostCachingAllocator::record_stream(void* ptr, StreamId stream) {
  std::lock_guard lock(mutex_);
  auto it = blocks_.find(ptr);
  if (it == blocks_.end() || !it->second->allocated) {
    throw InvalidPointerError(
        fmt::format("host cache: record_stream of {}, which is not a live pinned block", ptr));
  }
  auto& streams = it->second->streams;
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
}

void HostCachingAllocator::empty_cache() {
  std::lock_guard lock(mutex_);
  process_events_locked();
  release_free_locked();
}

HostCacheStats HostCachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace reservoir
