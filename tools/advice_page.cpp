// advise as a page: the segments at the moment and the sweep drawn.
#include "advice_view.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "advice_common.hpp"
#include "report_html.hpp"
#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools {

using namespace advice;  // NOLINT(google-build-using-namespace): the views' shared pieces

namespace {

// The segments at the moment, one row each, blocks to scale; the failed
// request drawn on the same scale above them. Segments with the most free
// memory inside them first.
std::string segments_svg(const Trace& trace, const Diagnosis& d, const std::string& id) {
  std::vector<const SegmentInfo*> rows;
  for (const SegmentInfo& s : d.segments.segments) rows.push_back(&s);
  auto free_in = [](const SegmentInfo* s) {
    std::uint64_t f = 0;
    for (const BlockInfo& b : s->blocks) f += b.state == BlockState::inactive ? b.size : 0;
    return f;
  };
  std::stable_sort(rows.begin(), rows.end(),
                   [&](const SegmentInfo* a, const SegmentInfo* b) { return free_in(a) > free_in(b); });
  constexpr std::size_t kMaxRows = 40;
  const std::size_t total = rows.size();
  if (rows.size() > kMaxRows) rows.resize(kMaxRows);
  std::uint64_t largest = d.request ? d.request->rounded : 1;
  for (const SegmentInfo* s : rows) largest = std::max<std::uint64_t>(largest, s->total_size);
  constexpr double W = 900, L = 170, row = 14, gap = 4;
  const double scale = (W - L - 8) / static_cast<double>(std::max<std::uint64_t>(largest, 1));
  const std::size_t n = rows.size() + (d.request ? 1 : 0);
  const double height = static_cast<double>(n) * (row + gap) + (d.request ? 8 : 0) + 4;
  std::string out = fmt::format(
      "<svg class=\"advice-segments\" id=\"{}\" viewBox=\"0 0 {} {:.0f}\" width=\"{}\" "
      "height=\"{:.0f}\" role=\"img\">\n",
      id, W, height, W, height);
  double y = 2;
  if (d.request) {
    const FailedRequest& r = *d.request;
    out += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">failed request</text>\n"
        "<rect class=\"request\" x=\"{}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" fill=\"none\" "
        "stroke=\"#c00\" stroke-width=\"2\" stroke-dasharray=\"5 3\"><title>the request that ran "
        "out of memory: {} (rounded), {}</title></rect>\n"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"tick\" fill=\"#c00\">{}</text>\n",
        L - 6, y + row - 3, L, y, static_cast<double>(r.rounded) * scale, row,
        esc(format_size(r.rounded)), esc(stream_name(r.stream)), L + 4, y + row - 3, esc(format_size(r.rounded)));
    y += row + gap + 8;
  }
  for (const SegmentInfo* s : rows) {
    // The stream only where it is not the default one (the compute stream).
    out += fmt::format("<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}{}{}</text>\n",
                       L - 6, y + row - 3, esc(format_size(s->total_size)), s->is_large ? "" : " small",
                       s->stream == 0 ? std::string() : esc(", " + stream_name(s->stream)));
    const bool whole_free = s->blocks.size() == 1 && s->blocks[0].state == BlockState::inactive;
    double x = L;
    for (const BlockInfo& b : s->blocks) {
      const double w = std::max(0.5, static_cast<double>(b.size) * scale);
      std::string cls = "live";
      std::string fill = "#4e79a7";
      std::string what = "allocated";
      if (b.state == BlockState::active_pending_free) {
        cls = "pending";
        fill = "#edc948";
        what = "freed, waiting on other streams";
      } else if (b.state == BlockState::inactive) {
        cls = whole_free ? "cached" : "hole";
        fill = whole_free ? "#bab0ac" : "#f28e2b";
        what = whole_free ? "cached whole segment" : "free hole in a split segment";
      }
      out += fmt::format(
          "<rect class=\"{}\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" fill=\"{}\" "
          "stroke=\"#fff\" stroke-width=\"0.5\"><title>{} {} at {:#x}</title></rect>\n",
          cls, x, y, w, row, fill, esc(format_size(b.size)), what, b.address);
      x += static_cast<double>(b.size) * scale;
    }
    y += row + gap;
  }
  out += "</svg>\n<div class=\"legend\"><span><i style=\"background:#4e79a7\"></i>allocated</span>"
         "<span><i style=\"background:#f28e2b\"></i>free hole in a split segment</span>"
         "<span><i style=\"background:#bab0ac\"></i>cached whole segment</span>"
         "<span><i style=\"background:#edc948\"></i>waiting on other streams</span>";
  if (d.request) out += "<span><i style=\"border:2px dashed #c00\"></i>the failed request</span>";
  out += "</div>\n";
  if (total > rows.size()) {
    out += fmt::format("<p class=\"note\">The {} segments with the most free memory of {} are shown.</p>\n",
                       rows.size(), total);
  }
  (void)trace;
  return out;
}

