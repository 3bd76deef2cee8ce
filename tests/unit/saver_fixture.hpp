// Helpers of the Saver's tests (saver_*_test.cpp): byte patterns, options,
// policy names.
#pragma once

#include <string>

#include "error_text.hpp"
#include "faulty_device.hpp"
#include "reservoir/saver.hpp"

namespace reservoir {
namespace {

using testing::error_of;
using testing::FaultyDevice;
[[maybe_unused]] constexpr std::size_t kMiB = std::size_t{1} << 20;

[[maybe_unused]] void fill(void* p, std::size_t n, unsigned seed) {
  auto* b = static_cast<unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>((i * 131 + seed) >> 3);
}
// The index of the first byte that differs from fill(), or -1.
[[maybe_unused]] long mismatch(const void* p, std::size_t n, unsigned seed) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    if (b[i] != static_cast<unsigned char>((i * 131 + seed) >> 3)) return static_cast<long>(i);
  }
  return -1;
}

[[maybe_unused]] SaverOptions options(const std::string& config = "", BackupStorage storage = BackupStorage::pinned) {
  SaverOptions o;
  o.config = AllocatorConfig::parse(config);
  o.storage = storage;
  o.chunk_bytes = std::size_t{1} << 20;
  o.copy_streams = 3;
  return o;
}

[[maybe_unused]] std::string policy_name(const std::string& c) {
  if (c.empty()) return "native";
  if (c.find("expandable") != std::string::npos) return "expandable";
  if (c.find("paging") != std::string::npos) return "paging";
  return "native_tuned";
}

}  // namespace
}  // namespace reservoir
