#include "reservoir/detail/debug_assert.hpp"

#include <cstdio>
#include <cstdlib>

namespace reservoir::detail {

void debug_assert_failed(const char* condition, const char* file, int line,
                         const char* function) noexcept {
  std::fprintf(stderr, "reservoir: internal check failed: %s, at %s:%d in %s\n", condition, file,
               line, function);
  std::fflush(stderr);
  std::abort();
}

}  // namespace reservoir::detail
