// Allocator statistics under PyTorch's names.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <type_traits>
#include <vector>

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
  void for_each_stat_pair(const DeviceStats& other, F&& f);

  bool operator==(const DeviceStats&) const = default;
};

// The nine statistics counted per pool ("all", small_pool, large_pool).
inline constexpr std::array<StatArray DeviceStats::*, 9> kPerPoolStats = {
    &DeviceStats::allocation,      &DeviceStats::segment,
    &DeviceStats::active,          &DeviceStats::inactive_split,
    &DeviceStats::allocated_bytes, &DeviceStats::reserved_bytes,
    &DeviceStats::active_bytes,    &DeviceStats::inactive_split_bytes,
    &DeviceStats::requested_bytes};

template <typename F>
void DeviceStats::for_each_stat_pair(const DeviceStats& other, F&& f) {
  for (StatArray DeviceStats::*a : kPerPoolStats) {
    for (std::size_t t = 0; t < kStatTypes; ++t) f((this->*a)[t], (other.*a)[t]);
  }
  f(oversize_allocations, other.oversize_allocations);
  f(oversize_segments, other.oversize_segments);
}

static_assert(std::is_standard_layout_v<DeviceStats>,
              "CombinedStats names a Stat by its byte offset in DeviceStats");

// Current values and peaks of the sum of several allocators' statistics (a
// Saver's untagged allocator and its tags), exact where adding each
// allocator's peak would only bound the sum's.
//
// One member at a time owns the sum: its changes are not published one by
// one. The sum is `base` (every other member's current values, frozen while
// it does not own) plus the owner's current values, so a rise of the owner's
// value past peak - base is a new peak of the sum; the owner keeps that
// threshold beside its own peak and checks both with one comparison, at no
// cost on its hot path. A member that wants to change its statistics claims
// the sum first (under the sum's mutex, and the old owner's lock, so the old
// owner is between operations): the old owner's values go into base, its own
// come out. Lock order: the sum's mutex, then one member's lock.
class CombinedStats {
 public:
  // An allocator whose statistics are combined (CachingAllocator's).
  class Member {
   public:
    // The member's own lock (its allocator's).
    virtual void lock_member() noexcept = 0;
    virtual void unlock_member() noexcept = 0;
    // Its statistics as reported ("all" entries added up, its own peaks).
    virtual DeviceStats member_values() const noexcept = 0;
    // It was added to `sum` (called under the sum's mutex and its lock).
    virtual void joined(CombinedStats& sum) noexcept = 0;
    // It owns the sum now, or the sum's peaks changed while it owns it: its
    // thresholds are to be set again from sum_for_owner().
    virtual void took_sum() noexcept = 0;

   protected:
    ~Member() = default;
  };

  CombinedStats() = default;
  CombinedStats(const CombinedStats&) = delete;
  CombinedStats& operator=(const CombinedStats&) = delete;

  // The current values and peaks of the sum; allocated and freed totals and
  // the counters are left zero (sum each allocator's).
  DeviceStats read() const;
  // Peaks fall to the current values.
  void reset_peaks();
  // Throws InvariantError unless the sum's current values are what the
  // members' add up to.
  void check() const;

  // Adds a member with its current values; with carry_peaks its peaks too
  // (on top of the sum's current values: exact for the first member).
  // Called without the member's lock held.
  void join(Member& member, bool carry_peaks);
  // Removes a member; its current values stay in the sum.
  void leave(Member& member) noexcept;
  // Makes `member` the owner (called without its lock held).
  void claim(Member& member) noexcept;
  bool owned_by(const Member& member) const noexcept {
    return owner_.load(std::memory_order_acquire) == &member;
  }

  // For the owner, under its lock: the sum's peaks (in each Stat's peak) and
  // the other members' values (in each Stat's current).
  DeviceStats& sum_for_owner() noexcept { return sum_; }

 private:
  mutable std::mutex mutex_;
  std::atomic<Member*> owner_{nullptr};
  // current: the members' values but the owner's; peak: the sum's peak.
  DeviceStats sum_;
  std::vector<Member*> members_;
};

// Flat, sorted map with exactly the keys torch.cuda.memory_stats() returns:
// "allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
// "num_alloc_retries", "oversize_segments.freed", ...
std::map<std::string, std::int64_t> to_map(const DeviceStats& stats);
// reserved_bytes_by_private_pools.<first>_<second>.<type>.<stat> (PyTorch 2.13 and later)
// keys, added to `out`.
void put_private_pools(std::map<std::string, std::int64_t>& out,
                       const std::map<std::pair<std::uint64_t, std::uint64_t>, StatArray>& pools);
// Whether a release reports them (pytorch_version: "2.13" and later).
bool reports_private_pools(const std::string& pytorch_version);

// The table torch.cuda.memory_summary() prints, from a stats map.
std::string memory_summary(const std::map<std::string, std::int64_t>& stats, int device,
                           bool abbreviated = false);

}  // namespace reservoir
