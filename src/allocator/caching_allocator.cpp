// The native policy: PyTorch's CUDACachingAllocator decisions.
#include "reservoir/caching_allocator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <thread>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::PrivatePool;
using detail::Segment;

// ---------------------------------------------------------------------------
// Size rules

std::size_t CachingAllocator::Impl::round_size(std::size_t size, const AllocatorConfig& config) {
  if (size < kMinBlockSize) return kMinBlockSize;
  const std::size_t divisions = config.divisions_for(size);
  if (divisions > 1 && size > kMinBlockSize * divisions) {
    // Round up to the next of `divisions` equal steps between powers of two.
    if (std::has_single_bit(size)) return size;
    const std::size_t floor = std::bit_floor(size);
    const std::size_t step = floor >> (std::bit_width(divisions) - 1);
    if (step == 0) return floor << 1;
    const std::size_t down = size & ~(step - 1);
    return down == size ? size : down + step;
  }
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

std::size_t CachingAllocator::Impl::allocation_size(std::size_t size) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

bool CachingAllocator::Impl::should_split(const Block* block, std::size_t size) const {
  const std::size_t remaining = block->size - size;
  if (in_stitched(block)) return false;  // one block, kept whole
  if (block->pool->is_small || vm_on()) return remaining >= kMinBlockSize;
  return size < config_.max_split_size && remaining > kSmallSize;
}

// ---------------------------------------------------------------------------
// Construction

CachingAllocator::Impl::Impl(Device& device, AllocatorConfig config, int device_index)
    : device_index_(device_index),
      device_(device),
      config_(config),
      large_(false, nullptr, &node_resource_),
      small_(true, nullptr, &node_resource_) {
  check_supported(config_);
  vm_mode_ = vm_mode(config_);
  stats_.max_split_size = static_cast<std::int64_t>(config_.max_split_size);
}

CachingAllocator::Impl::~Impl() {
  // Return everything to the device; failures cannot be reported from here.
  for (auto& [stream, queue] : pending_events_) {
    for (PendingEvent& e : queue) (void)device_.destroy_event(e.event);
  }
  for (EventId e : idle_events_) (void)device_.destroy_event(e);
  retry_stuck();  // stuck mappings go before their address space
  for (auto& [base, segment] : segments_) {
    if (segment->vm) {
      drop_vm_segment_locked(*segment);
    } else {
      (void)device_.free_segment(base);
    }
  }
  retry_stuck();
}

void CachingAllocator::Impl::check_supported(const AllocatorConfig& config) const {
  if (config.policy == Policy::paging && config.expandable_segments) {
    throw UsageError(fmt::format(
        "allocator config \"{}\": policy:paging and expandable_segments:True exclude each other; "
        "choose one",
        config.to_string()));
  }
  if (vm_mode(config) != VmMode::none && !device_.supports_virtual_memory()) {
    throw UsageError(fmt::format(
        "allocator config \"{}\": the {} device has no virtual-memory support, which "
        "expandable segments and policy:paging need",
        config.to_string(), device_.name()));
  }
}

// ---------------------------------------------------------------------------
// Allocation

Block* CachingAllocator::Impl::make_block(DevicePtr ptr, std::size_t size, StreamId stream,
                                          BlockPool* pool, Segment* segment) {
  Block* b = arena_.make();
  b->ptr = ptr;
  b->size = size;
  b->stream = stream;
  b->pool = pool;
  b->segment = segment;
  return b;
}

BlockPool& CachingAllocator::Impl::pool_for(std::size_t size, StreamId stream) {
  for (auto& [id, filter] : routes_) {
    if (filter(stream)) {
      PrivatePool& pool = *private_pools_.at(id);
      return size <= kSmallSize ? pool.small : pool.large;
    }
  }
  return size <= kSmallSize ? small_ : large_;
}

bool CachingAllocator::Impl::get_free_block(AllocParams& p) {
  BlockPool& pool = *p.pool;
  if (set_fraction_ && config_.garbage_collection_threshold > 0.0) {
    ++pool.get_free_blocks_call_count;  // block ages are counted only when GC is on
  }
  Block key;
  key.stream = p.stream;
  key.size = p.size;
  auto it = pool.blocks.lower_bound(&key);
  if (it == pool.blocks.end() || (*it)->stream != p.stream) return false;
  if (in_vm(*it)) {
    if (vm_on()) {
      // A cached block followed by unmapped space counts, for best fit, as
      // the size it can grow to (PyTorch's rule).
      auto growable = [](const Block* b) {
        return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
      };
      auto next = std::next(it);
      while ((*it)->segment->vm && next != pool.blocks.end() && (*next)->stream == p.stream &&
             growable(*next) < growable(*it)) {
        it = next++;
      }
    } else {
      // Virtual memory was switched off: only classic segments serve requests.
      do {
        ++it;
      } while (it != pool.blocks.end() && (*it)->segment->vm && (*it)->stream == p.stream);
      if (it == pool.blocks.end() || (*it)->stream != p.stream) return false;
    }
    // A stitched block is never split: it serves only requests that use all its pages.
    while (in_stitched(*it) && (*it)->size - p.size >= (*it)->segment->vm->page) {
      if (++it == pool.blocks.end() || (*it)->stream != p.stream) return false;
    }
  }
  const std::size_t max_split = config_.max_split_size;
  // Do not hand an oversize block to a request that could split.
  if (p.size < max_split && (*it)->size >= max_split) return false;
  // An oversize request may take a cached block only up to a limit larger.
  if (p.size >= max_split && (*it)->size >= p.size + config_.max_non_split_rounding_size) {
    return false;
  }
  p.block = *it;  // left in the set: alloc_found_block re-keys or removes it
  p.block_in_pool = true;
  return true;
}

bool CachingAllocator::Impl::alloc_block(AllocParams& p, bool is_retry) {
  const std::size_t size = p.alloc_size;
  if (is_retry) ++stats_.num_alloc_retries;
  // Private pools keep classic segments (as PyTorch's CUDA-graph pools).
  const bool vm = vm_on() && p.pool->owner == nullptr;
  // The paging policy checks the fraction against the pages it really maps.
  if (set_fraction_ && !(vm && vm_mode_ == VmMode::paging) &&
      total_reserved_ + size > allowed_memory_maximum_) {
    return false;
  }
  if (vm) return alloc_vm_block(p);
  DevicePtr ptr = 0;
  const Status status = device_.allocate_segment(size, &ptr);
  if (status == Status::out_of_memory) return false;
  if (status != Status::ok) {
    throw DeviceError(CallKind::allocate_segment, status,
                      fmt::format("allocating a segment of {} bytes", size));
  }
  auto segment = std::make_unique<Segment>();
  Block* block = make_block(ptr, size, p.stream, p.pool, segment.get());
  segment->base = ptr;
  segment->size = size;
  segment->stream = p.stream;
  segment->pool = p.pool;
  segment->head = block;
  segments_.emplace(ptr, std::move(segment));
  if (p.pool->owner != nullptr) ++p.pool->owner->device_alloc_count;
  total_reserved_ += size;
  for_types(*p.pool, [&](std::size_t t) {
    add_stat(stats_.segment[t], 1);
    add_stat(stats_.reserved_bytes[t], size);
  });
  if (size >= config_.max_split_size) add_stat(stats_.oversize_segments, 1);
  ++stats_.num_device_alloc;
  trace(TraceEntry::Action::segment_alloc, ptr, size, p.stream);
  p.block = block;
  return true;
}

Block* CachingAllocator::Impl::alloc_found_block(AllocParams& p, std::size_t requested) {
  Block* block = p.block;
  BlockPool& pool = *p.pool;
  const bool already_split = block->is_split();
  if (should_split(block, p.size)) {
    // The front of the block is handed out; the rest stays cached.
    Block* remaining = block;
    block = make_block(remaining->ptr, p.size, p.stream, &pool, remaining->segment);
    block->prev = remaining->prev;
    if (block->prev != nullptr) {
      block->prev->next = block;
    } else {
      block->segment->head = block;
    }
    block->next = remaining;
    remaining->prev = block;
    remaining->ptr += p.size;
    remaining->size -= p.size;
    if (p.block_in_pool) {
      pool.reposition(remaining);
    } else {
      pool.insert(remaining);
    }
    if (in_vm(block)) {
      // Expandable segments stay out of the inactive_split stats (PyTorch).
    } else if (already_split) {
      for_types(pool, [&](std::size_t t) { sub_stat(stats_.inactive_split_bytes[t], block->size); });
    } else {
      for_types(pool, [&](std::size_t t) {
        add_stat(stats_.inactive_split_bytes[t], remaining->size);
        add_stat(stats_.inactive_split[t], 1);
      });
    }
  } else {
    if (p.block_in_pool) pool.erase(block);
    if (already_split && !in_vm(block)) {
      for_types(pool, [&](std::size_t t) {
        sub_stat(stats_.inactive_split_bytes[t], block->size);
        sub_stat(stats_.inactive_split[t], 1);
      });
    }
  }
  block->allocated = true;
  block->requested_size = requested;
  allocated_.insert(block->ptr, block);
  for_types(pool, [&](std::size_t t) {
    add_stat(stats_.allocation[t], 1);
    add_stat(stats_.allocated_bytes[t], block->size);
    add_stat(stats_.active[t], 1);
    add_stat(stats_.active_bytes[t], block->size);
    add_stat(stats_.requested_bytes[t], requested);
  });
  if (block->size >= config_.max_split_size) add_stat(stats_.oversize_allocations, 1);
  block->context = trace(TraceEntry::Action::alloc, block->ptr, requested, block->stream);
  return block;
}

void* CachingAllocator::Impl::allocate(std::size_t requested, StreamId stream) {
  if (requested == 0) return nullptr;
  std::unique_lock lock(mutex_);
  if (routes_.empty()) process_events();
  const std::size_t size = round_size(requested, config_);
  AllocParams p{size, allocation_size(size), stream, &pool_for(size, stream)};

  bool found = get_free_block(p);
  if (!found && !free_memory_callbacks_.empty()) {
    const std::vector<FreeMemoryCallback> callbacks = free_memory_callbacks_;
    lock.unlock();  // LOCK RELEASED: callbacks may free memory through this allocator
    bool freed = false;
    for (const auto& callback : callbacks) freed |= callback();
    lock.lock();
    p.pool = &pool_for(size, stream);  // a pool may have changed while unlocked
    found = freed && get_free_block(p);
  }
  if (!found) {
    if (set_fraction_ && config_.garbage_collection_threshold > 0.0) {
      garbage_collect_cached_blocks();
    }
    found = alloc_block(p, false) ||
            (release_available_cached_blocks(p) && alloc_block(p, false)) ||
            (routes_.empty() && release_cached_blocks() && alloc_block(p, true));
  }
  if (!found) throw_oom(lock, p);
  return reinterpret_cast<void*>(alloc_found_block(p, requested)->ptr);
}

void CachingAllocator::Impl::throw_oom(std::unique_lock<PublishingMutex>& lock,
                                       const AllocParams& p) {
  MemoryInfo info;
  if (device_.memory_info(&info) != Status::ok) info = MemoryInfo{};
  std::string allowed_info;
  if (set_fraction_) allowed_info = format_size(allowed_memory_maximum_) + " allowed; ";
  trace(TraceEntry::Action::oom, info.free, p.size, p.stream);
  ++stats_.num_ooms;
  const auto allocated = static_cast<std::size_t>(stats_.allocated_bytes[0].current);
  const auto reserved = static_cast<std::size_t>(stats_.reserved_bytes[0].current);
  // Cached free bytes held by private pools, reported as PyTorch reports them.
  std::size_t in_private_pools = 0;
  for (auto& [id, pool] : private_pools_) {
    for (const Block* b : pool->large.blocks) in_private_pools += b->size;
    for (const Block* b : pool->small.blocks) in_private_pools += b->size;
  }
  std::string private_msg;
  if (in_private_pools > 0) {
    private_msg = "with " + format_size(in_private_pools) +
                  " allocated in private pools (e.g., CUDA Graphs), ";
  }
  const std::vector<OomObserver> observers = oom_observers_;
  const std::size_t limit = set_fraction_ ? allowed_memory_maximum_ : info.total;
  lock.unlock();  // LOCK RELEASED: observers may inspect or free memory
  for (const auto& observer : observers) observer(device_index_, p.alloc_size, limit, info.free);
  std::string message = fmt::format(
      "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} "
      "is free. {}Of the allocated memory {} is allocated by PyTorch, {}and {} is reserved by "
      "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
      "documentation for Memory Management  "
      "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
      format_size(p.alloc_size), device_index_, format_size(info.total), format_size(info.free),
      allowed_info, format_size(allocated + in_private_pools), private_msg,
      format_size(reserved - allocated - in_private_pools));
  throw OutOfMemoryError(message, p.alloc_size, info.free, info.total);
}

// ---------------------------------------------------------------------------
// Deallocation

void CachingAllocator::Impl::throw_invalid_pointer(DevicePtr ptr, const char* operation) const {
  // Explain what the pointer is, if anything: inside a block, or a free block.
  auto seg = segments_.upper_bound(ptr);
  if (seg != segments_.begin()) {
    --seg;
    const Segment& s = *seg->second;
    if (ptr < s.base + s.size) {
      for (const Block* b = s.head; b != nullptr; b = b->next) {
        if (ptr >= b->ptr && ptr < b->ptr + b->size) {
          if (ptr != b->ptr) {
            throw InvalidPointerError(fmt::format(
                "{}: pointer {:#x} points {} bytes into a block at {:#x}; pass the pointer "
                "allocate() returned",
                operation, ptr, ptr - b->ptr, b->ptr));
          }
          throw InvalidPointerError(
              fmt::format("{}: pointer {:#x} is not allocated (already freed, or never returned by "
                          "allocate())",
                          operation, ptr));
        }
      }
    }
  }
  throw InvalidPointerError(
      fmt::format("{}: pointer {:#x} was not allocated by this allocator (device {})", operation,
                  ptr, device_index_));
}

void CachingAllocator::Impl::deallocate(void* raw) {
  if (raw == nullptr || deallocate_held(raw)) return;
  std::lock_guard lock(mutex_);
  throw_invalid_pointer(reinterpret_cast<DevicePtr>(raw), "deallocate");
}

bool CachingAllocator::Impl::deallocate_held(void* raw) {
  const auto ptr = reinterpret_cast<DevicePtr>(raw);
  std::lock_guard lock(mutex_);
  Block** found = allocated_.find(ptr);
  if (found == nullptr) return false;
  Block* block = *found;
  const bool deferred = !block->stream_uses.empty();
  // Record stream events first: if the device fails, the block stays allocated
  // and nothing has changed.
  if (deferred && routes_.empty()) insert_events(block);
  allocated_.erase(ptr);
  block->allocated = false;
  for_types(*block->pool, [&](std::size_t t) {
    sub_stat(stats_.allocation[t], 1);
    sub_stat(stats_.allocated_bytes[t], block->size);
  });
  trace(TraceEntry::Action::free_requested, block->ptr, block->requested_size, block->stream);
  if (block->size >= config_.max_split_size) sub_stat(stats_.oversize_allocations, 1);
  if (deferred) {
    if (!routes_.empty()) deferred_event_blocks_.push_back(block);
  } else {
    free_block(block);
  }
  return true;
}

void CachingAllocator::Impl::record_stream(void* raw, StreamId stream) {
  if (raw == nullptr) return;
  const auto ptr = reinterpret_cast<DevicePtr>(raw);
  std::lock_guard lock(mutex_);
  Block** found = allocated_.find(ptr);
  if (found == nullptr) throw_invalid_pointer(ptr, "record_stream");
  Block* block = *found;
  if (stream == block->stream) return;  // uses on the allocation stream need no event
  if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
      block->stream_uses.end()) {
    block->stream_uses.push_back(stream);
  }
}

