// reservoir report TRACE... [--config C]... [--capacity SIZE] [--min-capacity] -o report.html
//
// One self-contained HTML file (inline CSS and SVG, no scripts, nothing
// fetched): per trace and config, memory over time, the segment map when
// reserved memory peaked, the largest allocations alive then with their
// context, a summary table, and each trace's advice (as `reservoir advise`). The plots are SVG written here because they
// are simple step lines and rectangles: a charting library would have to be
// inlined into every report, while the browser draws SVG natively.
#include <fmt/format.h>

#include <algorithm>
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

struct ReportArgs {
  std::vector<std::string> traces;
  std::vector<std::string> configs;
  std::string capacity;
  std::string output = "report.html";
  bool min_capacity = false;
  bool advice = true;
  std::size_t top = 25;
  std::optional<int> device;
};

void run(const ReportArgs& args) {
  ReplayOptions options;
  if (!args.capacity.empty()) options.capacity = parse_size(args.capacity);
  std::vector<std::string> configs = args.configs;
  if (configs.empty()) configs = default_configs();
  for (const std::string& c : configs) (void)AllocatorConfig::parse(c);  // fail before replaying
  Progress progress;
  std::string summary;
  std::string body;
  std::size_t task = 0;
  const std::size_t tasks = args.traces.size() * configs.size();
  std::size_t plot_id = 0;
  for (const std::string& path : args.traces) {
    progress.task(fmt::format("reading {}", path));
    for (const Trace& trace : load_devices(path, args.device)) {
    const std::string& label = trace.name;
    const ReplayProgram program = compile(trace);
    std::vector<std::unique_ptr<Run>> runs;
    for (const std::string& config_text : configs) {
      const AllocatorConfig config = AllocatorConfig::parse(config_text);
      progress.task(fmt::format("[{}/{}] {} [{}]", ++task, tasks, base_name(label),
                                config_label(config_text)));
      auto r = std::make_unique<Run>();
      r->config = config_text;
      ReplayOptions o = options;
      o.observer = &r->timeline;
      r->result = replay(program, config, config_text, o);
      ReplayStateCapture capture(r->result.peak_reserved_op + 1);  // after the peak's op
      o.observer = &capture;
      (void)replay(program, config, config_text, o);
      r->peak = std::move(capture.snapshot);
      r->peak_ids = std::move(capture.id_at);
      if (args.min_capacity) {
        o.observer = &progress;
        r->min_capacity = min_capacity(program, config, config_text, o).bytes;
      }
      runs.push_back(std::move(r));
    }
    // Summary rows.
    for (const auto& r : runs) {
      const ReplayResult& x = r->result;
      summary += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.3f}</td>{}<td>{}</td>"
          "<td>{:.1f}</td><td>{}</td><td{}>{}</td></tr>\n",
          esc(base_name(label)), esc(config_label(r->config)), esc(format_size(x.peak_requested_bytes)),
          esc(format_size(x.peak_allocated_bytes)), esc(format_size(x.peak_reserved_bytes)),
          x.peak_allocated_bytes ? static_cast<double>(x.peak_reserved_bytes) /
                                       static_cast<double>(x.peak_allocated_bytes)
                                 : 0.0,
          args.min_capacity ? fmt::format("<td>{}</td>", esc(format_size(*r->min_capacity))) : "",
          x.device_allocs + x.device_frees,
          x.allocations ? 1000.0 * static_cast<double>(x.device_calls) / static_cast<double>(x.allocations)
                        : 0.0,
          x.num_alloc_retries,
          x.num_ooms ? " class=\"oom\"" : "", x.num_ooms);
    }
    // Sections.
    body += fmt::format("<h2>{}</h2>\n<p>{} ({}), {} recorded events, {} allocator calls per replay{}.</p>\n",
                        esc(base_name(label)), esc(label), esc(trace.format), trace.events.size(),
                        runs.front()->result.ops,
                        trace.recorded_config.empty()
                            ? ""
                            : fmt::format("; recorded with <code>{}</code>", esc(trace.recorded_config)));
    if (runs.size() > 1) {
      std::vector<std::pair<std::string, const std::vector<std::uint64_t>*>> series;
      series.reserve(runs.size());
      for (const auto& r : runs) series.emplace_back(config_label(r->config), &r->timeline.reserved_);
      body += "<h3>Reserved memory, every config</h3>\n";
      body += plot(series, {std::begin(kPalette), std::end(kPalette)}, runs.front()->result.ops,
                   false, fmt::format("plot{}", plot_id++));
    }
    for (const auto& r : runs) {
      const ReplayResult& x = r->result;
      body += fmt::format("<h3>{}</h3>\n", esc(config_label(r->config)));
      if (x.num_ooms > 0) {
        body += fmt::format("<p class=\"oom\">{} out-of-memory errors; the first, at {}</p>\n",
                            x.num_ooms, esc(x.first_oom));
      }
      body += plot({{"reserved", &r->timeline.reserved_}, {"allocated", &r->timeline.allocated_}},
                   {"#4e79a7", "#e15759"}, x.ops, true, fmt::format("plot{}", plot_id++));
      body += fmt::format(
          "<h4>Segments when reserved memory peaked ({} at call {})</h4>\n<p class=\"note\">One row "
          "per segment, blocks to scale within the largest; allocated blocks are colored by where "
          "they were allocated, grey is cached free memory. Hover for details.</p>\n",
          esc(format_size(x.peak_reserved_bytes)), x.peak_reserved_op);
      body += segment_map(trace, program, *r, fmt::format("segmap{}", plot_id++));
      body += "<h4>Largest allocations alive at that moment</h4>\n";
      body += largest_table(trace, program, *r, args.top);
    }
    if (args.advice) {
      AdviseOptions advise_options;
      advise_options.capacity = options.capacity;
      advise_options.progress = [&](std::size_t done, std::size_t total) {
        progress.task(fmt::format("{}: advice, {}/{} settings swept", base_name(label), done, total));
      };
      body += advice_html(trace, advise(trace, advise_options), fmt::format("advice{}", plot_id++));
    }
    }
  }
  progress.clear();
  const std::string html = html_page(
      "reservoir report",
      fmt::format(
          "<p class=\"note\">{} trace(s) replayed on a simulated device{} under {} config(s), "
          "{}.</p>\n<h2>Summary</h2>\n<div class=\"wide\"><table class=\"summary\"><tr><th>trace</th>"
          "<th>config</th><th>peak requested</th><th>peak allocated</th><th>peak reserved</th>"
          "<th>reserved / allocated</th>{}<th>segment allocs + frees</th><th>device calls / 1k "
          "allocs</th><th>retries</th><th>OOMs</th></tr>\n{}</table></div>\n{}",
          args.traces.size(), args.capacity.empty() ? "" : fmt::format(" of {}", esc(args.capacity)),
          configs.size(), utc_now(), args.min_capacity ? "<th>min capacity</th>" : "", summary,
          body));
  write_file(args.output, html, "report");
  fmt::print("{}: {} for {} trace(s) x {} config(s)\n", args.output, format_size(html.size()),
             args.traces.size(), configs.size());
}

}  // namespace

