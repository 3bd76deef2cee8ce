// 200,000 seeded mixed operations over several streams and sizes, with the
// whole-structure validator after every one, and every live block's contents
// checked on a HostDevice run.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/sim_device.hpp"
#include "../unit/per_call_validation.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

struct Live {
  void* ptr;
  std::size_t size;
  StreamId stream;
};

std::size_t random_size(std::mt19937_64& rng) {
  switch (rng() % 8) {
    case 0: return 1 + rng() % 512;
    case 1:
    case 2: return 1 + rng() % kMiB;
    case 3: return kMiB + rng() % (9 * kMiB);
    case 4: return 10 * kMiB + rng() % (40 * kMiB);
    case 5: return 64 * kMiB + rng() % (200 * kMiB);
    default: return 512 * (1 + rng() % 64);
  }
}

void run_random(const std::string& config, std::uint64_t seed, int steps) {
  SimDeviceOptions options;
  options.capacity = std::size_t{3} << 30;  // tight enough for the ladder and OOMs
  SimDevice device(options);
  CachingAllocator allocator(device, AllocatorConfig::parse(config));
  std::mt19937_64 rng(seed);
  std::vector<Live> live;
  std::int64_t ooms = 0;
  const bool validated_per_call = testing::per_call_validation();
  for (int step = 0; step < steps; ++step) {
    const unsigned r = rng() % 1000;
    if (r < 440 || live.empty()) {
      const StreamId stream = rng() % 3;
      const std::size_t size = random_size(rng);
      try {
        live.push_back({allocator.allocate(size, stream), size, stream});
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
    } else if (r < 900) {
      const std::size_t k = rng() % live.size();
      allocator.deallocate(live[k].ptr);
      live[k] = live.back();
      live.pop_back();
    } else if (r < 960) {
      allocator.record_stream(live[rng() % live.size()].ptr, 3 + rng() % 2);
    } else if (r < 985) {
      device.complete_stream(3 + rng() % 2);
    } else if (r < 995) {
      allocator.empty_cache();
    } else {
      allocator.reset_peak_stats();
    }
    // Where the allocator validates itself after every call (RESERVOIR_VALIDATE,
    // the ASan build), once a step is that already.
    if (!validated_per_call) allocator.validate();
  }
  EXPECT_EQ(allocator.stats().num_ooms, ooms);
  for (const Live& l : live) allocator.deallocate(l.ptr);
  device.complete_all_events();
  allocator.empty_cache();
  allocator.validate();
  EXPECT_EQ(device.live_segments(), 0u);
  EXPECT_EQ(allocator.stats().reserved_bytes[0].current, 0);
}

TEST(RandomOps, NativeDefaults) {
  run_random("", 1, 200000);
}
TEST(RandomOps, MaxSplitAndDivisions) {
  run_random("max_split_size_mb:64,roundup_power2_divisions:[1:4,64:2,>:1]", 2, 60000);
}
TEST(RandomOps, GarbageCollection) {
  run_random("garbage_collection_threshold:0.7", 3, 40000);
}

TEST(RandomOps, ExpandableSegments) {
  run_random("expandable_segments:True", 4, 60000);
}
TEST(RandomOps, Paging) {
  run_random("policy:paging", 5, 200000);
}
TEST(RandomOps, PagingWithMaxSplit) {
  run_random("policy:paging,max_split_size_mb:64", 6, 40000);
}

TEST(RandomOps, HostDeviceContentsSurvive) {
  HostDeviceOptions options;
  options.capacity = std::size_t{1} << 30;
  HostDevice device(options);
  CachingAllocator allocator(device, AllocatorConfig{});
  std::mt19937_64 rng(9);
  struct Filled {
    unsigned char* p;
    std::size_t size;
    unsigned char tag;
  };
  std::vector<Filled> live;
  for (int step = 0; step < 4000; ++step) {
    if (rng() % 100 < 55 || live.empty()) {
      const std::size_t size = 1 + rng() % (3 * kMiB);
      const auto tag = static_cast<unsigned char>(rng());
      auto* p = static_cast<unsigned char*>(allocator.allocate(size));
      std::memset(p, tag, size);
      live.push_back({p, size, tag});
    } else {
      const std::size_t k = rng() % live.size();
      const Filled f = live[k];
      for (std::size_t i = 0; i < f.size; i += 61) ASSERT_EQ(f.p[i], f.tag);
      ASSERT_EQ(f.p[f.size - 1], f.tag);
      allocator.deallocate(f.p);
      live[k] = live.back();
      live.pop_back();
    }
  }
  allocator.validate();
}

}  // namespace
}  // namespace reservoir
