// Private pools (PyTorch's CUDA-graph pools): while a pool is being
// allocated to, requests from the streams its filter accepts are served
// from its own small and large pools.
#include <fmt/format.h>

#include <algorithm>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::PrivatePool;
using detail::Segment;

// The innermost route whose filter takes the stream wins: a pool routed
// inside another's route (nested torch.cuda.use_mem_pool) gets what is
// allocated inside it, as PyTorch's allocator gives it.
BlockPool* CachingAllocator::Impl::routed_pool(std::size_t size, StreamId stream) {
  for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
    if (it->second(stream)) {
      PrivatePool& pool = *private_pools_.at(it->first);
      return size <= kSmallSize ? &pool.small : &pool.large;
    }
  }
  return nullptr;
}

void CachingAllocator::Impl::begin_allocate_to_pool(PoolId id, PoolFilter filter) {
  if (!filter) throw UsageError("begin_allocate_to_pool: the filter is empty");
  detail::LockGuard lock(mutex_);
  for (auto& [routed, f] : routes_) {
    if (routed == id) {
      throw UsageError(fmt::format("begin_allocate_to_pool: already allocating to pool ({}, {})",
                                   id.first, id.second));
    }
  }
  auto it = private_pools_.find(id);
  if (it == private_pools_.end()) {
    auto pool = std::make_unique<PrivatePool>(id, &node_resource_);
    pool->no_split = std::find(no_split_pools_.begin(), no_split_pools_.end(), id) != no_split_pools_.end();
    if (auto a = pool_allocators_.find(id); a != pool_allocators_.end()) pool->segments = a->second;
    pool->large.set_order(tie_order() != detail::TieOrder::address);
    pool->small.set_order(tie_order() != detail::TieOrder::address);
    private_pools_.emplace(id, std::move(pool));
  } else {
    if (it->second->use_count == 0) {
      throw UsageError(
          fmt::format("begin_allocate_to_pool: pool ({}, {}) was released", id.first, id.second));
    }
    ++it->second->use_count;
  }
  routes_.emplace_back(id, std::move(filter));
}

void CachingAllocator::Impl::end_allocate_to_pool(PoolId id) {
  detail::LockGuard lock(mutex_);
  for (auto it = routes_.begin(); it != routes_.end(); ++it) {
    if (it->first == id) {
      routes_.erase(it);
      end_capture_reuse(id);
      return;
    }
  }
  throw UsageError(
      fmt::format("end_allocate_to_pool: not allocating to pool ({}, {})", id.first, id.second));
}

void CachingAllocator::Impl::release_pool(PoolId id) {
  detail::LockGuard lock(mutex_);
  auto it = private_pools_.find(id);
  if (it == private_pools_.end() || it->second->use_count == 0) {
    throw UsageError(fmt::format("release_pool: no live pool ({}, {})", id.first, id.second));
  }
  if (--it->second->use_count == 0) {
    freeable_pools_.push_back(id);
    // A released pool's options go with it.
    std::erase(use_on_oom_pools_, id);
    std::erase(no_split_pools_, id);
    pool_allocators_.erase(id);  // the pool (and each of its segments) keeps its own
  }
}

void CachingAllocator::Impl::set_pool_use_on_oom(PoolId id, bool use_on_oom) {
  detail::LockGuard lock(mutex_);
  std::erase(use_on_oom_pools_, id);
  if (use_on_oom) use_on_oom_pools_.push_back(id);
}

std::map<PoolId, StatArray> CachingAllocator::Impl::private_pool_reserved() const {
  detail::LockGuard lock(mutex_);
  return pool_reserved_;
}

void CachingAllocator::Impl::set_pool_no_split(PoolId id) {
  detail::LockGuard lock(mutex_);
  if (std::find(no_split_pools_.begin(), no_split_pools_.end(), id) == no_split_pools_.end()) {
    no_split_pools_.push_back(id);
  }
  if (auto it = private_pools_.find(id); it != private_pools_.end()) it->second->no_split = true;
}

void CachingAllocator::Impl::set_pool_allocator(PoolId id,
                                                std::shared_ptr<PoolSegmentAllocator> allocator) {
  detail::LockGuard lock(mutex_);
  auto it = private_pools_.find(id);
  if (it != private_pools_.end() && it->second->segments != allocator &&
      !pool_segments(*it->second).empty()) {
    throw UsageError(fmt::format(
        "set_pool_allocator: pool ({}, {}) holds segments already; its allocator is chosen "
        "before its first segment",
        id.first, id.second));
  }
  if (it != private_pools_.end() && it->second->use_count > 0) it->second->segments = allocator;
  // A null allocator forgets the setting (a pool that was never routed to).
  if (allocator) {
    pool_allocators_[id] = std::move(allocator);
  } else {
    pool_allocators_.erase(id);
  }
}

PrivatePool& CachingAllocator::Impl::live_pool(PoolId id, const char* operation) {
  auto it = private_pools_.find(id);
  if (it == private_pools_.end()) {
    throw UsageError(fmt::format("{}: no pool ({}, {})", operation, id.first, id.second));
  }
  if (it->second->use_count == 0) {
    throw UsageError(fmt::format("{}: pool ({}, {}) was released (its memory is being given back)",
                                 operation, id.first, id.second));
  }
  return *it->second;
}

std::vector<Segment*> CachingAllocator::Impl::pool_segments(const PrivatePool& pool) {
  std::vector<Segment*> out;
  for (auto& [base, seg] : segments_) {
    if (seg->pool->owner == &pool) out.push_back(seg.get());
  }
  return out;
}

