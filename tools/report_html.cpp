#include "report_html.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <ctime>
#include <unordered_set>

#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {

std::string axis_size(double bytes) {
  return format_size(static_cast<std::uint64_t>(std::llround(bytes)));
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

}  // namespace

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

std::string segment_map(const Trace& trace, const ReplayProgram& program, const Run& run,
                        const std::string& id) {
  const auto& segs = run.peak.segments;
  if (segs.empty()) return "<p>No segments.</p>\n";
  std::vector<const SegmentInfo*> shown;
  shown.reserve(segs.size());
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
  const double height = static_cast<double>(rows.size()) * (row + gap) + 4;
  std::string out = fmt::format(
      "<svg class=\"segmap\" id=\"{}\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\">\n", id, W,
      height, W, height);
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

std::string html_page(const std::string& title, const std::string& body) {
  return fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
      "<meta name=\"viewport\" content=\"width=device-width\">\n<title>{}</title>\n"
      "<style>{}</style></head><body>\n<h1>{}</h1>\n{}</body></html>\n",
      esc(title), kStyle, esc(title), body);
}

std::string utc_now() {
  char when[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  return when;
}

const char* const kStyle = R"(
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1000px;padding:0 12px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:36px;border-bottom:1px solid #ccc}h3{font-size:15px;margin-top:24px}
table{border-collapse:collapse;margin:8px 0;font-size:12px}.wide{overflow-x:auto}td,th{border:1px solid #ddd;padding:3px 6px;text-align:right;vertical-align:top}
th{background:#f4f4f4}td:last-child{text-align:left}table.summary td:first-child,table.summary td:nth-child(2){text-align:left}
.grid{stroke:#e5e5e5}.tick{font-size:11px;fill:#555}.legend span{margin-right:16px;font-size:12px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
.note{color:#666;font-size:12px}.ann{color:#7a4;font-weight:600}.none{color:#999}
details summary{cursor:pointer}details ol{margin:4px 0;padding-left:20px;font-size:12px;text-align:left}
code{font-size:12px}.oom{color:#c00;font-weight:600}
.tick.best{font-weight:700;fill:#222}table.diagnosis th{text-align:right;width:190px}table.diagnosis td{text-align:left}
.recommendation code.env{background:#eef4ea;padding:2px 6px;font-size:13px}ul.reasons li{margin:2px 0}div.answer{background:#eef4ea;border-left:4px solid #4a7a3a;padding:6px 12px;margin:8px 0}div.answer p{margin:4px 0}p.outcome{font-weight:bold}
)";

}  // namespace reservoir::tools
