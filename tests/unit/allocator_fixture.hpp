// Shared test fixture: a CachingAllocator on a SimDevice with deterministic
// addresses, validated after every step the test takes.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <memory>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir::testing {

inline constexpr std::size_t kKiB = std::size_t{1} << 10;
inline constexpr std::size_t kMiB = std::size_t{1} << 20;
inline constexpr DevicePtr kBase = 0x7f0000000000;

class AllocatorTest : public ::testing::Test {
 protected:
  void make(const std::string& config = "", std::size_t capacity = std::size_t{80} << 30) {
    SimDeviceOptions options;
    options.capacity = capacity;
    device_ = std::make_unique<SimDevice>(options);
    allocator_ = std::make_unique<CachingAllocator>(*device_, AllocatorConfig::parse(config));
  }
  void SetUp() override { make(); }
  void TearDown() override {
    if (allocator_) allocator_->validate();
  }
  DevicePtr alloc(std::size_t size, StreamId stream = 0) {
    void* p = allocator_->allocate(size, stream);
    allocator_->validate();
    return reinterpret_cast<DevicePtr>(p);
  }
  void release(DevicePtr p) {
    allocator_->deallocate(reinterpret_cast<void*>(p));
    allocator_->validate();
  }
  // Frees the blocks and empties the cache: the device must hold nothing.
  void release_all(std::initializer_list<DevicePtr> blocks) {
    for (DevicePtr p : blocks) release(p);
    allocator_->empty_cache();
    allocator_->validate();
    EXPECT_EQ(device_->used_bytes(), 0u);
    EXPECT_EQ(device_->live_physical(), 0u);
  }
  std::int64_t stat(const std::string& key) const { return allocator_->stats_map().at(key); }

  std::unique_ptr<SimDevice> device_;
  std::unique_ptr<CachingAllocator> allocator_;
};

}  // namespace reservoir::testing
