// reservoir summary TRACE [--config C] [--abbreviated]
#include <fmt/format.h>

#include <memory>

#include "commands.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {

struct SummaryArgs {
  std::string trace;
  std::optional<std::string> config;
  bool abbreviated = false;
  std::optional<int> device;
};

void run(const SummaryArgs& args) {
  bool first = true;
  for (const Trace& trace : load_devices(args.trace, args.device)) {
    const std::string config = args.config.value_or(trace.recorded_config);
    Recorder recorder(trace, args.abbreviated);
    const ReplayResult r = recorder.run(config);
    fmt::print("{}{}: {} recorded events replayed with {}\n", first ? "" : "\n", trace.name,
               trace.events.size(), config.empty() ? "the native defaults" : "'" + config + "'");
    if (r.num_ooms > 0) {
      fmt::print("{} out-of-memory errors; the first, at {}\n", r.num_ooms, r.first_oom);
    }
    fmt::print("{}", recorder.summary());
    first = false;
  }
}

}  // namespace

void add_summary(CLI::App& app) {
  auto args = std::make_shared<SummaryArgs>();
  CLI::App* cmd = app.add_subcommand(
      "summary",
      "Print torch.cuda.memory_summary() for a trace: its requests replayed with the settings it "
      "was recorded with (or --config), the table as the allocator stands at the end");
  cmd->add_option("trace", args->trace, "trace to summarize")->required()->check(CLI::ExistingFile);
  cmd->add_option("--config,-c", args->config, "allocator config (default: the recorded one)");
  cmd->add_flag("--abbreviated", args->abbreviated, "the short table (all pools only)");
  add_device_option(*cmd, args->device);
  set_examples(*cmd, {
      {"reservoir summary run.pickle",
       "torch.cuda.memory_summary() as it stood at the end of the recording"},
      {"reservoir summary run.pickle -c max_split_size_mb:128 --abbreviated",
       "the same under another setting, all pools only"},
  });
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