void add_report(CLI::App& app) {
  auto args = std::make_shared<ReportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "report", "Write one self-contained HTML report: memory over time, the segment map at the "
                "peak, the largest allocations and a summary, per trace and config");
  cmd->add_option("traces", args->traces, "traces (pickle, JSON, RMM CSV, text)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--config,-c", args->configs,
                  "allocator config (repeatable; '' = defaults; none named: '' and policy:native_paged)");
  add_size_option(*cmd, "--capacity", args->capacity, "device capacity, e.g. 24GiB (default: unlimited)");
  cmd->add_flag("--min-capacity", args->min_capacity, "also find each config's minimum capacity");
  cmd->add_flag("!--no-advice", args->advice,
                "leave out each trace's advice (diagnosis and sweep of settings, as `advise`)");
  cmd->add_option("--top", args->top, "largest allocations listed (default 25)")
      ->check(whole_number(1, 100'000, "rows"));
  add_device_option(*cmd, args->device);
  cmd->add_option("-o,--output", args->output, "HTML file to write (default report.html)")
      ->check(output_path());
  set_examples(*cmd, {
      {"reservoir report run.pickle -o report.html",
       "one page: memory over time, the segments at the peak, the largest allocations"},
      {"reservoir report run.pickle -c '' -c policy:paging --min-capacity",
       "the same beside reservoir's paging policy"},
  });
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
