// Reservoir's statistics and segments in PyTorch's types (torch_stats.hpp).
#include "torch_stats.hpp"

#include <algorithm>
#include <cstdint>
#include <string>

namespace reservoir_torch_hooks {
namespace {

// One statistic's all/small_pool/large_pool entries into PyTorch's array.
void fill(c10::CachingDeviceAllocator::StatArray& out, const nlohmann::json& stats,
          const std::string& name) {
  static const char* const kTypes[] = {"all", "small_pool", "large_pool"};
  for (std::size_t t = 0; t < 3; ++t) {
    const std::string prefix = name + "." + kTypes[t] + ".";
    c10::CachingDeviceAllocator::Stat& s = out[t];
    s.current = stats.value(prefix + "current", std::int64_t{0});
    s.peak = stats.value(prefix + "peak", std::int64_t{0});
    s.allocated = stats.value(prefix + "allocated", std::int64_t{0});
    s.freed = stats.value(prefix + "freed", std::int64_t{0});
  }
}

void fill(c10::CachingDeviceAllocator::Stat& s, const nlohmann::json& stats,
          const std::string& name) {
  s.current = stats.value(name + ".current", std::int64_t{0});
  s.peak = stats.value(name + ".peak", std::int64_t{0});
  s.allocated = stats.value(name + ".allocated", std::int64_t{0});
  s.freed = stats.value(name + ".freed", std::int64_t{0});
}

}  // namespace

c10::CachingDeviceAllocator::DeviceStats device_stats(const nlohmann::json& stats) {
  c10::CachingDeviceAllocator::DeviceStats out;
  fill(out.allocation, stats, "allocation");
  fill(out.segment, stats, "segment");
  fill(out.active, stats, "active");
  fill(out.inactive_split, stats, "inactive_split");
  fill(out.allocated_bytes, stats, "allocated_bytes");
  fill(out.reserved_bytes, stats, "reserved_bytes");
  fill(out.active_bytes, stats, "active_bytes");
  fill(out.inactive_split_bytes, stats, "inactive_split_bytes");
  fill(out.requested_bytes, stats, "requested_bytes");
  out.num_alloc_retries = stats.value("num_alloc_retries", std::int64_t{0});
  out.num_ooms = stats.value("num_ooms", std::int64_t{0});
  out.num_sync_all_streams = stats.value("num_sync_all_streams", std::int64_t{0});
  out.num_device_alloc = stats.value("num_device_alloc", std::int64_t{0});
  out.num_device_free = stats.value("num_device_free", std::int64_t{0});
  fill(out.oversize_allocations, stats, "oversize_allocations");
  fill(out.oversize_segments, stats, "oversize_segments");
  out.max_split_size = stats.value("max_split_size", std::int64_t{0});
#if RESERVOIR_TORCH_PRIVATE_POOL_STATS
  // Each private pool's reserved bytes:
  // reserved_bytes_by_private_pools.<first>_<second>.<type>.<stat>.
  static const std::string kPrefix = "reserved_bytes_by_private_pools.";
  for (auto it = stats.begin(); it != stats.end(); ++it) {
    if (!it.key().starts_with(kPrefix)) continue;
    const std::string rest = it.key().substr(kPrefix.size());
    const std::size_t underscore = rest.find('_');
    const std::size_t dot = rest.find('.');
    if (underscore == std::string::npos || dot == std::string::npos || underscore > dot) continue;
    const MempoolId id{std::stoull(rest.substr(0, underscore)),
                       std::stoull(rest.substr(underscore + 1, dot - underscore - 1))};
    if (out.reserved_bytes_by_private_pools.count(id) == 0) {
      fill(out.reserved_bytes_by_private_pools[id], stats, kPrefix + rest.substr(0, dot));
    }
  }
#endif
  return out;
}

void fill_config(cca::AllocatorConfigInfo& c, const nlohmann::json& j) {
  c.garbage_collection_threshold = j.value("garbage_collection_threshold", 0.0);
  c.max_split_size = j.value("max_split_size", std::size_t{0});
  c.pinned_num_register_threads = j.value("pinned_num_register_threads", std::size_t{1});
  c.expandable_segments = j.value("expandable_segments", false);
  c.release_lock_on_malloc = j.value("release_lock_on_malloc", false);
  c.pinned_use_host_register = j.value("pinned_use_host_register", false);
#if RESERVOIR_TORCH_CONFIG_RECORD_STREAM_REUSE
  c.graph_capture_record_stream_reuse = j.value("graph_capture_record_stream_reuse", false);
#endif
  c.last_allocator_settings = j.value("settings", std::string());
  c.roundup_power2_divisions = j.value("roundup_power2_divisions", std::vector<std::size_t>{});
#if RESERVOIR_TORCH_CONFIG_ROUND_AND_CACHED
  c.max_round_threshold = j.value("max_round_threshold", std::size_t{0});
  c.max_cached_size = j.value("max_cached_size", std::size_t{0});
#endif
}

std::size_t largest_free_block(const nlohmann::json& state, std::size_t largest) {
  for (const nlohmann::json& seg : state["segments"]) {
    if (pool_of(seg) != kDefaultPools) continue;
    for (const nlohmann::json& b : seg["blocks"]) {
      if (b["state"].get<std::string>() == "inactive")
        largest = std::max(largest, b["size"].get<std::size_t>());
    }
  }
  return largest;
}

void* segment_holding(const nlohmann::json& state, std::size_t at, std::size_t* size) {
  for (const nlohmann::json& seg : state["segments"]) {
    const auto base = seg["address"].get<std::size_t>();
    const auto total = seg["total_size"].get<std::size_t>();
    if (at >= base && at < base + total) {
      if (size != nullptr) *size = total;
      return reinterpret_cast<void*>(base);
    }
  }
  return nullptr;
}

#if RESERVOIR_TORCH_EXPANDABLE_SEGMENT_SIZES
std::vector<cca::StreamSegmentSize> expandable_segment_sizes(const nlohmann::json& state) {
  std::vector<cca::StreamSegmentSize> out;
  for (const nlohmann::json& seg : state["segments"]) {
    if (!seg["is_expandable"].get<bool>()) continue;
    if (pool_of(seg) != kDefaultPools) continue;
    const auto stream = reinterpret_cast<cudaStream_t>(seg["stream"].get<std::uintptr_t>());
    if (stream == nullptr) continue;  // the default stream's are not reported, as PyTorch's
    const bool small = !seg["is_large"].get<bool>();
    const auto size = seg["total_size"].get<std::size_t>();
    auto it = std::find_if(out.begin(), out.end(), [&](const cca::StreamSegmentSize& s) {
      return s.stream == stream && s.is_small_pool == small;
    });
    if (it == out.end()) {
      out.emplace_back(stream, small, size);
    } else {
      it->total_size += size;
    }
  }
  return out;
}
#endif

bool pool_holds_exactly(const nlohmann::json& state, MempoolId id,
                        const std::unordered_set<void*>& expected, bool* found) {
  std::size_t live_in_pool = 0;
  *found = false;
  bool only_expected = true;
  for (const nlohmann::json& seg : state["segments"]) {
    if (pool_of(seg) != id) continue;
    *found = true;
    for (const nlohmann::json& b : seg["blocks"]) {
      if (b["state"].get<std::string>() != "active_allocated") continue;
      if (expected.count(reinterpret_cast<void*>(b["address"].get<std::size_t>())) == 0) {
        only_expected = false;
        continue;
      }
      ++live_in_pool;
    }
  }
  return only_expected && live_in_pool == expected.size();
}

}  // namespace reservoir_torch_hooks
