// reservoir compare A B [--json] [--top N]
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <set>

#include "commands.hpp"
#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {

struct CompareArgs {
  std::string a;
  std::string b;
  bool json = false;
  std::size_t top = 15;
  std::optional<int> device;
};

struct Totals {
  std::map<std::string, std::int64_t> figures;          // in display order below
  std::map<std::string, std::int64_t> by_context;       // allocated bytes per context label
  std::set<std::pair<DevicePtr, std::size_t>> segments;  // (address, size)
  std::map<std::pair<DevicePtr, std::size_t>, StreamId> streams;
};

const char* const kFigures[] = {"segments",         "reserved_bytes",     "allocated_bytes",
                                "active_bytes",     "requested_bytes",    "inactive_bytes",
                                "allocated_blocks", "inactive_blocks",    "largest_inactive_block",
                                "small_pool_reserved_bytes", "large_pool_reserved_bytes"};

Totals totals(const Trace& t) {
  Totals out;
  for (const char* f : kFigures) out.figures[f] = 0;
  auto& f = out.figures;
  for (const SegmentInfo& s : t.final_state.segments) {
    f["segments"] += 1;
    f["reserved_bytes"] += static_cast<std::int64_t>(s.total_size);
    f[s.is_large ? "large_pool_reserved_bytes" : "small_pool_reserved_bytes"] +=
        static_cast<std::int64_t>(s.total_size);
    out.segments.emplace(s.address, s.total_size);
    out.streams[{s.address, s.total_size}] = s.stream;
    for (const BlockInfo& b : s.blocks) {
      const auto size = static_cast<std::int64_t>(b.size);
      if (b.state == BlockState::inactive) {
        f["inactive_bytes"] += size;
        f["inactive_blocks"] += 1;
        f["largest_inactive_block"] = std::max(f["largest_inactive_block"], size);
        continue;
      }
      f["active_bytes"] += size;
      f["requested_bytes"] += static_cast<std::int64_t>(b.requested_size);
      if (b.state == BlockState::active_allocated) {
        f["allocated_bytes"] += size;
        f["allocated_blocks"] += 1;
        out.by_context[context_label(t, b.context)] += size;
      }
    }
  }
  return out;
}

std::string signed_size(std::int64_t v) {
  if (v == 0) return "0";
  return (v < 0 ? "-" : "+") + format_size(static_cast<std::uint64_t>(v < 0 ? -v : v));
}

bool is_bytes(const std::string& key) {
  return key.find("bytes") != std::string::npos || key.find("block") == 0 ||
         key == "largest_inactive_block";
}

