// libFuzzer target: the pickle decoder and the snapshot reader on top of it.
// Anything that decodes must encode and decode again to the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "reservoir/errors.hpp"
#include "reservoir/pickle.hpp"
#include "reservoir/trace.hpp"

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
  try {
    const reservoir::Trace t = reservoir::read_pytorch_snapshot(input, "fuzz");
    (void)reservoir::compile(t);
  } catch (const reservoir::TraceError&) {
  }
  return 0;
}
