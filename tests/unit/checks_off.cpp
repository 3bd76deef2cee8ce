// Compiled with RESERVOIR_DEBUG_ASSERTS=0 (tests/CMakeLists.txt).
#include "reservoir/detail/debug_assert.hpp"

static_assert(RESERVOIR_DEBUG_ASSERTS == 0, "this file is compiled with the checks off");

namespace reservoir {

int conditions_evaluated_when_off() {
  int evaluated = 0;
  RESERVOIR_DEBUG_ASSERT(++evaluated == 1);
  RESERVOIR_DEBUG_ASSERT(++evaluated == 100);  // would fail, were it evaluated
  return evaluated;
}

}  // namespace reservoir
