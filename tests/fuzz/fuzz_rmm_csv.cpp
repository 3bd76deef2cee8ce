// libFuzzer target: RMM's CSV log reader, and compiling what it accepts.
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
    const reservoir::Trace t = reservoir::fuzz::read_as(reservoir::TraceFormat::rmm_csv, reservoir::fuzz::bytes_of(text));
    const reservoir::ReplayProgram p = reservoir::compile(t);
    if (p.contexts.size() != p.id_count) std::abort();
  } catch (const reservoir::TraceError&) {
  }
  return 0;
}