// Minimum capacity per setting, as horizontal bars, with the peak of
// requested memory and the capacity marked.
std::string sweep_svg(const Advice& a, const std::string& id) {
  constexpr double W = 900, L = 360, R = 170, row = 16, gap = 4, T = 18, line = 12;
  constexpr std::size_t kLabel = 52;
  std::uint64_t top = a.peak_requested_bytes;
  std::uint64_t best_bytes = std::numeric_limits<std::uint64_t>::max();
  std::size_t label_lines = 0;
  for (const Candidate& c : a.candidates) {
    top = std::max(top, c.min_capacity_bytes);
    best_bytes = std::min(best_bytes, c.min_capacity_bytes);
    label_lines += wrap_setting(config_cell(c), kLabel).size();
  }
  if (a.capacity_bytes) top = std::max(top, *a.capacity_bytes);
  // The axis starts at zero, so that bars compare as the bytes do; the
  // difference to the best setting is written beside each bar.
  const double span = std::max(1.0, static_cast<double>(top) * 1.02);
  auto x = [&](std::uint64_t v) { return L + (W - L - R) * static_cast<double>(v) / span; };
  const double height = T + static_cast<double>(a.candidates.size()) * (row + gap) +
                        static_cast<double>(label_lines - a.candidates.size()) * line + 24;
  std::string out = fmt::format(
      "<svg class=\"advice-sweep\" id=\"{}\" viewBox=\"0 0 {} {:.0f}\" width=\"{}\" height=\"{:.0f}\" "
      "role=\"img\">\n",
      id, W, height, W, height);
  double y = T;
  for (std::size_t i = 0; i < a.candidates.size(); ++i) {
    const Candidate& c = a.candidates[i];
    const bool best = i == a.best_pytorch || i == a.best_reservoir;
    const std::string fill = c.reservoir_only ? "#59a14f" : "#4e79a7";
    // A long setting wraps at its commas, one line under the other.
    const std::vector<std::string> label = wrap_setting(config_cell(c), kLabel);
    std::string tspans;
    for (std::size_t l = 0; l < label.size(); ++l) {
      tspans += fmt::format("<tspan x=\"{}\" dy=\"{}\">{}</tspan>", L - 6, l == 0 ? 0.0 : line, esc(label[l]));
    }
    const double over = best_bytes > 0 ? 100.0 * (static_cast<double>(c.min_capacity_bytes) /
                                                      static_cast<double>(best_bytes) - 1.0)
                                       : 0.0;
    const std::string figure =
        format_size(c.min_capacity_bytes) + (over < 0.05 ? std::string(" (least)") : fmt::format(" (+{:.1f}%)", over));
    out += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" class=\"tick{}\" text-anchor=\"end\">{}</text>\n"
        "<rect class=\"bar{}\" data-config=\"{}\" x=\"{}\" y=\"{:.1f}\" width=\"{:.2f}\" "
        "height=\"{}\" fill=\"{}\"{}><title>{}: minimum capacity {} ({:.4f}x peak requested), "
        "{:.1f} device calls per 1,000 allocations</title></rect>\n"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"tick\">{}</text>\n",
        L - 6, y + row - 4, best ? " best" : "", tspans, best ? " best" : "",
        esc(c.config), L, y, std::max(1.0, x(c.min_capacity_bytes) - L), row, fill,
        best ? " stroke=\"#222\" stroke-width=\"2\"" : "",
        esc(config_cell(c)), esc(format_size(c.min_capacity_bytes)), c.min_capacity_over_requested,
        c.device_calls_per_1000_allocs, x(c.min_capacity_bytes) + 4, y + row - 4, esc(figure));
    y += row + gap + static_cast<double>(label.size() - 1) * line;
  }
  auto mark = [&](std::uint64_t v, const char* cls, const char* color, const std::string& label) {
    return fmt::format(
        "<line class=\"{}\" x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"{}\" y2=\"{:.1f}\" stroke=\"{}\" "
        "stroke-width=\"1.5\" stroke-dasharray=\"4 3\"/><text x=\"{:.1f}\" y=\"{:.1f}\" "
        "class=\"tick\" fill=\"{}\" text-anchor=\"middle\">{}</text>\n",
        cls, x(v), x(v), T - 4, y, color, x(v), cls == std::string("capacity") ? y + 14 : T - 6,
        color, esc(label));
  };
  out += mark(a.peak_requested_bytes, "requested", "#555",
              "peak requested " + format_size(a.peak_requested_bytes));
  if (a.capacity_bytes) {
    out += mark(*a.capacity_bytes, "capacity", "#c00", "capacity " + format_size(*a.capacity_bytes));
  }
  out += fmt::format("<text x=\"{}\" y=\"{:.1f}\" class=\"tick\">axis from 0 bytes</text>\n", L, height - 2);
  out += "</svg>\n<div class=\"legend\"><span><i style=\"background:#4e79a7\"></i>stock PyTorch "
         "setting</span><span><i style=\"background:#59a14f\"></i>reservoir policy</span><span><i "
         "style=\"border:2px solid #222\"></i>recommended</span></div>\n";
  return out;
}

}  // namespace

