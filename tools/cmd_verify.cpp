// reservoir verify TRACE...
#include <fmt/format.h>

#include <memory>

#include "commands.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"

namespace reservoir::tools {
namespace {

struct VerifyArgs {
  std::vector<std::string> traces;
};

std::string label(const std::string& path, const Trace& trace) {
  return trace.device_count > 1 ? fmt::format("{} (device {})", path, trace.device) : path;
}

// Prints one device's result; returns 0 agreed, 1 diverged, 3 cannot verify.
int report(const std::string& path, const Trace& trace, const VerifyResult& r) {
  const std::string name = label(path, trace);
  if (r.agreed) {
    fmt::print(
        "{}: agrees with the recording\n"
        "  {} events; started from {} segments ({} wholly free) and {} live blocks ({} with an "
        "unsplit tail)\n"
        "  {} alloc addresses, {} segment_alloc sizes and addresses, {} segment_free, {} oom "
        "checked; final segment layout {}\n",
        name, r.events, r.initial_segments, r.initial_free_segments, r.initial_live_blocks,
        r.unsplit_tails, r.allocs_checked, r.segment_allocs_checked, r.segment_frees_checked,
        r.ooms_checked, r.final_state_checked ? "identical" : "not recorded");
    if (r.reservations_checked + r.segment_maps_checked + r.segment_unmaps_checked +
            r.initial_reservations >
        0) {
      fmt::print(
          "  expandable segments: {} reservations at the start, {} new reservations, {} "
          "segment_map and {} segment_unmap checked\n",
          r.initial_reservations, r.reservations_checked, r.segment_maps_checked,
          r.segment_unmaps_checked);
    }
    if (r.empty_cache_calls + r.allocator_releases + r.garbage_collections + r.undecided_releases >
        0) {
      fmt::print(
          "  segment releases: {} empty_cache() calls, {} by the retry ladder, {} by "
          "garbage collection, {} of all unused segments before a device request "
          "(empty_cache() or the ladder; the same either way)\n",
          r.empty_cache_calls, r.allocator_releases, r.garbage_collections, r.undecided_releases);
    }
    if (r.zero_size_skipped > 0) {
      fmt::print("  {} zero-byte events skipped (no allocator work)\n", r.zero_size_skipped);
    }
    if (!trace.settings_recorded) {
      fmt::print(
          "  note: the snapshot records no allocator settings; PyTorch's defaults were "
          "assumed\n");
    }
    return 0;
  }
  const char* what = r.cannot_verify ? "CANNOT VERIFY" : "DIVERGES";
  fmt::print(
      "{}: {} at event {} of {}\n  {}\n  agreed before it: {} alloc addresses, "
      "{} segment_allocs, {} segment_frees\n",
      name, what, r.divergence_event, r.events, r.divergence, r.allocs_checked,
      r.segment_allocs_checked, r.segment_frees_checked);
  return r.cannot_verify ? 3 : 1;
}

void run(const VerifyArgs& args) {
  int worst = 0;
  for (const std::string& path : args.traces) {
    Trace trace = read_trace_file(path);
    const std::size_t devices = trace.device_count;
    for (std::size_t d = 0; d < devices; ++d) {
      if (d > 0) trace = read_trace_file(path, static_cast<int>(d));
      if (devices > 1 && trace.events.empty() && trace.final_state.segments.empty()) continue;
      const int rc = report(path, trace, verify(trace));
      if (rc == 1 || (rc == 3 && worst == 0)) worst = rc;  // a divergence outranks
    }
  }
  if (worst != 0) throw CLI::RuntimeError(worst);
}

}  // namespace

void add_verify(CLI::App& app) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify",
      "Replay PyTorch snapshots exactly as recorded and check every device request and "
      "address (exit 0: all agree, 1: a divergence, 3: a recording that cannot be verified)");
  cmd->add_option("traces", args->traces, "PyTorch snapshot pickles")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
