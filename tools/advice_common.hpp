// What the views of advise share (advice_text.cpp, advice_json.cpp,
// advice_page.cpp): the answer first, in words, and the pieces each view
// prints its own way.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "reservoir/advise.hpp"

namespace reservoir::tools::advice {

// "large" or "small".
std::string pool(bool large);

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
  std::string scope;                  // scope_text() where the recording ends at its error
};

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
  std::string scope;  // scope_text() where a rank's recording ends at its error
};

// 3274 as "3,274".
std::string grouped(std::uint64_t n);

// Where in the recording an event falls, in words: "the 3,274th of 3,274
// recorded events, 12.5 s into the recording" (the time where recorded).
std::string when_text(const Trace& trace, std::uint64_t event);

std::string moment_text(const Trace& trace, const Diagnosis& d);

std::string source_text(const Diagnosis& d);

std::string config_cell(const Candidate& c);

// ", 744.90 ms before" for the last range that ended before the moment.
std::string ago(const Diagnosis& d);

// For which PyTorch the settings are written, and why.
std::string written_for(const Advice& a);

std::string headroom_text(const Advice& a, const Candidate& c);

std::string fraction_text(const Candidate& c);

nlohmann::json opt(const std::optional<std::uint64_t>& v);

// A word for a shell: quoted where it holds anything but safe characters.
std::string shell_word(const std::string& w);

// The command that replays the same file under a candidate at the capacity
// advise found, so that anyone can check the claim: the same setting, the
// same memory fraction (garbage_collection_threshold acts only under one, as
// in PyTorch), the same device of the file.
std::string replay_command(const Trace& trace, const Candidate& c);

// The command as lines to copy, continued with a backslash where it would
// not fit in 100 columns: before its options, and after "reservoir replay"
// when the file's path leaves no room beside it (a longer path stays whole).
std::string command_lines(const std::string& cmd, const std::string& indent);

nlohmann::json choice_json(const Trace& trace, const Advice& a, const std::optional<std::size_t>& index,
                           bool on_reservoir);

Answer answer_of(const Advice& a);

std::string rank_list(const JobAdvice& job, bool ran_out);

std::string job_env_line(const JobAdvice& job, const JobCandidate& c, bool on_reservoir);

std::string job_headroom(const JobAdvice& job, const JobCandidate& c);

JobAnswer job_answer_of(const JobAdvice& job);

}  // namespace reservoir::tools::advice
