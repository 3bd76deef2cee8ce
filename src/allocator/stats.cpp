#include "reservoir/stats.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "reservoir/config.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {
namespace {

constexpr const char* kTypeNames[kStatTypes] = {"all", "small_pool", "large_pool"};

void put(std::map<std::string, std::int64_t>& out, const std::string& prefix, const Stat& s) {
  out[prefix + ".current"] = s.current;
  out[prefix + ".peak"] = s.peak;
  out[prefix + ".allocated"] = s.allocated;
  out[prefix + ".freed"] = s.freed;
}

void put(std::map<std::string, std::int64_t>& out, const std::string& name, const StatArray& a) {
  for (std::size_t t = 0; t < kStatTypes; ++t) put(out, name + "." + kTypeNames[t], a[t]);
}

// torch/cuda/memory.py's _format_size: the unit follows the "all" row's value.
std::string format_size_cell(std::int64_t value, std::int64_t pref) {
  static constexpr const char* kPrefixes[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
  std::size_t prefix = 0;
  double pref_value = static_cast<double>(pref);
  for (std::size_t next = 1; next < 6; ++next) {
    if (pref_value < 768.0 * 1024.0) break;
    prefix = next;
    value = value >= 0 ? value / 1024 : -((-value + 1023) / 1024);  // Python floor division
    pref_value /= 1024.0;
  }
  return fmt::format("{:6d} {}", value, kPrefixes[prefix]);
}

std::string format_count_cell(std::int64_t value, std::int64_t pref) {
  static constexpr const char* kPrefixes[] = {" ", "K", "M"};
  std::size_t prefix = 0;
  double pref_value = static_cast<double>(pref);
  for (std::size_t next = 1; next < 3; ++next) {
    if (pref_value < 750.0 * 1000.0) break;
    prefix = next;
    value = value >= 0 ? value / 1000 : -((-value + 999) / 1000);
    pref_value /= 1000.0;
  }
  return fmt::format("{:7d} {} ", value, kPrefixes[prefix]);
}

}  // namespace

std::map<std::string, std::int64_t> to_map(const DeviceStats& s) {
  std::map<std::string, std::int64_t> out;
  put(out, "allocation", s.allocation);
  put(out, "segment", s.segment);
  put(out, "active", s.active);
  put(out, "inactive_split", s.inactive_split);
  put(out, "allocated_bytes", s.allocated_bytes);
  put(out, "reserved_bytes", s.reserved_bytes);
  put(out, "active_bytes", s.active_bytes);
  put(out, "inactive_split_bytes", s.inactive_split_bytes);
  put(out, "requested_bytes", s.requested_bytes);
  put(out, "oversize_allocations", s.oversize_allocations);
  put(out, "oversize_segments", s.oversize_segments);
  out["num_alloc_retries"] = s.num_alloc_retries;
  out["num_ooms"] = s.num_ooms;
  out["num_sync_all_streams"] = s.num_sync_all_streams;
  out["num_device_alloc"] = s.num_device_alloc;
  out["num_device_free"] = s.num_device_free;
  out["max_split_size"] = s.max_split_size;
  return out;
}

void put_private_pools(std::map<std::string, std::int64_t>& out,
                       const std::map<std::pair<std::uint64_t, std::uint64_t>, StatArray>& pools) {
  for (const auto& [id, stats] : pools) {
    put(out, fmt::format("reserved_bytes_by_private_pools.{}_{}", id.first, id.second), stats);
  }
}

bool reports_private_pools(const std::string& pytorch_version) {
  // From PyTorch 2.13 (read off 2.11 to 2.15's memory_stats: test_release.py).
  return !pytorch_version.empty() && compare_versions(pytorch_version, "2.13") >= 0;
}

std::string memory_summary(const std::map<std::string, std::int64_t>& stats, int device,
                           bool abbreviated) {
  auto get = [&stats](const std::string& key) {
    auto it = stats.find(key);
    return it == stats.end() ? std::int64_t{0} : it->second;
  };
  using Formatter = std::string (*)(std::int64_t, std::int64_t);
  struct Metric {
    const char* key;
    const char* name;
    Formatter format;
  };
  static const Metric kMetrics[] = {
      {"allocated_bytes", "Allocated memory", format_size_cell},
      {"active_bytes", "Active memory", format_size_cell},
      {"requested_bytes", "Requested memory", format_size_cell},
      {"reserved_bytes", "GPU reserved memory", format_size_cell},
      {"inactive_split_bytes", "Non-releasable memory", format_size_cell},
      {"allocation", "Allocations", format_count_cell},
      {"active", "Active allocs", format_count_cell},
      {"segment", "GPU reserved segments", format_count_cell},
      {"inactive_split", "Non-releasable allocs", format_count_cell},
  };
  const std::string rule(75, '-');
  const std::string double_rule(75, '=');
  std::vector<std::string> lines;
  lines.push_back(double_rule);
  lines.push_back(
      fmt::format(" {:16} PyTorch CUDA memory summary, device ID {:<17d} ", "", device));
  lines.push_back(rule);
  lines.push_back(fmt::format("  {:9} CUDA OOMs: {:<12d} | {:6} cudaMalloc retries: {:<8d}  ", "",
                              get("num_ooms"), "", get("num_alloc_retries")));
  lines.push_back(double_rule);
  lines.push_back("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ");
  for (const Metric& m : kMetrics) {
    lines.push_back(rule);
    std::vector<std::pair<std::string, std::string>> rows = {{"all", m.name}};
    if (!abbreviated) {
      rows.emplace_back("large_pool", "      from large pool");
      rows.emplace_back("small_pool", "      from small pool");
    }
    const std::string all = std::string(m.key) + ".all.";
    const std::int64_t pref[4] = {get(all + "current"), get(all + "peak"), get(all + "allocated"),
                                  get(all + "freed")};
    for (const auto& [sub, label] : rows) {
      const std::string p = std::string(m.key) + "." + sub + ".";
      lines.push_back(
          fmt::format(" {:<21} | {} | {} | {} | {} ", label, m.format(get(p + "current"), pref[0]),
                      m.format(get(p + "peak"), pref[1]), m.format(get(p + "allocated"), pref[2]),
                      m.format(get(p + "freed"), pref[3])));
    }
  }
  static const Metric kOversize[] = {
      {"oversize_allocations", "Oversize allocations", format_count_cell},
      {"oversize_segments", "Oversize GPU segments", format_count_cell},
  };
  for (const Metric& m : kOversize) {
    lines.push_back(rule);
    const std::string p = std::string(m.key) + ".";
    const std::int64_t cur = get(p + "current");
    const std::int64_t peak = get(p + "peak");
    const std::int64_t alloc = get(p + "allocated");
    const std::int64_t freed = get(p + "freed");
    lines.push_back(fmt::format(" {:<21} | {} | {} | {} | {} ", m.name, m.format(cur, cur),
                                m.format(peak, peak), m.format(alloc, alloc),
                                m.format(freed, freed)));
  }
  lines.push_back(double_rule);
  std::string out = "|";
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (i) out += "|\n|";
    out += lines[i];
  }
  out += "|\n";
  return out;
}

