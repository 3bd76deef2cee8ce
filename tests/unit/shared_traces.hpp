// The real PyTorch snapshots beside the checkout (../shared/traces), for the
// tests that run on them when they are there.
#pragma once

#include <algorithm>
#include <filesystem>
#include <vector>
#include "source_dir.hpp"

namespace reservoir::testing {

inline std::filesystem::path shared_trace_dir() {
  return std::filesystem::path(RESERVOIR_SOURCE_DIR) / ".." / "shared" / "traces";
}

// The .pickle files there and in oom/ (recordings that end out of memory),
// in name order (empty when the folder is absent).
inline std::vector<std::filesystem::path> shared_traces() {
  std::vector<std::filesystem::path> out;
  if (!std::filesystem::exists(shared_trace_dir())) return out;
  for (const auto& dir : {shared_trace_dir(), shared_trace_dir() / "oom"}) {
    if (!std::filesystem::exists(dir)) continue;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().extension() == ".pickle") out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace reservoir::testing