void CachingAllocator::Impl::free_block(Block* block) {
  trace(TraceEntry::Action::free_completed, block->ptr, block->requested_size, block->stream);
  const std::size_t original_size = block->size;
  const std::size_t requested = block->requested_size;
  BlockPool& pool = *block->pool;
  Block* const prev = block->prev;
  Block* const next = block->next;
  const bool merge_prev = prev != nullptr && prev->is_free();
  const bool merge_next = next != nullptr && next->is_free();
  std::int64_t split_blocks_change = 0;
  std::int64_t split_bytes_change = 0;
  Block* merged = block;
  if (merge_prev || merge_next) {
    // Merge into a neighbour that is already cached, so that it can keep its
    // place in the pool; the freed block's own fields carry over as PyTorch's
    // merge keeps them.
    merged = merge_next ? next : prev;
    DevicePtr start = block->ptr;
    std::size_t total = block->size;
    Block* new_prev = block->prev;
    Block* new_next = block->next;
    if (merge_prev) {
      split_blocks_change -= 1;
      split_bytes_change -= static_cast<std::int64_t>(prev->size);
      start = prev->ptr;
      total += prev->size;
      new_prev = prev->prev;
    }
    if (merge_next) {
      split_blocks_change -= 1;
      split_bytes_change -= static_cast<std::int64_t>(next->size);
      total += next->size;
      new_next = next->next;
    }
    if (merge_prev && merge_next) {
      pool.erase(prev);
      arena_.recycle(prev);
    }
    merged->ptr = start;
    merged->size = total;
    merged->requested_size = block->requested_size;
    merged->prev = new_prev;
    merged->next = new_next;
    if (new_prev != nullptr) {
      new_prev->next = merged;
    } else {
      merged->segment->head = merged;
    }
    if (new_next != nullptr) new_next->prev = merged;
    arena_.recycle(block);
    pool.reposition(merged);
  } else {
    pool.insert(block);
  }
  if (merged->is_split()) {
    split_blocks_change += 1;
    split_bytes_change += static_cast<std::int64_t>(merged->size);
  }
  if (in_vm(merged)) {
    split_blocks_change = 0;  // expandable segments stay out of inactive_split (PyTorch)
    split_bytes_change = 0;
  }
  for_types(pool, [&](std::size_t t) {
    if (split_blocks_change > 0) {
      add_stat(stats_.inactive_split[t], static_cast<std::uint64_t>(split_blocks_change));
    } else if (split_blocks_change < 0) {
      sub_stat(stats_.inactive_split[t], static_cast<std::uint64_t>(-split_blocks_change));
    }
    if (split_bytes_change > 0) {
      add_stat(stats_.inactive_split_bytes[t], static_cast<std::uint64_t>(split_bytes_change));
    } else if (split_bytes_change < 0) {
      sub_stat(stats_.inactive_split_bytes[t], static_cast<std::uint64_t>(-split_bytes_change));
    }
    sub_stat(stats_.active[t], 1);
    sub_stat(stats_.active_bytes[t], original_size);
    sub_stat(stats_.requested_bytes[t], requested);
  });
}

