// Allocator statistics under PyTorch's names.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

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
    for_each_stat_pair(*this, [&](Stat& s, const Stat&) { f(s); });
  }
  // Visits every Stat beside the same Stat of `other`.
  template <typename F>
  void for_each_stat_pair(const DeviceStats& other, F&& f) {
    for (StatArray DeviceStats::*a :
         {&DeviceStats::allocation, &DeviceStats::segment, &DeviceStats::active,
          &DeviceStats::inactive_split, &DeviceStats::allocated_bytes, &DeviceStats::reserved_bytes,
          &DeviceStats::active_bytes, &DeviceStats::inactive_split_bytes,
          &DeviceStats::requested_bytes}) {
      for (std::size_t t = 0; t < kStatTypes; ++t) f((this->*a)[t], (other.*a)[t]);
    }
    f(oversize_allocations, other.oversize_allocations);
    f(oversize_segments, other.oversize_segments);
  }

  bool operator==(const DeviceStats&) const = default;
};

// The nine statistics counted per pool ("all", small_pool, large_pool).
inline constexpr std::array<StatArray DeviceStats::*, 9> kPerPoolStats = {
    &DeviceStats::allocation,      &DeviceStats::segment,
    &DeviceStats::active,          &DeviceStats::inactive_split,
    &DeviceStats::allocated_bytes, &DeviceStats::reserved_bytes,
    &DeviceStats::active_bytes,    &DeviceStats::inactive_split_bytes,
    &DeviceStats::requested_bytes};

static_assert(std::is_standard_layout_v<DeviceStats>,
              "CombinedStats names a Stat by its byte offset in DeviceStats");

// Current values and peaks of the sum of several allocators' statistics (a
// Saver's untagged allocator and its tags), exact where adding each
// allocator's peak would only bound the sum's. Allocators attached with
// CachingAllocator::combine_stats publish the changes each of their locked
// sections made, as one step: a peak inside a section (a segment mapped and
// given back within one allocation) counts, and concurrent sections apply in
// the order their locks are released.
class CombinedStats {
 public:
  // What one allocator's locked section changed: for each Stat, the net
  // change and the highest running total reached within the section.
  class Section {
   public:
    // `s` is a Stat of `stats` (the allocator's DeviceStats).
    void note(const DeviceStats& stats, const Stat& s, std::int64_t delta) noexcept {
      const auto slot = static_cast<std::size_t>(reinterpret_cast<const char*>(&s) -
                                                 reinterpret_cast<const char*>(&stats)) /
                        8;
      dirty_[slot / 64] |= std::uint64_t{1} << (slot % 64);
      const std::int64_t net = net_[slot] += delta;
      if (net > high_[slot]) high_[slot] = net;
    }
    bool empty() const noexcept { return (dirty_[0] | dirty_[1]) == 0; }

   private:
    friend class CombinedStats;
    static constexpr std::size_t kSlots = sizeof(DeviceStats) / 8;  // a Stat's offset / 8
    static_assert(kSlots <= 128, "dirty_ has 128 bits");
    std::array<std::uint64_t, 2> dirty_{};
    std::array<std::int64_t, kSlots> net_{};
    std::array<std::int64_t, kSlots> high_{};
  };

  // The current values and peaks of the sum; allocated and freed totals and
  // the counters are left zero (sum each allocator's).
  DeviceStats read() const;
  // Peaks fall to the current values.
  void reset_peaks();
  // Changes each time something is added or published.
  std::uint64_t version() const;

  // Adds an allocator's current values; with carry_peaks its peaks too (on
  // top of the sum's current values: exact for the first allocator).
  void add(const DeviceStats& stats, bool carry_peaks);
  // Applies a section as one step, and empties it.
  void publish(Section& section) noexcept;

 private:
  mutable std::mutex mutex_;
  DeviceStats sum_;
  std::uint64_t version_ = 0;
};

// Flat, sorted map with exactly the keys torch.cuda.memory_stats() returns:
// "allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
// "num_alloc_retries", "oversize_segments.freed", ...
std::map<std::string, std::int64_t> to_map(const DeviceStats& stats);

// The table torch.cuda.memory_summary() prints, from a stats map.
std::string memory_summary(const std::map<std::string, std::int64_t>& stats, int device,
                           bool abbreviated = false);

}  // namespace reservoir
