// Reservoir's statistics and segments (its JSON answers) in PyTorch's types:
// torch.cuda.memory_stats()'s DeviceStats, the allocator settings a snapshot
// carries, and what PyTorch asks of the segments (the largest cached block,
// the segment holding a pointer, each stream's expandable segments, a pool's
// live allocations). Stateless. Internal to the per-release libraries.
#pragma once

#include <cstddef>
#include <unordered_set>
#include <vector>

#include "torch_types.hpp"

namespace reservoir_torch_hooks {

// torch.cuda.memory_stats()'s keys, from reservoir's stats JSON.
c10::CachingDeviceAllocator::DeviceStats device_stats(const nlohmann::json& stats);

// A snapshot's allocator settings, from reservoir's snapshot "config".
void fill_config(cca::AllocatorConfigInfo& c, const nlohmann::json& config);

// The largest inactive block of the default pools, no less than `largest`.
std::size_t largest_free_block(const nlohmann::json& state, std::size_t largest);

// The segment holding address `at`: its base (and total size in *size),
// null when none does.
void* segment_holding(const nlohmann::json& state, std::size_t at, std::size_t* size);

#if RESERVOIR_TORCH_EXPANDABLE_SEGMENT_SIZES
// The memory mapped into each stream's expandable segment of the default
// pools (small and large apart), as PyTorch's allocator reports it (the
// default stream's left out, as there); reservoir's snapshot lists a
// segment's mapped ranges one by one.
std::vector<cca::StreamSegmentSize> expandable_segment_sizes(const nlohmann::json& state);
#endif

// Whether pool `id`'s live allocations are exactly `expected`; *found tells
// whether the state has a segment of the pool.
bool pool_holds_exactly(const nlohmann::json& state, MempoolId id,
                        const std::unordered_set<void*>& expected, bool* found);

}  // namespace reservoir_torch_hooks
