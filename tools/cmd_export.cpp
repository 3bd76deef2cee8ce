// reservoir export TRACE -o OUT [--format pickle|json|text] [-c CONFIG] [--capacity SIZE]
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>

#include "commands.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {

struct ExportArgs {
  std::string trace;
  std::string output;
  std::string format = "auto";
  std::optional<std::string> config;
  std::string capacity;
  std::optional<int> device;
};

// The format to write: --format's, else the one whose file endings the output has.
const TraceFormatInfo& format_for(const ExportArgs& a) {
  if (a.format != "auto") return *exported_format(a.format);  // CLI11 checked the name
  std::vector<std::string_view> endings;
  for (const TraceFormatInfo& f : trace_formats()) {
    if (f.write == nullptr) continue;
    for (std::string_view e : f.extensions) {
      if (a.output.ends_with(e)) return f;
      endings.push_back(e);
    }
  }
  throw UsageError(fmt::format(
      "export: cannot tell the format of '{}' from its extension ({}); give --format", a.output,
      fmt::join(endings, ", ")));
}

void run(const ExportArgs& args) {
  const TraceFormatInfo& format = format_for(args);
  std::vector<Trace> devices = load_devices(args.trace, args.device);
  if (devices.size() > 1) {
    std::vector<int> ids;
    ids.reserve(devices.size());
    for (const Trace& t : devices) ids.push_back(t.device);
    throw UsageError(fmt::format("export: {} holds events of devices {}; a snapshot is written "
                                 "for one: give --device",
                                 args.trace, fmt::join(ids, ", ")));
  }
  Trace trace = std::move(devices.front());
  if (args.config) {
    // The trace as this config would have served it.
    Recorder recorder(trace);
    ReplayOptions options;
    if (!args.capacity.empty()) options.capacity = parse_size(args.capacity);
    const ReplayResult r = recorder.run(*args.config, options);
    trace = recorder.trace(trace.name, *args.config);
    if (r.num_ooms > 0) {
      fmt::print(stderr, "reservoir export: {} out-of-memory errors in the replay; the first, at {}\n",
                 r.num_ooms, r.first_oom);
    }
  }
  const std::string out = format.write(trace);
  write_file(args.output, out, "export");
  fmt::print("{}: {} events, {} segments, written as {} ({})\n", args.output, trace.events.size(),
             trace.final_state.segments.size(), format.export_name, format_size(out.size()));
}

}  // namespace

void add_export(CLI::App& app) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "export",
      "Convert a trace (pickle, JSON, RMM CSV, text) to a PyTorch snapshot pickle for memory_viz, "
      "JSON or text; with --config, the snapshot of its replay under that config");
  cmd->add_option("trace", args->trace, "trace to read")->required()->check(CLI::ExistingFile);
  cmd->add_option("-o,--output", args->output, "file to write")->required()->check(output_path());
  std::vector<std::string> formats{"auto"};
  for (const TraceFormatInfo& f : trace_formats()) {
    if (f.write != nullptr) formats.emplace_back(f.export_name);
  }
  cmd->add_option("--format", args->format,
                  fmt::format("{} (default: by extension)",
                              fmt::join(formats.begin() + 1, formats.end(), ", ")))
      ->check(CLI::IsMember(formats));
  cmd->add_option("--config,-c", args->config, "replay under this allocator config first");
  add_device_option(*cmd, args->device);
  add_size_option(*cmd, "--capacity", args->capacity, "device capacity for the replay, e.g. 24GiB");
  set_examples(*cmd, {
      {"reservoir export run.trace -o run.pickle",
       "a PyTorch snapshot for pytorch.org/memory_viz"},
      {"reservoir export run.pickle -c expandable_segments:True -o expandable.pickle",
       "the snapshot of its replay under another setting"},
      {"reservoir export run.pickle -c '' --capacity 16GiB -o at16.pickle",
       "what PyTorch would have done on a 16 GiB device, out-of-memory errors included"},
  });
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
