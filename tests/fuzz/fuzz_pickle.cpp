// libFuzzer target: the pickle decoder and the snapshot reader on top of it.
// Anything that decodes must encode and decode again to the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/pickle.hpp"
#include "reservoir/trace.hpp"
#include "format_table.hpp"

constexpr auto kPickle = reservoir::TraceFormat::pytorch_pickle;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> input(data, size);
  try {
    const reservoir::pickle::Document doc = reservoir::pickle::decode(input);
    std::string once;
    try {
      once = reservoir::pickle::encode(doc.root());
    } catch (const reservoir::TraceError&) {
      return 0;  // a cyclic structure cannot be encoded; the encoder says so
    }
    const auto again = reservoir::pickle::decode(
        std::span(reinterpret_cast<const std::uint8_t*>(once.data()), once.size()));
    if (reservoir::pickle::encode(again.root()) != once) std::abort();
  } catch (const reservoir::TraceError&) {
  }
  // Every device, read as the tools read them (each device's entries moved
  // out as read): device 0 as read alone.
  try {
    const std::vector<reservoir::Trace> all = reservoir::trace_format(kPickle).read(input, "fuzz", {});
    const reservoir::Trace first = reservoir::fuzz::read_as(kPickle, input);
    if (all.empty() || all.front().events != first.events) std::abort();
  } catch (const reservoir::TraceError&) {
  }
  reservoir::Trace t;
  try {
    t = reservoir::fuzz::read_as(kPickle, input);
    (void)reservoir::compile(t);
  } catch (const reservoir::TraceError&) {
    return 0;
  }
  // What the reader accepts writes back and reads again to the same trace.
  std::string written;
  try {
    written = reservoir::fuzz::write_as(kPickle, t);
  } catch (const reservoir::ConfigError&) {
    return 0;  // settings the reader passed through but no config accepts
  }
  const reservoir::Trace back = reservoir::fuzz::read_as(kPickle, reservoir::fuzz::bytes_of(written));
  if (back.events != t.events || back.final_state.contexts != t.final_state.contexts ||
      back.final_state.segments != t.final_state.segments) {
    std::abort();
  }
  return 0;
}
