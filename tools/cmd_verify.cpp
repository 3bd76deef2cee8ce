// reservoir verify TRACE...
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>

#include "commands.hpp"
#include "support.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "reservoir/trace.hpp"

namespace reservoir::tools {
namespace {

struct VerifyArgs {
  std::vector<std::string> traces;
  std::optional<int> device;
  std::optional<double> fraction;
  std::string device_memory;
  std::optional<std::string> settings;
};

// Prints one device's result; returns 0 agreed, 1 diverged, 3 cannot verify.
int report(const Trace& trace, const VerifyResult& r, const VerifyOptions& options) {
  const std::string& name = trace.name;
  if (r.agreed) {
    // Lines of at most 100 columns as written (the path line aside), so
    // that what scripts look for is never broken by wrapping.
    fmt::print("{}: agrees with the recording\n", name);
    print_wrapped(fmt::format(
        "  {} events; started from {} segments ({} wholly free), {} live blocks ({} with an "
        "unsplit tail)\n"
        "  {} alloc addresses, {} segment_alloc sizes and addresses, {} segment_free, {} oom "
        "checked\n  final segment layout {}\n",
        r.events, r.initial_segments, r.initial_free_segments, r.initial_live_blocks,
        r.unsplit_tails, r.allocs_checked, r.segment_allocs_checked, r.segment_frees_checked,
        r.ooms_checked, r.final_state_checked ? "identical" : "not recorded"));
    if (r.reservations_checked + r.segment_maps_checked + r.segment_unmaps_checked +
            r.initial_reservations >
        0) {
      print_wrapped(fmt::format(
          "  {}: {} new reservations, {} segment_map and {} segment_unmap checked "
          "({} reserved at the start)\n",
          r.pages_of.empty() ? "expandable segments" : r.pages_of, r.reservations_checked, r.segment_maps_checked, r.segment_unmaps_checked,
          r.initial_reservations));
    }
    if (r.empty_cache_calls + r.allocator_releases + r.garbage_collections + r.undecided_releases >
        0) {
      print_wrapped(fmt::format(
          "  segment releases: {} empty_cache() calls, {} by the retry ladder, {} by garbage "
          "collection,\n  {} of all unused segments before a device request (empty_cache() or "
          "the ladder: the same)\n",
          r.empty_cache_calls, r.allocator_releases, r.garbage_collections, r.undecided_releases));
    }
    if (r.zero_size_skipped > 0) {
      print_wrapped(fmt::format("  {} zero-byte events skipped (no allocator work)\n", r.zero_size_skipped));
    }
    if (r.device_memory_inferred) {
      print_wrapped(fmt::format(
          "  the device's memory taken as {} ({} bytes): the pages mapped and the free memory "
          "recorded at an out-of-memory error (--device-memory sets it)\n",
          format_size(*r.device_memory), *r.device_memory));
    }
    if (!r.pytorch_rules.empty() && compare_versions(r.pytorch_rules, "2.12") >= 0) {
      const bool inferred = trace.pytorch_since.empty() ||
                            compare_versions(trace.pytorch_since, "2.12") < 0;
      const bool only_2_12 = compare_versions(r.pytorch_rules, "2.13") < 0;
      print_wrapped(fmt::format(
          "  rules of PyTorch {} (of cached blocks of equal size, {}){}\n",
          only_2_12 ? "2.12" : "2.13 and later",
          only_2_12 ? "the block made first" : "the oldest segment's first",
          inferred ? fmt::format(": the snapshot shows {} or later, and only these rules agree",
                                 trace.pytorch_since)
                   : ""));
    }
    if (r.private_pool_segments > 0) {
      print_wrapped(fmt::format(
          "  not checked: {} segments ({}) of private pools (CUDA graphs, torch.cuda.MemPool): "
          "a recording does not say which allocations were routed there\n",
          r.private_pool_segments, format_size(r.private_pool_bytes)));
    }
    if (!trace.settings_recorded && options.settings) {
      print_wrapped(fmt::format("  note: the snapshot records no allocator settings; those given were "
                                "assumed (--settings '{}')\n",
                                options.settings->to_string()));
    } else if (!trace.settings_recorded) {
      print_wrapped(fmt::format(
          "  note: the snapshot records no allocator settings; PyTorch's defaults were "
          "assumed (--settings gives others)\n"));
    }
    return kExitOk;
  }
  const char* what = r.cannot_verify ? "CANNOT VERIFY" : "DIVERGES";
  const std::string where = r.divergence_event >= r.events
                                ? fmt::format("at the final state, after all {} events", r.events)
                                : fmt::format("at event {} of {}", r.divergence_event, r.events);
  // A reason about the whole recording has no event to name.
  const bool whole = r.cannot_verify && r.divergence_event >= r.events;
  // The verdict's line is whole, as "agrees with the recording" is (scripts
  // look for it); the reason wraps.
  fmt::print("{}: {}{}\n", name, what, whole ? "" : " " + where);
  print_wrapped(fmt::format("  {}\n", r.divergence));
  if (!whole || r.allocs_checked > 0) {
    print_wrapped(fmt::format("  agreed before it: {} alloc addresses, {} segment_allocs, {} segment_frees\n",
               r.allocs_checked, r.segment_allocs_checked, r.segment_frees_checked));
  }
  return r.cannot_verify ? kExitCannotVerify : kExitDiverges;
}

void run(const VerifyArgs& args) {
  VerifyOptions options;
  options.memory_fraction = args.fraction;
  if (!args.device_memory.empty()) options.device_memory = parse_size(args.device_memory);
  if (args.settings) options.settings = AllocatorConfig::parse(*args.settings);
  if (options.memory_fraction && !options.device_memory) {
    throw CLI::ValidationError(
        "--memory-fraction",
        "give --device-memory with it: PyTorch's limit is the fraction of the device's total "
        "memory (torch.cuda.mem_get_info()[1])");
  }
  int worst = kExitOk;
  for (const std::string& path : args.traces) {
    const std::vector<Trace> devices = load_devices(path, args.device);
    for (const Trace& trace : devices) {
      const int rc = report(trace, verify(trace, options), options);
      if (rc == kExitDiverges || (rc == kExitCannotVerify && worst == kExitOk)) {
        worst = rc;  // a divergence outranks
      }
    }
    // Devices the file holds no history for: nothing of theirs was checked.
    std::vector<std::size_t> silent;
    const std::vector<std::uint64_t>& counts = devices.front().device_events;
    for (std::size_t d = 0; d < counts.size(); ++d) {
      if (counts[d] == 0) silent.push_back(d);
    }
    if (counts.size() > 1 && !silent.empty() && !args.device) {
      print_wrapped(fmt::format("{}: not checked: device{} {} of the file recorded no events\n", path,
                                silent.size() > 1 ? "s" : "", fmt::join(silent, ", ")));
    }
  }
  if (worst != kExitOk) throw CLI::RuntimeError(worst);
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
  add_device_option(*cmd, args->device);
  cmd->add_option("--memory-fraction", args->fraction,
                  "the program's torch.cuda.set_per_process_memory_fraction, set before the "
                  "recording began (a snapshot does not record it): with --device-memory, "
                  "garbage collection and the limit are checked exactly")
      ->check(fraction(false));
  add_size_option(*cmd, "--device-memory", args->device_memory,
                  "the device's total memory as CUDA reports it (torch.cuda.mem_get_info()[1]), "
                  "e.g. 80GiB, or 85899345920B in bytes: the replay's device has that much "
                  "(reservoir's page policies map by what is free)");
  cmd->add_option("--settings", args->settings,
                  "the PYTORCH_CUDA_ALLOC_CONF the program ran under, for a snapshot that does not "
                  "record it (PyTorch before 2.3; later snapshots record theirs)");
  set_examples(*cmd, {
      {"reservoir verify run.pickle",
       "replay the recording exactly and check every address and device request"},
      {"reservoir verify run.pickle --memory-fraction 0.5 --device-memory 80GiB",
       "a program that set set_per_process_memory_fraction(0.5) on an 80 GiB device"},
      {"reservoir verify run.pickle --settings max_split_size_mb:128",
       "a PyTorch 2.0 to 2.3 snapshot, recorded under PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128"},
  });
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
