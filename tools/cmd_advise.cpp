// reservoir advise TRACE... [--capacity SIZE] [--config C]... [--json] [-o advice.html]
#include <fmt/format.h>

#include <memory>

#include "advice_view.hpp"
#include "commands.hpp"
#include "progress.hpp"
#include "report_html.hpp"
#include "reservoir/advise.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {

struct AdviseArgs {
  std::vector<std::string> traces;
  std::vector<std::string> configs;
  std::string capacity;
  std::string output;
  bool json = false;
  unsigned threads = 0;
  std::optional<int> device;
};

void run(const AdviseArgs& args) {
  AdviseOptions options;
  if (!args.capacity.empty()) options.capacity = parse_size(args.capacity);
  options.configs = args.configs;
  options.threads = args.threads;
  for (const std::string& c : args.configs) (void)AllocatorConfig::parse(c);  // fail before replaying
  Progress progress;
  std::string label;
  options.progress = [&](std::size_t done, std::size_t total) {
    progress.task(fmt::format("{}: {}/{} settings swept", label, done, total));
  };
  nlohmann::json all = nlohmann::json::array();
  std::string text;
  std::string sections;
  std::size_t section = 0;
  for (const std::string& path : args.traces) {
    label = base_name(path);
    progress.task(fmt::format("{}: reading and diagnosing", label));
    // A snapshot of several devices: each device's recording is advised on.
    for (const Trace& trace : load_devices(path, args.device)) {
      const Advice advice = advise(trace, options);
      all.push_back(advice_json(trace, advice));
      if (!text.empty()) text += "\n";
      text += advice_text(trace, advice);
      if (args.output.empty()) continue;
      sections += fmt::format("<h2>{}</h2>\n<p class=\"note\">{} ({}), {} recorded events{}.</p>\n",
                              esc(base_name(trace.name)), esc(trace.name), esc(trace.format),
                              trace.events.size(),
                              trace.recorded_config.empty()
                                  ? ""
                                  : fmt::format("; recorded with <code>{}</code>",
                                                esc(trace.recorded_config)));
      sections += advice_html(trace, advice, fmt::format("advice{}", section++));
    }
  }
  progress.clear();
  if (!args.output.empty()) {
    const std::string html = html_page(
        "reservoir advise",
        fmt::format("<p class=\"note\">{} trace(s), each replayed on a simulated device under "
                    "every setting swept, {}.</p>\n{}",
                    args.traces.size(), utc_now(), sections));
    write_file(args.output, html, "advise");
  }
  if (args.json) {
    fmt::print("{}\n", (all.size() == 1 ? all.front() : all).dump(2));
  } else {
    fmt::print("{}", text);
    if (!args.output.empty()) fmt::print("\n{}: written\n", args.output);
  }
}

}  // namespace

void add_advise(CLI::App& app) {
  auto args = std::make_shared<AdviseArgs>();
  CLI::App* cmd = app.add_subcommand(
      "advise", "Why a recording ran out of memory (or where it peaked), and which allocator "
                "setting makes it fit: every setting replayed to its minimum capacity");
  cmd->add_option("traces", args->traces, "PyTorch snapshots (or any trace replay reads)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--capacity", args->capacity,
                  "memory the allocator may have, e.g. 80GiB (default: what the recording's "
                  "out-of-memory event shows it had)");
  cmd->add_option("--config,-c", args->configs,
                  "sweep these settings instead of the default list (repeatable; '' = defaults)");
  cmd->add_flag("--json", args->json, "print the advice as JSON (keys: docs/tools.md)");
  cmd->add_option("-o,--output", args->output, "also write the advice as an HTML page");
  cmd->add_option("--threads", args->threads, "replays run in parallel (default: every core)");
  add_device_option(*cmd, args->device);
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
