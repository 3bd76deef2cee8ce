// Giving cached memory back to the device: garbage collection, the retry
// ladder's releases, empty_cache (PyTorch's release_cached_blocks).
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::PrivatePool;
using detail::Segment;

void CachingAllocator::Impl::garbage_collect_cached_blocks() {
  const auto threshold = static_cast<std::size_t>(config_.garbage_collection_threshold *
                                                  static_cast<double>(allowed_memory_maximum_));
  if (total_reserved_ <= threshold) return;
  collect_garbage_locked(total_reserved_ - threshold);
}

void CachingAllocator::Impl::collect_garbage_locked(std::size_t target) {
  std::size_t reclaimed = 0;
  // Average age of the unsplit (releasable) cached large blocks.
  std::size_t total_age = 0;
  int freeable = 0;
  for (const Block* b : large_.blocks) {
    if (!b->is_split()) {
      total_age += large_.gc_count(b);
      ++freeable;
    }
  }
  if (freeable == 0) return;
  bool block_freed = true;
  while (reclaimed < target && block_freed && freeable > 0) {
    const double age_threshold = static_cast<double>(total_age) / freeable;
    block_freed = false;
    // Free every block at least as old as the average, past the target too,
    // so that GC does not run again at once.
    auto it = large_.blocks.begin();
    while (it != large_.blocks.end()) {
      Block* b = *it;
      ++it;
      if (!b->is_split() && static_cast<double>(large_.gc_count(b)) >= age_threshold) {
        const std::size_t age = large_.gc_count(b);
        const std::size_t size = b->size;
        release_block(b);
        block_freed = true;
        reclaimed += size;
        total_age -= age;
        --freeable;
      }
    }
  }
}

bool CachingAllocator::Impl::release_available_cached_blocks(const AllocParams& p) {
  const std::size_t max_split = config_.max_split_size;
  if (max_split == std::numeric_limits<std::size_t>::max()) return false;
  BlockPool& pool = *p.pool;
  const detail::SizeKey key{p.stream, std::max(p.size, max_split)};
  auto it = pool.blocks.lower_bound(key);
  if (it == pool.blocks.end() || (*it)->stream != p.stream) {
    // No single oversize block is large enough: free oversize blocks of this
    // stream from the largest down until enough is released.
    if (it == pool.blocks.begin()) return false;
    std::size_t released = 0;
    --it;
    std::vector<Block*> victims;  // released after the walk: unmapping edits the pool
    while (released < key.size && (*it)->size >= max_split && (*it)->stream == p.stream) {
      released += (*it)->size;
      victims.push_back(*it);
      if (it == pool.blocks.begin()) break;
      --it;
    }
    for (Block* b : victims) release_block(b);
    return released >= key.size;
  }
  release_block(*it);
  return true;
}

bool CachingAllocator::Impl::release_cached_blocks() {
  synchronize_and_free_events();
  dissolve_cached_stitched();  // lent pages return first, so whole handles can go
  retry_stuck();
  release_blocks(large_);
  release_blocks(small_);
  // native_paged: the free pages of segments still in use go too.
  (void)release_free_pages(std::numeric_limits<std::size_t>::max());
  for (auto it = freeable_pools_.begin(); it != freeable_pools_.end();) {
    it = release_freeable_pool(it);
  }
  return true;
}

std::vector<PoolId>::iterator CachingAllocator::Impl::release_freeable_pool(
    std::vector<PoolId>::iterator it) {
  auto pool_it = private_pools_.find(*it);
  PrivatePool& pool = *pool_it->second;
  release_blocks(pool.small);
  release_blocks(pool.large);
  // The pool's reservations with nothing mapped go too (one whose first
  // mapping failed): no block may outlive its pool.
  for (BlockPool* bp : {&pool.small, &pool.large}) {
    std::vector<Block*> bare;
    for (Block* b : bp->unmapped) {
      if (b->prev == nullptr && b->next == nullptr) bare.push_back(b);
    }
    for (Block* b : bare) release_vm_segment(b);
  }
  if (pool.device_alloc_count != 0 || !pool_segments(pool).empty()) return std::next(it);
  private_pools_.erase(pool_it);
  return freeable_pools_.erase(it);
}

void CachingAllocator::Impl::empty_pool_cache(PoolId id) {
  detail::LockGuard lock(mutex_);
  auto it = std::find(freeable_pools_.begin(), freeable_pools_.end(), id);
  if (it == freeable_pools_.end()) return;  // in use (or unknown): PyTorch keeps its blocks too
  // PyTorch waits for the pool's own events alone; reservoir for all (the
  // same count in num_sync_all_streams). Waiting leaves freeable_pools_ as it is.
  synchronize_and_free_events();
  (void)release_freeable_pool(it);
}

void CachingAllocator::Impl::release_blocks(BlockPool& pool) {
  std::vector<Block*> to_unmap;  // unmapping edits the pool: after the walk
  auto it = pool.blocks.begin();
  while (it != pool.blocks.end()) {
    Block* b = *it;
    ++it;
    if (b->segment->vm) {
      to_unmap.push_back(b);
    } else if (!b->is_split()) {
      release_block(b);
    }
  }
  release_vm_blocks(to_unmap);
}

void CachingAllocator::Impl::free_classic_segment(const Segment& segment) {
  if (segment.from) {
    segment.from->free(segment.base, segment.size, segment.stream);
    return;
  }
  const Status status = device_.free_segment(segment.base);
  if (status != Status::ok) {
    throw DeviceError(
        CallKind::free_segment, status,
        fmt::format("freeing the segment at {:#x} ({} bytes)", segment.base, segment.size));
  }
}

void CachingAllocator::Impl::release_block(Block* block) {
  if (block->segment->paged) {
    release_paged_segment(block, /*in_pool=*/true);
    return;
  }
  if (block->segment->vm) {
    // PyTorch asserts here when max_split_size_mb or GC meets an expandable
    // block; reservoir unmaps the block's free pages instead.
    unmap_block(block);
    return;
  }
  free_classic_segment(*block->segment);
  ++stats_.num_device_free;
  trace(TraceAction::segment_free, block->ptr, block->size, block->stream);
  total_reserved_ -= block->size;
  BlockPool& pool = *block->pool;
  if (pool.owner != nullptr) {
    --pool.owner->device_alloc_count;
    StatArray& reserved = pool_reserved_[pool.owner->id];
    reserved[0].decrease(block->size);
    reserved[stat_index(pool)].decrease(block->size);
  }
  sub_stats(stats_.segment, stat_index(pool), 1);
  sub_stats(stats_.reserved_bytes, stat_index(pool), block->size);
  if (block->size >= config_.max_split_size) sub_stat(stats_.oversize_segments, 1);
  pool.erase(block);
  segments_.erase(block->ptr);
  arena_.recycle(block);
}

}  // namespace reservoir