// ---------------------------------------------------------------------------
// Releasing cached memory

void CachingAllocator::Impl::garbage_collect_cached_blocks() {
  const auto threshold = static_cast<std::size_t>(config_.garbage_collection_threshold *
                                                  static_cast<double>(allowed_memory_maximum_));
  if (total_reserved_ <= threshold) return;
  const std::size_t target = total_reserved_ - threshold;
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
  Block key;
  key.stream = p.stream;
  key.size = std::max(p.size, max_split);
  auto it = pool.blocks.lower_bound(&key);
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
  for (auto it = freeable_pools_.begin(); it != freeable_pools_.end();) {
    auto pool_it = private_pools_.find(*it);
    PrivatePool& pool = *pool_it->second;
    release_blocks(pool.small);
    release_blocks(pool.large);
    if (pool.device_alloc_count == 0) {
      private_pools_.erase(pool_it);
      it = freeable_pools_.erase(it);
    } else {
      ++it;
    }
  }
  return true;
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
  for (Block* b : to_unmap) {
    if (b->segment->vm->stitched) {
      dissolve_stitched(b);
      continue;
    }
    unmap_block(b);
    if (!b->mapped && !b->is_split()) release_vm_segment(b);
  }
}

void CachingAllocator::Impl::release_block(Block* block) {
  if (block->segment->vm) {
    // PyTorch asserts here when max_split_size_mb or GC meets an expandable
    // block; reservoir unmaps the block's free pages instead.
    unmap_block(block);
    return;
  }
  const Status status = device_.free_segment(block->ptr);
  if (status != Status::ok) {
    throw DeviceError(
        CallKind::free_segment, status,
        fmt::format("freeing the segment at {:#x} ({} bytes)", block->ptr, block->size));
  }
  ++stats_.num_device_free;
  trace(TraceEntry::Action::segment_free, block->ptr, block->size, block->stream);
  total_reserved_ -= block->size;
  BlockPool& pool = *block->pool;
  if (pool.owner != nullptr) --pool.owner->device_alloc_count;
  for_types(pool, [&](std::size_t t) {
    sub_stat(stats_.segment[t], 1);
    sub_stat(stats_.reserved_bytes[t], block->size);
  });
  if (block->size >= config_.max_split_size) sub_stat(stats_.oversize_segments, 1);
  pool.erase(block);
  segments_.erase(block->ptr);
  arena_.recycle(block);
}

