// Snapshots of the allocator's segments and blocks, in the structure of
// PyTorch's torch.cuda.memory._snapshot(): "segments", and the history of
// events ("device_traces") with the context each was recorded in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reservoir/device.hpp"

namespace reservoir {

// A private pool's id, as PyTorch's MempoolId_t; {0, 0} is the default pool.
using PoolId = std::pair<std::uint64_t, std::uint64_t>;

enum class BlockState : std::uint8_t {
  active_allocated,     // handed out to a caller
  active_pending_free,  // freed by the caller, waiting for stream events
  inactive,             // cached, free
};
std::string_view to_string(BlockState state) noexcept;

// One frame of a call stack, as PyTorch's snapshot frames.
struct Frame {
  std::string filename;  // source file, or the module when no line information exists
  int line = 0;          // 0 (or -1, as PyTorch writes) when unknown
  std::string name;      // function
  bool operator==(const Frame&) const = default;
};

// Where an event happened: the annotation stack of the thread (outermost
// first) and, when stacks are recorded, the call stack (innermost first).
struct Context {
  std::vector<std::string> annotations;
  std::vector<Frame> frames;
  bool empty() const noexcept { return annotations.empty() && frames.empty(); }
  bool operator==(const Context&) const = default;
};
// A string equal for equal contexts and different otherwise (for interning).
std::string context_key(const Context& context);

// What happened, as PyTorch's TraceEvent actions.
enum class TraceAction : std::uint8_t {
  alloc,           // addr, size = requested bytes
  free_requested,  // the caller freed addr
  free_completed,  // the block returned to the cache (after stream events)
  segment_alloc,   // the allocator got a segment of size bytes at addr
  segment_free,
  segment_map,  // virtual-memory segments: pages mapped at addr
  segment_unmap,
  snapshot,
  oom,          // an allocation of size bytes failed; addr = device free bytes
  empty_cache,  // text traces: the program called empty_cache()
  // PyTorch 2.15's torch.cuda.memory._annotate_tensor: metadata attached to
  // the live allocation at addr (size: its size); no allocator work.
  annotate,
};
std::string_view to_string(TraceAction action) noexcept;

// One allocator event, as PyTorch's TraceEntry (context and time are set
// only in recorded history).
struct TraceEvent {
  TraceAction action = TraceAction::alloc;
  DevicePtr addr = 0;
  std::uint64_t size = 0;
  StreamId stream = 0;
  std::int64_t time_us = 0;   // microseconds since the epoch; 0 when not recorded
  std::uint32_t context = 0;  // index into the owner's contexts; 0: none
  bool operator==(const TraceEvent&) const = default;
};

struct BlockInfo {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  BlockState state = BlockState::inactive;
  std::uint32_t context = 0;  // where it was allocated (index into contexts)
  bool operator==(const BlockInfo&) const = default;
};

struct SegmentInfo {
  int device = 0;
  DevicePtr address = 0;
  std::size_t total_size = 0;
  std::size_t allocated_size = 0;
  std::size_t active_size = 0;
  std::size_t requested_size = 0;
  StreamId stream = 0;
  bool is_large = false;  // segment_type "large" or "small"
  bool is_expandable = false;
  PoolId pool_id{0, 0};
  std::vector<BlockInfo> blocks;  // in address order, tiling the segment
  bool operator==(const SegmentInfo&) const = default;
};

struct Snapshot {
  std::vector<SegmentInfo> segments;  // in address order
  // Recorded events, oldest first (empty unless history is on), and the
  // contexts that events and blocks refer to; contexts[0] is the empty one.
  std::vector<TraceEvent> history;
  std::vector<Context> contexts{Context{}};
  // Segments of reservoir's native_paged policy, which the snapshot shows as
  // the native policy's (their whole address space): the bytes of each with
  // memory behind it, by the segment's address. A segment not listed is
  // backed whole (total_size).
  std::map<DevicePtr, std::size_t> backed_bytes;
  std::size_t backed(const SegmentInfo& s) const {
    const auto it = backed_bytes.find(s.address);
    return it == backed_bytes.end() ? s.total_size : it->second;
  }
};

}  // namespace reservoir
