// reservoir replay's views (replay_view.hpp).
#include "replay_view.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <map>
#include <string>

#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {


double calls_per_1000(const ReplayResult& r) {
  return r.allocations ? 1000.0 * static_cast<double>(r.device_calls) /
                             static_cast<double>(r.allocations)
                       : 0.0;
}

double min_over_requested(const Row& row) {
  return row.r.peak_requested_bytes ? static_cast<double>(*row.min_capacity) /
                                          static_cast<double>(row.r.peak_requested_bytes)
                                    : 1.0;
}

std::string gib(std::uint64_t bytes) {
  return fmt::format("{:.3f} GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
}

double reserved_over_allocated(const ReplayResult& r) {
  return r.peak_allocated_bytes ? static_cast<double>(r.peak_reserved_bytes) /
                                      static_cast<double>(r.peak_allocated_bytes)
                                : 0.0;
}


nlohmann::json to_json(const Row& row) {
  const ReplayResult& r = row.r;
  const double ratio = reserved_over_allocated(r);
  nlohmann::json j{
      {"trace", r.trace},
      {"config", r.config},
      {"events", r.events},
      {"ops", r.ops},
      {"peak_requested_bytes", r.peak_requested_bytes},
      {"peak_allocated_bytes", r.peak_allocated_bytes},
      {"peak_reserved_bytes", r.peak_reserved_bytes},
      {"reserved_over_allocated", ratio},
      {"peak_reserved_op", r.peak_reserved_op},
      {"final_reserved_bytes", r.final_reserved_bytes},
      {"device_allocs", r.device_allocs},
      {"device_frees", r.device_frees},
      {"num_alloc_retries", r.num_alloc_retries},
      {"num_ooms", r.num_ooms},
      {"first_oom", r.first_oom},
      {"device_call_seconds", r.device_call_seconds},
      {"replay_seconds", r.wall_seconds},
      {"allocations", r.allocations},
      {"device_calls", r.device_calls},
      {"device_calls_per_1000_allocs", calls_per_1000(r)},
  };
  if (const auto& o = r.over_native) {
    j["over_native"] = {
        {"worst_bytes", o->worst_bytes},
        {"worst_op", o->worst_op},
        {"slack_bytes_per_stream", o->slack_bytes},
        {"ops_over_bound", o->ops_over_bound},
        {"worst_over_bound_bytes", o->worst_over_bound_bytes},
    };
  }
  if (row.min_capacity) {
    j["min_capacity_bytes"] = *row.min_capacity;
    j["min_capacity_over_requested"] = min_over_requested(row);
  }
  return j;
}

// One block per trace, a line per config, in 100 columns: what a person
// compares (reserved, device calls, out-of-memory errors, minimum capacity);
// long settings wrap at their commas. --wide and --json give every figure.
void print_narrow(const std::vector<Row>& rows) {
  const bool with_min = !rows.empty() && rows.front().min_capacity.has_value();
  // 100 columns: the setting gets what the figures leave.
  const std::size_t kConfig = with_min ? 29 : 49;
  std::string trace;
  for (const Row& row : rows) {
    const ReplayResult& r = row.r;
    if (r.trace != trace) {
      trace = r.trace;
      fmt::print("{}{}\n  {} recorded events, {} allocator calls; peak requested {}\n",
                 &row == &rows.front() ? "" : "\n", r.trace, r.events, r.ops, format_size(r.peak_requested_bytes));
      fmt::print("  {:<{}} {:>11} {:>9} {:>9} {:>4} {:>9}", "config", kConfig, "reserved", "res/alloc",
                 "dev.calls", "OOMs", "dev.time");
      if (with_min) fmt::print(" {:>12} {:>7}", "min capacity", "min/req");
      fmt::print("\n");
    }
    const std::vector<std::string> config = wrap_setting(config_label(r.config), kConfig);
    fmt::print("  {:<{}} {:>11} {:>9.3f} {:>9} {:>4} {:>7.1f}ms", config.front(), kConfig,
               format_size(r.peak_reserved_bytes), reserved_over_allocated(r), r.device_allocs + r.device_frees,
               r.num_ooms, r.device_call_seconds * 1e3);
    if (with_min) fmt::print(" {:>12} {:>7.3f}", format_size(*row.min_capacity), min_over_requested(row));
    fmt::print("\n");
    for (std::size_t i = 1; i < config.size(); ++i) fmt::print("    {}\n", config[i]);
    if (const auto& o = r.over_native; o && o->worst_bytes > 0) {
      fmt::print("    vs native: at most +{} (call {}); {} call{} above native + {} a stream\n",
                 format_size(o->worst_bytes), o->worst_op, o->ops_over_bound,
                 o->ops_over_bound == 1 ? "" : "s", format_size(o->slack_bytes));
    }
  }
}

void print_config_summary(const std::vector<Row>& rows) {
  // Per config, over the traces: the figures the policies are judged by.
  struct Summary {
    double log_sum = 0.0;
    double worst = 0.0;
    double calls = 0.0;
    int n = 0;
  };
  std::vector<std::string> order;
  std::map<std::string, Summary> by_config;
  for (const Row& row : rows) {
    const std::string label = config_label(row.r.config);
    if (by_config.find(label) == by_config.end()) order.push_back(label);
    Summary& s = by_config[label];
    const double ratio = min_over_requested(row);
    s.log_sum += std::log(ratio);
    s.worst = std::max(s.worst, ratio);
    s.calls += calls_per_1000(row.r);
    ++s.n;
  }
  fmt::print("\n{:<29} {:>6} {:>22} {:>14} {:>14}\n", "config", "traces", "min/req geometric mean",
             "min/req worst", "calls/1k mean");
  for (const std::string& label : order) {
    const Summary& s = by_config[label];
    const std::vector<std::string> lines = wrap_setting(label, 29);
    fmt::print("{:<29} {:>6} {:>22.4f} {:>14.4f} {:>14.1f}\n", lines.front(), s.n, std::exp(s.log_sum / s.n),
               s.worst, s.calls / s.n);
    for (std::size_t i = 1; i < lines.size(); ++i) fmt::print("  {}\n", lines[i]);
  }
}

void print_ooms(const std::vector<Row>& rows, bool wrap) {
  for (const Row& row : rows) {
    const ReplayResult& r = row.r;
    if (r.first_oom.empty()) continue;
    const std::string line = fmt::format("{} [{}]: {} out-of-memory errors; the first, at {}", r.trace,
                                         config_label(r.config), r.num_ooms, r.first_oom);
    fmt::print("\n{}\n", wrap ? wrap_words(line, kTextWidth, kTextWidth, "  ") : line);
  }
}

void print_table(const std::vector<Row>& rows) {
  const bool with_min = !rows.empty() && rows.front().min_capacity.has_value();
  fmt::print("{:<44} {:<28} {:>13} {:>13} {:>13} {:>9} {:>8} {:>8} {:>8} {:>7} {:>5} {:>11}",
             "trace", "config", "peak request", "peak alloc", "peak reserve", "res/alloc",
             "dev.allc", "dev.free", "calls/1k", "retries", "OOMs", "device time");
  if (with_min) fmt::print(" {:>13} {:>7}", "min capacity", "min/req");
  fmt::print("\n");
  for (const Row& row : rows) {
    const ReplayResult& r = row.r;
    std::string name = base_name(r.trace);
    if (name.size() > 44) name = "..." + name.substr(name.size() - 41);
    std::string config = r.config.empty() ? "(native defaults)" : r.config;
    if (config.size() > 28) config = config.substr(0, 25) + "...";
    const double ratio = reserved_over_allocated(r);
    fmt::print(
        "{:<44} {:<28} {:>13} {:>13} {:>13} {:>9.3f} {:>8} {:>8} {:>8.1f} {:>7} {:>5} {:>9.1f}ms",
        name, config, gib(r.peak_requested_bytes), gib(r.peak_allocated_bytes),
        gib(r.peak_reserved_bytes), ratio, r.device_allocs, r.device_frees, calls_per_1000(r),
        r.num_alloc_retries, r.num_ooms, r.device_call_seconds * 1e3);
    if (with_min) fmt::print(" {:>13} {:>7.3f}", gib(*row.min_capacity), min_over_requested(row));
    fmt::print("\n");
  }
  if (with_min) print_config_summary(rows);
  print_ooms(rows, false);
  for (const Row& row : rows) {
    const ReplayResult& r = row.r;
    fmt::print(
        "\n{} [{}]: {} recorded events, {} allocator calls in {:.3f} s; reserved peaked at "
        "call {}, ending at {}",
        r.trace, config_label(r.config), r.events, r.ops, r.wall_seconds, r.peak_reserved_op,
        gib(r.final_reserved_bytes));
  }
  fmt::print("\n");
}

}  // namespace

void show_replays(const std::vector<Row>& rows, ReplayView view) {
  if (view == ReplayView::json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& row : rows) out.push_back(to_json(row));
    fmt::print("{}\n", out.dump(2));
  } else if (view == ReplayView::wide) {
    print_table(rows);
  } else {
    print_narrow(rows);
    if (!rows.empty() && rows.front().min_capacity) print_config_summary(rows);
    print_ooms(rows, true);
  }
}

}  // namespace reservoir::tools
