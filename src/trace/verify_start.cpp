#include "verify_start.hpp"

#include <fmt/format.h>

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
  std::size_t free_event = 0;  // index of its free_requested event
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

  if (first_alloc_made_its_segment && !events.empty() &&
      events[0].action == TraceAction::alloc) {
    auto it = segments.find(events[0].addr);
    if (it != segments.end()) {
      out.made_by_first_alloc = std::make_pair(it->first, it->second.total_size);
      segments.erase(it);
    }
  }

  std::map<DevicePtr, StartBlock> blocks;
  std::unordered_set<DevicePtr> live;
  std::unordered_set<DevicePtr> touched;
  std::unordered_set<DevicePtr> requested;  // freed, waiting for free_completed
  for (std::size_t i = 0; i < events.size(); ++i) {
    const TraceEvent& e = events[i];
    if (e.action == TraceAction::alloc) {
      live.insert(e.addr);
      touched.insert(e.addr);
    } else if (e.action == TraceAction::free_completed) {
      if (requested.erase(e.addr) != 0 || touched.count(e.addr) != 0) continue;
      // Freed before the recording began, its stream work still pending.
      touched.insert(e.addr);
      StartBlock b;
      b.size = CachingAllocator::round_size(e.size, config);
      b.requested = e.size;
      b.stream = e.stream;
      b.free_event = i;
      blocks.emplace(e.addr, b);
      out.pending_frees.push_back(e.addr);
    } else if (e.action == TraceAction::free_requested) {
      touched.insert(e.addr);
      requested.insert(e.addr);
      if (live.erase(e.addr) == 0) {
        StartBlock b;
        b.size = CachingAllocator::round_size(e.size, config);
        b.requested = e.size;
        b.stream = e.stream;
        b.free_event = i;
        blocks.emplace(e.addr, b);
      }
    }
  }
  for (const SegmentInfo& s : trace.final_state.segments) {
    if (s.pool_id != PoolId{0, 0} || s.is_expandable) continue;
    for (const BlockInfo& bi : s.blocks) {
      if (bi.state == BlockState::inactive || touched.count(bi.address) != 0) continue;
      StartBlock b;
      b.size = bi.size;
      b.requested = bi.requested_size;
      b.stream = s.stream;
      b.exact = true;
      blocks.emplace(bi.address, b);
    }
  }

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

}  // namespace reservoir::detail
