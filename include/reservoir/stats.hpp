// Allocator statistics under PyTorch's names.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace reservoir {

struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // total ever added
  std::int64_t freed = 0;      // total ever removed

  void increase(std::uint64_t amount) noexcept {
    current += static_cast<std::int64_t>(amount);
    if (current > peak) peak = current;
    allocated += static_cast<std::int64_t>(amount);
  }
  void decrease(std::uint64_t amount) noexcept {
    current -= static_cast<std::int64_t>(amount);
    freed += static_cast<std::int64_t>(amount);
  }
  void reset_accumulated() noexcept { allocated = freed = 0; }
  void reset_peak() noexcept { peak = current; }
  bool operator==(const Stat&) const = default;
};

enum class StatType : std::uint8_t { all = 0, small_pool = 1, large_pool = 2 };
inline constexpr std::size_t kStatTypes = 3;
using StatArray = std::array<Stat, kStatTypes>;

struct DeviceStats {
  StatArray allocation;      // number of allocated blocks
  StatArray segment;         // number of device segments
  StatArray active;          // blocks allocated or awaiting their events
  StatArray inactive_split;  // free blocks inside split segments
  StatArray allocated_bytes;
  StatArray reserved_bytes;
  StatArray active_bytes;
  StatArray inactive_split_bytes;
  StatArray requested_bytes;  // bytes the callers asked for
  std::int64_t num_alloc_retries = 0;
  std::int64_t num_ooms = 0;
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  Stat oversize_allocations;
  Stat oversize_segments;
  std::int64_t max_split_size = 0;  // -1 when unlimited, as PyTorch reports it

  // Visits every Stat (the nine arrays, then the two oversize stats).
  template <typename F>
  void for_each_stat(F&& f) {
    for (StatArray* a : {&allocation, &segment, &active, &inactive_split, &allocated_bytes,
                         &reserved_bytes, &active_bytes, &inactive_split_bytes, &requested_bytes}) {
      for (Stat& s : *a) f(s);
    }
    f(oversize_allocations);
    f(oversize_segments);
  }

  bool operator==(const DeviceStats&) const = default;
};

// Flat, sorted map with exactly the keys torch.cuda.memory_stats() returns:
// "allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
// "num_alloc_retries", "oversize_segments.freed", ...
std::map<std::string, std::int64_t> to_map(const DeviceStats& stats);

// The table torch.cuda.memory_summary() prints, from a stats map.
std::string memory_summary(const std::map<std::string, std::int64_t>& stats, int device,
                           bool abbreviated = false);

}  // namespace reservoir
