// libFuzzer target: the text trace reader; what it accepts must write back to
// text it reads to the same events, and must replay.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"
#include "format_table.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const reservoir::Trace t = reservoir::fuzz::read_as(reservoir::TraceFormat::text, reservoir::fuzz::bytes_of(text));
    const std::string written = reservoir::fuzz::write_as(reservoir::TraceFormat::text, t);
    const reservoir::Trace back = reservoir::fuzz::read_as(reservoir::TraceFormat::text, reservoir::fuzz::bytes_of(written));
    if (back.events.size() != t.events.size()) std::abort();
    if (t.events.size() <= 2000) {
      reservoir::ReplayOptions options;
      options.capacity = std::size_t{1} << 34;
      (void)reservoir::replay(reservoir::compile(t),
                              reservoir::AllocatorConfig::parse(t.recorded_config),
                              t.recorded_config, options);
    }
  } catch (const reservoir::TraceError&) {
  } catch (const reservoir::UsageError&) {
  }
  return 0;
}
