// HostDevice with real memory: contents through pointers, and RSS.
#include <gtest/gtest.h>

#include <cstring>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
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
  const std::size_t before = current_rss_bytes();
  PhysicalHandle h = 0;
  ASSERT_EQ(d.create_physical(bytes, &h), Status::ok);
  ASSERT_EQ(d.map(va, bytes, h, 0), Status::ok);
  ASSERT_EQ(d.set_access(va, bytes), Status::ok);
  // Mapped memory has its pages at once, as a GPU's physical memory does.
  const std::size_t touched = current_rss_bytes();
  EXPECT_GE(touched, before + bytes * 9 / 10);
  std::memset(reinterpret_cast<void*>(va), 0xab, bytes);
  EXPECT_LE(current_rss_bytes(), touched + bytes / 10);
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

// The virtual-memory policies on real memory: live blocks keep every byte
// through unmapping, handle release and stitching, and RSS follows.
class HostVm : public ::testing::TestWithParam<const char*> {};

TEST_P(HostVm, LiveBytesSurviveEveryRemapping) {
  HostDeviceOptions options;
  options.capacity = 192 * kMiB;  // tight: pages are unmapped, handles released, pages stitched
  HostDevice d(options);
  CachingAllocator allocator(d, AllocatorConfig::parse(GetParam()));
  struct Filled {
    unsigned char* p;
    std::size_t size;
    unsigned char tag;
  };
  std::vector<Filled> live;
  std::uint64_t seed = 12345;
  auto next = [&seed] {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return seed >> 33;
  };
  auto check = [](const Filled& f) {
    for (std::size_t i = 0; i < f.size; i += 4093) ASSERT_EQ(f.p[i], f.tag) << i;
    ASSERT_EQ(f.p[f.size - 1], f.tag);
  };
  int ooms = 0;
  for (int step = 0; step < 1500; ++step) {
    if (next() % 100 < 55 || live.empty()) {
      const std::size_t size = next() % 4 == 0 ? kMiB + next() % (40 * kMiB) : 1 + next() % kMiB;
      const auto tag = static_cast<unsigned char>(next());
      try {
        auto* p = static_cast<unsigned char*>(allocator.allocate(size));
        std::memset(p, tag, size);
        live.push_back({p, size, tag});
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
    } else {
      const std::size_t k = next() % live.size();
      check(live[k]);
      allocator.deallocate(live[k].p);
      live[k] = live.back();
      live.pop_back();
    }
    if (step % 100 == 0) allocator.validate();
  }
  for (const Filled& f : live) check(f);
  EXPECT_GT(allocator.stats().num_device_free, 0);  // memory really went back mid-run
  const std::size_t rss = current_rss_bytes();
  for (const Filled& f : live) allocator.deallocate(f.p);
  allocator.empty_cache();
  allocator.validate();
  EXPECT_EQ(d.used_bytes(), 0u);
  EXPECT_LT(current_rss_bytes(), rss);
}

INSTANTIATE_TEST_SUITE_P(Policies, HostVm,
                         ::testing::Values("expandable_segments:True", "policy:paging"),
                         [](const auto& info) {
                           return std::string(info.param[0] == 'e' ? "expandable" : "paging");
                         });

TEST(HostVm, AMovedHandleServesTheGrowingArenaAndTheNeighboursKeepTheirBytes) {
  HostDeviceOptions options;
  options.capacity = 80 * kMiB;
  HostDevice d(options);
  CachingAllocator allocator(d, AllocatorConfig::parse("policy:paging"));
  std::vector<unsigned char*> blocks;
  for (int i = 0; i < 3; ++i) {
    blocks.push_back(static_cast<unsigned char*>(allocator.allocate(20 * kMiB)));
    std::memset(blocks.back(), 0x20 + i, 20 * kMiB);
  }
  allocator.deallocate(blocks[1]);
  // The device has 20 MiB left: the freed handle is unmapped and mapped again
  // under the new block, with 20 MiB of new memory after it.
  auto* moved = static_cast<unsigned char*>(allocator.allocate(40 * kMiB));
  std::memset(moved, 0xee, 40 * kMiB);
  EXPECT_EQ(d.used_bytes(), 80 * kMiB);
  for (int i : {0, 2}) {
    for (std::size_t k = 0; k < 20 * kMiB; k += 4096) ASSERT_EQ(blocks[i][k], 0x20 + i) << k;
  }
  EXPECT_EQ(moved[40 * kMiB - 1], 0xee);
  allocator.validate();
  allocator.deallocate(moved);
  allocator.deallocate(blocks[0]);
  allocator.deallocate(blocks[2]);
  allocator.empty_cache();
  EXPECT_EQ(d.used_bytes(), 0u);
}

// Under pressure, free handles scattered between live memory serve a
// request, each mapped whole from its start (as CUDA maps a handle): the
// memory is real, the live block beside them untouched, and released pages
// leave the process's memory.
TEST(HostVm, FreeHandlesServeARequestOnAFullDeviceAndReleasedPagesLeaveRss) {
  HostDeviceOptions options;
  options.capacity = 60 * kMiB;
  HostDevice d(options);
  CachingAllocator allocator(d, AllocatorConfig::parse("policy:paging"));
  std::vector<unsigned char*> part;
  for (int i = 0; i < 3; ++i) {
    part.push_back(static_cast<unsigned char*>(allocator.allocate(20 * kMiB)));
    std::memset(part.back(), 0x10 + i, 20 * kMiB);
  }
  allocator.deallocate(part[0]);
  allocator.deallocate(part[2]);
  auto* s = static_cast<unsigned char*>(allocator.allocate(40 * kMiB));
  std::memset(s, 0xee, 40 * kMiB);
  for (std::size_t k = 0; k < 20 * kMiB; k += 4096) ASSERT_EQ(part[1][k], 0x11);
  EXPECT_EQ(s[40 * kMiB - 1], 0xee);
  EXPECT_EQ(d.used_bytes(), 60 * kMiB);
  allocator.validate();
  allocator.deallocate(s);
  allocator.deallocate(part[1]);
  const std::size_t rss = current_rss_bytes();
  allocator.empty_cache();
  EXPECT_EQ(d.used_bytes(), 0u);
  EXPECT_LE(current_rss_bytes(), rss - 50 * kMiB);
}

}  // namespace
}  // namespace reservoir
