// The state a recording starts from (verify's starting point).
//
// Starting state. Most snapshots begin mid-run. The segments live at the start
// are the final segments that no segment event touches, plus those whose first
// event is a segment_free. The blocks live at the start are those freed before
// any alloc at their address (their size is the rounded requested size) plus
// final allocated blocks no event touches (their size is exact). The rest of
// each starting segment is free. A large block may carry an unsplit tail of up
// to 1 MiB (PyTorch does not split off a remainder of 1 MiB or less), which its
// free event does not show: a gap of 1 MiB or less after it must be such a
// tail (a free large block is always larger), and otherwise the first alloc
// into the gap, before the block is freed, lands where the gap really starts.
//
#pragma once

#include <cstddef>

#include "reservoir/config.hpp"
#include "reservoir/snapshot.hpp"
#include "reservoir/trace.hpp"

namespace reservoir::detail {

struct StartingState {
  Snapshot layout;              // the segments live at the start, their blocks placed
  std::size_t live_blocks = 0;  // blocks live at the start
  std::size_t unsplit_tails = 0;
};

// Throws TraceError when the recording contradicts itself (a block in no
// segment, overlapping blocks).
StartingState starting_state(const Trace& trace, const AllocatorConfig& config);

}  // namespace reservoir::detail