void run(const CompareArgs& args) {
  const Trace ta = state_of(args.a, args.device);
  const Trace tb = state_of(args.b, args.device);
  const Totals a = totals(ta);
  const Totals b = totals(tb);
  std::vector<std::pair<DevicePtr, std::size_t>> only_a;
  std::vector<std::pair<DevicePtr, std::size_t>> only_b;
  std::set_difference(a.segments.begin(), a.segments.end(), b.segments.begin(), b.segments.end(),
                      std::back_inserter(only_a));
  std::set_difference(b.segments.begin(), b.segments.end(), a.segments.begin(), a.segments.end(),
                      std::back_inserter(only_b));
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> contexts;
  for (const auto& [k, v] : a.by_context) contexts[k].first = v;
  for (const auto& [k, v] : b.by_context) contexts[k].second = v;
  std::vector<std::pair<std::string, std::pair<std::int64_t, std::int64_t>>> changed(
      contexts.begin(), contexts.end());
  std::erase_if(changed, [](const auto& c) { return c.second.first == c.second.second; });
  std::stable_sort(changed.begin(), changed.end(), [](const auto& x, const auto& y) {
    return std::abs(x.second.second - x.second.first) > std::abs(y.second.second - y.second.first);
  });

  if (args.json) {
    nlohmann::json j;
    j["a"] = args.a;
    j["b"] = args.b;
    for (const char* f : kFigures) {
      j["figures"][f] = {{"a", a.figures.at(f)}, {"b", b.figures.at(f)},
                         {"delta", b.figures.at(f) - a.figures.at(f)}};
    }
    auto segs = [](const auto& list) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& [addr, size] : list) out.push_back({{"address", addr}, {"size", size}});
      return out;
    };
    j["segments_only_in_a"] = segs(only_a);
    j["segments_only_in_b"] = segs(only_b);
    j["allocated_by_context"] = nlohmann::json::array();
    for (const auto& [label, v] : changed) {
      j["allocated_by_context"].push_back(
          {{"context", label}, {"a", v.first}, {"b", v.second}, {"delta", v.second - v.first}});
    }
    fmt::print("{}\n", j.dump(2));
    return;
  }
  fmt::print("A: {} ({})\nB: {} ({})\n\n", args.a, ta.format, args.b, tb.format);
  fmt::print("{:<28} {:>16} {:>16} {:>16}\n", "", "A", "B", "B - A");
  for (const char* f : kFigures) {
    const std::int64_t x = a.figures.at(f);
    const std::int64_t y = b.figures.at(f);
    if (is_bytes(f)) {
      fmt::print("{:<28} {:>16} {:>16} {:>16}\n", f, format_size(static_cast<std::uint64_t>(x)),
                 format_size(static_cast<std::uint64_t>(y)), signed_size(y - x));
    } else {
      fmt::print("{:<28} {:>16} {:>16} {:>+16}\n", f, x, y, y - x);
    }
  }
  auto list = [&](const char* title, const auto& segs, const Totals& t) {
    std::uint64_t bytes = 0;
    for (const auto& s : segs) bytes += s.second;
    fmt::print("\n{}: {} ({})\n", title, segs.size(), format_size(bytes));
    for (std::size_t i = 0; i < segs.size() && i < args.top; ++i) {
      fmt::print("  {:#x}  {:>12}  stream {}\n", segs[i].first, format_size(segs[i].second),
                 t.streams.at(segs[i]));
    }
    if (segs.size() > args.top) fmt::print("  ... {} more\n", segs.size() - args.top);
  };
  list("segments only in A", only_a, a);
  list("segments only in B", only_b, b);
  fmt::print("\nallocated bytes by context, largest changes first ({} contexts differ)\n",
             changed.size());
  if (!changed.empty()) {
    fmt::print("  {:>14} {:>14} {:>14}  {}\n", "A", "B", "B - A", "context");
  }
  for (std::size_t i = 0; i < changed.size() && i < args.top; ++i) {
    const auto& [label, v] = changed[i];
    fmt::print("  {:>14} {:>14} {:>14}  {}\n", format_size(static_cast<std::uint64_t>(v.first)),
               format_size(static_cast<std::uint64_t>(v.second)), signed_size(v.second - v.first),
               label);
  }
}

}  // namespace

void add_compare(CLI::App& app) {
  auto args = std::make_shared<CompareArgs>();
  CLI::App* cmd = app.add_subcommand(
      "compare",
      "Differences between two snapshots: totals, segments only in one, allocated bytes by "
      "context (traces without segments are replayed with their recorded settings first)");
  cmd->add_option("a", args->a, "the first snapshot or trace")->required()->check(CLI::ExistingFile);
  cmd->add_option("b", args->b, "the second")->required()->check(CLI::ExistingFile);
  cmd->add_flag("--json", args->json, "print the comparison as JSON");
  cmd->add_option("--top", args->top, "rows per list (default 15)");
  add_device_option(*cmd, args->device);
  set_examples(*cmd, {
      {"reservoir compare before.pickle after.pickle",
       "what changed between two snapshots: totals, segments, bytes by call site"},
      {"reservoir compare a.pickle b.pickle --json --top 5",
       "the same as JSON, five rows per list"},
  });
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