namespace {

// A DeviceStats holding the current values and peaks of `sum` only.
DeviceStats currents_and_peaks(const DeviceStats& sum) {
  DeviceStats out;
  out.for_each_stat_pair(sum, [](Stat& o, const Stat& s) {
    o.current = s.current;
    o.peak = s.peak;
  });
  return out;
}

}  // namespace

DeviceStats CombinedStats::read() const {
  std::lock_guard lock(mutex_);
  Member* owner = owner_.load(std::memory_order_relaxed);
  if (owner == nullptr) return currents_and_peaks(sum_);
  owner->lock_member();  // the owner changes sum_'s peaks under its lock
  DeviceStats out = currents_and_peaks(sum_);
  const DeviceStats values = owner->member_values();
  owner->unlock_member();
  out.for_each_stat_pair(values, [](Stat& o, const Stat& v) { o.current += v.current; });
  return out;
}

void CombinedStats::reset_peaks() {
  std::lock_guard lock(mutex_);
  Member* owner = owner_.load(std::memory_order_relaxed);
  if (owner == nullptr) {
    sum_.for_each_stat([](Stat& s) { s.peak = s.current; });
    return;
  }
  owner->lock_member();
  const DeviceStats values = owner->member_values();
  sum_.for_each_stat_pair(values, [](Stat& s, const Stat& v) { s.peak = s.current + v.current; });
  owner->took_sum();
  owner->unlock_member();
}