// ---------------------------------------------------------------------------
// Stream events

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

// ---------------------------------------------------------------------------
// Control

void CachingAllocator::Impl::empty_cache() {
  std::lock_guard lock(mutex_);
  release_cached_blocks();
}

void CachingAllocator::Impl::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw UsageError(
        fmt::format("set_memory_fraction: invalid fraction {}; accepted: 0.0 to 1.0", fraction));
  }
  MemoryInfo info;
  const Status status = device_.memory_info(&info);
  if (status != Status::ok) {
    throw DeviceError(CallKind::memory_info, status, "set_memory_fraction");
  }
  std::lock_guard lock(mutex_);
  allowed_memory_maximum_ = static_cast<std::size_t>(fraction * static_cast<double>(info.total));
  set_fraction_ = true;
}

void CachingAllocator::Impl::set_config(const AllocatorConfig& config) {
  check_supported(config);
  std::lock_guard lock(mutex_);
  if (config.max_split_size != config_.max_split_size) max_split_changed_ = true;
  config_ = config;
  vm_mode_ = vm_mode(config_);
  stats_.max_split_size = static_cast<std::int64_t>(config_.max_split_size);
}

AllocatorConfig CachingAllocator::Impl::config() const {
  std::lock_guard lock(mutex_);
  return config_;
}

