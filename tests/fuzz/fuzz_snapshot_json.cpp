// libFuzzer target: the JSON snapshot reader. Whatever it accepts must write
// back and read again to the same trace.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  reservoir::Trace t;
  try {
    t = reservoir::read_snapshot_json(text, "fuzz");
    (void)reservoir::compile(t);
  } catch (const reservoir::TraceError&) {
    return 0;
  }
  std::string once;
  try {
    once = reservoir::write_snapshot_json(t);
  } catch (const reservoir::ConfigError&) {
    return 0;  // settings the reader passed through but no config accepts
  }
  const reservoir::Trace back = reservoir::read_snapshot_json(once, "fuzz");
  if (back.events != t.events || back.final_state.contexts != t.final_state.contexts ||
      back.final_state.segments != t.final_state.segments ||
      reservoir::write_snapshot_json(back) != once) {
    std::abort();
  }
  return 0;
}
