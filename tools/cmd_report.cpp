// reservoir report TRACE... [--config C]... [--capacity SIZE] [--min-capacity] -o report.html
//
// One self-contained HTML file (inline CSS and SVG, no scripts, nothing
// fetched): per trace and config, memory over time, the segment map when
// reserved memory peaked, the largest allocations alive then with their
// context, and a summary table. The plots are SVG written here because they
// are simple step lines and rectangles: a charting library would have to be
// inlined into every report, while the browser draws SVG natively.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "commands.hpp"
#include "progress.hpp"
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
  std::size_t top = 25;
};

constexpr std::size_t kBuckets = 600;
const char* const kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2",
                                "#edc948", "#ff9da7", "#9c755f", "#e15759", "#86bcb6"};

std::string esc(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// Allocated and reserved bytes after every op (the allocator's own
// counters), kept as per-bucket maxima.
class Timeline : public ReplayObserver {
 public:
  void on_start(CachingAllocator& allocator, const ReplayProgram& program) override {
    allocator_ = &allocator;
    total_ = std::max<std::uint64_t>(1, program.initial.size() + program.ops.size());
    allocated_.assign(kBuckets, 0);
    reserved_.assign(kBuckets, 0);
  }
  void on_op(std::uint64_t index, const ReplayOp&, const void*) override {
    const DeviceStats s = allocator_->stats();
    const std::size_t b = static_cast<std::size_t>(index * kBuckets / total_);
    allocated_[b] = std::max(allocated_[b], static_cast<std::uint64_t>(s.allocated_bytes[0].current));
    reserved_[b] = std::max(reserved_[b], static_cast<std::uint64_t>(s.reserved_bytes[0].current));
  }
  std::uint64_t total_ = 1;
  std::vector<std::uint64_t> allocated_;
  std::vector<std::uint64_t> reserved_;

 private:
  const CachingAllocator* allocator_ = nullptr;
};

// The allocator's segments at one op, with each live block's request id.
class PeakCapture : public ReplayObserver {
 public:
  explicit PeakCapture(std::uint64_t at) : at_(at) {}
  void on_start(CachingAllocator& allocator, const ReplayProgram& program) override {
    allocator_ = &allocator;
    ptrs_.assign(program.id_count, 0);
  }
  void on_op(std::uint64_t index, const ReplayOp& op, const void* ptr) override {
    if (op.kind == ReplayOp::Kind::alloc && ptr != nullptr) {
      ptrs_[op.id] = reinterpret_cast<DevicePtr>(ptr);
    } else if (op.kind == ReplayOp::Kind::free) {
      ptrs_[op.id] = 0;
    }
    if (index == at_) {
      snapshot_ = allocator_->snapshot();
      for (std::uint32_t id = 0; id < ptrs_.size(); ++id) {
        if (ptrs_[id] != 0) id_at_[ptrs_[id]] = id;
      }
    }
  }
  Snapshot snapshot_;
  std::unordered_map<DevicePtr, std::uint32_t> id_at_;

 private:
  std::uint64_t at_;
  CachingAllocator* allocator_ = nullptr;
  std::vector<DevicePtr> ptrs_;
};

struct Run {
  std::string config;
  ReplayResult result;
  std::optional<std::uint64_t> min_capacity;
  Timeline timeline;
  Snapshot peak;
  std::unordered_map<DevicePtr, std::uint32_t> peak_ids;
};

std::string axis_size(double bytes) {
  return format_size(static_cast<std::uint64_t>(std::llround(bytes)));
}

// A step plot of one or more series over the op index.
std::string plot(const std::vector<std::pair<std::string, const std::vector<std::uint64_t>*>>& series,
                 const std::vector<std::string>& colors, std::uint64_t ops, bool fill_first,
                 const std::string& id) {
  constexpr double W = 900, H = 260, L = 80, R = 20, T = 16, B = 36;
  std::uint64_t top = 1;
  for (const auto& [name, s] : series) top = std::max(top, *std::max_element(s->begin(), s->end()));
  const double ymax = static_cast<double>(top) * 1.05;
  auto x = [&](std::size_t i) { return L + (W - L - R) * static_cast<double>(i) / kBuckets; };
  auto y = [&](double v) { return T + (H - T - B) * (1.0 - v / ymax); };
  std::string out = fmt::format(
      "<svg class=\"plot\" id=\"{}\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" "
      "role=\"img\">\n",
      id, W, H, W, H);
  for (int k = 0; k <= 4; ++k) {
    const double v = ymax * k / 4;
    out += fmt::format(
        "<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" class=\"grid\"/>"
        "<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}</text>\n",
        L, W - R, y(v), y(v), L - 6, y(v) + 4, esc(axis_size(v)));
  }
  for (int k = 0; k <= 4; ++k) {
    const double px = L + (W - L - R) * k / 4;
    out += fmt::format("<text x=\"{:.1f}\" y=\"{}\" class=\"tick\" text-anchor=\"middle\">{}</text>\n",
                       px, H - B + 16, static_cast<std::uint64_t>(ops * k / 4));
  }
  out += fmt::format(
      "<text x=\"{}\" y=\"{}\" class=\"tick\" text-anchor=\"middle\">allocator calls</text>\n",
      (L + W - R) / 2, H - 4);
  for (std::size_t si = 0; si < series.size(); ++si) {
    const auto& s = *series[si].second;
    std::string points;
    for (std::size_t i = 0; i < s.size(); ++i) {
      const double v = static_cast<double>(s[i]);
      points += fmt::format("{:.1f},{:.1f} {:.1f},{:.1f} ", x(i), y(v), x(i + 1), y(v));
    }
    const std::string& color = colors[si % colors.size()];
    if (si == 0 && fill_first) {
      out += fmt::format(
          "<polygon class=\"area\" points=\"{:.1f},{:.1f} {}{:.1f},{:.1f}\" fill=\"{}\" "
          "fill-opacity=\"0.25\" stroke=\"none\"/>\n",
          x(0), y(0), points, x(kBuckets), y(0), color);
    }
    out += fmt::format(
        "<polyline class=\"series\" data-series=\"{}\" points=\"{}\" fill=\"none\" stroke=\"{}\" "
        "stroke-width=\"1.6\"><title>{}</title></polyline>\n",
        esc(series[si].first), points, color, esc(series[si].first));
  }
  out += "</svg>\n<div class=\"legend\">";
  for (std::size_t si = 0; si < series.size(); ++si) {
    const auto& s = *series[si].second;
    out += fmt::format("<span><i style=\"background:{}\"></i>{} (peak {})</span>",
                       colors[si % colors.size()], esc(series[si].first),
                       esc(format_size(*std::max_element(s.begin(), s.end()))));
  }
  out += "</div>\n";
  return out;
}

std::string color_for(const std::string& label) {
  return kPalette[std::hash<std::string>{}(label) % std::size(kPalette)];
}

// The context label of a block alive at the peak.
std::string block_label(const Trace& trace, const ReplayProgram& program, const Run& run,
                        DevicePtr address) {
  auto it = run.peak_ids.find(address);
  if (it == run.peak_ids.end() || it->second >= program.contexts.size()) return "(no context)";
  return context_label(trace, program.contexts[it->second]);
}

std::string segment_map(const Trace& trace, const ReplayProgram& program, const Run& run,
                        const std::string& id) {
  const auto& segs = run.peak.segments;
  if (segs.empty()) return "<p>No segments.</p>\n";
  std::vector<const SegmentInfo*> shown;
  for (const SegmentInfo& s : segs) shown.push_back(&s);
  constexpr std::size_t kMaxRows = 200;
  std::size_t hidden = 0;
  if (shown.size() > kMaxRows) {
    std::stable_sort(shown.begin(), shown.end(), [](auto* a, auto* b) {
      return a->total_size > b->total_size;
    });
    hidden = shown.size() - kMaxRows;
    shown.resize(kMaxRows);
    std::sort(shown.begin(), shown.end(), [](auto* a, auto* b) { return a->address < b->address; });
  }
  // Consecutive segments laid out alike (same block sizes, states and
  // contexts) share one row, marked with their count.
  auto signature = [&](const SegmentInfo* s) {
    std::string sig = fmt::format("{}|", s->is_large);
    for (const BlockInfo& b : s->blocks) {
      sig += fmt::format("{}:{}:{};", b.size, static_cast<int>(b.state),
                         b.state == BlockState::active_allocated
                             ? block_label(trace, program, run, b.address)
                             : "");
    }
    return sig;
  };
  std::vector<std::pair<const SegmentInfo*, std::size_t>> rows;
  std::string last;
  for (const SegmentInfo* s : shown) {
    std::string sig = signature(s);
    if (!rows.empty() && sig == last) {
      ++rows.back().second;
    } else {
      rows.emplace_back(s, 1);
      last = std::move(sig);
    }
  }
  std::size_t largest = 1;
  for (const SegmentInfo* s : shown) largest = std::max(largest, s->total_size);
  constexpr double W = 900, L = 150, row = 12, gap = 3;
  const double H = static_cast<double>(rows.size()) * (row + gap) + 4;
  std::string out = fmt::format(
      "<svg class=\"segmap\" id=\"{}\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\">\n", id, W,
      H, W, H);
  double yy = 2;
  for (const auto& [s, count] : rows) {
    const double scale = (W - L - 4) / static_cast<double>(largest);
    out += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}{}{}</text>\n", L - 6,
        yy + row - 2, esc(format_size(s->total_size)), s->is_large ? "" : " small",
        count > 1 ? fmt::format(" \u00d7{}", count) : "");
    double xx = L;
    for (const BlockInfo& b : s->blocks) {
      const double w = std::max(0.5, static_cast<double>(b.size) * scale);
      std::string fill = "#d9d9d9";
      std::string label = "cached (free)";
      if (b.state == BlockState::active_pending_free) {
        fill = "#f1a340";
        label = "freed, waiting for stream events";
      } else if (b.state == BlockState::active_allocated) {
        label = block_label(trace, program, run, b.address);
        fill = color_for(label);
      }
      out += fmt::format(
          "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" fill=\"{}\" "
          "class=\"block {}\"><title>{} at {:#x}: {} (requested {}){}</title></rect>\n",
          xx, yy, w, row, fill, to_string(b.state), esc(label), b.address,
          esc(format_size(b.size)), esc(format_size(b.requested_size)),
          count > 1 ? fmt::format("; this row stands for {} segments", count) : "");
      xx += static_cast<double>(b.size) * scale;
    }
    yy += row + gap;
  }
  out += "</svg>\n";
  if (hidden > 0) {
    out += fmt::format("<p class=\"note\">The {} largest of {} segments are shown.</p>\n",
                       shown.size(), segs.size());
  }
  return out;
}

