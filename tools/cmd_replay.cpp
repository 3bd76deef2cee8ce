// reservoir replay TRACE... [--generated N [--first-seed S]] [--config STR]... [--capacity SIZE]
//                  [--min-capacity] [--vs-native] [--json]
#include <fmt/format.h>

#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "commands.hpp"
#include "progress.hpp"
#include "replay_view.hpp"
#include "support.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "reservoir/generated.hpp"
#include "reservoir/trace.hpp"

namespace reservoir::tools {
namespace {

struct ReplayArgs {
  std::vector<std::string> traces;
  std::vector<std::string> configs;
  std::string capacity;
  std::optional<double> fraction;
  bool json = false;
  bool validate = false;
  bool min_capacity = false;
  bool wide = false;
  bool vs_native = false;
  bool reuse_addresses = false;
  std::uint64_t generated = 0;
  std::uint64_t first_seed = 0;
  std::optional<int> device;
};

void run(const ReplayArgs& args) {
  ReplayOptions options;
  if (!args.capacity.empty()) options.capacity = parse_size(args.capacity);
  options.validate_each_step = args.validate;
  options.memory_fraction = args.fraction;
  options.reuse_freed_addresses = args.reuse_addresses;
  std::vector<std::pair<std::string, AllocatorConfig>> configs;
  for (const std::string& c : args.configs) {
    configs.emplace_back(c, AllocatorConfig::parse(c));
    // What the release ignores with a warning (an invalid reserve), said as it says it.
    for (const std::string& w : configs.back().second.warnings.list) {
      fmt::print(stderr, "{}", wrapped(fmt::format("warning: [{}]: {}\n", c, w)));
    }
    // PyTorch collects garbage only under a memory fraction: said, so that a
    // replay without one is not taken for what advise (which sets one) claims.
    if (configs.back().second.garbage_collection_threshold > 0.0 && !args.fraction) {
      fmt::print(stderr, "{}", wrapped(fmt::format(
          "note: [{}]: garbage_collection_threshold acts only under a memory fraction "
          "(PyTorch collects garbage only after set_per_process_memory_fraction): without "
          "--memory-fraction it never runs here\n", c)));
    }
  }
  if (configs.empty()) {
    for (const std::string& c : default_configs()) configs.emplace_back(c, AllocatorConfig::parse(c));
  }
  std::vector<Row> rows;
  Progress progress;
  options.observer = &progress;
  const std::size_t tasks = (args.traces.size() + args.generated) * configs.size();
  auto replay_all = [&](const ReplayProgram& program) {
    // For --vs-native: the native policy's reserved memory after each op,
    // under each config's other settings (one replay per distinct one).
    std::map<std::string, std::vector<std::uint64_t>> native;
    for (const auto& [text, config] : configs) {
      rows.push_back(Row{});
      ReplayOptions o = options;
      if (args.vs_native) {
        const AllocatorConfig same = config.with_native_policy();
        auto [it, fresh] = native.try_emplace(same.to_string());
        if (fresh) {
          progress.task(fmt::format("{} [native, for the comparison]", base_name(program.name)));
          ReplayOptions n = options;
          n.keep_reserved = true;
          it->second = replay(program, same, same.to_string(), n).reserved_after_op;
        }
        o.native_reserved = &it->second;
      }
      progress.task(fmt::format("[{}/{}] {} [{}]{}", rows.size(), tasks, base_name(program.name),
                                config_label(text),
                                args.min_capacity ? ", finding the minimum capacity" : ""));
      rows.back().r = replay(program, config, text, o);
      if (args.min_capacity) {
        rows.back().min_capacity = min_capacity(program, config, text, options).bytes;
      }
    }
  };
  for (const std::string& path : args.traces) {
    progress.task(fmt::format("reading {}", path));
    // replay shows no stacks: they are not read.
    for (const Trace& trace : load_devices(path, args.device, ReadOptions{.contexts = false, .consumed = {}})) {
      replay_all(compile(trace));
    }
  }
  for (std::uint64_t i = 0; i < args.generated; ++i) replay_all(generated_program(args.first_seed + i));
  progress.clear();
  show_replays(rows, args.json ? ReplayView::json : args.wide ? ReplayView::wide : ReplayView::narrow);
  for (const Row& row : rows) {
    if (row.r.num_ooms > 0) throw CLI::RuntimeError(kExitOutOfMemory);
  }
}

}  // namespace

void add_replay(CLI::App& app) {
  auto args = std::make_shared<ReplayArgs>();
  CLI::App* cmd = app.add_subcommand(
      "replay",
      "Replay traces on a simulated device under each config and report what they reserve");
  cmd->add_option("traces", args->traces, "PyTorch snapshot pickles or reservoir text traces")
      ->check(CLI::ExistingFile);
  cmd->add_option("--generated", args->generated,
                  "also replay N generated programs (training, inference, huge allocations among "
                  "small ones, several streams; docs/replay.md)")
      ->check(whole_number(0, 1'000'000, "programs"));
  cmd->add_option("--first-seed", args->first_seed, "the first generated program's seed (default 0)")
      ->check(whole_number(0, std::numeric_limits<std::int64_t>::max() - 1'000'000, "(a seed)"));
  cmd->add_flag("--vs-native", args->vs_native,
                "also replay each under the native policy and report how far each config's "
                "reserved memory went above it at the same call");
  cmd->add_flag("--reuse-addresses", args->reuse_addresses,
                "the simulated device gives a new segment the lowest freed range it fits, as a real "
                "driver can (default: always above the last)");
  cmd->add_option("--config,-c", args->configs,
                  "allocator config in PYTORCH_CUDA_ALLOC_CONF syntax (repeatable; '' = defaults; "
                  "none named: '' and policy:native_paged)");
  add_size_option(*cmd, "--capacity", args->capacity, "device capacity, e.g. 24GiB (default: unlimited)");
  cmd->add_option("--memory-fraction", args->fraction,
                  "set_per_process_memory_fraction before replaying (enables garbage collection)")
      ->check(fraction(true));
  cmd->add_flag("--json", args->json, "print results as JSON (keys: docs/replay.md)");
  cmd->add_flag("--wide", args->wide,
                "one wide line per replay with every figure (peaks, device allocs and frees, retries)");
  add_device_option(*cmd, args->device);
  cmd->add_flag("--validate", args->validate, "check allocator invariants after every operation");
  cmd->add_flag("--min-capacity", args->min_capacity,
                "also find the smallest device capacity (2 MiB steps) with no out-of-memory error");
  set_examples(*cmd, {
      {"reservoir replay run.pickle -c '' -c expandable_segments:True -c policy:paging",
       "what each setting reserves for the same requests"},
      {"reservoir replay run.pickle --capacity 24GiB",
       "would it run on 24 GiB? (exit 4 when a replay runs out of memory)"},
      {"reservoir replay run.pickle --min-capacity --json",
       "the smallest device it fits, per setting, as JSON"},
      {"reservoir replay --generated 200 -c policy:paging,paging_slack_mb:2 --vs-native",
       "how far paging goes above native on 200 generated programs"},
  });
  cmd->callback([args] {
    if (args->traces.empty() && args->generated == 0) {
      throw CLI::ValidationError("replay", "name a trace, or --generated N");
    }
    run(*args);
  });
}

}  // namespace reservoir::tools
