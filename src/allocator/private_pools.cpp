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

BlockPool* CachingAllocator::Impl::routed_pool(std::size_t size, StreamId stream) {
  for (auto& [id, filter] : routes_) {
    if (filter(stream)) {
      PrivatePool& pool = *private_pools_.at(id);
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
    pool->large.set_order(config_.oldest_segment_first());
    pool->small.set_order(config_.oldest_segment_first());
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


}  // namespace reservoir
