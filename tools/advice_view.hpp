// How `reservoir advise` shows its advice: a text report, JSON with the keys
// docs/tools.md documents, and an HTML section (also in `reservoir report`).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "reservoir/advise.hpp"

namespace reservoir::tools {

std::string advice_text(const Trace& trace, const Advice& advice);
nlohmann::json advice_json(const Trace& trace, const Advice& advice);
// The diagnosis with a picture of the segments at the moment (the failed
// request drawn beside them), the sweep as a chart, and the recommendation.
// `id` makes the section's element ids unique on a page.
std::string advice_html(const Trace& trace, const Advice& advice, const std::string& id);

// A job of many ranks: the answer first (which ranks ran out of memory, one
// setting for all), then how the ranks differ, then the settings across ranks.
std::string job_text(const JobAdvice& job);
nlohmann::json job_json(const JobAdvice& job);
// The job's page; `rank_pages` holds each rank's page (relative link, or ""
// when it has none), in the order of job.ranks.
std::string job_html(const JobAdvice& job, const std::vector<std::string>& rank_pages);

}  // namespace reservoir::tools
