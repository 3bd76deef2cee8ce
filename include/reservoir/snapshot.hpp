// Snapshots of the allocator's segments and blocks, in the structure of
// PyTorch's torch.cuda.memory._snapshot()["segments"].
#pragma once

#include <cstddef>
#include <cstdint>
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

struct BlockInfo {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  BlockState state = BlockState::inactive;
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
};

struct Snapshot {
  std::vector<SegmentInfo> segments;  // in address order
};

}  // namespace reservoir
