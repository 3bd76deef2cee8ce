// libFuzzer target: the JSON snapshot reader. Whatever it accepts must write
// back and read again to the same trace.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"
#include "format_table.hpp"

constexpr auto kJson = reservoir::TraceFormat::snapshot_json;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  reservoir::Trace t;
  try {
    t = reservoir::fuzz::read_as(kJson, reservoir::fuzz::bytes_of(text));
    (void)reservoir::compile(t);
  } catch (const reservoir::TraceError&) {
    return 0;
  }
  std::string once;
  try {
    once = reservoir::fuzz::write_as(kJson, t);
  } catch (const reservoir::ConfigError&) {
    return 0;  // settings the reader passed through but no config accepts
  }
  const reservoir::Trace back = reservoir::fuzz::read_as(kJson, reservoir::fuzz::bytes_of(once));
  if (back.events != t.events || back.final_state.contexts != t.final_state.contexts ||
      back.final_state.segments != t.final_state.segments ||
      reservoir::fuzz::write_as(kJson, back) != once) {
    std::abort();
  }
  return 0;
}
