// HostDevice with real memory: contents through pointers, and RSS.
#include <gtest/gtest.h>

#include <cstring>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/host_device.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST(HostDevice, MappedPhysicalMemoryKeepsItsContentsAcrossRemapping) {
  HostDevice d;
  const std::size_t g = d.granularity();
  DevicePtr va1 = 0, va2 = 0;
  ASSERT_EQ(d.reserve(4 * g, 0, &va1), Status::ok);
  ASSERT_EQ(d.reserve(4 * g, 0, &va2), Status::ok);
  PhysicalHandle h = 0;
  ASSERT_EQ(d.create_physical(2 * g, &h), Status::ok);
  ASSERT_EQ(d.map(va1, 2 * g, h, 0), Status::ok);
  ASSERT_EQ(d.set_access(va1, 2 * g), Status::ok);
  auto* p = reinterpret_cast<unsigned char*>(va1);
  for (std::size_t i = 0; i < 2 * g; ++i) p[i] = static_cast<unsigned char>(i * 7);
  // The same physical memory at another address shows the same bytes.
  ASSERT_EQ(d.map(va2 + g, 2 * g, h, 0), Status::ok);
  ASSERT_EQ(d.set_access(va2 + g, 2 * g), Status::ok);
  EXPECT_EQ(std::memcmp(p, reinterpret_cast<void*>(va2 + g), 2 * g), 0);
  ASSERT_EQ(d.unmap(va1, 2 * g), Status::ok);
  ASSERT_EQ(d.release_physical(h), Status::ok);
  auto* q = reinterpret_cast<unsigned char*>(va2 + g);
  for (std::size_t i = 0; i < 2 * g; ++i) ASSERT_EQ(q[i], static_cast<unsigned char>(i * 7)) << i;
  ASSERT_EQ(d.unmap(va2 + g, 2 * g), Status::ok);
  EXPECT_EQ(d.used_bytes(), 0u);
  EXPECT_EQ(d.unreserve(va1, 4 * g), Status::ok);
  EXPECT_EQ(d.unreserve(va2, 4 * g), Status::ok);
}

TEST(HostDevice, ResidentMemoryFallsWhenPhysicalMemoryIsReleased) {
  HostDevice d;
  const std::size_t bytes = 64 * kMiB;
  DevicePtr va = 0;
  ASSERT_EQ(d.reserve(bytes, 0, &va), Status::ok);
  PhysicalHandle h = 0;
  ASSERT_EQ(d.create_physical(bytes, &h), Status::ok);
  ASSERT_EQ(d.map(va, bytes, h, 0), Status::ok);
  ASSERT_EQ(d.set_access(va, bytes), Status::ok);
  const std::size_t before = current_rss_bytes();
  std::memset(reinterpret_cast<void*>(va), 0xab, bytes);
  const std::size_t touched = current_rss_bytes();
  EXPECT_GE(touched, before + bytes * 9 / 10);
  ASSERT_EQ(d.unmap(va, bytes), Status::ok);
  ASSERT_EQ(d.release_physical(h), Status::ok);
  EXPECT_LE(current_rss_bytes(), touched - bytes * 9 / 10);
  ASSERT_EQ(d.unreserve(va, bytes), Status::ok);
}

TEST(HostDevice, CachingAllocatorBlocksHoldRealData) {
  HostDevice d;
  CachingAllocator allocator(d, AllocatorConfig{});
  std::vector<std::pair<unsigned char*, std::size_t>> blocks;
  for (std::size_t i = 0; i < 40; ++i) {
    const std::size_t size = (i % 3 == 0) ? 3 * kMiB + i : 4096 * (i + 1);
    auto* p = static_cast<unsigned char*>(allocator.allocate(size));
    std::memset(p, static_cast<int>(i), size);
    blocks.emplace_back(p, size);
  }
  for (std::size_t i = 0; i < blocks.size(); i += 2) allocator.deallocate(blocks[i].first);
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    for (std::size_t k = 0; k < blocks[i].second; ++k) {
      ASSERT_EQ(blocks[i].first[k], static_cast<unsigned char>(i));
    }
  }
  allocator.validate();
  const std::size_t rss = current_rss_bytes();
  for (std::size_t i = 1; i < blocks.size(); i += 2) allocator.deallocate(blocks[i].first);
  allocator.empty_cache();
  EXPECT_EQ(d.used_bytes(), 0u);
  EXPECT_LT(current_rss_bytes(), rss);
}

}  // namespace
}  // namespace reservoir
