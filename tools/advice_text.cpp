// advise as text: the answer first, then the diagnosis and the sweep.
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

std::string advice_text(const Trace& trace, const Advice& a) {
  const Diagnosis& d = a.diagnosis;
  const Answer ans = answer_of(a);
  std::string out = ans.outcome + "\n";
  if (!ans.action.empty()) out += ans.action + "\n";
  if (!ans.scope.empty()) out += ans.scope + "\n";
  out += "\n";
  out += fmt::format(
      "{} ({}, recorded with {}): {} events; {} settings replayed to their minimum capacity in "
      "{:.2f} s ({} replays)\n\n",
      trace.name, trace.format, config_label(trace.recorded_config), trace.events.size(),
      a.candidates.size(), a.seconds, a.replays);
  out += fmt::format("Diagnosis, {}, from {}\n", moment_text(trace, d), source_text(d));
  if (d.request) {
    const FailedRequest& r = *d.request;
    out += fmt::format("  failed request        {} on {}, {} pool (rounded to {}; a new "
                       "segment needs {}){}\n",
                       format_size(r.size), stream_name(r.stream), pool(r.large), format_size(r.rounded),
                       format_size(r.segment_size),
                       r.context != 0 ? "\n    at " + context_label(trace, r.context) : "");
  }
  if (!d.during.empty()) {
    out += fmt::format("  during                {}\n", fmt::join(d.during, " > "));
  }
  if (!d.last_mark.empty()) out += fmt::format("  after the mark        {}\n", d.last_mark);
  if (!d.last_ended.empty()) out += fmt::format("  the last range ended  {}{}\n", d.last_ended, ago(d));
  out += fmt::format("  allocated             {}\n  reserved              {}\n", format_size(d.allocated_bytes),
                     format_size(d.reserved_bytes));
  out += fmt::format("  reserved, unallocated {}\n", format_size(d.reserved_bytes - d.allocated_bytes));
  out += fmt::format("    free in split segments   {}\n", format_size(d.split_free_bytes));
  for (const FreeGroup& g : d.split_free) {
    out += fmt::format("      {} pool, {}: {} in {} blocks, the largest {}{}\n", pool(g.large),
                       stream_name(g.stream), format_size(g.bytes), g.blocks, format_size(g.largest),
                       !d.request                       ? ""
                       : g.stream == d.request->stream ? " (the request's stream)"
                                                        : " (another stream: the request's cannot use it)");
  }
  out += fmt::format("    cached whole segments    {} ({} segments)\n",
                     format_size(d.cached_segment_bytes), d.cached_segments);
  out += fmt::format("    waiting on streams       {} ({} blocks freed, their streams' work pending)\n",
                     format_size(d.pending_free_bytes), d.pending_free_blocks);
  if (d.device_free_bytes) {
    out += fmt::format("  device free           {} (recorded with the oom)\n",
                       format_size(*d.device_free_bytes));
    out += d.outside_bytes
               ? fmt::format("  outside this allocator {} (capacity - reserved - device free)\n",
                             format_size(*d.outside_bytes))
               : "  outside this allocator not recorded: a snapshot records the device's free memory, not\n"
                 "                        its total, so the capacity below is reserved + free, and memory\n"
                 "                        held outside this allocator is not in it (--capacity gives the total)\n";
  }
  if (d.limit_below) {
    out += fmt::format("  memory limit          at least {}, below {} (the device had room: "
                       "set_per_process_memory_fraction refused it)\n",
                       format_size(*d.limit_at_least), format_size(*d.limit_below));
  }
  if (d.request) {
    out += "  why no block could serve it:\n";
    for (const std::string& reason : d.request->reasons) out += "    - " + reason + "\n";
  }
  if (!d.worst_segments.empty()) {
    out += "  segments holding the most unusable free memory, and the allocations pinning them:\n";
    for (const PinnedSegment& s : d.worst_segments) {
      out += fmt::format("    {:#x}  {} segment, {} free (largest piece {}), {} pool, {}\n",
                         s.address, format_size(s.total), format_size(s.free_bytes),
                         format_size(s.largest_free), pool(s.large), stream_name(s.stream));
      for (const PinningBlock& b : s.live) {
        out += fmt::format("      {:>12} at {:#x}  {}\n", format_size(b.size), b.address,
                           context_label(trace, b.context));
      }
    }
  }

  out += fmt::format("\nSweep: minimum capacity per setting{}\n",
                     a.capacity_bytes ? fmt::format(" (capacity {}, {})", format_size(*a.capacity_bytes),
                                                    a.capacity_source)
                                      : " (no capacity known: give --capacity for OOMs at it)");
  constexpr std::size_t kSetting = 44;
  out += fmt::format("  {:<{}} {:>13} {:>8} {:>9} {:>10} {:>5}\n", "setting", kSetting, "min capacity",
                     "min/req", "calls/1k", "call time", "OOMs");
  for (std::size_t i = 0; i < a.candidates.size(); ++i) {
    const Candidate& c = a.candidates[i];
    const bool py = i == a.best_pytorch;
    const bool res = i == a.best_reservoir;
    const char* mark = py && res ? "*+" : py ? "* " : res ? "+ " : "  ";
    const std::vector<std::string> lines = wrap_setting(config_cell(c), kSetting);
    out += fmt::format("{}{:<{}} {:>13} {:>8.4f} {:>9.1f} {:>8.1f}ms {:>5}\n", mark, lines.front(), kSetting,
                       format_size(c.min_capacity_bytes), c.min_capacity_over_requested,
                       c.device_calls_per_1000_allocs, c.device_call_seconds * 1e3,
                       c.ooms_at_capacity ? fmt::format("{}", *c.ooms_at_capacity) : "-");
    for (std::size_t l = 1; l < lines.size(); ++l) out += "    " + lines[l] + "\n";
  }
  out += fmt::format("  (* best with stock PyTorch, + best with reservoir; peak requested {})\n",
                     format_size(a.peak_requested_bytes));

  out += fmt::format("\nRecommendation ({})\n", written_for(a));
  if (a.best_pytorch) {
    const Candidate& c = a.candidates[*a.best_pytorch];
    out += fmt::format("  With PyTorch:   {}{}\n    minimum capacity {} ({:.4f}x peak requested){}\n",
                       env_line(c, false, a.pytorch_env), fraction_text(c), format_size(c.min_capacity_bytes),
                       c.min_capacity_over_requested, headroom_text(a, c));
    out += "    check it (exit 0: it fits):\n" + command_lines(replay_command(trace, c), "      ");
  }
  const Candidate& best = a.candidates[a.best_reservoir];
  out += fmt::format("  With reservoir: {}{}\n    minimum capacity {} ({:.4f}x peak requested){}\n",
                     env_line(best, true), fraction_text(best), format_size(best.min_capacity_bytes),
                     best.min_capacity_over_requested, headroom_text(a, best));
  out += "    check it (exit 0: it fits):\n" + command_lines(replay_command(trace, best), "      ");
  if (a.shrink_bytes) {
    out += fmt::format(
        "  No allocator setting can fit: the program itself holds {} at its peak, more than the "
        "{} there is. Its own memory must shrink by at least {} (smaller batches, activation "
        "checkpointing, lower precision).\n",
        format_size(a.peak_requested_bytes), format_size(*a.capacity_bytes), format_size(*a.shrink_bytes));
  } else if (a.fits && !*a.fits) {
    out += "  No stock PyTorch setting fits in the capacity";
    out += best.min_capacity_bytes <= *a.capacity_bytes ? "; reservoir's does.\n" : "; nor does reservoir's.\n";
  }
  return out;
}

