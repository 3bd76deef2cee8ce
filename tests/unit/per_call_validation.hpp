// How much of a long property test to run: all of it, or a tenth where the
// allocator validates itself after every call (RESERVOIR_VALIDATE, set in the
// ASan build). The full run in the fast build checks the property; the
// tenth checks the invariants under the sanitizers without taking most of an
// hour.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

namespace reservoir::testing {

inline bool per_call_validation() {
  const char* v = std::getenv("RESERVOIR_VALIDATE");
  return v != nullptr && *v != '\0' && std::string_view(v) != "0";
}

inline int scaled_for_validation(int n) { return per_call_validation() ? std::max(n / 10, 1) : n; }

// Per-call validation off while it lives (RESERVOIR_VALIDATE=0, then as it
// was): for tests of what surrounds the allocator (trace formats, advice)
// that replay real traces many times, where the replay and verify tests run
// the same traces validated.
class WithoutPerCallValidation {
 public:
  WithoutPerCallValidation() {
    if (const char* v = std::getenv("RESERVOIR_VALIDATE")) saved_ = v;
    ::setenv("RESERVOIR_VALIDATE", "0", 1);
  }
  ~WithoutPerCallValidation() {
    if (saved_) {
      ::setenv("RESERVOIR_VALIDATE", saved_->c_str(), 1);
    } else {
      ::unsetenv("RESERVOIR_VALIDATE");
    }
  }
  WithoutPerCallValidation(const WithoutPerCallValidation&) = delete;
  WithoutPerCallValidation& operator=(const WithoutPerCallValidation&) = delete;

 private:
  std::optional<std::string> saved_;
};

}  // namespace reservoir::testing