std::string advice_html(const Trace& trace, const Advice& a, const std::string& id) {
  const Diagnosis& d = a.diagnosis;
  std::string out = fmt::format(
      "<section class=\"advice\" id=\"{}\">\n<h3>{}</h3>\n", id,
      d.moment == "oom" ? "Why it ran out of memory, and which setting fits"
                        : "Where reserved memory peaked, and which setting needs the least");
  const Answer ans = answer_of(a);
  out += fmt::format("<div class=\"answer\"><p class=\"outcome\">{}</p><p class=\"action\">{}</p>{}</div>\n",
                     esc(ans.outcome), esc(ans.action),
                     ans.scope.empty() ? "" : fmt::format("<p class=\"scope\">{}</p>", esc(ans.scope)));
  out += fmt::format("<p>Diagnosis {}, from {}.</p>\n", esc(moment_text(trace, d)), esc(source_text(d)));
  out += "<table class=\"diagnosis\">\n";
  auto row = [&](const std::string& k, const std::string& v) {
    out += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", esc(k), v);
  };
  if (d.request) {
    const FailedRequest& r = *d.request;
    row("failed request", esc(fmt::format("{} on {}, {} pool (rounded to {}; a new segment needs {})",
                                          format_size(r.size), stream_name(r.stream), pool(r.large),
                                          format_size(r.rounded), format_size(r.segment_size))) +
                              (r.context != 0 ? frames_html(trace.context(r.context)) : ""));
  }
  if (!d.during.empty()) row("during", esc(fmt::format("{}", fmt::join(d.during, " > "))));
  if (!d.last_mark.empty()) row("after the mark", esc(d.last_mark));
  if (!d.last_ended.empty()) row("the last range ended", esc(d.last_ended + ago(d)));
  row("allocated", esc(format_size(d.allocated_bytes)));
  row("reserved", esc(format_size(d.reserved_bytes)));
  std::string groups;
  for (const FreeGroup& g : d.split_free) {
    groups += esc(fmt::format("; {} pool, {}: {} in {} blocks, the largest {}", pool(g.large),
                              stream_name(g.stream), format_size(g.bytes), g.blocks, format_size(g.largest)));
  }
  row("free in split segments", esc(format_size(d.split_free_bytes)) + groups);
  row("cached whole segments",
      esc(fmt::format("{} ({} segments)", format_size(d.cached_segment_bytes), d.cached_segments)));
  row("waiting on other streams",
      esc(fmt::format("{} ({} blocks)", format_size(d.pending_free_bytes), d.pending_free_blocks)));
  if (d.device_free_bytes) row("device free", esc(format_size(*d.device_free_bytes)));
  if (d.outside_bytes) row("outside this allocator", esc(format_size(*d.outside_bytes)));
  if (d.limit_below) {
    row("memory limit", esc(fmt::format("at least {}, below {} (set_per_process_memory_fraction)",
                                        format_size(*d.limit_at_least), format_size(*d.limit_below))));
  }
  out += "</table>\n";
  if (d.request && !d.request->reasons.empty()) {
    out += "<ul class=\"reasons\">";
    for (const std::string& r : d.request->reasons) out += "<li>" + esc(r) + "</li>";
    out += "</ul>\n";
  }
  out += segments_svg(trace, d, id + "-segments");
  if (!d.worst_segments.empty()) {
    out += "<h4>Segments holding the most unusable free memory</h4>\n<table class=\"pinned\"><tr>"
           "<th>segment</th><th>size</th><th>free</th><th>largest piece</th><th>live allocations "
           "pinning it</th></tr>\n";
    for (const PinnedSegment& s : d.worst_segments) {
      std::string live;
      for (const PinningBlock& b : s.live) {
        live += fmt::format("<div>{} at <code>{:#x}</code> {}</div>", esc(format_size(b.size)), b.address,
                            b.context != 0 ? frames_html(trace.context(b.context))
                                           : "<span class=\"none\">(no context)</span>");
      }
      out += fmt::format("<tr><td><code>{:#x}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                         s.address, esc(format_size(s.total)), esc(format_size(s.free_bytes)),
                         esc(format_size(s.largest_free)), live);
    }
    out += "</table>\n";
  }
  out += fmt::format("<h4>Minimum capacity per setting{}</h4>\n",
                     a.capacity_bytes ? esc(fmt::format(" (capacity {}, {})", format_size(*a.capacity_bytes),
                                                        a.capacity_source))
                                      : "");
  out += sweep_svg(a, id + "-sweep");
  out += "<div class=\"recommendation\">";
  out += fmt::format("<p class=\"note\">Settings written {}.</p>", esc(written_for(a)));
  if (a.best_pytorch) {
    const Candidate& c = a.candidates[*a.best_pytorch];
    out += fmt::format("<p>With PyTorch: <code class=\"env\">{}</code>{}: minimum capacity {}{}.</p>",
                       esc(env_line(c, false, a.pytorch_env)), esc(fraction_text(c)), esc(format_size(c.min_capacity_bytes)),
                       esc(headroom_text(a, c)));
  }
  const Candidate& best = a.candidates[a.best_reservoir];
  out += fmt::format("<p>With reservoir: <code class=\"env\">{}</code>{}: minimum capacity {}{}.</p>",
                     esc(env_line(best, true)), esc(fraction_text(best)), esc(format_size(best.min_capacity_bytes)),
                     esc(headroom_text(a, best)));
  if (a.shrink_bytes) {
    out += fmt::format("<p class=\"oom\">No allocator setting can fit: the program's own memory must "
                       "shrink by at least {}.</p>",
                       esc(format_size(*a.shrink_bytes)));
  }
  out += "</div>\n</section>\n";
  return out;
}

