// The checkout's root folder, where the tests find their data files. It
// comes from one source generated per build (source_dir.cpp.in), not from a
// compiler flag on every test: a compiler cache then reuses every other
// test object in a clone at another path.
#pragma once

namespace reservoir::testing {
const char* source_dir();
}  // namespace reservoir::testing

#define RESERVOIR_SOURCE_DIR ::reservoir::testing::source_dir()
