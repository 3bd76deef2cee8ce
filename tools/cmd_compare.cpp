// reservoir compare A B [--json] [--top N]
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>

#include "commands.hpp"
#include "compare_view.hpp"
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

void run(const CompareArgs& args) {
  const Trace ta = state_of(args.a, args.device);
  const Trace tb = state_of(args.b, args.device);
  Comparison c{args.a, args.b, ta.format, tb.format, totals(ta), totals(tb), {}, {}, {}};
  const Totals& a = c.a;
  const Totals& b = c.b;
  auto& only_a = c.only_a;
  auto& only_b = c.only_b;
  std::set_difference(a.segments.begin(), a.segments.end(), b.segments.begin(), b.segments.end(),
                      std::back_inserter(only_a));
  std::set_difference(b.segments.begin(), b.segments.end(), a.segments.begin(), a.segments.end(),
                      std::back_inserter(only_b));
  std::map<std::string, std::pair<std::int64_t, std::int64_t>> contexts;
  for (const auto& [k, v] : a.by_context) contexts[k].first = v;
  for (const auto& [k, v] : b.by_context) contexts[k].second = v;
  auto& changed = c.changed;
  changed.assign(contexts.begin(), contexts.end());
  std::erase_if(changed, [](const auto& e) { return e.second.first == e.second.second; });
  std::stable_sort(changed.begin(), changed.end(), [](const auto& x, const auto& y) {
    return std::abs(x.second.second - x.second.first) > std::abs(y.second.second - y.second.first);
  });
  show_comparison(c, args.json, args.top);
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
  cmd->add_option("--top", args->top, "rows per list (default 15)")
      ->check(whole_number(1, 100'000, "rows"));
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
