#include "advice_common.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "report_html.hpp"
#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools::advice {

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
  if (d.moment == "oom") {
    // The diagnosis is of the latest error (a program that catches its errors records several).
    const auto errors = std::count_if(trace.events.begin(), trace.events.end(), [](const TraceEvent& e) {
      return e.action == TraceAction::oom && e.size > 0;
    });
    return errors > 1 ? fmt::format("at the last of {} out-of-memory errors ({})", errors, when_text(trace, d.event))
                      : fmt::format("at the out-of-memory error ({})", when_text(trace, d.event));
  }
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
  if (a.pytorch_release_known) {
    return fmt::format("for PyTorch {}, the release it ran under: {}", a.pytorch_since, a.pytorch_env);
  }
  if (a.pytorch_since.empty()) {
    return fmt::format("for PyTorch before 2.3, as the snapshot records no settings: {}",
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


Answer answer_of(const Advice& a) {
  Answer ans;
  const Diagnosis& d = a.diagnosis;
  ans.ran_out = d.moment == "oom";
  if (d.ends_at_error) ans.scope = scope_text();
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

// ---- a job of many ranks ------------------------------------------------------

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


JobAnswer job_answer_of(const JobAdvice& job) {
  JobAnswer ans;
  if (std::any_of(job.ranks.begin(), job.ranks.end(), [](const RankAdvice& r) { return r.ok && r.ends_at_error; })) {
    ans.scope = scope_text();
  }
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
      // reservoir's policy is named only where its own replay needs less
      // than the program's settings do (on the hungriest rank under it).
      const JobCandidate* ours = job.candidates.empty() ? nullptr : &job.candidates[job.best_reservoir];
      const bool ours_helps = ours != nullptr && ours->reservoir_only &&
                              ours->worst_min_capacity_bytes < *ans.recorded_worst;
      ans.action = fmt::format(
          "Your settings are already within {:.1f}% of the best stock PyTorch setting: the hungriest "
          "rank ({}) needs {} under them. What would help instead: less live memory on that rank at "
          "its peak (its own advice names the allocations){}.",
          std::max(0.0, ans.saves_percent), ans.recorded_worst_rank, format_size(*ans.recorded_worst),
          ours_helps ? fmt::format(", or reservoir's {} ({}: the hungriest rank, {}, needs {} under it)",
                                   ours->config, job_env_line(job, *ours, true), ours->worst_rank,
                                   format_size(ours->worst_min_capacity_bytes))
                     : std::string());
    }
  }
  return ans;
}

}  // namespace reservoir::tools::advice
