#include "release_bursts.hpp"

#include <algorithm>
#include <cctype>
#include <string_view>
#include <unordered_map>

namespace reservoir::detail {
namespace {

bool is_release(TraceAction a) {
  return a == TraceAction::segment_free || a == TraceAction::segment_unmap;
}

bool names(std::string_view name, std::string_view word) {
  auto lower = [](char c) {
    return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  };
  return std::search(name.begin(), name.end(), word.begin(), word.end(),
                     [&](char a, char b) { return lower(a) == lower(b); }) != name.end();
}

// A frame of Python's torch.cuda.empty_cache or the C++ emptyCache.
bool names_empty_cache(const Context& c) {
  return std::any_of(c.frames.begin(), c.frames.end(), [](const Frame& f) {
    return names(f.name, "empty_cache") || names(f.name, "emptycache");
  });
}

// A frame inside the allocator's malloc: its retry ladder or garbage collection.
bool names_allocator(const Context& c) {
  return std::any_of(c.frames.begin(), c.frames.end(), [](const Frame& f) {
    return names(f.name, "CachingAllocator::malloc") ||
           names(f.name, "garbage_collect_cached_blocks") ||
           names(f.name, "release_available_cached_blocks");
  });
}

// Whether the recording gives frees their allocation's stack rather than
// the stack that freed: PyTorch 2.0 always does (its trace entries carry the
// block's allocation context), later releases under
// _record_memory_history(context="alloc"). Then a release's frames say where
// its segment was allocated, not who released it, and are no evidence. Seen
// when every free with a recorded allocation (one at least) carries exactly
// that allocation's stack; a program that allocates and frees from the same
// line looks so too, and loses only the frames' evidence.
bool frees_carry_allocation_stacks(const Trace& trace) {
  std::unordered_map<DevicePtr, std::uint32_t> allocated;
  std::size_t pairs = 0;
  for (const TraceEvent& e : trace.events) {
    if (e.action == TraceAction::alloc) {
      allocated[e.addr] = e.context;
    } else if (e.action == TraceAction::free_requested) {
      const auto it = allocated.find(e.addr);
      if (it == allocated.end() || it->second == 0) continue;
      if (e.context != it->second) return false;
      ++pairs;
    }
  }
  return pairs > 0;
}

}  // namespace

std::vector<ReleaseRun> release_runs(const Trace& trace) {
  std::vector<ReleaseRun> runs;
  const bool frames_tell = !frees_carry_allocation_stacks(trace);
  const auto& events = trace.events;
  const std::size_t n = events.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (!is_release(events[i].action)) continue;
    ReleaseRun run;
    run.first = i;
    run.last = i;
    for (std::size_t j = i + 1; j < n; ++j) {
      const TraceAction a = events[j].action;
      if (is_release(a)) {
        run.last = j;
      } else if (a != TraceAction::free_completed && a != TraceAction::snapshot) {
        break;
      }
    }
    // What follows: a device request (or oom) before the next allocation?
    bool device_request = false;
    std::size_t k = run.last + 1;
    for (; k < n; ++k) {
      const TraceAction a = events[k].action;
      if (a == TraceAction::segment_alloc || a == TraceAction::segment_map) device_request = true;
      if (a == TraceAction::alloc || a == TraceAction::oom) break;
      if (a == TraceAction::free_requested || a == TraceAction::empty_cache) {
        k = n;  // the program acted first: nothing asked for this memory
        break;
      }
    }
    if (k < n && events[k].action == TraceAction::oom) device_request = true;

    bool empty_cache_frames = false;
    bool allocator_frames = false;
    bool request_frames = false;
    for (std::size_t e = run.first; e <= run.last && frames_tell; ++e) {
      if (!is_release(events[e].action)) continue;
      const std::uint32_t id = events[e].context;
      if (id == 0 || id >= trace.final_state.contexts.size()) continue;
      const Context& c = trace.context(id);
      empty_cache_frames |= names_empty_cache(c);
      allocator_frames |= names_allocator(c);
      request_frames |= k < n && events[k].context == id;
    }
    if (empty_cache_frames) {
      run.cause = ReleaseCause::empty_cache;
      run.evidence = "its frames name empty_cache";
    } else if (!device_request) {
      run.cause = ReleaseCause::empty_cache;
      run.evidence =
          "no device request follows it, as one follows every release of the "
          "allocator's own";
    } else if (allocator_frames) {
      run.cause = ReleaseCause::allocator;
      run.evidence = "its frames name the allocator's malloc";
    } else if (request_frames) {
      run.cause = ReleaseCause::allocator;
      run.evidence = "its frames are those of the allocation that follows";
    } else {
      run.cause = ReleaseCause::undecided;
      run.evidence = frames_tell ? "a device request follows it and no frames tell"
                                 : "a device request follows it; the recording's frames are where "
                                   "memory was allocated, not who released it";
    }
    runs.push_back(std::move(run));
    i = runs.back().last;
  }
  return runs;
}

std::unordered_set<std::size_t> empty_cache_points(const Trace& trace) {
  std::unordered_set<std::size_t> at;
  for (const ReleaseRun& run : release_runs(trace)) {
    if (run.cause == ReleaseCause::empty_cache) at.insert(run.last);
  }
  return at;
}

}  // namespace reservoir::detail