std::string frames_html(const Context& c) {
  std::string out;
  if (!c.annotations.empty()) {
    out += fmt::format("<div class=\"ann\">{}</div>", esc(fmt::format("{}", fmt::join(c.annotations, " / "))));
  }
  if (c.frames.empty()) return out;
  const Frame* telling = telling_frame(c);
  out += fmt::format("<details><summary>{}:{} {}</summary><ol>", esc(base_name(telling->filename)),
                     telling->line, esc(telling->name));
  for (const Frame& f : c.frames) {
    out += fmt::format("<li>{}:{} {}</li>", esc(f.filename), f.line, esc(f.name));
  }
  out += "</ol></details>";
  return out;
}

std::string largest_table(const Trace& trace, const ReplayProgram& program, const Run& run,
                          std::size_t top) {
  struct Live {
    const BlockInfo* block;
    StreamId stream;
  };
  std::vector<Live> live;
  for (const SegmentInfo& s : run.peak.segments) {
    for (const BlockInfo& b : s.blocks) {
      if (b.state == BlockState::active_allocated) live.push_back({&b, s.stream});
    }
  }
  std::stable_sort(live.begin(), live.end(),
                   [](const Live& a, const Live& b) { return a.block->size > b.block->size; });
  std::unordered_set<std::uint32_t> initial;
  for (const ReplayOp& op : program.initial) initial.insert(op.id);
  std::string out =
      "<table class=\"largest\"><tr><th>#</th><th>size</th><th>requested</th><th>address</th>"
      "<th>stream</th><th>where</th></tr>\n";
  for (std::size_t i = 0; i < live.size() && i < top; ++i) {
    const BlockInfo& b = *live[i].block;
    auto it = run.peak_ids.find(b.address);
    const std::uint32_t ctx = it != run.peak_ids.end() && it->second < program.contexts.size()
                                  ? program.contexts[it->second]
                                  : 0;
    const bool before = it != run.peak_ids.end() && initial.count(it->second) != 0;
    const std::string where =
        ctx != 0 ? frames_html(trace.context(ctx))
                 : fmt::format("<span class=\"none\">({})</span>",
                               before ? "allocated before recording began; no context"
                                      : "no context recorded");
    out += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td><code>{:#x}</code></td><td>{}</td><td>{}</td>"
        "</tr>\n",
        i + 1, esc(format_size(b.size)), esc(format_size(b.requested_size)), b.address,
        live[i].stream, where);
  }
  out += "</table>\n";
  if (live.size() > top) {
    out += fmt::format("<p class=\"note\">{} of {} live allocations shown.</p>\n", top, live.size());
  }
  return out;
}