DeviceStats CachingAllocator::Impl::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingAllocator::Impl::reset_peak_stats() {
  std::lock_guard lock(mutex_);
  stats_.for_each_stat([](Stat& s) { s.reset_peak(); });
}

void CachingAllocator::Impl::combine_stats(std::shared_ptr<CombinedStats> combined,
                                           bool carry_peaks) {
  if (!combined) throw UsageError("combine_stats: no combined statistics given");
  std::lock_guard lock(mutex_);
  if (combined_) throw UsageError("combine_stats: this allocator's statistics are combined already");
  combined->add(stats_, carry_peaks);
  combined_ = std::move(combined);
}

void CachingAllocator::Impl::reset_accumulated_stats() {
  std::lock_guard lock(mutex_);
  stats_.for_each_stat([](Stat& s) { s.reset_accumulated(); });
  stats_.num_alloc_retries = 0;
  stats_.num_ooms = 0;
  stats_.num_sync_all_streams = 0;
  stats_.num_device_alloc = 0;
  stats_.num_device_free = 0;
}

std::size_t CachingAllocator::Impl::largest_cached_block() const {
  std::lock_guard lock(mutex_);
  std::size_t largest = 0;
  auto scan = [&largest](const BlockPool& pool) {
    for (const Block* b : pool.blocks) largest = std::max(largest, b->size);
  };
  scan(large_);
  scan(small_);
  for (auto& [id, pool] : private_pools_) {
    scan(pool->large);
    scan(pool->small);
  }
  return largest;
}

