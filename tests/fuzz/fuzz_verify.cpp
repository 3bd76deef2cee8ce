// libFuzzer target: verify, and advise's diagnosis (verify watched to the
// moment, else a replay), on whatever snapshot the JSON reader accepts. They
// must answer (agree, diverge, cannot verify; a diagnosis) or refuse with an
// error; they never crash, abort or leak.
#include <cstddef>
#include <cstdint>
#include <string>

#include "reservoir/advise.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const reservoir::Trace t = reservoir::read_snapshot_json(text, "fuzz");
    if (t.events.size() > 5000) return 0;  // keeps each run short
    (void)reservoir::verify(t);
    (void)reservoir::diagnose(t, std::uint64_t{1} << 30);
  } catch (const reservoir::Error&) {
  }
  return 0;
}
