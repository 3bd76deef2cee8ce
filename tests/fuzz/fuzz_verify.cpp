// libFuzzer target: verify on whatever snapshot the JSON reader accepts. It
// must answer (agree, diverge, cannot verify) or refuse with an error; it
// never crashes, aborts or leaks.
#include <cstddef>
#include <cstdint>
#include <string>

#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const reservoir::Trace t = reservoir::read_snapshot_json(text, "fuzz");
    if (t.events.size() > 5000) return 0;  // keeps each run short
    (void)reservoir::verify(t);
  } catch (const reservoir::Error&) {
  }
  return 0;
}
