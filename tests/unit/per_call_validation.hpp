// How much of a long property test to run: all of it, or a tenth where the
// allocator validates itself after every call (RESERVOIR_VALIDATE, set in the
// sanitizer builds). The full run in the fast build checks the property; the
// tenth checks the invariants under the sanitizers without taking most of an
// hour.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string_view>

namespace reservoir::testing {

inline bool per_call_validation() {
  const char* v = std::getenv("RESERVOIR_VALIDATE");
  return v != nullptr && *v != '\0' && std::string_view(v) != "0";
}

inline int scaled_for_validation(int n) { return per_call_validation() ? std::max(n / 10, 1) : n; }

}  // namespace reservoir::testing
