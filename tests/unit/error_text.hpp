// The message of the E that f throws, or "no error" when it throws none.
#pragma once

#include <string>

namespace reservoir::testing {

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace reservoir::testing
