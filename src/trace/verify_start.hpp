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
// An oversize block (max_split_size_mb and up) is never split, so with no
// such alloc its tail is the whole gap. A block whose first event is a
// free_completed was freed before the recording, its stream work pending.
//
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/config.hpp"
#include "reservoir/snapshot.hpp"
#include "reservoir/trace.hpp"

namespace reservoir::detail {

struct StartingState {
  Snapshot layout;              // the segments live at the start, their blocks placed
  std::size_t live_blocks = 0;  // blocks live at the start
  std::size_t unsplit_tails = 0;
  // Blocks (allocated in `layout`) the program had freed before the recording
  // began whose stream work was still pending: their first event is a
  // free_completed. verify frees them at once, held until that event.
  std::vector<DevicePtr> pending_frees;
  // The segment the first event's alloc got from the device, its
  // segment_alloc lost to the start of the recording: (address, size), or
  // (0, 0).
  std::pair<DevicePtr, std::uint64_t> made_by_first_alloc{0, 0};
  // Expandable segments: the reservations live at the start (layout holds
  // their mapped ranges, is_expandable).
  std::vector<ExpandableReservation> reservations;
};

// A recording that starts with an alloc may have lost that allocation's
// segment_alloc to its start (a ring buffer's cut): with
// first_alloc_made_its_segment, the segment at that address is taken as
// made by the alloc rather than present at the start.
// Throws TraceError when the recording contradicts itself (a block in no
// segment, overlapping blocks).
StartingState starting_state(const Trace& trace, const AllocatorConfig& config,
                             bool first_alloc_made_its_segment = false);

// The same for a recording made with expandable segments. The ranges mapped
// at the start are the final segments' with the recording's maps and unmaps
// undone, last first. Each belongs to the reservation of its stream and pool
// (the pool from the final segment, the sizes of the blocks and maps in it);
// a reservation's base, which no snapshot records, is taken as the lowest
// address the recording maps in it before it may have been released (wholly
// unmapped). Blocks are never split unevenly there, so sizes are exact.
// Throws TraceError when the recording contradicts itself.
StartingState expandable_starting_state(const Trace& trace, const AllocatorConfig& config);

}  // namespace reservoir::detail
