// reservoir replay's views: the narrow text (a block per trace, what a
// person compares), the wide table (every figure) and JSON (docs/replay.md's
// keys). The command replays; these show what it found.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "reservoir/replay.hpp"

namespace reservoir::tools {

// One replay: its result, and the smallest capacity it ran in when asked.
struct Row {
  ReplayResult r;
  std::optional<std::uint64_t> min_capacity;
};

enum class ReplayView { narrow, wide, json };

// Prints the rows on standard output as `view` shows them (narrow: with the
// per-config summary when minimum capacities were found, and the
// out-of-memory errors).
void show_replays(const std::vector<Row>& rows, ReplayView view);

}  // namespace reservoir::tools
