// advise as JSON (the keys: docs/tools.md).
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
                           {"ends_at_error", d.ends_at_error},
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
         {"min_capacity_exact", c.min_capacity_exact},
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
      {"scope", ans.scope.empty() ? nlohmann::json(nullptr) : nlohmann::json(ans.scope)},
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
                        {"scope", ans.scope.empty() ? nlohmann::json(nullptr) : nlohmann::json(ans.scope)},
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

}  // namespace reservoir::tools