void CachingAllocator::Impl::attach_oom_observer(OomObserver observer) {
  std::lock_guard lock(mutex_);
  oom_observers_.push_back(std::move(observer));
}

void CachingAllocator::Impl::add_free_memory_callback(FreeMemoryCallback callback) {
  std::lock_guard lock(mutex_);
  free_memory_callbacks_.push_back(std::move(callback));
}

void CachingAllocator::Impl::attach_trace_tracker(TraceTracker tracker) {
  std::lock_guard lock(mutex_);
  trackers_.push_back(std::move(tracker));
  observed_ = true;
}

void CachingAllocator::Impl::record_history(const HistoryOptions& options) {
  std::lock_guard lock(mutex_);
  if (!history_) {
    if (!options.enabled) return;
    history_ = std::make_unique<detail::History>();
  }
  history_->configure(options);
  observed_ = !trackers_.empty() || history_->on();
}

std::uint32_t CachingAllocator::Impl::emit(const TraceEntry& entry) {
  for (const auto& tracker : trackers_) tracker(entry);
  if (history_ && history_->on()) {
    return history_->record(entry.action, entry.addr, entry.size, entry.stream);
  }
  return 0;
}

void CachingAllocator::Impl::begin_allocate_to_pool(PoolId id, PoolFilter filter) {
  if (!filter) throw UsageError("begin_allocate_to_pool: the filter is empty");
  std::lock_guard lock(mutex_);
  for (auto& [routed, f] : routes_) {
    if (routed == id) {
      throw UsageError(fmt::format("begin_allocate_to_pool: already allocating to pool ({}, {})",
                                   id.first, id.second));
    }
  }
  auto it = private_pools_.find(id);
  if (it == private_pools_.end()) {
    private_pools_.emplace(id, std::make_unique<PrivatePool>(id, &node_resource_));
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
  std::lock_guard lock(mutex_);
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
  std::lock_guard lock(mutex_);
  auto it = private_pools_.find(id);
  if (it == private_pools_.end() || it->second->use_count == 0) {
    throw UsageError(fmt::format("release_pool: no live pool ({}, {})", id.first, id.second));
  }
  if (--it->second->use_count == 0) freeable_pools_.push_back(id);
}

// ---------------------------------------------------------------------------
// The public class forwards to Impl.

CachingAllocator::CachingAllocator(Device& device, AllocatorConfig config, int device_index)
    : impl_(std::make_unique<Impl>(device, config, device_index)) {}
CachingAllocator::~CachingAllocator() = default;
void* CachingAllocator::allocate(std::size_t size, StreamId stream) {
  return impl_->allocate(size, stream);
}
void CachingAllocator::deallocate(void* ptr) {
  impl_->deallocate(ptr);
}
bool CachingAllocator::try_deallocate(void* ptr) {
  return ptr == nullptr || impl_->deallocate_held(ptr);
}
void CachingAllocator::record_stream(void* ptr, StreamId stream) {
  impl_->record_stream(ptr, stream);
}
void CachingAllocator::empty_cache() {
  impl_->empty_cache();
}
void CachingAllocator::set_memory_fraction(double fraction) {
  impl_->set_memory_fraction(fraction);
}
void CachingAllocator::set_config(const AllocatorConfig& config) {
  impl_->set_config(config);
}
AllocatorConfig CachingAllocator::config() const {
  return impl_->config();
}
int CachingAllocator::device_index() const noexcept {
  return impl_->device_index_;
}
DeviceStats CachingAllocator::stats() const {
  return impl_->stats();
}
std::map<std::string, std::int64_t> CachingAllocator::stats_map() const {
  return to_map(impl_->stats());
}
void CachingAllocator::reset_peak_stats() {
  impl_->reset_peak_stats();
}
void CachingAllocator::reset_accumulated_stats() {
  impl_->reset_accumulated_stats();
}
void CachingAllocator::combine_stats(std::shared_ptr<CombinedStats> combined, bool carry_peaks) {
  impl_->combine_stats(std::move(combined), carry_peaks);
}
std::string CachingAllocator::memory_summary(bool abbreviated) const {
  return reservoir::memory_summary(stats_map(), impl_->device_index_, abbreviated);
}
Snapshot CachingAllocator::snapshot() const {
  return impl_->snapshot();
}
std::vector<std::pair<DevicePtr, std::size_t>> CachingAllocator::live_allocations() const {
  return impl_->live_allocations();
}
std::size_t CachingAllocator::largest_cached_block() const {
  return impl_->largest_cached_block();
}
void CachingAllocator::attach_oom_observer(OomObserver observer) {
  impl_->attach_oom_observer(std::move(observer));
}
void CachingAllocator::add_free_memory_callback(FreeMemoryCallback callback) {
  impl_->add_free_memory_callback(std::move(callback));
}
void CachingAllocator::attach_trace_tracker(TraceTracker tracker) {
  impl_->attach_trace_tracker(std::move(tracker));
}

void CachingAllocator::record_history(const HistoryOptions& options) {
  impl_->record_history(options);
}
void CachingAllocator::begin_allocate_to_pool(PoolId id, PoolFilter filter) {
  impl_->begin_allocate_to_pool(id, std::move(filter));
}
void CachingAllocator::begin_allocate_current_thread_to_pool(PoolId id) {
  const std::thread::id owner = std::this_thread::get_id();
  impl_->begin_allocate_to_pool(id,
                                [owner](StreamId) { return std::this_thread::get_id() == owner; });
}
void CachingAllocator::end_allocate_to_pool(PoolId id) {
  impl_->end_allocate_to_pool(id);
}
void CachingAllocator::release_pool(PoolId id) {
  impl_->release_pool(id);
}
void CachingAllocator::validate() const {
  impl_->validate();
}
std::size_t CachingAllocator::round_size(std::size_t size, const AllocatorConfig& config) {
  return Impl::round_size(size, config);
}
std::size_t CachingAllocator::allocation_size(std::size_t rounded) {
  return Impl::allocation_size(rounded);
}
void CachingAllocator::restore(const Snapshot& layout) {
  impl_->restore(layout);
}

}  // namespace reservoir