std::string job_text(const JobAdvice& job) {
  const JobAnswer ans = job_answer_of(job);
  std::string answer = ans.outcome + "\n" + (ans.action.empty() ? "" : ans.action + "\n") +
                       (ans.scope.empty() ? "" : ans.scope + "\n") + "\n";
  std::size_t ok = 0;
  std::size_t out_of_memory = 0;
  for (const RankAdvice& r : job.ranks) {
    ok += r.ok ? 1 : 0;
    out_of_memory += r.ok && r.ran_out ? 1 : 0;
  }
  std::string out = answer + fmt::format("Job of {} ranks, advised in {:.2f} s", job.ranks.size(), job.seconds);
  out += job.unreadable ? fmt::format(" ({} could not be read)\n", job.unreadable) : "\n";
  if (out_of_memory > 0) {
    out += fmt::format("  ran out of memory: {}\n", rank_list(job, true));
    if (out_of_memory < ok) out += fmt::format("  did not:           {}\n", rank_list(job, false));
  } else {
    out += "  no rank ran out of memory: advice is for where each rank's reserved memory peaked\n";
  }
  if (!job.candidates.empty()) {
    out += fmt::format("\nOne setting for every rank (for PyTorch {}: {})\n",
                       job.pytorch_since.empty()    ? std::string("before 2.3")
                       : job.pytorch_release_known ? job.pytorch_since
                                                   : job.pytorch_since + " or newer",
                       job.pytorch_env);
    if (job.best_pytorch) {
      const JobCandidate& c = job.candidates[*job.best_pytorch];
      out += fmt::format("  With PyTorch:   {}\n    the hungriest rank ({}) needs {}{}\n",
                         job_env_line(job, c, false), c.worst_rank,
                         format_size(c.worst_min_capacity_bytes), job_headroom(job, c));
    }
    const JobCandidate& best = job.candidates[job.best_reservoir];
    out += fmt::format("  With reservoir: {}\n    the hungriest rank ({}) needs {}{}\n",
                       job_env_line(job, best, true), best.worst_rank,
                       format_size(best.worst_min_capacity_bytes), job_headroom(job, best));
    if (job.fits && !*job.fits) {
      out += "  No swept setting fits every rank: the ranks' own memory must shrink (see each rank's "
             "advice).\n";
    }
  }
  out += fmt::format("\nHow the ranks differ (at each rank's moment: its oom, else its peak of reserved)\n"
                     "  {:<20} {:<14} {:>11} {:>12} {:>11} {:>11} {:>13}\n",
                     "rank", "moment", "failed req.", "peak request", "reserved", "unusable",
                     "largest alloc");
  for (const RankAdvice& r : job.ranks) {
    if (!r.ok) continue;
    // 100 columns: a name longer than its column has a line of its own.
    const bool long_name = r.name.size() > 20;
    if (long_name) out += "  " + r.name + "\n";
    out += fmt::format("  {:<20} {:<14} {:>11} {:>12} {:>11} {:>11} {:>13}\n", long_name ? "" : r.name,
                       r.ran_out ? "out of memory" : "peak reserved",
                       r.oom_request ? format_size(*r.oom_request) : "-",
                       format_size(r.peak_requested_bytes), format_size(r.reserved_bytes),
                       format_size(r.unusable_bytes), format_size(r.largest_allocation));
    if (!r.during.empty()) out += fmt::format("    during {}\n", fmt::join(r.during, " > "));
  }
  if (!job.candidates.empty()) {
    out += fmt::format("\nSettings across ranks (the capacity the hungriest rank needs)\n  {:<44} {:>13}  {}\n",
                       "setting", "worst rank", "needs it");
    for (std::size_t i = 0; i < job.candidates.size(); ++i) {
      const JobCandidate& c = job.candidates[i];
      const char* mark = job.best_pytorch == i ? "*" : i == job.best_reservoir ? "+" : " ";
      const std::vector<std::string> lines =
          wrap_setting(c.config.empty() ? "native defaults" : c.config, 44);
      out += fmt::format("{} {:<44} {:>13}  {}\n", mark, lines.front(), format_size(c.worst_min_capacity_bytes),
                         c.worst_rank);
      for (std::size_t l = 1; l < lines.size(); ++l) out += "    " + lines[l] + "\n";
    }
  }
  for (const RankAdvice& r : job.ranks) {
    if (r.ok) continue;
    // The reader's error names the file; the path is added where it does not.
    out += r.error.find(r.path) != std::string::npos
               ? fmt::format("\ncannot read {}: {}\n", r.name, r.error)
               : fmt::format("\ncannot read {} ({}): {}\n", r.name, r.path, r.error);
  }
  return out;
}

}  // namespace reservoir::tools
