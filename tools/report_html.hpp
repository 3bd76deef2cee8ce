// The report's drawing: HTML and inline SVG for what `reservoir report`
// measured (cmd_report.cpp runs the replays and assembles the page).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "reservoir/trace.hpp"

namespace reservoir::tools {

inline constexpr std::size_t kBuckets = 600;  // points per plotted series
inline constexpr const char* kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2",
                                "#edc948", "#ff9da7", "#9c755f", "#e15759", "#86bcb6"};

// Allocated and reserved bytes after every op (the allocator's own
// counters), kept as per-bucket maxima.
class Timeline : public ReplayObserver {
 public:
  void on_start(CachingAllocator& allocator, const ReplayProgram& program) override {
    allocator_ = &allocator;
    total_ = std::max<std::uint64_t>(1, program.initial.size() + program.ops.size());
    allocated_.assign(kBuckets, 0);
    reserved_.assign(kBuckets, 0);
  }
  void on_op(std::uint64_t index, const ReplayOp&, const void*) override {
    const DeviceStats s = allocator_->stats();
    const std::size_t b = static_cast<std::size_t>(index * kBuckets / total_);
    allocated_[b] = std::max(allocated_[b], static_cast<std::uint64_t>(s.allocated_bytes[0].current));
    reserved_[b] = std::max(reserved_[b], static_cast<std::uint64_t>(s.reserved_bytes[0].current));
  }
  std::uint64_t total_ = 1;
  std::vector<std::uint64_t> allocated_;
  std::vector<std::uint64_t> reserved_;

 private:
  const CachingAllocator* allocator_ = nullptr;
};

// One replay of a trace under one configuration, as drawn.
struct Run {
  std::string config;
  ReplayResult result;
  std::optional<std::uint64_t> min_capacity;
  Timeline timeline;
  Snapshot peak;
  std::unordered_map<DevicePtr, std::uint32_t> peak_ids;
};

// HTML-escaped text.
std::string esc(std::string_view s);
// A context's annotations and frames (the telling frame shown, the rest folded).
std::string frames_html(const Context& context);
// A step plot of one or more series over the op index.
std::string plot(const std::vector<std::pair<std::string, const std::vector<std::uint64_t>*>>& series,
                 const std::vector<std::string>& colors, std::uint64_t ops, bool fill_first,
                 const std::string& id);
// The segments at the peak, each block a rectangle coloured by its context.
std::string segment_map(const Trace& trace, const ReplayProgram& program, const Run& run,
                        const std::string& id);
// The `top` largest allocations alive at the peak, with their contexts.
std::string largest_table(const Trace& trace, const ReplayProgram& program, const Run& run,
                          std::size_t top);
// The page's style sheet.
extern const char* const kStyle;
// A whole self-contained page: title, style sheet, an h1, then `body`.
std::string html_page(const std::string& title, const std::string& body);
// The time now, as pages print it ("2026-11-23 18:54 UTC").
std::string utc_now();

}  // namespace reservoir::tools