constexpr const char* kStyle = R"(
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1000px;padding:0 12px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:36px;border-bottom:1px solid #ccc}h3{font-size:15px;margin-top:24px}
table{border-collapse:collapse;margin:8px 0;font-size:12px}.wide{overflow-x:auto}td,th{border:1px solid #ddd;padding:3px 6px;text-align:right;vertical-align:top}
th{background:#f4f4f4}td:last-child{text-align:left}table.summary td:first-child,table.summary td:nth-child(2){text-align:left}
.grid{stroke:#e5e5e5}.tick{font-size:11px;fill:#555}.legend span{margin-right:16px;font-size:12px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
.note{color:#666;font-size:12px}.ann{color:#7a4;font-weight:600}.none{color:#999}
details summary{cursor:pointer}details ol{margin:4px 0;padding-left:20px;font-size:12px;text-align:left}
code{font-size:12px}.oom{color:#c00;font-weight:600}
)";

void run(const ReportArgs& args) {
  ReplayOptions options;
  if (!args.capacity.empty()) options.capacity = parse_size(args.capacity);
  std::vector<std::string> configs = args.configs;
  if (configs.empty()) configs.emplace_back("");
  for (const std::string& c : configs) (void)AllocatorConfig::parse(c);  // fail before replaying
  Progress progress;
  std::string summary;
  std::string body;
  std::size_t task = 0;
  const std::size_t tasks = args.traces.size() * configs.size();
  std::size_t plot_id = 0;
  for (const std::string& path : args.traces) {
    progress.task(fmt::format("reading {}", path));
    const Trace trace = read_trace_file(path);
    const ReplayProgram program = compile(trace);
    std::vector<std::unique_ptr<Run>> runs;
    for (const std::string& config_text : configs) {
      const AllocatorConfig config = AllocatorConfig::parse(config_text);
      progress.task(fmt::format("[{}/{}] {} [{}]", ++task, tasks, base_name(path),
                                config_label(config_text)));
      auto r = std::make_unique<Run>();
      r->config = config_text;
      ReplayOptions o = options;
      o.observer = &r->timeline;
      r->result = replay(program, config, config_text, o);
      PeakCapture capture(r->result.peak_reserved_op);
      o.observer = &capture;
      (void)replay(program, config, config_text, o);
      r->peak = std::move(capture.snapshot_);
      r->peak_ids = std::move(capture.id_at_);
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
          esc(base_name(path)), esc(config_label(r->config)), esc(format_size(x.peak_requested_bytes)),
          esc(format_size(x.peak_allocated_bytes)), esc(format_size(x.peak_reserved_bytes)),
          x.peak_allocated_bytes ? static_cast<double>(x.peak_reserved_bytes) / x.peak_allocated_bytes
                                 : 0.0,
          args.min_capacity ? fmt::format("<td>{}</td>", esc(format_size(*r->min_capacity))) : "",
          x.device_allocs + x.device_frees,
          x.allocations ? 1000.0 * x.device_calls / x.allocations : 0.0, x.num_alloc_retries,
          x.num_ooms ? " class=\"oom\"" : "", x.num_ooms);
    }
    // Sections.
    body += fmt::format("<h2>{}</h2>\n<p>{} ({}), {} recorded events, {} allocator calls per replay{}.</p>\n",
                        esc(base_name(path)), esc(path), esc(trace.format), trace.events.size(),
                        runs.front()->result.ops,
                        trace.recorded_config.empty()
                            ? ""
                            : fmt::format("; recorded with <code>{}</code>", esc(trace.recorded_config)));
    if (runs.size() > 1) {
      std::vector<std::pair<std::string, const std::vector<std::uint64_t>*>> series;
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
  }
  progress.clear();
  char when[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width\">\n<title>reservoir report</title>\n"
      "<style>{}</style></head><body>\n<h1>reservoir report</h1>\n<p class=\"note\">{} trace(s) "
      "replayed on a simulated device{} under {} config(s), {}.</p>\n"
      "<h2>Summary</h2>\n<div class=\"wide\"><table class=\"summary\"><tr><th>trace</th><th>config</th>"
      "<th>peak requested</th><th>peak allocated</th><th>peak reserved</th><th>reserved / "
      "allocated</th>{}<th>segment allocs + frees</th><th>device calls / 1k allocs</th>"
      "<th>retries</th><th>OOMs</th></tr>\n{}</table></div>\n{}</body></html>\n",
      kStyle, args.traces.size(),
      args.capacity.empty() ? "" : fmt::format(" of {}", esc(args.capacity)), configs.size(), when,
      args.min_capacity ? "<th>min capacity</th>" : "", summary, body);
  std::ofstream out(args.output, std::ios::binary);
  if (!out) throw UsageError(fmt::format("report: cannot write '{}'", args.output));
  out << html;
  out.close();
  if (!out) throw UsageError(fmt::format("report: writing '{}' failed", args.output));
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
  cmd->add_option("--config,-c", args->configs, "allocator config (repeatable; '' = defaults)");
  cmd->add_option("--capacity", args->capacity, "device capacity, e.g. 24GiB (default: unlimited)");
  cmd->add_flag("--min-capacity", args->min_capacity, "also find each config's minimum capacity");
  cmd->add_option("--top", args->top, "largest allocations listed (default 25)");
  cmd->add_option("-o,--output", args->output, "HTML file to write (default report.html)");
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