std::string job_html(const JobAdvice& job, const std::vector<std::string>& rank_pages) {
  const JobAnswer ans = job_answer_of(job);
  std::string body = fmt::format(
      "<div class=\"answer\"><p class=\"outcome\">{}</p><p class=\"action\">{}</p>{}</div>\n"
      "<p class=\"note\">{} ranks, {}.</p>\n<pre class=\"job\">{}</pre>\n",
      esc(ans.outcome), esc(ans.action),
      ans.scope.empty() ? "" : fmt::format("<p class=\"scope\">{}</p>", esc(ans.scope)), job.ranks.size(),
      utc_now(), esc(job_text(job)));
  body += "<h2>Each rank</h2>\n<table class=\"summary\"><tr><th>rank</th><th>moment</th><th>failed "
          "request</th><th>peak requested</th><th>reserved</th><th>unusable</th><th>largest "
          "allocation</th><th>file</th></tr>\n";
  for (std::size_t i = 0; i < job.ranks.size(); ++i) {
    const RankAdvice& r = job.ranks[i];
    const std::string name = i < rank_pages.size() && !rank_pages[i].empty()
                                 ? fmt::format("<a href=\"{}\">{}</a>", esc(rank_pages[i]), esc(r.name))
                                 : esc(r.name);
    if (!r.ok) {
      body += fmt::format("<tr><td>{}</td><td class=\"oom\" colspan=\"6\">cannot read: {}</td><td>{}</td></tr>\n",
                          name, esc(r.error), esc(r.path));
      continue;
    }
    body += fmt::format("<tr><td>{}</td><td{}>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                        name, r.ran_out ? " class=\"oom\"" : "", r.ran_out ? "out of memory" : "peak reserved",
                        r.oom_request ? esc(format_size(*r.oom_request)) : "-",
                        esc(format_size(r.peak_requested_bytes)), esc(format_size(r.reserved_bytes)),
                        esc(format_size(r.unusable_bytes)), esc(format_size(r.largest_allocation)),
                        esc(r.path));
  }
  body += "</table>\n";
  return html_page("reservoir advise: job", body);
}

}  // namespace reservoir::tools