PoolCheckpoint CachingAllocator::Impl::checkpoint_pool(PoolId id) {
  detail::LockGuard lock(mutex_);
  PrivatePool& pool = live_pool(id, "checkpoint_pool");
  // Frees that waited for a capture to end get their events now, as PyTorch's.
  if (!deferred_event_blocks_.empty() && routes_.empty()) insert_deferred_events();
  PoolCheckpoint out;
  out.pool = id;
  for (const Segment* seg : pool_segments(pool)) {
    // A virtual-memory segment with nothing mapped at its start is left
    // out, as PyTorch's checkpoint (it starts from blocks in use or cached).
    if (!seg->head->mapped) continue;
    PoolCheckpoint::SegmentState state;
    state.is_small = seg->pool->is_small;
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      if (b->event_count > 0) {
        throw UsageError(fmt::format(
            "checkpoint_pool: the block at {:#x} of pool ({}, {}) waits for {} stream event(s); "
            "synchronize its streams first",
            b->ptr, id.first, id.second, b->event_count));
      }
      state.blocks.push_back({b->ptr, b->size, b->stream, b->allocated, b->mapped});
    }
    out.segments.push_back(std::move(state));
  }
  return out;
}

PoolRestore CachingAllocator::Impl::restore_pool(const PoolCheckpoint& checkpoint) {
  detail::LockGuard lock(mutex_);
  const PoolId id = checkpoint.pool;
  PrivatePool& pool = live_pool(id, "restore_pool");
  const auto where = [&](std::size_t s) {
    return fmt::format("restore_pool: segment {} of the checkpoint of pool ({}, {})", s, id.first,
                       id.second);
  };
  // Checked before anything changes: each checkpointed segment is one of the
  // pool's, of the same kind and size, its blocks tiling it with no two free
  // ones side by side; no block in it waits for stream events or would
  // (an allocation with stream uses is freed only once they complete).
  std::vector<Segment*> laid_out;
  for (std::size_t s = 0; s < checkpoint.segments.size(); ++s) {
    const PoolCheckpoint::SegmentState& state = checkpoint.segments[s];
    if (state.blocks.empty()) throw UsageError(fmt::format("{} has no blocks", where(s)));
    const DevicePtr base = state.blocks.front().ptr;
    auto it = segments_.find(base);
    if (it == segments_.end() || it->second->pool->owner != &pool) {
      throw UsageError(fmt::format("{}: pool ({}, {}) holds no segment at {:#x} now", where(s),
                                   id.first, id.second, base));
    }
    Segment& seg = *it->second;
    if (seg.pool->is_small != state.is_small) {
      throw UsageError(fmt::format("{}: the segment at {:#x} is in the {} pool, the checkpoint says {}",
                                   where(s), base, seg.pool->is_small ? "small" : "large",
                                   state.is_small ? "small" : "large"));
    }
    if (std::find(laid_out.begin(), laid_out.end(), &seg) != laid_out.end()) {
      throw UsageError(fmt::format("{}: the segment at {:#x} is given twice", where(s), base));
    }
    // A virtual-memory segment's unmapped ranges are restored as they are:
    // the checkpoint's must be the segment's now (PyTorch takes the
    // reservation's unmapped end as it finds it).
    std::vector<std::pair<DevicePtr, std::size_t>> unmapped_now;
    for (const Block* b = seg.head; b != nullptr; b = b->next) {
      if (!b->mapped) unmapped_now.emplace_back(b->ptr, b->size);
    }
    std::vector<std::pair<DevicePtr, std::size_t>> unmapped_then;
    DevicePtr at = base;
    for (std::size_t i = 0; i < state.blocks.size(); ++i) {
      const PoolCheckpoint::BlockState& b = state.blocks[i];
      if (b.ptr != at || b.size == 0 || b.size % kMinBlockSize != 0) {
        throw UsageError(fmt::format("{}: block {} ({:#x}, {} bytes) does not follow the one before it",
                                     where(s), i, b.ptr, b.size));
      }
      if (!b.mapped) {
        if (b.allocated) {
          throw UsageError(fmt::format("{}: block {} ({:#x}) is allocated and unmapped", where(s), i, b.ptr));
        }
        unmapped_then.emplace_back(b.ptr, b.size);
      } else if (!b.allocated && i > 0 && state.blocks[i - 1].mapped && !state.blocks[i - 1].allocated) {
        throw UsageError(fmt::format("{}: blocks {} and {} are both free (the allocator merges them)",
                                     where(s), i - 1, i));
      }
      at += b.size;
    }
    if (unmapped_then != unmapped_now) {
      throw UsageError(fmt::format(
          "{}: the segment at {:#x} has {} unmapped range(s) now and {} in the checkpoint, or at other "
          "addresses (its pages were mapped or unmapped since)",
          where(s), base, unmapped_now.size(), unmapped_then.size()));
    }
    if (at != base + seg.size) {
      throw UsageError(fmt::format("{}: its blocks cover {} bytes of a segment of {}", where(s),
                                   at - base, seg.size));
    }
    for (const Block* b = seg.head; b != nullptr; b = b->next) {
      if (b->event_count > 0 || (b->allocated && !b->stream_uses.empty()) ||
          (b->mapped && !b->allocated && !b->cached)) {
        throw UsageError(fmt::format(
            "{}: the block at {:#x} is still in use on another stream; synchronize first", where(s),
            b->ptr));
      }
    }
    laid_out.push_back(&seg);
  }
  PoolRestore out;
  // Every allocation of the pool is freed first (live or not: the
  // checkpoint's are made again), segment by segment in address order.
  for (const Segment* seg : pool_segments(pool)) {
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
      if (b->allocated) out.freed.push_back(b->ptr);
    }
  }
  free_allocations(out.freed);
  for (std::size_t s = 0; s < checkpoint.segments.size(); ++s) {
    lay_out_segment(*laid_out[s], checkpoint.segments[s], out);
  }
  return out;
}

}  // namespace reservoir
