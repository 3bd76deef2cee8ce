// Runs of segment releases in a recording, and what caused each.
//
// PyTorch gives memory back to the device in three places: empty_cache()
// (every wholly free cached segment of both pools, after synchronizing the
// events of pending frees), the retry ladder of an allocation that missed
// the cache (oversize cached blocks, then everything, before retrying the
// device), and garbage collection (old unsplit large blocks, before the
// device allocation, when a memory fraction and
// garbage_collection_threshold are set). None of them leaves an event of its
// own: a recording shows a run of segment_free (segment_unmap for
// expandable segments) events, possibly with free_completed events among
// them.
//
// The cause is read from the frames where the recording has them, and from
// the run's structure where not: the allocator's own releases are always
// followed by a device request (segment_alloc, segment_map) or an oom event
// before the next allocation is answered; a run followed by neither was the
// program's empty_cache().
#pragma once

#include <cstddef>
#include <string>
#include <unordered_set>
#include <vector>

#include "reservoir/trace.hpp"

namespace reservoir::detail {

enum class ReleaseCause {
  empty_cache,  // the program called empty_cache()
  allocator,    // the retry ladder or garbage collection of the allocation that follows
  undecided,    // a device request follows and no frames tell: the allocator state decides
};

struct ReleaseRun {
  std::size_t first = 0;  // index of the first release event
  std::size_t last = 0;   // index of the last release event
  ReleaseCause cause = ReleaseCause::undecided;
  std::string evidence;  // why: "frames name empty_cache", ...
};

// Every run of segment_free / segment_unmap events (free_completed events
// inside a run belong to it), in order.
std::vector<ReleaseRun> release_runs(const Trace& trace);

// The program's empty_cache() calls: the index of the last event of each
// run whose cause is empty_cache (replay and text export apply them there).
std::unordered_set<std::size_t> empty_cache_points(const Trace& trace);

}  // namespace reservoir::detail
