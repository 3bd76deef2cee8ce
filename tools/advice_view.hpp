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

}  // namespace reservoir::tools
