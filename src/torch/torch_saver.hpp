// The savers PyTorch's allocator serves each device from, created on first
// use (see reservoir_torch.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "reservoir/explain.hpp"
#include "reservoir/saver.hpp"

namespace reservoir {
// The saver of `device`, created on first use. Throws on failure.
Saver& torch_saver(int device);
// The devices whose saver exists, in order.
std::vector<int> torch_saver_devices();
// A region (untagged without a tag) on the calling thread of every device's
// saver: those that exist now and those created before it closes. Returns
// its id for torch_pop_region_everywhere, which must close the innermost
// first (UsageError otherwise).
std::uint64_t torch_push_region_everywhere(std::optional<std::string> tag, RegionOptions options);
void torch_pop_region_everywhere(std::uint64_t id);
// Every device's saver (those created later too) records its latest
// `max_entries` events and explains its out-of-memory errors from them
// (reservoir/explain.hpp), the lines also printed on stderr.
void torch_explain_oom(const ExplainOptions& options, std::size_t max_entries);
}  // namespace reservoir
