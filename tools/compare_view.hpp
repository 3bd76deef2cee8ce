// reservoir compare's views: two snapshots side by side as text or JSON.
// The command works the comparison out; these show it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "reservoir/trace_model.hpp"

namespace reservoir::tools {

struct Totals {
  std::map<std::string, std::int64_t> figures;          // in display order below
  std::map<std::string, std::int64_t> by_context;       // allocated bytes per context label
  std::set<std::pair<DevicePtr, std::size_t>> segments;  // (address, size)
  std::map<std::pair<DevicePtr, std::size_t>, StreamId> streams;
};

inline constexpr const char* kFigures[] = {"segments",         "reserved_bytes",     "allocated_bytes",
                                "active_bytes",     "requested_bytes",    "inactive_bytes",
                                "allocated_blocks", "inactive_blocks",    "largest_inactive_block",
                                "small_pool_reserved_bytes", "large_pool_reserved_bytes"};

// Two snapshots compared: their figures, the segments only one holds, and
// the allocated bytes per context that changed (largest change first).
struct Comparison {
  std::string a_path;
  std::string b_path;
  std::string a_format;
  std::string b_format;
  Totals a;
  Totals b;
  std::vector<std::pair<DevicePtr, std::size_t>> only_a;
  std::vector<std::pair<DevicePtr, std::size_t>> only_b;
  std::vector<std::pair<std::string, std::pair<std::int64_t, std::int64_t>>> changed;
};

// Prints it on standard output: JSON, or text with `top` rows per list.
void show_comparison(const Comparison& c, bool json, std::size_t top);

}  // namespace reservoir::tools
