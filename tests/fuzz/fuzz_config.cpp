// libFuzzer target: the allocator config parser. Any input either parses to a
// config whose canonical string parses back to the same config, or raises
// ConfigError; nothing else may escape.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "reservoir/config.hpp"
#include "reservoir/errors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const reservoir::AllocatorConfig c = reservoir::AllocatorConfig::parse(text);
    if (!(reservoir::AllocatorConfig::parse(c.to_string()) == c)) std::abort();
  } catch (const reservoir::ConfigError&) {
  }
  return 0;
}
