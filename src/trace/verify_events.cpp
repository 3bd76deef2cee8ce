// verify: each recorded event replayed (alloc, free_requested,
// free_completed, oom, segment events) and what a disagreeing address says.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "verifier.hpp"

namespace reservoir::detail {

void Verifier::step(CachingAllocator& allocator, SimDevice& device, std::size_t i) {
  const TraceEvent& e = trace_.events[i];
  switch (e.action) {
    case TraceAction::segment_alloc:
    case TraceAction::segment_free:
      if (e.action == TraceAction::segment_free) release_held_pool(allocator, i);
      if (vm_) {
        settings_changed(i);
      } else if (e.action == TraceAction::segment_alloc) {
        expect_.segment_allocs.emplace_back(e.addr, e.size);
      } else {
        expect_.segment_frees.emplace_back(e.addr, e.size);
      }
      return;
    case TraceAction::segment_map:
    case TraceAction::segment_unmap:
      // (A private pool's pages unmapped: the pool was let go, as a segment freed.)
      if (e.action == TraceAction::segment_unmap) release_held_pool(allocator, i);
      if (!vm_) {
        settings_changed(i);
      } else if (e.action == TraceAction::segment_map) {
        expect_.maps.emplace_back(e.addr, e.size);
      } else {
        expect_.segment_frees.emplace_back(e.addr, e.size);
      }
      return;
    case TraceAction::alloc: alloc(allocator, i); return;
    case TraceAction::oom: oom(allocator, i); return;
    case TraceAction::free_requested: {
      if (zero_size_.erase(e.addr) != 0) {
        ++result_.zero_size_skipped;
        return;
      }
      const bool completes_now = i + 1 < trace_.events.size() &&
                                 trace_.events[i + 1].action == TraceAction::free_completed &&
                                 trace_.events[i + 1].addr == e.addr &&
                                 !completed_by_the_ladder(i + 1);
      try {
        if (completes_now) {
          allocator.deallocate(reinterpret_cast<void*>(e.addr));
        } else {
          hold_and_free(allocator, e.addr);
        }
      } catch (const InvalidPointerError& err) {
        diverge(i, fmt::format("free of {:#x}: {}", e.addr, err.what()));
      }
      return;
    }
    case TraceAction::free_completed: {
      // PyTorch records free_completed as it returns the block to the cache.
      auto it = held_.find(e.addr);
      if (it != held_.end() && !completed_by_the_ladder(i)) {
        device.complete_stream(it->second);
        held_.erase(it);
        try {
          allocator.process_completed_frees();
        } catch (const DeviceError& err) {
          diverge(i, err.what());
        }
      }
      return;
    }
    default: return;  // snapshot markers
  }
}

bool Verifier::completed_by_the_ladder(std::size_t i) const {
  // A free_completed event followed (through others and the releases of
  // the cache) by an oom whose request the freed block would have served:
  // the block was not in the pool when the request searched it, so the
  // free completed inside the retry ladder (release_cached_blocks waits for
  // pending frees), which then asked only the device and raised (every
  // release's ladder, pytorch/pytorch#189504). The block stays pending until
  // the replay's own ladder waits for it.
  const TraceEvent& freed = trace_.events[i];
  for (std::size_t j = i + 1; j < trace_.events.size(); ++j) {
    const TraceEvent& e = trace_.events[j];
    switch (e.action) {
      case TraceAction::free_completed:
      case TraceAction::segment_free:
      case TraceAction::segment_unmap: continue;
      case TraceAction::oom: {
        const std::size_t want = CachingAllocator::round_size(e.size, config_);
        const std::size_t block = CachingAllocator::round_size(freed.size, config_);
        const std::size_t max_split = config_.max_split_size;
        return e.stream == freed.stream && (want <= kSmallSize) == (block <= kSmallSize) &&
               block >= want && !(want < max_split && block >= max_split) &&
               !(want >= max_split && block >= want + config_.max_non_split_rounding_size);
      }
      default: return false;
    }
  }
  return false;
}

void Verifier::hold_and_free(CachingAllocator& allocator, DevicePtr addr) {
  const StreamId hold = kHoldStreamBase + next_hold_++;
  allocator.record_stream(reinterpret_cast<void*>(addr), hold);
  held_[addr] = hold;
  allocator.deallocate(reinterpret_cast<void*>(addr));
}

void Verifier::settings_changed(std::size_t i) {
  cannot_verify(
      i, fmt::format("cannot verify: a {} event, but the recorded settings {} "
                     "expandable segments (were they changed while recording?)",
                     to_string(trace_.events[i].action), vm_ ? "enable" : "do not enable"));
}

void Verifier::alloc(CachingAllocator& allocator, std::size_t i) {
  const TraceEvent& e = trace_.events[i];
  if (e.size == 0) {
    // PyTorch answers a zero-byte request without its allocator; nothing to replay.
    zero_size_.insert(e.addr);
    ++result_.zero_size_skipped;
    return;
  }
  void* got = nullptr;
  if (bare_releases_.contains(i)) (void)allocator.release_unmapped_segments();
  try {
    if (pending_gc_ && !exact_limit_) collect_garbage(allocator);
    got = allocate_routed(allocator, i);
  } catch (const UsageError& err) {
    diverge(i, fmt::format("alloc of {} bytes in its private pool: {}", e.size, err.what()));
    return;
  } catch (const OutOfMemoryError&) {
    diverge(i, expect_.problem.empty()
                   ? fmt::format("alloc of {} bytes: reservoir ran out of memory; the "
                                 "recording returned {:#x}",
                                 e.size, e.addr)
                   : expect_.problem);
    return;
  } catch (const DeviceError& err) {
    diverge(i, expect_.problem.empty() ? std::string(err.what()) : expect_.problem);
    return;
  }
  if (!settle(i)) return;
  const auto ptr = reinterpret_cast<DevicePtr>(got);
  if (ptr != e.addr) {
    diverge(i, explain_alloc(allocator, e, ptr));
    return;
  }
  ++result_.allocs_checked;
}

void* Verifier::allocate_routed(CachingAllocator& allocator, std::size_t i) {
  const TraceEvent& e = trace_.events[i];
  const PoolId* pool = pool_of(i);
  if (pool == nullptr) return allocator.allocate(e.size, e.stream);
  // The route PyTorch opened (a capture, use_mem_pool) for this request's
  // stream; its first use makes the pool, which the replay then holds.
  const bool made_here = held_pools_.insert(*pool).second;
  if (made_here) released_pools_.erase(*pool);
  allocator.begin_allocate_to_pool(*pool, [stream = e.stream](StreamId s) { return s == stream; });
  class Route {
   public:
    Route(CachingAllocator& allocator, PoolId pool, bool drop_use)
        : allocator_(allocator), pool_(pool), drop_use_(drop_use) {}
    Route(const Route&) = delete;
    Route& operator=(const Route&) = delete;
    Route(Route&&) = delete;
    Route& operator=(Route&&) = delete;
    ~Route() {
      try {
        allocator_.end_allocate_to_pool(pool_);
        if (drop_use_) allocator_.release_pool(pool_);  // back to the one use the replay holds
      } catch (const Error&) {
        // The route was opened by allocate_routed and is ours: nothing else ends it.
      }
    }

   private:
    CachingAllocator& allocator_;
    PoolId pool_;
    bool drop_use_;
  } route(allocator, *pool, !made_here);
  return allocator.allocate(e.size, e.stream);
}

// The recording frees a segment of a private pool (or unmaps its pages):
// PyTorch had let the pool go (its graph or MemPool deleted), so the replay
// lets it go too, and the release that follows frees its unused memory.
void Verifier::release_held_pool(CachingAllocator& allocator, std::size_t i) {
  const PoolId* pool = pool_of(i);
  if (pool == nullptr || held_pools_.erase(*pool) == 0) return;
  allocator.release_pool(*pool);
  released_pools_.insert(*pool);
}

void Verifier::oom(CachingAllocator& allocator, std::size_t i) {
  const TraceEvent& e = trace_.events[i];
  expect_.oom_expected = true;
  try {
    if (pending_gc_ && !exact_limit_) collect_garbage(allocator);
    void* got = allocator.allocate(e.size, e.stream);
    expect_.oom_expected = false;
    diverge(i, fmt::format("the recording ran out of memory allocating {} bytes; reservoir "
                           "returned {:#x}",
                           e.size, reinterpret_cast<DevicePtr>(got)));
    return;
  } catch (const OutOfMemoryError&) {
  } catch (const DeviceError&) {
  }
  expect_.oom_expected = false;
  if (settle(i)) ++result_.ooms_checked;
}

std::string Verifier::explain_alloc(const CachingAllocator& allocator, const TraceEvent& e,
                          DevicePtr got) const {
  const std::size_t size = CachingAllocator::round_size(e.size, config_);
  const bool small = size <= kSmallSize;
  std::string out = fmt::format(
      "alloc of {} bytes (rounded to {}, {} pool, stream {}): expected {:#x}, got {:#x}", e.size,
      size, small ? "small" : "large", e.stream, e.addr, got);
  const Snapshot snap = allocator.snapshot();
  std::vector<std::pair<std::uint64_t, DevicePtr>> fits;
  for (const SegmentInfo& s : snap.segments) {
    for (const BlockInfo& b : s.blocks) {
      if (e.addr >= b.address && e.addr < b.address + b.size) {
        out += fmt::format(
            "\n  reservoir's block holding the expected address: {:#x}, {} bytes, "
            "{} (segment {:#x}, {} bytes, {})",
            b.address, b.size, to_string(b.state), s.address, s.total_size,
            s.is_large ? "large" : "small");
      }
      if (b.state == BlockState::inactive && s.is_large == !small && s.stream == e.stream &&
          b.size >= size) {
        fits.emplace_back(b.size, b.address);
      }
    }
  }
  std::sort(fits.begin(), fits.end());
  out +=
      fmt::format("\n  free blocks of the pool that fit, best first ({} in all):", fits.size());
  for (std::size_t k = 0; k < fits.size() && k < 5; ++k) {
    out += fmt::format("\n    {:#x}: {} bytes", fits[k].second, fits[k].first);
  }
  return out;
}

}  // namespace reservoir::detail