void CombinedStats::check() const {
  std::lock_guard lock(mutex_);
  Member* owner = owner_.load(std::memory_order_relaxed);
  if (owner != nullptr) owner->lock_member();
  // The other members are frozen: they change only after claiming the sum,
  // which takes mutex_.
  DeviceStats members;
  for (Member* m : members_) {
    members.for_each_stat_pair(m->member_values(),
                               [](Stat& s, const Stat& v) { s.current += v.current; });
  }
  DeviceStats sum = currents_and_peaks(sum_);
  if (owner != nullptr) {
    sum.for_each_stat_pair(owner->member_values(),
                           [](Stat& s, const Stat& v) { s.current += v.current; });
    owner->unlock_member();
  }
  const auto want = to_map(members);
  const auto got = to_map(sum);
  for (const auto& [key, value] : got) {
    const bool current = key.size() > 8 && key.compare(key.size() - 8, 8, ".current") == 0;
    if (current && value != want.at(key)) {
      throw InvariantError(
          fmt::format("combined statistics have {} = {}, the allocators add up to {}", key, value,
                      want.at(key)));
    }
    const std::string peak = current ? key.substr(0, key.size() - 8) + ".peak" : std::string();
    if (current && got.at(peak) < value) {
      throw InvariantError(fmt::format("combined statistics have {} = {} below {} = {}", peak,
                                       got.at(peak), key, value));
    }
  }
}

void CombinedStats::join(Member& member, bool carry_peaks) {
  std::lock_guard lock(mutex_);
  // The sum now is sum_.current plus the owner's values (not in sum_).
  Member* owner = owner_.load(std::memory_order_relaxed);
  DeviceStats owned;
  if (owner != nullptr) {
    owner->lock_member();
    owned = owner->member_values();
  }
  member.lock_member();
  DeviceStats added = member.member_values();
  added.for_each_stat_pair(owned, [&](Stat& a, const Stat& o) {
    a.peak = (carry_peaks ? a.peak : a.current) + o.current;  // the sum's high with it
  });
  sum_.for_each_stat_pair(added, [](Stat& s, const Stat& a) {
    const std::int64_t high = s.current + a.peak;
    s.current += a.current;
    if (high > s.peak) s.peak = high;
  });
  member.joined(*this);
  member.unlock_member();
  if (owner != nullptr) {
    owner->took_sum();  // its thresholds move with the others' values
    owner->unlock_member();
  }
  members_.push_back(&member);
}

void CombinedStats::leave(Member& member) noexcept {
  std::lock_guard lock(mutex_);
  if (owner_.load(std::memory_order_relaxed) == &member) {
    const DeviceStats values = member.member_values();
    sum_.for_each_stat_pair(values, [](Stat& s, const Stat& v) { s.current += v.current; });
    owner_.store(nullptr, std::memory_order_release);
  }
  std::erase(members_, &member);
}

void CombinedStats::claim(Member& member) noexcept {
  std::lock_guard lock(mutex_);
  Member* old = owner_.load(std::memory_order_relaxed);
  if (old == &member) return;
  if (old != nullptr) {
    old->lock_member();  // the old owner is between operations
    owner_.store(nullptr, std::memory_order_relaxed);
    const DeviceStats values = old->member_values();
    old->unlock_member();
    sum_.for_each_stat_pair(values, [](Stat& s, const Stat& v) { s.current += v.current; });
  }
  // The new owner is frozen too: its threads wait for mutex_ to claim.
  const DeviceStats values = member.member_values();
  sum_.for_each_stat_pair(values, [](Stat& s, const Stat& v) { s.current -= v.current; });
  member.took_sum();
  owner_.store(&member, std::memory_order_release);
}

}  // namespace reservoir
