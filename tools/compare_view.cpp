// reservoir compare's views (compare_view.hpp).
#include "compare_view.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "reservoir/format.hpp"

namespace reservoir::tools {
namespace {

std::string signed_size(std::int64_t v) {
  if (v == 0) return "0";
  return fmt::format("{}{}", v < 0 ? '-' : '+', format_size(static_cast<std::uint64_t>(v < 0 ? -v : v)));
}

bool is_bytes(const std::string& key) {
  return key.find("bytes") != std::string::npos || key.find("block") == 0 ||
         key == "largest_inactive_block";
}

}  // namespace

void show_comparison(const Comparison& c, bool json, std::size_t top) {
  const Totals& a = c.a;
  const Totals& b = c.b;
  const auto& only_a = c.only_a;
  const auto& only_b = c.only_b;
  const auto& changed = c.changed;
  if (json) {
    nlohmann::json j;
    j["a"] = c.a_path;
    j["b"] = c.b_path;
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
  fmt::print("A: {} ({})\nB: {} ({})\n\n", c.a_path, c.a_format, c.b_path, c.b_format);
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
    for (std::size_t i = 0; i < segs.size() && i < top; ++i) {
      fmt::print("  {:#x}  {:>12}  stream {}\n", segs[i].first, format_size(segs[i].second),
                 t.streams.at(segs[i]));
    }
    if (segs.size() > top) fmt::print("  ... {} more\n", segs.size() - top);
  };
  list("segments only in A", only_a, a);
  list("segments only in B", only_b, b);
  fmt::print("\nallocated bytes by context, largest changes first ({} contexts differ)\n",
             changed.size());
  if (!changed.empty()) {
    fmt::print("  {:>14} {:>14} {:>14}  {}\n", "A", "B", "B - A", "context");
  }
  for (std::size_t i = 0; i < changed.size() && i < top; ++i) {
    const auto& [label, v] = changed[i];
    fmt::print("  {:>14} {:>14} {:>14}  {}\n", format_size(static_cast<std::uint64_t>(v.first)),
               format_size(static_cast<std::uint64_t>(v.second)), signed_size(v.second - v.first),
               label);
  }
}

}  // namespace reservoir::tools
