#include "advice_view.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "report_html.hpp"
#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {

std::string pool(bool large) { return large ? "large" : "small"; }

// 3274 as "3,274".
std::string grouped(std::uint64_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// Where in the recording an event falls, in words: "the 3,274th of 3,274
// recorded events, 12.5 s into the recording" (the time where recorded).
std::string when_text(const Trace& trace, std::uint64_t event) {
  const std::uint64_t nth = event + 1;
  const char* suffix = (nth % 100 >= 11 && nth % 100 <= 13) ? "th"
                       : nth % 10 == 1                      ? "st"
                       : nth % 10 == 2                      ? "nd"
                       : nth % 10 == 3                      ? "rd"
                                                            : "th";
  std::string out = fmt::format("the {}{} of {} recorded events", grouped(nth), suffix, grouped(trace.events.size()));
  if (event < trace.events.size() && !trace.events.empty() && trace.events.front().time_us > 0 &&
      trace.events[event].time_us >= trace.events.front().time_us) {
    const double s = static_cast<double>(trace.events[event].time_us - trace.events.front().time_us) / 1e6;
    out += s < 1.0 ? fmt::format(", {:.0f} ms into the recording", s * 1e3)
                   : fmt::format(", {:.1f} s into the recording", s);
  }
  return out;
}

std::string moment_text(const Trace& trace, const Diagnosis& d) {
  if (d.moment == "oom") return fmt::format("at the first out-of-memory error ({})", when_text(trace, d.event));
  if (d.at_recording_start) {
    return "when your recording started (reserved memory never rose above what was reserved then)";
  }
  return fmt::format("where reserved memory peaked ({})", when_text(trace, d.event));
}

std::string source_text(const Diagnosis& d) {
  if (d.source == "verified") return "the state of a replay verified against the recording";
  if (d.source == "recorded") return "the recorded segments";
  return fmt::format("the state of a replay under the recorded settings ({})", d.source_note);
}

std::string config_cell(const Candidate& c) {
  std::string s = config_label(c.config);
  if (c.recorded) s += " (recorded)";
  return s;
}

// ", 744.90 ms before" for the last range that ended before the moment.
std::string ago(const Diagnosis& d) {
  if (!d.last_ended_us_before) return "";
  return fmt::format(", {:.2f} ms before", static_cast<double>(*d.last_ended_us_before) / 1e3);
}

// For which PyTorch the settings are written, and why.
std::string written_for(const Advice& a) {
  if (a.torch_version_given) {
    return fmt::format("for PyTorch {}, as --torch-version asks: {}", a.pytorch_since, a.pytorch_env);
  }
  if (a.pytorch_since.empty()) {
    return fmt::format("for PyTorch before 2.4, as the snapshot records no settings: {}",
                       a.pytorch_env);
  }
  return fmt::format("for PyTorch {} or newer, as the snapshot shows: {}{}", a.pytorch_since,
                     a.pytorch_env,
                     a.pytorch_env == "PYTORCH_ALLOC_CONF"
                         ? "; older releases read PYTORCH_CUDA_ALLOC_CONF, which it reads too"
                         : "");
}

std::string headroom_text(const Advice& a, const Candidate& c) {
  if (!a.capacity_bytes) return "";
  const std::uint64_t cap = *a.capacity_bytes;
  if (c.min_capacity_bytes <= cap) {
    return fmt::format("; {} of headroom on {}", format_size(cap - c.min_capacity_bytes),
                       format_size(cap));
  }
  return fmt::format("; {} more than the {} there is", format_size(c.min_capacity_bytes - cap),
                     format_size(cap));
}

std::string fraction_text(const Candidate& c) {
  return c.memory_fraction
             ? fmt::format(", with torch.cuda.set_per_process_memory_fraction({:.1f}) (garbage "
                           "collection runs only under a memory fraction)",
                           *c.memory_fraction)
             : "";
}

nlohmann::json opt(const std::optional<std::uint64_t>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

// A word for a shell: quoted where it holds anything but safe characters.
std::string shell_word(const std::string& w) {
  const bool plain = !w.empty() && w.find_first_not_of(
                                       "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                       "_-./:=,+@%") == std::string::npos;
  if (plain) return w;
  std::string out = "'";
  for (char ch : w) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// The command that replays the same file under a candidate at the capacity
// advise found, so that anyone can check the claim: the same setting, the
// same memory fraction (garbage_collection_threshold acts only under one, as
// in PyTorch), the same device of the file.
std::string replay_command(const Trace& trace, const Candidate& c) {
  std::string path = trace.name;
  const std::string suffix = fmt::format(" (device {})", trace.device);
  if (trace.device_count > 1 && path.size() > suffix.size() &&
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    path.resize(path.size() - suffix.size());
  }
  std::string cmd = "reservoir replay " + shell_word(path);
  if (trace.device_count > 1) cmd += fmt::format(" --device {}", trace.device);
  cmd += " -c " + shell_word(c.config) + fmt::format(" --capacity {}B", c.min_capacity_bytes);
  if (c.memory_fraction) cmd += fmt::format(" --memory-fraction {}", *c.memory_fraction);
  return cmd;
}

// The command as lines to copy, continued with a backslash where it would
// not fit in 100 columns: before its options, and after "reservoir replay"
// when the file's path leaves no room beside it (a longer path stays whole).
std::string command_lines(const std::string& cmd, const std::string& indent) {
  const std::string lead = indent + "$ ";
  const std::string program = "reservoir replay ";
  // The last " -c ": a setting has no spaces, a quoted path may.
  const std::size_t cut = cmd.rfind(" -c ");
  if (lead.size() + cmd.size() <= kTextWidth || cut == std::string::npos) return lead + cmd + "\n";
  const std::string more = indent + "    ";
  const std::string head = cmd.substr(0, cut);
  std::string out;
  if (lead.size() + head.size() + 2 > kTextWidth && head.starts_with(program)) {
    out = lead + program + "\\\n" + more + head.substr(program.size()) + " \\\n";
  } else {
    out = lead + head + " \\\n";
  }
  return out + more + cmd.substr(cut + 1) + "\n";
}

nlohmann::json choice_json(const Trace& trace, const Advice& a, const std::optional<std::size_t>& index,
                           bool on_reservoir) {
  if (!index) return nullptr;
  const Candidate& c = a.candidates[*index];
  nlohmann::json j{{"config", c.config},
                   {"env", env_line(c, on_reservoir, a.pytorch_env)},
                   {"min_capacity_bytes", c.min_capacity_bytes},
                   {"memory_fraction", c.memory_fraction ? nlohmann::json(*c.memory_fraction)
                                                         : nlohmann::json(nullptr)},
                   {"replay_command", replay_command(trace, c)}};
  if (a.capacity_bytes) {
    j["headroom_bytes"] = static_cast<std::int64_t>(*a.capacity_bytes) -
                          static_cast<std::int64_t>(c.min_capacity_bytes);
  } else {
    j["headroom_bytes"] = nullptr;
  }
  return j;
}

// The answer, before any detail: did the job run out of memory, the line to
// set, and what it saves over the recorded settings; or, when no stock
// setting saves more than about 1%, that the settings are fine and what would
// help instead.
struct Answer {
  bool ran_out = false;
  std::string outcome;                // one sentence
  std::string action;                 // one or two sentences
  const Candidate* recorded = nullptr;  // the recorded settings' replay
  const Candidate* best = nullptr;      // the best stock PyTorch setting
  std::int64_t saves_bytes = 0;       // recorded minus best minimum capacity
  double saves_percent = 0.0;         // of the recorded minimum capacity
  bool settings_matter = false;       // the best saves more than 1%
};

Answer answer_of(const Advice& a) {
  Answer ans;
  const Diagnosis& d = a.diagnosis;
  ans.ran_out = d.moment == "oom";
  if (ans.ran_out && d.request) {
    ans.outcome = fmt::format("The job ran out of memory: a {} request found {} free on the device.",
                              format_size(d.request->size),
                              d.device_free_bytes ? format_size(*d.device_free_bytes) : "too little");
  } else if (ans.ran_out) {
    ans.outcome = "The job ran out of memory.";
  } else if (a.capacity_bytes) {
    ans.outcome = fmt::format(
        "The job did not run out of memory: reserved memory peaked at {}, {:.1f}% of the {} it may have.",
        format_size(d.reserved_bytes),
        100.0 * static_cast<double>(d.reserved_bytes) / static_cast<double>(*a.capacity_bytes),
        format_size(*a.capacity_bytes));
  } else {
    ans.outcome = fmt::format(
        "The recording shows no out-of-memory error: reserved memory peaked at {} (give --capacity "
        "to judge it against your GPU).",
        format_size(d.reserved_bytes));
  }
  for (const Candidate& c : a.candidates) {
    if (c.recorded) ans.recorded = &c;
  }
  // One peak, with its meaning: the reserved memory at the moment counts
  // segments cached before the recording, which the replays (and so every
  // capacity below) start without.
  if (!ans.ran_out && ans.recorded != nullptr && d.reserved_bytes != ans.recorded->min_capacity_bytes) {
    ans.outcome += d.at_recording_start
                       ? fmt::format(" That was when your recording started, {} of it in segments cached "
                                     "before the recording, which replays start without: under your "
                                     "settings the recording's own requests need {}.",
                                     format_size(d.cached_segment_bytes),
                                     format_size(ans.recorded->min_capacity_bytes))
                   : d.cached_segment_bytes > 0
                       ? fmt::format(" The smallest device it fits under your settings is {}: cached, "
                                     "unused segments ({} at the peak) are given back when memory runs "
                                     "short, and replays start with an empty cache.",
                                     format_size(ans.recorded->min_capacity_bytes),
                                     format_size(d.cached_segment_bytes))
                       : fmt::format(" The smallest device it fits under your settings is {} (replays "
                                     "start with an empty cache; the recording started with segments "
                                     "cached before it).",
                                     format_size(ans.recorded->min_capacity_bytes));
  }
  if (a.best_pytorch) ans.best = &a.candidates[*a.best_pytorch];
  const Candidate& reservoir_best = a.candidates[a.best_reservoir];
  if (ans.recorded != nullptr && ans.best != nullptr && ans.recorded->min_capacity_bytes > 0) {
    ans.saves_bytes = static_cast<std::int64_t>(ans.recorded->min_capacity_bytes) -
                      static_cast<std::int64_t>(ans.best->min_capacity_bytes);
    ans.saves_percent = 100.0 * static_cast<double>(ans.saves_bytes) /
                        static_cast<double>(ans.recorded->min_capacity_bytes);
  }
  ans.settings_matter = ans.best != nullptr && ans.recorded != nullptr && ans.best != ans.recorded &&
                        ans.saves_percent > 1.0;
  const auto gib = [](std::int64_t bytes) { return static_cast<double>(bytes) / double(1 << 30); };
  if (a.shrink_bytes) {
    ans.action = fmt::format(
        "No setting can make it fit: the program itself holds {} at its peak, {} more than there is; "
        "its own memory must shrink (smaller batches, activation checkpointing, lower precision).",
        format_size(a.peak_requested_bytes), format_size(*a.shrink_bytes));
  } else if (ans.settings_matter && ans.best != nullptr && ans.recorded != nullptr) {
    ans.action = fmt::format("Set {}{}: it needs {}, {:.2f} GiB ({:.1f}%) less than your settings ({}){}.",
                             env_line(*ans.best, false, a.pytorch_env), fraction_text(*ans.best),
                             format_size(ans.best->min_capacity_bytes), gib(ans.saves_bytes),
                             ans.saves_percent, format_size(ans.recorded->min_capacity_bytes),
                             headroom_text(a, *ans.best));
  } else if (ans.recorded != nullptr) {
    const double within =
        ans.best != nullptr && ans.best->min_capacity_bytes > 0
            ? 100.0 * (static_cast<double>(ans.recorded->min_capacity_bytes) /
                           static_cast<double>(ans.best->min_capacity_bytes) -
                       1.0)
            : 0.0;
    const bool reservoir_helps =
        reservoir_best.reservoir_only &&
        static_cast<double>(reservoir_best.min_capacity_bytes) <
            0.99 * static_cast<double>(ans.recorded->min_capacity_bytes);
    ans.action = fmt::format(
        "Your settings are already within {:.1f}% of the best stock PyTorch setting; the program itself "
        "needs {} at its peak. What would help instead: {}less live memory at the peak (the "
        "allocations listed below).",
        std::max(within, 0.0), format_size(a.peak_requested_bytes),
        reservoir_helps ? fmt::format("reservoir's {} (it needs {}), or ", reservoir_best.config,
                                      format_size(reservoir_best.min_capacity_bytes))
                        : std::string());
  }
  return ans;
}

}  // namespace

std::string advice_text(const Trace& trace, const Advice& a) {
  const Diagnosis& d = a.diagnosis;
  const Answer ans = answer_of(a);
  std::string out = ans.outcome + "\n";
  if (!ans.action.empty()) out += ans.action + "\n";
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
               : "  outside this allocator unknown (--capacity gives the device's total)\n";
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

nlohmann::json advice_json(const Trace& trace, const Advice& a) {
  const Diagnosis& d = a.diagnosis;
  nlohmann::json groups = nlohmann::json::array();
  for (const FreeGroup& g : d.split_free) {
    groups.push_back({{"pool", pool(g.large)}, {"stream", g.stream}, {"bytes", g.bytes},
                      {"blocks", g.blocks}, {"largest_bytes", g.largest}});
  }
  nlohmann::json worst = nlohmann::json::array();
  for (const PinnedSegment& s : d.worst_segments) {
    nlohmann::json live = nlohmann::json::array();
    for (const PinningBlock& b : s.live) {
      live.push_back({{"address", b.address}, {"size_bytes", b.size},
                      {"context", context_label(trace, b.context)}});
    }
    worst.push_back({{"address", s.address}, {"total_bytes", s.total}, {"free_bytes", s.free_bytes},
                     {"largest_free_bytes", s.largest_free}, {"pool", pool(s.large)},
                     {"stream", s.stream}, {"live", live}});
  }
  nlohmann::json request = nullptr;
  if (d.request) {
    const FailedRequest& r = *d.request;
    request = {{"size_bytes", r.size},
               {"rounded_bytes", r.rounded},
               {"segment_bytes", r.segment_size},
               {"stream", r.stream},
               {"pool", pool(r.large)},
               {"context", context_label(trace, r.context)},
               {"largest_free_same_stream_bytes", r.largest_same_stream},
               {"largest_free_other_streams_bytes", r.largest_other_stream},
               {"ladder_released_bytes", r.ladder_released},
               {"reasons", r.reasons}};
  }
  nlohmann::json diagnosis{{"moment", d.moment},
                           {"event", d.event},
                           {"at_recording_start", d.at_recording_start},
                           {"source", d.source},
                           {"source_note", d.source_note},
                           {"during", d.during},
                           {"last_mark", d.last_mark},
                           {"last_ended", d.last_ended},
                           {"last_ended_us_before", d.last_ended_us_before
                                                        ? nlohmann::json(*d.last_ended_us_before)
                                                        : nlohmann::json(nullptr)},
                           {"allocated_bytes", d.allocated_bytes},
                           {"reserved_bytes", d.reserved_bytes},
                           {"unallocated_bytes", d.reserved_bytes - d.allocated_bytes},
                           {"split_free_bytes", d.split_free_bytes},
                           {"split_free", groups},
                           {"cached_segment_bytes", d.cached_segment_bytes},
                           {"cached_segments", d.cached_segments},
                           {"pending_free_bytes", d.pending_free_bytes},
                           {"pending_free_blocks", d.pending_free_blocks},
                           {"device_free_bytes", opt(d.device_free_bytes)},
                           {"outside_allocator_bytes", opt(d.outside_bytes)},
                           {"memory_limit_at_least_bytes", opt(d.limit_at_least)},
                           {"memory_limit_below_bytes", opt(d.limit_below)},
                           {"request", request},
                           {"worst_segments", worst}};
  nlohmann::json candidates = nlohmann::json::array();
  for (const Candidate& c : a.candidates) {
    candidates.push_back(
        {{"config", c.config},
         {"reservoir_only", c.reservoir_only},
         {"recorded", c.recorded},
         {"memory_fraction",
          c.memory_fraction ? nlohmann::json(*c.memory_fraction) : nlohmann::json(nullptr)},
         {"min_capacity_bytes", c.min_capacity_bytes},
         {"min_capacity_over_requested", c.min_capacity_over_requested},
         {"peak_reserved_bytes", c.peak_reserved_bytes},
         {"device_calls_per_1000_allocs", c.device_calls_per_1000_allocs},
         {"device_call_seconds", c.device_call_seconds},
         {"ooms_at_capacity",
          c.ooms_at_capacity ? nlohmann::json(*c.ooms_at_capacity) : nlohmann::json(nullptr)}});
  }
  const Answer ans = answer_of(a);
  nlohmann::json answer = {
      {"ran_out_of_memory", ans.ran_out},
      {"outcome", ans.outcome},
      {"action", ans.action},
      {"settings_matter", ans.settings_matter},
      {"line", ans.settings_matter ? env_line(*ans.best, false, a.pytorch_env) : std::string()},
      {"recorded_min_capacity_bytes",
       ans.recorded != nullptr ? nlohmann::json(ans.recorded->min_capacity_bytes) : nlohmann::json(nullptr)},
      {"best_min_capacity_bytes",
       ans.best != nullptr ? nlohmann::json(ans.best->min_capacity_bytes) : nlohmann::json(nullptr)},
      {"saves_bytes", ans.saves_bytes},
      {"saves_percent", ans.saves_percent},
      // The one peak and what it means (the outcome says it in words).
      {"reserved_at_moment_bytes", d.reserved_bytes},
      {"moment", moment_text(trace, d)},
      {"peak_at_recording_start", d.at_recording_start}};
  return {{"answer", answer},
          {"trace", a.trace},
          {"recorded_config", a.recorded_config},
          {"pytorch_since", a.pytorch_since},
          {"torch_version_given", a.torch_version_given},
          {"pytorch_env", a.pytorch_env},
          {"peak_requested_bytes", a.peak_requested_bytes},
          {"capacity_bytes", opt(a.capacity_bytes)},
          {"capacity_source", a.capacity_source},
          {"fits", a.fits ? nlohmann::json(*a.fits) : nlohmann::json(nullptr)},
          {"diagnosis", diagnosis},
          {"candidates", candidates},
          {"recommendation",
           {{"pytorch", choice_json(trace, a, a.best_pytorch, false)},
            {"reservoir", choice_json(trace, a, a.best_reservoir, true)},
            {"shrink_bytes", opt(a.shrink_bytes)}}},
          {"replays", a.replays},
          {"seconds", a.seconds}};
}

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
  out += fmt::format("<div class=\"answer\"><p class=\"outcome\">{}</p><p class=\"action\">{}</p></div>\n",
                     esc(ans.outcome), esc(ans.action));
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

}  // namespace reservoir::tools

// ---- a job of many ranks ------------------------------------------------------

namespace reservoir::tools {
namespace {

std::string rank_list(const JobAdvice& job, bool ran_out) {
  std::vector<std::string> names;
  for (const RankAdvice& r : job.ranks) {
    if (r.ok && r.ran_out == ran_out) names.push_back(r.name);
  }
  if (names.size() > 8) {
    return fmt::format("{}, ... ({} ranks)", fmt::join(names.begin(), names.begin() + 6, ", "),
                       names.size());
  }
  return fmt::format("{}", fmt::join(names, ", "));
}

std::string job_env_line(const JobAdvice& job, const JobCandidate& c, bool on_reservoir) {
  Candidate one;
  one.config = c.config;
  one.reservoir_only = c.reservoir_only;
  return env_line(one, on_reservoir, job.pytorch_env);
}

std::string job_headroom(const JobAdvice& job, const JobCandidate& c) {
  if (!job.capacity_bytes) return "";
  const auto cap = static_cast<std::int64_t>(*job.capacity_bytes);
  const auto need = static_cast<std::int64_t>(c.worst_min_capacity_bytes);
  return need <= cap ? fmt::format(" of the {} each rank has", format_size(*job.capacity_bytes))
                     : fmt::format(", more than the {} each rank has", format_size(*job.capacity_bytes));
}

// The job's answer, before any detail: which ranks ran out of memory, the
// one line to set on every rank and what it saves over the recorded settings
// for the hungriest rank, or that the settings are already close to the best.
struct JobAnswer {
  std::string outcome;
  std::string action;
  std::vector<std::string> ran_out;
  bool settings_matter = false;
  std::string line;
  std::optional<std::uint64_t> recorded_worst;  // the recorded settings, hungriest rank
  std::string recorded_worst_rank;
  std::optional<std::uint64_t> best_worst;
  std::int64_t saves_bytes = 0;
  double saves_percent = 0.0;
};

JobAnswer job_answer_of(const JobAdvice& job) {
  JobAnswer ans;
  std::size_t ok = 0;
  for (const RankAdvice& r : job.ranks) {
    if (!r.ok) continue;
    ++ok;
    if (r.ran_out) ans.ran_out.push_back(r.name);
    for (const Candidate& c : r.candidates) {
      if (c.recorded && (!ans.recorded_worst || c.min_capacity_bytes > *ans.recorded_worst)) {
        ans.recorded_worst = c.min_capacity_bytes;
        ans.recorded_worst_rank = r.name;
      }
    }
  }
  const std::string names = ans.ran_out.size() > 6
                                ? fmt::format("{}, ...", fmt::join(ans.ran_out.begin(), ans.ran_out.begin() + 6, ", "))
                                : fmt::format("{}", fmt::join(ans.ran_out, ", "));
  ans.outcome = ans.ran_out.empty()
                    ? fmt::format("No rank of the {} ran out of memory.", ok)
                    : fmt::format("{} of {} ranks ran out of memory: {}.", ans.ran_out.size(), ok, names);
  if (job.best_pytorch) {
    const JobCandidate& best = job.candidates[*job.best_pytorch];
    ans.best_worst = best.worst_min_capacity_bytes;
    if (ans.recorded_worst && *ans.recorded_worst > 0) {
      ans.saves_bytes = static_cast<std::int64_t>(*ans.recorded_worst) -
                        static_cast<std::int64_t>(best.worst_min_capacity_bytes);
      ans.saves_percent = 100.0 * static_cast<double>(ans.saves_bytes) / static_cast<double>(*ans.recorded_worst);
    }
    ans.settings_matter = ans.recorded_worst && ans.saves_percent > 1.0;
    if (ans.settings_matter) {
      ans.line = job_env_line(job, best, false);
      ans.action = fmt::format(
          "Set {} on every rank: the hungriest rank ({}) needs {}, {:.2f} GiB ({:.1f}%) less than your "
          "settings need ({}, {}){}.",
          ans.line, best.worst_rank, format_size(best.worst_min_capacity_bytes),
          static_cast<double>(ans.saves_bytes) / double(1 << 30), ans.saves_percent,
          format_size(*ans.recorded_worst), ans.recorded_worst_rank, job_headroom(job, best));
    } else if (ans.recorded_worst) {
      ans.action = fmt::format(
          "Your settings are already within {:.1f}% of the best stock PyTorch setting: the hungriest "
          "rank ({}) needs {} under them. What would help instead: less live memory on that rank at "
          "its peak (its own advice names the allocations), or reservoir's policy ({}).",
          std::max(0.0, ans.saves_percent), ans.recorded_worst_rank, format_size(*ans.recorded_worst),
          job.candidates.empty() ? std::string("RESERVOIR_ALLOC_CONF=policy:paging")
                                 : job_env_line(job, job.candidates[job.best_reservoir], true));
    }
  }
  return ans;
}

}  // namespace

std::string job_text(const JobAdvice& job) {
  const JobAnswer ans = job_answer_of(job);
  std::string answer = ans.outcome + "\n" + (ans.action.empty() ? "" : ans.action + "\n") + "\n";
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
                       job.pytorch_since.empty() ? std::string("before 2.4") : job.pytorch_since + " or newer",
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

nlohmann::json job_json(const JobAdvice& job) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankAdvice& r : job.ranks) {
    nlohmann::json candidates = nlohmann::json::array();
    for (const Candidate& c : r.candidates) {
      candidates.push_back({{"config", c.config}, {"min_capacity_bytes", c.min_capacity_bytes}});
    }
    ranks.push_back({{"name", r.name},
                     {"path", r.path},
                     {"device", r.device},
                     {"ok", r.ok},
                     {"error", r.error},
                     {"ran_out", r.ran_out},
                     {"oom_request_bytes", r.oom_request ? nlohmann::json(*r.oom_request) : nlohmann::json(nullptr)},
                     {"moment", r.moment},
                     {"peak_requested_bytes", r.peak_requested_bytes},
                     {"allocated_bytes", r.allocated_bytes},
                     {"reserved_bytes", r.reserved_bytes},
                     {"unusable_bytes", r.unusable_bytes},
                     {"largest_allocation_bytes", r.largest_allocation},
                     {"capacity_bytes", r.capacity_bytes ? nlohmann::json(*r.capacity_bytes) : nlohmann::json(nullptr)},
                     {"during", r.during},
                     {"candidates", candidates}});
  }
  nlohmann::json candidates = nlohmann::json::array();
  for (const JobCandidate& c : job.candidates) {
    candidates.push_back({{"config", c.config},
                          {"reservoir_only", c.reservoir_only},
                          {"worst_min_capacity_bytes", c.worst_min_capacity_bytes},
                          {"worst_rank", c.worst_rank}});
  }
  auto choice = [&](const std::optional<std::size_t>& i, bool on_reservoir) -> nlohmann::json {
    if (!i) return nullptr;
    const JobCandidate& c = job.candidates[*i];
    return {{"config", c.config}, {"env", job_env_line(job, c, on_reservoir)},
            {"worst_min_capacity_bytes", c.worst_min_capacity_bytes}, {"worst_rank", c.worst_rank}};
  };
  const JobAnswer ans = job_answer_of(job);
  const auto optional_bytes = [](const std::optional<std::uint64_t>& v) {
    return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
  };
  nlohmann::json answer{{"ran_out_of_memory", !ans.ran_out.empty()},
                        {"ranks_out_of_memory", ans.ran_out},
                        {"outcome", ans.outcome},
                        {"action", ans.action},
                        {"settings_matter", ans.settings_matter},
                        {"line", ans.line},
                        {"recorded_worst_min_capacity_bytes", optional_bytes(ans.recorded_worst)},
                        {"recorded_worst_rank", ans.recorded_worst_rank},
                        {"best_worst_min_capacity_bytes", optional_bytes(ans.best_worst)},
                        {"saves_bytes", ans.saves_bytes},
                        {"saves_percent", ans.saves_percent}};
  return {{"answer", answer},
          {"ranks", ranks},
          {"candidates", candidates},
          {"recommendation",
           {{"pytorch", choice(job.best_pytorch, false)},
            {"reservoir", job.candidates.empty() ? nlohmann::json(nullptr)
                                                 : choice(job.best_reservoir, true)}}},
          {"capacity_bytes", job.capacity_bytes ? nlohmann::json(*job.capacity_bytes) : nlohmann::json(nullptr)},
          {"fits", job.fits ? nlohmann::json(*job.fits) : nlohmann::json(nullptr)},
          {"pytorch_since", job.pytorch_since},
          {"pytorch_env", job.pytorch_env},
          {"unreadable", job.unreadable},
          {"seconds", job.seconds}};
}

std::string job_html(const JobAdvice& job, const std::vector<std::string>& rank_pages) {
  const JobAnswer ans = job_answer_of(job);
  std::string body = fmt::format(
      "<div class=\"answer\"><p class=\"outcome\">{}</p><p class=\"action\">{}</p></div>\n"
      "<p class=\"note\">{} ranks, {}.</p>\n<pre class=\"job\">{}</pre>\n",
      esc(ans.outcome), esc(ans.action), job.ranks.size(), utc_now(), esc(job_text(job)));
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
