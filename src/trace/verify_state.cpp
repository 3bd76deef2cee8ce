// verify: the recorded state at the end, the private pools a recording
// cannot say it routed to, and where the history stops before the state.
#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <string>
#include <unordered_set>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "verifier.hpp"

namespace reservoir::detail {

std::string Verifier::paged_late_start() const {
  std::unordered_set<DevicePtr> allocated;
  std::map<DevicePtr, std::uint64_t> mapped;  // ranges mapped by the recording
  const auto late = [&](std::size_t i, const std::string& what) {
    return fmt::format(
        "cannot verify: recorded under reservoir's policy:{}, which verify replays from an "
        "empty allocator, but the recording starts with memory held (event {}: {}): start "
        "recording before the first allocation",
        to_string(config_.policy), i, what);
  };
  for (std::size_t i = 0; i < trace_.events.size(); ++i) {
    const TraceEvent& e = trace_.events[i];
    if (e.size == 0) continue;
    switch (e.action) {
      case TraceAction::alloc: allocated.insert(e.addr); break;
      case TraceAction::free_requested:
        if (allocated.count(e.addr) == 0) {
          return late(i, fmt::format("a free of {:#x}, which it never allocated", e.addr));
        }
        break;
      case TraceAction::free_completed: allocated.erase(e.addr); break;
      case TraceAction::annotate:
        // Metadata is attached to an allocation the program holds.
        if (allocated.count(e.addr) == 0) {
          return late(i, fmt::format("an annotation of {:#x}, which it never allocated", e.addr));
        }
        break;
      case TraceAction::segment_map: {
        // Kept merged: one unmap may span pages mapped by several maps.
        DevicePtr lo = e.addr;
        DevicePtr hi = e.addr + e.size;
        auto it = mapped.upper_bound(lo);
        if (it != mapped.begin() && std::prev(it)->first + std::prev(it)->second >= lo) --it;
        while (it != mapped.end() && it->first <= hi) {
          lo = std::min(lo, it->first);
          hi = std::max(hi, it->first + it->second);
          it = mapped.erase(it);
        }
        mapped[lo] = hi - lo;
        break;
      }
      case TraceAction::segment_unmap: {
        // Pages unmapped lie in pages mapped before.
        auto it = mapped.upper_bound(e.addr);
        if (it == mapped.begin() || std::prev(it)->first + std::prev(it)->second < e.addr + e.size) {
          return late(i, fmt::format("pages unmapped at {:#x} ({} bytes), which it never mapped",
                                     e.addr, e.size));
        }
        --it;
        const DevicePtr lo = it->first;
        const DevicePtr hi = it->first + it->second;
        mapped.erase(it);
        if (lo < e.addr) mapped[lo] = e.addr - lo;
        if (e.addr + e.size < hi) mapped[e.addr + e.size] = hi - (e.addr + e.size);
        break;
      }
      default: break;
    }
  }
  return {};
}

std::string Verifier::history_cut() const {
  std::unordered_map<DevicePtr, std::size_t> last;  // address -> its last alloc/free event
  for (std::size_t i = 0; i < trace_.events.size(); ++i) {
    const TraceEvent& e = trace_.events[i];
    if (e.size == 0) continue;
    if (e.action == TraceAction::alloc || e.action == TraceAction::free_completed) {
      last[e.addr] = i;
    }
  }
  std::unordered_map<DevicePtr, BlockState> state;
  for (const SegmentInfo& s : trace_.final_state.segments) {
    for (const BlockInfo& b : s.blocks) state.emplace(b.address, b.state);
  }
  std::size_t live_freed = 0;
  std::size_t freed_live = 0;
  std::size_t example = trace_.events.size();
  for (const auto& [addr, i] : last) {
    const auto it = state.find(addr);
    const bool allocated = it != state.end() && it->second == BlockState::active_allocated;
    const bool alloc = trace_.events[i].action == TraceAction::alloc;
    const bool live_but_free = alloc && (it == state.end() || it->second == BlockState::inactive);
    const bool freed_but_allocated = !alloc && allocated;
    if (!live_but_free && !freed_but_allocated) continue;
    if (private_segment_of(addr)) continue;  // private pools are not replayed at all
    ++(live_but_free ? live_freed : freed_live);
    if (example == trace_.events.size() || i > example) example = i;
  }
  if (live_freed + freed_live == 0) return {};
  const TraceEvent& e = trace_.events[example];
  return fmt::format(
      "cannot verify: the history stops before the state was taken (recording stopped early, "
      "or its last events were lost): {} allocation{} the history leaves live {} free in the "
      "recorded state and {} it frees {} allocated there; the latest, {} of {} bytes at "
      "{:#x} (event {}), is {} there. The starting state is rebuilt from the recorded one, so "
      "nothing can be checked.",
      live_freed, live_freed == 1 ? "" : "s", live_freed == 1 ? "is" : "are", freed_live,
      freed_live == 1 ? "is" : "are", to_string(e.action), e.size, e.addr, example,
      e.action == TraceAction::alloc ? "free" : "allocated");
}

bool Verifier::private_segment_of(DevicePtr addr) const {
  if (following_pools_) return false;  // replayed like every other segment
  for (const SegmentInfo& s : trace_.final_state.segments) {
    if (s.pool_id != PoolId{0, 0} && addr >= s.address && addr < s.address + s.total_size) {
      return true;
    }
  }
  return false;
}

const PoolId* Verifier::pool_of(std::size_t i) const {
  if (!following_pools_) return nullptr;
  const auto it = trace_.event_pools.find(i);
  return it == trace_.event_pools.end() ? nullptr : &it->second;
}

void Verifier::find_private_pools() {
  // A recording that names each event's pool is followed. Each private
  // pool's allocation must fall in a segment (or pages, under expandable
  // segments) the history made: a pool made before the recording began
  // cannot be rebuilt.
  if (following_pools_) {
    std::map<DevicePtr, std::uint64_t> made;  // segments and mappings the history made so far
    for (std::size_t i = 0; i < trace_.events.size(); ++i) {
      const TraceEvent& e = trace_.events[i];
      if (e.action == TraceAction::segment_alloc || e.action == TraceAction::segment_map) {
        made[e.addr] = e.size;
      }
      if (e.action == TraceAction::segment_free) made.erase(e.addr);
      if (e.action == TraceAction::segment_unmap) {
        // Pages unmapped go from the mappings they were part of.
        const DevicePtr lo = e.addr;
        const DevicePtr hi = e.addr + e.size;
        auto it = made.upper_bound(lo);
        if (it != made.begin()) --it;
        std::vector<std::pair<DevicePtr, std::uint64_t>> keep;
        while (it != made.end() && it->first < hi) {
          const DevicePtr end = it->first + it->second;
          if (end <= lo) {
            ++it;
            continue;
          }
          if (it->first < lo) keep.emplace_back(it->first, lo - it->first);
          if (end > hi) keep.emplace_back(hi, end - hi);
          it = made.erase(it);
        }
        for (const auto& [at, size] : keep) made[at] = size;
      }
      if (e.action != TraceAction::alloc || e.size == 0 || pool_of(i) == nullptr) continue;
      auto it = made.upper_bound(e.addr);
      if (it != made.begin() && e.addr < std::prev(it)->first + std::prev(it)->second) continue;
      private_stop_ = i;
      private_reason_ = fmt::format(
          "cannot verify: this alloc at {:#x} is in private pool ({}, {}) (CUDA graph capture or "
          "torch.cuda.MemPool), whose segment was made before the recording began; a pool's "
          "segments cannot be rebuilt from the recorded state",
          e.addr, pool_of(i)->first, pool_of(i)->second);
      return;
    }
    return;
  }
  for (const SegmentInfo& s : trace_.final_state.segments) {
    if (s.pool_id == PoolId{0, 0}) continue;
    ++result_.private_pool_segments;
    result_.private_pool_bytes += s.total_size;
    std::size_t first = trace_.events.size();
    for (std::size_t i = trace_.events.size(); i-- > 0;) {
      const TraceEvent& e = trace_.events[i];
      if (e.action == TraceAction::segment_alloc && e.addr == s.address) {
        first = i;  // this segment's own device request
        break;
      }
      if ((e.action == TraceAction::alloc || e.action == TraceAction::free_requested) &&
          e.addr >= s.address && e.addr < s.address + s.total_size) {
        first = i;
      }
    }
    if (first < trace_.events.size() && first < private_stop_) {
      private_stop_ = first;
      private_reason_ = fmt::format(
          "cannot verify: this {} at {:#x} is in a segment of private pool ({}, {}) "
          "(CUDA graph capture or torch.cuda.MemPool); a recording does not say which "
          "allocations were routed to a private pool, so they cannot be replayed",
          to_string(trace_.events[first].action), trace_.events[first].addr, s.pool_id.first,
          s.pool_id.second);
    }
  }
  if (result_.private_pool_segments != 0) {
    // Earlier allocations may have gone to pools released before the end,
    // which the recording cannot show either: a difference before the stop
    // may be theirs.
    if (!assumption_.empty()) assumption_ += "; and ";
    assumption_ += fmt::format(
        "the program allocated in private pools (CUDA graphs or torch.cuda.MemPool: {} segments "
        "at the end), and this recording does not say which allocations went to them (PyTorch "
        "records each event's pool from 2.15 on); verify replays them in the default pools, so "
        "one routed to a pool released before the end would look like this",
        result_.private_pool_segments);
  }
}

std::string Verifier::outside_history(const Snapshot& ours,
                                   const std::vector<const SegmentInfo*>& theirs) {
  std::map<DevicePtr, const SegmentInfo*> a;
  std::map<DevicePtr, const SegmentInfo*> b;
  for (const SegmentInfo& s : ours.segments) a.emplace(s.address, &s);
  for (const SegmentInfo* s : theirs) b.emplace(s->address, s);
  for (const auto& [addr, s] : b) {
    auto it = a.find(addr);
    if (it == a.end() || it->second->total_size != s->total_size) {
      return fmt::format("the recorded state holds a segment at {:#x} ({}) that no recorded "
                         "event made",
                         addr, format_size(s->total_size));
    }
  }
  for (const auto& [addr, s] : a) {
    if (b.find(addr) == b.end()) {
      return fmt::format("the recorded state lacks the segment at {:#x} ({}) that the history "
                         "leaves in place, with no segment_free for it",
                         addr, format_size(s->total_size));
    }
  }
  for (const auto& [addr, s] : b) {
    std::set<DevicePtr> live_a;
    std::set<DevicePtr> live_b;
    for (const BlockInfo& k : a.at(addr)->blocks) {
      if (k.state != BlockState::inactive) live_a.insert(k.address);
    }
    for (const BlockInfo& k : s->blocks) {
      if (k.state != BlockState::inactive) live_b.insert(k.address);
    }
    for (const DevicePtr p : live_b) {
      if (live_a.count(p) == 0) {
        return fmt::format("the recorded state holds an allocation at {:#x} (segment {:#x}) "
                           "that the history frees or never makes",
                           p, addr);
      }
    }
    for (const DevicePtr p : live_a) {
      if (live_b.count(p) == 0) {
        return fmt::format("the history leaves an allocation at {:#x} (segment {:#x}) that "
                           "the recorded state does not hold, with no free for it",
                           p, addr);
      }
    }
  }
  return {};
}

void Verifier::compare_final_state(const Snapshot& ours) {
  std::vector<const SegmentInfo*> theirs;
  for (const SegmentInfo& s : trace_.final_state.segments) {
    if (following_pools_ || s.pool_id == PoolId{0, 0}) theirs.push_back(&s);
  }
  if (const std::string why = outside_history(ours, theirs); !why.empty()) {
    cannot_verify(trace_.events.size(),
                  fmt::format("cannot verify the final state: {}; the history stops before "
                              "the state was taken (recording stopped early, or events "
                              "outside it), so there is nothing to compare it with. Every "
                              "recorded event agreed.",
                              why));
    return;
  }
  result_.final_state_checked = true;
  const std::size_t n = std::max(ours.segments.size(), theirs.size());
  for (std::size_t k = 0; k < n; ++k) {
    if (k >= ours.segments.size() || k >= theirs.size()) {
      diverge(trace_.events.size(),
              fmt::format("final state: reservoir holds {} segments, the recording {}",
                          ours.segments.size(), theirs.size()));
      return;
    }
    const SegmentInfo& a = ours.segments[k];
    const SegmentInfo& b = *theirs[k];
    if (a.address != b.address || a.total_size != b.total_size) {
      diverge(trace_.events.size(),
              fmt::format("final state: segment {} is {:#x} ({} bytes) in reservoir and {:#x} "
                          "({} bytes) in the recording",
                          k, a.address, a.total_size, b.address, b.total_size));
      return;
    }
    const std::size_t m = std::max(a.blocks.size(), b.blocks.size());
    for (std::size_t j = 0; j < m; ++j) {
      const bool same = j < a.blocks.size() && j < b.blocks.size() &&
                        a.blocks[j].address == b.blocks[j].address &&
                        a.blocks[j].size == b.blocks[j].size &&
                        (a.blocks[j].state == BlockState::inactive) ==
                            (b.blocks[j].state == BlockState::inactive);
      if (!same) {
        auto describe = [](const SegmentInfo& s, std::size_t j) {
          if (j >= s.blocks.size()) return std::string("no block");
          return fmt::format("{:#x} ({} bytes, {})", s.blocks[j].address, s.blocks[j].size,
                             to_string(s.blocks[j].state));
        };
        diverge(trace_.events.size(),
                fmt::format("final state: segment {:#x}, block {}: reservoir has {}, the "
                            "recording {}",
                            a.address, j, describe(a, j), describe(b, j)));
        return;
      }
    }
  }
}

}  // namespace reservoir::detail
