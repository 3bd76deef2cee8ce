// The native policy: PyTorch's CUDACachingAllocator decisions on sizes,
// allocation and deallocation (releasing cached memory: cache_release.cpp).
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <bit>

#include "allocator_impl.hpp"
#include "reservoir/detail/debug_assert.hpp"
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
  if (divisions != 0) [[unlikely]] {
    // Before PyTorch 2.4 one division keeps the size as asked (unaligned):
    // its rounding returned early for one division (seen in 2.3's addresses).
    if (divisions == 1) return config.one_division_keeps_size() ? size : round_to_block(size);
    if (size > kMinBlockSize * divisions) {
      // Round up to the next of `divisions` equal steps between powers of two.
      if (std::has_single_bit(size)) return size;
      const std::size_t floor = std::bit_floor(size);
      const std::size_t step = floor >> (std::bit_width(divisions) - 1);
      if (step == 0) return floor << 1;
      const std::size_t down = size & ~(step - 1);
      return down == size ? size : down + step;
    }
  }
  return round_to_block(size);
}

std::size_t CachingAllocator::Impl::allocation_size(std::size_t size,
                                                    const AllocatorConfig& config) {
  if (size <= kSmallSize) return kSmallBuffer;
  if (size < kMinLargeAlloc) return config.large_segment_size;
  return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

// ---------------------------------------------------------------------------
// Allocation

Segment* CachingAllocator::Impl::add_segment(DevicePtr base, std::size_t size, StreamId stream,
                                             BlockPool* pool, std::unique_ptr<detail::VmState> vm,
                                             bool with_head) {
  auto segment = std::make_unique<Segment>();
  Segment* seg = segment.get();
  seg->order = ++segments_made_;
  seg->base = base;
  seg->size = size;
  seg->stream = stream;
  seg->pool = pool;
  seg->vm = std::move(vm);
  if (with_head) seg->head = make_block(base, size, stream, pool, seg);
  segments_.emplace(base, std::move(segment));
  return seg;
}

void CachingAllocator::Impl::count_segment_alloc(const BlockPool& pool, std::size_t size) {
  total_reserved_ += size;
  add_stats(stats_.segment, stat_index(pool), 1);
  add_stats(stats_.reserved_bytes, stat_index(pool), size);
  if (pool.owner != nullptr) {
    StatArray& reserved = pool_reserved_[pool.owner->id];
    reserved[0].increase(size);
    reserved[stat_index(pool)].increase(size);
  }
  if (size >= config_.max_split_size) add_stat(stats_.oversize_segments, 1);
  ++stats_.num_device_alloc;
}

// (Here rather than in vm_policy.cpp: get_free_block inlines it.)
// get_free_block's candidate when the best fit lies in a VM segment.
[[gnu::always_inline]] inline bool CachingAllocator::Impl::vm_candidate(
    const AllocParams& p, detail::BlockSet::iterator& it) {
  const BlockPool& pool = *p.pool;
  if (vm_on()) {
    // A cached block followed by unmapped space counts, for best fit, as
    // the size it can grow to (PyTorch's rule).
    auto growable = [](const Block* b) {
      return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
    };
    // Blocks of a stream sort by size: one that cannot grow (no unmapped
    // space after it) is beaten by none after it.
    while ((*it)->in_vm && (*it)->next != nullptr && !(*it)->next->mapped) {
      const auto next = std::next(it);
      if (next == pool.blocks.end() || (*next)->stream != p.stream ||
          growable(*next) >= growable(*it)) {
        break;
      }
      it = next;
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
  return true;
}

[[gnu::always_inline]] inline bool CachingAllocator::Impl::get_free_block(AllocParams& p) {
  BlockPool& pool = *p.pool;
  if (set_fraction_ && config_.garbage_collection_threshold > 0.0) {
    ++pool.get_free_blocks_call_count;  // block ages are counted only when GC is on
  }
  auto it = pool.blocks.lower_bound(detail::SizeKey{p.stream, p.size});
  if (it == pool.blocks.end() || (*it)->stream != p.stream) return false;
  if (in_vm(*it) && !vm_candidate(p, it)) return false;
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
  if (is_retry) ++stats_.num_alloc_retries;
  // The default pool's memory comes from the policy's source; private pools
  // keep classic segments unless the source serves them too (PyTorch's
  // expandable segments from 2.5).
  PrivatePool* const owner = p.pool->owner;
  // A pool over another allocator (MemPool(allocator=...)) never takes the
  // source's virtual memory.
  const bool from_source = owner == nullptr || (traits_.private_pools && !owner->segments);
  if (set_fraction_ && !(from_source && traits_.checks_fraction) &&
      total_reserved_ + p.alloc_size > allowed_memory_maximum_) {
    return false;
  }
  if (!from_source) return owner != nullptr && owner->segments ? new_pool_segment(p) : new_segment(p);
  if (!source_->obtain(p)) return false;
  // PyTorch counts one device allocation of a private pool per request
  // served by mapping, and one release per unmapping (unmap_pages).
  if (owner != nullptr) ++owner->device_alloc_count;
  return true;
}

bool CachingAllocator::Impl::new_segment(AllocParams& p) {
  const std::size_t size = p.alloc_size;
  DevicePtr ptr = 0;
  const Status status = device_.allocate_segment_on(size, p.stream, &ptr);
  if (status == Status::out_of_memory) return false;
  if (status != Status::ok) {
    throw DeviceError(CallKind::allocate_segment, status,
                      fmt::format("allocating a segment of {} bytes", size));
  }
  Block* block = add_segment(ptr, size, p.stream, p.pool)->head;
  if (p.pool->owner != nullptr) ++p.pool->owner->device_alloc_count;
  count_segment_alloc(*p.pool, size);
  trace(TraceAction::segment_alloc, ptr, size, p.stream);
  p.block = block;
  return true;
}

bool CachingAllocator::Impl::new_pool_segment(AllocParams& p) {
  const std::size_t size = p.alloc_size;
  std::shared_ptr<PoolSegmentAllocator> from = p.pool->owner->segments;
  const DevicePtr ptr = from->allocate(size, p.stream);
  if (ptr == 0) return false;  // out of memory: the retry ladder follows
  detail::Segment* segment = add_segment(ptr, size, p.stream, p.pool);
  segment->from = std::move(from);
  ++p.pool->owner->device_alloc_count;
  count_segment_alloc(*p.pool, size);
  trace(TraceAction::segment_alloc, ptr, size, p.stream);
  p.block = segment->head;
  return true;
}

[[gnu::always_inline]] inline Block* CachingAllocator::Impl::alloc_found_block(
    AllocParams& p, std::size_t requested) {
  return alloc_found_block(p, requested, should_split(p.block, p.size));
}

[[gnu::always_inline]] inline Block* CachingAllocator::Impl::alloc_found_block(
    AllocParams& p, std::size_t requested, bool split, const StreamId* caller) {
  Block* block = p.block;
  BlockPool& pool = *p.pool;
  const bool already_split = block->is_split();
  if (split) {
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
    RESERVOIR_DEBUG_ASSERT(remaining->size > p.size);
    remaining->ptr += p.size;
    remaining->size -= p.size;
    if (p.block_in_pool) {
      pool.reposition_shrunk(remaining);
    } else {
      pool.insert(remaining);
    }
    if (in_vm(block)) {
      // Expandable segments stay out of the inactive_split stats (PyTorch).
    } else if (already_split) {
      sub_stats(stats_.inactive_split_bytes, stat_index(pool), block->size);
    } else {
      add_stats(stat_index(pool),
                {{stats_.inactive_split_bytes, remaining->size}, {stats_.inactive_split, 1}});
    }
  } else {
    if (p.block_in_pool) pool.erase(block);
    if (already_split && !in_vm(block)) {
      sub_stats(stat_index(pool),
                {{stats_.inactive_split_bytes, block->size}, {stats_.inactive_split, 1}});
    }
  }
  count_allocation(block, requested);
  // (On the caller's stream: a replay of the history asks as it did.)
  block->context =
      trace(TraceAction::alloc, block->ptr, requested, caller != nullptr ? *caller : block->stream);
  return block;
}

[[gnu::always_inline]] inline void* CachingAllocator::Impl::allocate(std::size_t requested,
                                                                     StreamId stream) {
  if (requested == 0) return nullptr;
  if (requested >= kLargestRequest) [[unlikely]] refuse_impossible(requested);
  detail::UniqueLock lock(mutex_);
  if (events_pending() && routes_.empty()) process_events();
  const std::size_t size = rounded(requested);
  AllocParams p{size, 0, stream, &request_pool(size, stream)};

  const bool found = get_free_block(p);
  // A native_paged segment's block may need pages mapped first (allocate_slow),
  // but not in the steady state: a segment mapped whole, memory to spare.
  if (found) [[likely]] {
    const detail::VmState* paged = p.block->segment->paged.get();
    if (paged == nullptr ||
        (paged->whole && total_reserved_ + paged->plentiful_above <= total_capacity_)) [[likely]] {
      return reinterpret_cast<void*>(alloc_found_block(p, requested)->ptr);
    }
  }
  return allocate_slow(p, requested, found, lock);
}

void* CachingAllocator::Impl::allocate_slow(AllocParams& p, std::size_t requested, bool found,
                                            detail::UniqueLock<ClaimingMutex>& lock) {
  p.requested = requested;  // back_block maps the pages under it
  refused_reserve_ = 0;
  if (found) {
    if (back_block(p)) return reinterpret_cast<void*>(alloc_found_block(p, requested)->ptr);
    found = false;
  }
  const std::size_t size = p.size;
  const StreamId stream = p.stream;
  p.alloc_size = allocation_size(size, config_);
  if (!free_memory_callbacks_.empty()) {
    const std::vector<FreeMemoryCallback> callbacks = free_memory_callbacks_;
    lock.unlock();  // LOCK RELEASED: callbacks may free memory through this allocator
    bool freed = false;
    for (const auto& callback : callbacks) freed |= callback();
    lock.lock();
    p.pool = &pool_for(size, stream);  // a pool may have changed while unlocked
    found = freed && get_free_block(p) && (p.block->segment->paged == nullptr || back_block(p));
  }
  if (!found) {
    if (set_fraction_ && config_.garbage_collection_threshold > 0.0) {
      garbage_collect_cached_blocks();
    }
    // A use_on_oom pool's free block (PyTorch's MemPool(use_on_oom=True)),
    // for a request outside every private pool, comes before freeing any
    // cached memory, as in PyTorch 2.11 and later.
    found = alloc_block(p, false) ||
            (!use_on_oom_pools_.empty() && p.pool->owner == nullptr && borrow_from_use_on_oom_pools(p)) ||
            (release_available_cached_blocks(p) && alloc_block(p, false)) ||
            (routes_.empty() && release_cached_blocks() &&
             (search_after_release(p) || alloc_block(p, true))) ||
            (traits_.rescues && rescue_paged(p));
  }
  if (!found) {
    Oom oom = out_of_memory(p);
    lock.unlock();  // LOCK RELEASED: observers may inspect or free memory
    for (const auto& observer : oom.observers)
      observer(device_index_, p.alloc_size, oom.limit, oom.free);
    throw explained(oom);
  }
  Block* block = alloc_found_block(p, requested, should_split(p.block, p.size), &stream);
  // A block lent by another stream's segment (native_paged's rescue) stays
  // that stream's; the caller's stream is a use of it, as by record_stream.
  if (block->stream != stream) block->stream_uses.push_back(stream);
  return reinterpret_cast<void*>(block->ptr);
}

bool CachingAllocator::Impl::search_after_release(AllocParams& p) {
  // A free that was pending on another stream's event is in the pool now
  // (release_cached_blocks waited for it) and may serve the request where
  // PyTorch's ladder asks only the device (pytorch/pytorch#189504). Counted
  // as no retry, as the search at the top of the ladder.
  if (!config_.retry_searches_pool) return false;
  p.pool = &pool_for(p.size, p.stream);
  return get_free_block(p) && (p.block->segment->paged == nullptr || back_block(p));
}

void CachingAllocator::Impl::refuse_impossible(std::size_t requested) {
  // PyTorch's check ahead of its device allocator: no statistics, no history
  // entry, no observers. Every size computed from a request below it (its
  // rounding, a segment, a page count, an address range) stays far from
  // wrapping: 2^60 leaves sixteen times the room.
  MemoryInfo info;
  if (device_.memory_info(&info) != Status::ok) info = MemoryInfo{};
  throw OutOfMemoryError(
      fmt::format("CUDA out of memory. Tried to allocate more than 1EB memory ({} bytes "
                  "requested on device {}).",
                  requested, device_index_),
      requested, info.free, info.total);
}

bool CachingAllocator::Impl::borrow_from_use_on_oom_pools(AllocParams& p) {
  for (const PoolId& id : use_on_oom_pools_) {
    auto it = private_pools_.find(id);
    if (it == private_pools_.end() || it->second->use_count == 0) continue;  // nothing cached yet, or released
    detail::PrivatePool& pool = *it->second;
    AllocParams borrowed{p.size, p.alloc_size, p.stream, p.size <= kSmallSize ? &pool.small : &pool.large};
    if (get_free_block(borrowed)) {
      p = borrowed;
      return true;
    }
  }
  return false;
}

std::string CachingAllocator::Impl::process_memory_sentences() {
  // PyTorch's, from NVML: each process using the device and what it holds
  // (this process's figure includes its CUDA context and any library's
  // memory); left out where the device cannot list them.
  std::vector<ProcessMemory> processes;
  if (device_.running_processes(&processes) != Status::ok) return {};
  const auto self = static_cast<unsigned int>(getpid());
  std::string out;
  for (const ProcessMemory& pm : processes) {
    out += pm.pid == self ? std::string("Including non-PyTorch memory, this process")
                          : fmt::format("Process {}", pm.pid);
    out += fmt::format(" has {} memory in use. ", format_size(pm.used));
  }
  return out;
}

CachingAllocator::Impl::Oom CachingAllocator::Impl::out_of_memory(const AllocParams& p) {
  MemoryInfo info;
  if (device_.memory_info(&info) != Status::ok) info = MemoryInfo{};
  std::string allowed_info;
  if (set_fraction_) allowed_info = format_size(allowed_memory_maximum_) + " allowed; ";
  trace(TraceAction::oom, info.free, p.size, p.stream);
  ++stats_.num_ooms;
  const auto allocated = static_cast<std::size_t>(all_current(stats_.allocated_bytes));
  const auto reserved = static_cast<std::size_t>(all_current(stats_.reserved_bytes));
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
  // The closing advice as the release writes it (read from each release's
  // libc10_cuda.so): 2.10 names PYTORCH_ALLOC_CONF, 2.11 on link the
  // documentation's new address; a release not named writes the newest's.
  const std::string& release = config_.pytorch_version;
  const bool before_2_11 = !release.empty() && compare_versions(release, "2.11") < 0;
  const bool names_alloc_conf = !release.empty() && compare_versions(release, "2.10") >= 0 && before_2_11;
  // From 2.15, under expandable segments the advice is about address space.
  const bool advises_address_space =
      (config_.expandable_segments || config_.policy == Policy::expandable) && !release.empty() &&
      compare_versions(release, "2.15") >= 0;
  // A request no new expandable segment could hold (expandable_segments_reserve):
  // 2.15 says so in place of that advice.
  const std::string advice =
      refused_reserve_ != 0
          ? fmt::format(" This allocation exceeds the expandable-segment reserve of {} {}, and a single "
                        "allocation cannot span expandable segments. Raise PYTORCH_CUDA_ALLOC_CONF "
                        "expandable_segments_reserve or expandable_segments_reserve_by_class (or unset it) so "
                        "that a segment is at least {}.",
                        format_size(refused_reserve_),
                        refused_reserve_class_.empty()
                            ? std::string("for this stream")
                            : fmt::format("for stream reserve class '{}'", refused_reserve_class_),
                        format_size(p.alloc_size))
      : advises_address_space
          ? std::string(
                " expandable_segments is enabled. If instead the process is running out of virtual "
                "address space (VSZ), expandable segments may be over-reserving VA (each segment "
                "reserves ~9/8 of device memory, times the number of streams); reduce it via "
                "PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve / "
                "expandable_segments_reserve_by_class.")
          : fmt::format(
                " If reserved but unallocated memory is large try setting "
                "{}=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
                "Management  ({})",
                names_alloc_conf ? "PYTORCH_ALLOC_CONF" : "PYTORCH_CUDA_ALLOC_CONF",
                before_2_11 ? "https://pytorch.org/docs/stable/notes/cuda.html#environment-variables"
                            : "https://docs.pytorch.org/docs/stable/notes/cuda.html"
                              "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf");
  std::string message = fmt::format(
      "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} "
      "is free. {}{}Of the allocated memory {} is allocated by PyTorch, {}and {} is reserved by "
      "PyTorch but unallocated.{}",
      format_size(p.alloc_size), device_index_, format_size(info.total), format_size(info.free),
      process_memory_sentences(), allowed_info, format_size(allocated + in_private_pools), private_msg,
      format_size(reserved - allocated - in_private_pools), advice);
  return Oom{OutOfMemoryError(message, p.alloc_size, info.free, info.total), oom_observers_,
             set_fraction_ ? allowed_memory_maximum_ : info.total, info.free, oom_explainer_};
}

OutOfMemoryError CachingAllocator::Impl::explained(Oom& oom) {
  if (!oom.explainer) return std::move(oom.error);
  std::string answer;
  try {
    answer = oom.explainer(oom.error);
  } catch (...) {
    // The answer is an addition: whatever went wrong in it, the error is thrown as it was.
    return std::move(oom.error);
  }
  if (answer.empty()) return std::move(oom.error);
  return OutOfMemoryError(std::string(oom.error.what()) + "\n" + answer, oom.error.requested_bytes(),
                          oom.error.device_free(), oom.error.device_total());
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

[[gnu::always_inline]] inline void CachingAllocator::Impl::cache_block(Block* block) {
  trace(TraceAction::free_completed, block->ptr, block->requested_size, block->stream);
  const std::size_t original_size = block->size;
  const std::size_t requested = block->requested_size;
  BlockPool& pool = *block->pool;
  Block* const prev = block->prev;
  Block* const next = block->next;
  const bool merge_prev = prev != nullptr && prev->cached;  // is_free(), as kept in the pool
  const bool merge_next = next != nullptr && next->cached;
  RESERVOIR_DEBUG_ASSERT(block->event_count == 0);
  RESERVOIR_DEBUG_ASSERT(prev == nullptr || prev->ptr + prev->size == block->ptr);
  RESERVOIR_DEBUG_ASSERT(next == nullptr || block->ptr + block->size == next->ptr);
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
    if (block_age_) [[unlikely]] {
      // PyTorch keeps the freed block, and with it its age: under 2.12's
      // rule a key of its own (within a segment ages are equal otherwise).
      pool.erase(merged);
      merged->order = block->order;
      pool.insert(merged);
    } else {
      pool.reposition_grown(merged);
    }
    arena_.recycle(block);
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
  const std::size_t k = stat_index(pool);
  if (split_blocks_change > 0) {
    add_stats(stats_.inactive_split, k, static_cast<std::uint64_t>(split_blocks_change));
  } else if (split_blocks_change < 0) {
    sub_stats(stats_.inactive_split, k, static_cast<std::uint64_t>(-split_blocks_change));
  }
  if (split_bytes_change > 0) {
    add_stats(stats_.inactive_split_bytes, k, static_cast<std::uint64_t>(split_bytes_change));
  } else if (split_bytes_change < 0) {
    sub_stats(stats_.inactive_split_bytes, k, static_cast<std::uint64_t>(-split_bytes_change));
  }
  sub_stats(k, {{stats_.active, 1},
                {stats_.active_bytes, original_size},
                {stats_.requested_bytes, requested}});
}

void CachingAllocator::Impl::free_block(Block* block) {
  cache_block(block);
}

[[gnu::always_inline]] inline bool CachingAllocator::Impl::deallocate_locked(DevicePtr ptr) {
  Block** found = allocated_.find(ptr);
  if (found == nullptr) return false;
  Block* block = *found;
  const bool deferred = !block->stream_uses.empty();
  // Record stream events (or capture markers) first: if the device fails,
  // the block stays allocated and nothing has changed.
  if (deferred) [[unlikely]] {
    if (routes_.empty()) {
      insert_events(block);
    } else if (config_.graph_capture_record_stream_reuse) {
      mark_capture_free(block);
    }
  }
  allocated_.erase_found(found);
  block->allocated = false;
  const std::size_t k = stat_index(*block->pool);
  sub_stats(k, {{stats_.allocation, 1}, {stats_.allocated_bytes, block->size}});
  trace(TraceAction::free_requested, block->ptr, block->requested_size, block->stream);
  if (block->size >= config_.max_split_size) sub_stat(stats_.oversize_allocations, 1);
  if (deferred) {
    if (!routes_.empty()) deferred_event_blocks_.push_back(block);
  } else {
    cache_block(block);
    if (traits_.after_free) [[unlikely]]
      source_->after_free();
  }
  return true;
}

[[gnu::always_inline]] inline void CachingAllocator::Impl::deallocate(void* raw) {
  if (raw == nullptr) return;
  const auto ptr = reinterpret_cast<DevicePtr>(raw);
  detail::LockGuard lock(mutex_);
  if (!deallocate_locked(ptr)) throw_invalid_pointer(ptr, "deallocate");
}

[[gnu::always_inline]] inline bool CachingAllocator::Impl::deallocate_held(void* raw) {
  // A pointer held elsewhere (a Saver asks each allocator in turn) changes
  // nothing here: it is looked up without claiming combined statistics.
  const auto ptr = reinterpret_cast<DevicePtr>(raw);
  mutex_.lock_unclaimed();
  if (allocated_.find(ptr) == nullptr) {
    mutex_.unlock();
    return false;
  }
  if (!mutex_.owns_sum()) {
    mutex_.unlock();
    mutex_.lock();  // claims; the pointer may have been freed meanwhile
  }
  bool freed = false;
  try {
    freed = deallocate_locked(ptr);
  } catch (...) {
    mutex_.unlock();
    throw;
  }
  mutex_.unlock();
  return freed;
}

void CachingAllocator::Impl::record_stream(void* raw, StreamId stream) {
  if (raw == nullptr) return;
  const auto ptr = reinterpret_cast<DevicePtr>(raw);
  detail::LockGuard lock(mutex_);
  Block** found = allocated_.find(ptr);
  if (found == nullptr) throw_invalid_pointer(ptr, "record_stream");
  Block* block = *found;
  if (stream == block->stream) return;  // uses on the allocation stream need no event
  if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
      block->stream_uses.end()) {
    block->stream_uses.push_back(stream);
  }
  if (traits_.observes) source_->stream_used(ptr, stream);
}

void CachingAllocator::Impl::free_allocations(const std::vector<DevicePtr>& ptrs) {
  for (const DevicePtr ptr : ptrs) {
    if (!deallocate_locked(ptr)) throw_invalid_pointer(ptr, "restore_pool");
  }
}

void CachingAllocator::Impl::lay_out_segment(Segment& seg, const PoolCheckpoint::SegmentState& state,
                                             PoolRestore& out) {
  // Every block allocated in turn from the segment's free block (one per
  // mapped run of a virtual-memory segment; its unmapped ranges are left as
  // they are), split where the checkpoint has more blocks after it (PyTorch
  // splits whatever max_split_size says now), with the block's size as
  // requested size.
  Block* block = seg.head;
  for (const PoolCheckpoint::BlockState& b : state.blocks) {
    RESERVOIR_DEBUG_ASSERT(block != nullptr && block->ptr == b.ptr);
    if (!b.mapped) {
      block = block->next;
      continue;
    }
    RESERVOIR_DEBUG_ASSERT(block->cached);
    AllocParams p{b.size, 0, b.stream, block->pool, block, true};
    block = alloc_found_block(p, b.size, block->size > b.size)->next;
  }
  // Then the checkpoint's free blocks are freed (no two are neighbours:
  // restore_pool checked it, so none merges before its turn).
  std::vector<DevicePtr> to_free;
  for (const PoolCheckpoint::BlockState& b : state.blocks) {
    if (!b.mapped) continue;
    if (b.allocated) {
      out.allocated.push_back(b.ptr);
    } else {
      to_free.push_back(b.ptr);
    }
  }
  free_allocations(to_free);
}

// The public entry points of the hot path, here so that it inlines into them.
void* CachingAllocator::allocate(std::size_t size, StreamId stream) {
  return impl_->checked(&Impl::allocate, size, stream);
}
void CachingAllocator::deallocate(void* ptr) {
  impl_->checked(&Impl::deallocate, ptr);
}
bool CachingAllocator::try_deallocate(void* ptr) {
  return ptr == nullptr || impl_->checked(&Impl::deallocate_held, ptr);
}

}  // namespace reservoir
