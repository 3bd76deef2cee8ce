// How much of a long property test to run: all of it, or a tenth where the
// allocator validates itself after every call (RESERVOIR_VALIDATE, set in the
// ASan build) or the build is unoptimized or sanitized (the build without
// CUDA's headers, the sanitizers'). The full run in the optimized build
// (make test) checks the property; the tenth checks the invariants under
// the sanitizers, and the other build's code, without taking most of an
// hour (NativePaged's rescue test: 23 s optimized, 194 s at -O0).
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

inline constexpr bool slow_build() {
#if !defined(__OPTIMIZE__) || defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return true;
#else
  return false;
#endif
}

inline int scaled_for_validation(int n) {
  return per_call_validation() || slow_build() ? std::max(n / 10, 1) : n;
}

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
