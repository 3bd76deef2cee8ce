#include "verify_start.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"

namespace reservoir::detail {
namespace {

struct StartBlock {
  std::uint64_t size = 0;
  std::uint64_t requested = 0;
  StreamId stream = 0;
  std::size_t free_event = 0;  // index of the event that returned it to the cache
  bool exact = false;          // size known exactly (from the final snapshot)
};

// The unsplit tail after a large block freed before any alloc at its address.
// An oversize request (max_split_size_mb and up) is never split: its block
// reaches the next block, however far, unless an alloc lands in between
// first (it lands where the free space, hence the tail's end, starts).
std::uint64_t unsplit_tail(const Trace& trace, DevicePtr addr, const StartBlock& b, DevicePtr limit,
                           const AllocatorConfig& config, StartingState& out) {
  const DevicePtr end = addr + b.size;
  const std::uint64_t gap = limit - end;
  const bool oversize = b.size >= config.max_split_size;
  const std::uint64_t reach = oversize ? gap : kSmallSize;
  std::uint64_t tail = 0;
  if (gap > 0 && gap <= kSmallSize) {
    tail = gap;  // a free large block is always larger than 1 MiB
  } else if (gap > kSmallSize) {
    tail = oversize ? gap : 0;
    for (std::size_t i = 0; i < b.free_event; ++i) {
      const TraceEvent& e = trace.events[i];
      if (e.action == TraceAction::alloc && e.addr >= end && e.addr <= end + reach &&
          e.addr < limit) {
        tail = e.addr - end;
        break;
      }
    }
  }
  if (tail > 0) ++out.unsplit_tails;
  return tail;
}

// Blocks live at the start: freed before any alloc at their address (their
// size the rounded request), pending free at the start (first event a
// free_completed), and final allocated blocks no event touches (exact), of
// classic segments or, with `expandable`, of expandable ones.
std::map<DevicePtr, StartBlock> start_blocks(const Trace& trace, const AllocatorConfig& config,
                                             bool expandable, StartingState& out) {
  const auto& events = trace.events;
  std::map<DevicePtr, StartBlock> blocks;
  std::unordered_set<DevicePtr> live;
  std::unordered_set<DevicePtr> touched;
  std::unordered_set<DevicePtr> requested;  // freed, waiting for free_completed
  std::unordered_set<DevicePtr> reused;     // allocated within the recording
  // A block live at the start, known from its free event `i`.
  auto add_freed = [&](const TraceEvent& e, std::size_t i) {
    StartBlock b;
    b.size = CachingAllocator::round_size(e.size, config);
    b.requested = e.size;
    b.stream = e.stream;
    b.free_event = i;
    blocks.emplace(e.addr, b);
  };
  for (std::size_t i = 0; i < events.size(); ++i) {
    const TraceEvent& e = events[i];
    if (e.action == TraceAction::alloc) {
      live.insert(e.addr);
      touched.insert(e.addr);
      reused.insert(e.addr);
    } else if (e.action == TraceAction::free_completed) {
      if (requested.erase(e.addr) != 0) {
        // A delayed free: the block is in use until now, which is what
        // bounds its unsplit tail.
        auto it = blocks.find(e.addr);
        if (it != blocks.end() && !it->second.exact && reused.count(e.addr) == 0) {
          it->second.free_event = i;
        }
        continue;
      }
      if (touched.count(e.addr) != 0) continue;
      // Freed before the recording began, its stream work still pending.
      touched.insert(e.addr);
      add_freed(e, i);
      out.pending_frees.push_back(e.addr);
    } else if (e.action == TraceAction::free_requested) {
      touched.insert(e.addr);
      requested.insert(e.addr);
      if (live.erase(e.addr) == 0) add_freed(e, i);
    }
  }
  for (const SegmentInfo& s : trace.final_state.segments) {
    if (s.pool_id != PoolId{0, 0} || s.is_expandable != expandable) continue;
    for (const BlockInfo& bi : s.blocks) {
      // Still pending free at the end, never allocated again: its exact size.
      if (bi.state == BlockState::active_pending_free && reused.count(bi.address) == 0) {
        auto it = blocks.find(bi.address);
        if (it != blocks.end() && !it->second.exact) {
          it->second.size = bi.size;
          it->second.exact = true;
        }
      }
      if (bi.state == BlockState::inactive || touched.count(bi.address) != 0) continue;
      StartBlock b;
      b.size = bi.size;
      b.requested = bi.requested_size;
      b.stream = s.stream;
      b.exact = true;
      blocks.emplace(bi.address, b);
    }
  }

  return blocks;
}

}  // namespace

StartingState starting_state(const Trace& trace, const AllocatorConfig& config,
                             bool first_alloc_made_its_segment) {
  StartingState out;
  const auto& events = trace.events;
  std::map<DevicePtr, SegmentInfo> segments;
  std::unordered_set<DevicePtr> segment_seen;
  for (const TraceEvent& e : events) {
    if (e.action == TraceAction::segment_alloc) {
      segment_seen.insert(e.addr);
    } else if (e.action == TraceAction::segment_free && segment_seen.insert(e.addr).second) {
      SegmentInfo s;
      s.address = e.addr;
      s.total_size = e.size;
      s.stream = e.stream;
      s.is_large = e.size != kSmallBuffer;
      segments.emplace(e.addr, s);
    }
  }
  // Private pools' segments are left out: verify stops at their first event.
  // Expandable ones are all mapped within the recording (verify checks).
  for (const SegmentInfo& s : trace.final_state.segments) {
    if (s.pool_id == PoolId{0, 0} && !s.is_expandable && segment_seen.count(s.address) == 0) {
      SegmentInfo copy = s;
      copy.blocks.clear();
      segments.emplace(s.address, copy);
    }
  }

  if (first_alloc_made_its_segment && !events.empty() && events[0].action == TraceAction::alloc) {
    auto it = segments.find(events[0].addr);
    if (it != segments.end()) {
      out.made_by_first_alloc = std::make_pair(it->first, it->second.total_size);
      segments.erase(it);
    }
  }

  std::map<DevicePtr, StartBlock> blocks = start_blocks(trace, config, false, out);

  // Place each block in its segment, find unsplit tails, and lay out the gaps.
  Snapshot layout;
  auto block_it = blocks.begin();
  for (auto& entry : segments) {
    const DevicePtr base = entry.first;
    SegmentInfo& seg = entry.second;
    const DevicePtr end = base + seg.total_size;
    std::vector<std::pair<DevicePtr, StartBlock*>> inside;
    for (; block_it != blocks.end() && block_it->first < end; ++block_it) {
      if (block_it->first < base) break;
      inside.emplace_back(block_it->first, &block_it->second);
    }
    if (block_it != blocks.end() && block_it->first < base) {
      throw TraceError(
          fmt::format("verify {}: a block live at the start, at {:#x}, lies in no "
                      "starting segment",
                      trace.name, block_it->first));
    }
    for (std::size_t k = 0; k < inside.size(); ++k) {
      auto& [addr, b] = inside[k];
      const DevicePtr limit = k + 1 < inside.size() ? inside[k + 1].first : end;
      if (addr + b->size > limit) {
        throw TraceError(
            fmt::format("verify {}: the block live at the start at {:#x} ({} bytes) "
                        "overlaps what follows at {:#x}",
                        trace.name, addr, b->size, limit));
      }
      if (!b->exact && seg.is_large) b->size += unsplit_tail(trace, addr, *b, limit, config, out);
    }
    DevicePtr cursor = base;
    auto add_free = [&](DevicePtr to) {
      if (to > cursor) seg.blocks.push_back({cursor, to - cursor, 0, BlockState::inactive});
      cursor = to;
    };
    for (auto& [addr, b] : inside) {
      add_free(addr);
      seg.blocks.push_back({addr, b->size, b->requested, BlockState::active_allocated});
      cursor = addr + b->size;
    }
    add_free(end);
    layout.segments.push_back(seg);
    out.live_blocks += inside.size();
  }
  if (block_it != blocks.end()) {
    throw TraceError(
        fmt::format("verify {}: a block live at the start, at {:#x}, lies in no "
                    "starting segment",
                    trace.name, block_it->first));
  }
  out.layout = std::move(layout);
  return out;
}

namespace {

// Disjoint address ranges, [start, end), with the stream and pool of each.
struct Range {
  DevicePtr end = 0;
  StreamId stream = 0;
  int large = -1;  // 1 large pool, 0 small, -1 not known yet
  bool private_pool = false;  // a private pool's pages (PyTorch 2.5 and later)
};
using Ranges = std::map<DevicePtr, Range>;

// Removes [lo, hi) from `ranges`; false when part of it is not there.
bool remove_range(Ranges& ranges, DevicePtr lo, DevicePtr hi) {
  auto it = ranges.upper_bound(lo);
  if (it == ranges.begin()) return false;
  --it;
  DevicePtr cursor = lo;
  std::vector<std::pair<DevicePtr, Range>> keep;
  while (it != ranges.end() && it->first < hi) {
    if (it->first > cursor) return false;  // a hole
    const Range r = it->second;
    if (it->first < lo) keep.emplace_back(it->first, Range{lo, r.stream, r.large, r.private_pool});
    if (r.end > hi) keep.emplace_back(hi, Range{r.end, r.stream, r.large, r.private_pool});
    cursor = r.end;
    it = ranges.erase(it);
  }
  if (cursor < hi) return false;
  for (auto& [at, r] : keep) ranges[at] = r;
  return true;
}

// Adds [lo, hi); false when part of it is there already.
bool add_range(Ranges& ranges, DevicePtr lo, DevicePtr hi, StreamId stream, int large,
               bool private_pool = false) {
  auto it = ranges.lower_bound(lo);
  if (it != ranges.end() && it->first < hi) return false;
  if (it != ranges.begin() && std::prev(it)->second.end > lo) return false;
  ranges[lo] = Range{hi, stream, large, private_pool};
  return true;
}

Ranges::iterator range_at(Ranges& ranges, DevicePtr a) {
  auto it = ranges.upper_bound(a);
  if (it == ranges.begin()) return ranges.end();
  --it;
  return a < it->second.end ? it : ranges.end();
}

// The pool a request or a mapping of `size` bytes implies: 1 large, 0 small, -1 either.
int pool_of_request(std::uint64_t size, const AllocatorConfig& config) {
  return CachingAllocator::round_size(size, config) <= kSmallSize ? 0 : 1;
}
int pool_of_mapping(std::uint64_t size, const AllocatorConfig& config) {
  return size % config.large_segment_size != 0 ? 0 : -1;
}

}  // namespace

StartingState expandable_starting_state(const Trace& trace, const AllocatorConfig& config) {
  StartingState out;
  const auto& events = trace.events;
  auto fail = [&](const std::string& what) {
    throw TraceError(fmt::format("verify {}: {}", trace.name, what));
  };
  // Mapped at the end, then each map and unmap undone, last first. A
  // private pool's pages (expandable from PyTorch 2.5) are undone too; any
  // of them mapped before the recording began cannot be rebuilt.
  Ranges mapped;
  for (const SegmentInfo& s : trace.final_state.segments) {
    if (!s.is_expandable) continue;
    if (!add_range(mapped, s.address, s.address + s.total_size, s.stream, s.is_large ? 1 : 0,
                   s.pool_id != PoolId{0, 0})) {
      fail(fmt::format("the final segments overlap at {:#x}", s.address));
    }
  }
  const auto in_private_pool = [&](std::size_t i) {
    const auto it = trace.event_pools.find(i);
    return it != trace.event_pools.end() && it->second != PoolId{0, 0};
  };
  for (std::size_t i = events.size(); i-- > 0;) {
    const TraceEvent& e = events[i];
    if (e.action == TraceAction::segment_map) {
      if (!remove_range(mapped, e.addr, e.addr + e.size)) {
        fail(
            fmt::format("event {}: segment_map at {:#x} ({} bytes) maps pages the recording "
                        "unmaps again, or maps twice",
                        i, e.addr, e.size));
      }
    } else if (e.action == TraceAction::segment_unmap) {
      if (!add_range(mapped, e.addr, e.addr + e.size, e.stream, pool_of_mapping(e.size, config),
                     in_private_pool(i))) {
        fail(
            fmt::format("event {}: segment_unmap at {:#x} ({} bytes) unmaps pages that are "
                        "mapped again later without an unmap",
                        i, e.addr, e.size));
      }
    }
  }
  for (const auto& [at, r] : mapped) {
    if (r.private_pool) {
      fail(fmt::format("{} bytes at {:#x} of a private pool (CUDA graph capture or torch.cuda.MemPool) "
                       "were mapped before the recording began; a pool's memory cannot be rebuilt "
                       "from the recorded state",
                       r.end - at, at));
    }
  }
  if (mapped.empty()) return out;

  // Their pools: from the blocks and maps inside.
  std::map<DevicePtr, StartBlock> blocks = start_blocks(trace, config, true, out);
  for (const TraceEvent& e : events) {
    if (e.action != TraceAction::alloc && e.action != TraceAction::free_requested) continue;
    auto it = range_at(mapped, e.addr);
    if (it != mapped.end() && it->second.large < 0 && e.size != 0) {
      it->second.large = pool_of_request(e.size, config);
    }
  }
  for (auto& [at, r] : mapped) {
    if (r.large < 0) r.large = (r.end - at) % config.large_segment_size == 0 ? 1 : 0;
  }

  // Reservations: one per stream and pool with ranges mapped at the start;
  // its base the lowest address mapped in it until it is wholly unmapped.
  struct Group {
    DevicePtr base = 0;
    std::uint64_t mapped = 0;
    bool alive = true;
  };
  std::map<std::pair<StreamId, bool>, Group> groups;
  for (const auto& [at, r] : mapped) {
    auto [g, fresh] = groups.try_emplace({r.stream, r.large == 1}, Group{at, 0, true});
    g->second.base = std::min(g->second.base, at);
    g->second.mapped += r.end - at;
  }
  for (const TraceEvent& e : events) {
    if (e.action != TraceAction::segment_map && e.action != TraceAction::segment_unmap) continue;
    const int kind = pool_of_mapping(e.size, config);
    Group* g = nullptr;
    for (const bool large : {true, false}) {
      if (kind == (large ? 0 : 1)) continue;
      auto it = groups.find({e.stream, large});
      if (it != groups.end() && it->second.alive) {
        g = &it->second;
        break;
      }
    }
    if (g == nullptr) continue;
    if (e.action == TraceAction::segment_map) {
      g->base = std::min(g->base, e.addr);
      g->mapped += e.size;
    } else {
      g->mapped -= std::min(g->mapped, e.size);
      if (g->mapped == 0) g->alive = false;
    }
  }
  for (const auto& [key, g] : groups) {
    out.reservations.push_back({g.base, key.first, key.second});
  }
  std::sort(out.reservations.begin(), out.reservations.end(),
            [](const ExpandableReservation& a, const ExpandableReservation& b) {
              return a.base < b.base;
            });

  // The mapped ranges as segments, contiguous ones of one pool joined, with
  // the blocks live at the start placed; the rest is free.
  Snapshot layout;
  for (const auto& [at, r] : mapped) {
    if (!layout.segments.empty()) {
      SegmentInfo& last = layout.segments.back();
      if (last.address + last.total_size == at && last.stream == r.stream &&
          last.is_large == (r.large == 1)) {
        last.total_size += r.end - at;
        continue;
      }
    }
    SegmentInfo seg;
    seg.address = at;
    seg.total_size = r.end - at;
    seg.stream = r.stream;
    seg.is_large = r.large == 1;
    seg.is_expandable = true;
    layout.segments.push_back(seg);
  }
  auto block_it = blocks.begin();
  for (SegmentInfo& seg : layout.segments) {
    const DevicePtr end = seg.address + seg.total_size;
    DevicePtr cursor = seg.address;
    for (; block_it != blocks.end() && block_it->first < end; ++block_it) {
      const auto& [addr, b] = *block_it;
      if (addr < cursor || addr + b.size > end) {
        fail(
            fmt::format("the block live at the start at {:#x} ({} bytes) is not inside the "
                        "memory mapped then",
                        addr, b.size));
      }
      if (addr > cursor) seg.blocks.push_back({cursor, addr - cursor, 0, BlockState::inactive});
      seg.blocks.push_back({addr, b.size, b.requested, BlockState::active_allocated});
      cursor = addr + b.size;
      ++out.live_blocks;
    }
    if (end > cursor) seg.blocks.push_back({cursor, end - cursor, 0, BlockState::inactive});
  }
  if (block_it != blocks.end()) {
    fail(fmt::format("the block live at the start at {:#x} is not inside the memory mapped then",
                     block_it->first));
  }
  out.layout = std::move(layout);
  return out;
}

}  // namespace reservoir::detail
