// One conformance suite over every registered segment policy
// (reservoir::policies(): a policy added to the table is tested here without
// a line changed). What any policy must keep: contents, statistics and the
// allocator's invariants through a random program on real memory; blocks per
// stream; the memory fraction; the retry ladder giving cached memory back
// before running out; device failures reported and undone; private pools on
// classic segments; the configuration naming the policy.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "faulty_device.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/config.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/snapshot.hpp"

namespace reservoir {
// gtest prints a parameter by this (the test list shows the policy's name).
inline void PrintTo(const PolicyInfo& policy, std::ostream* os) { *os << policy.name; }
}  // namespace reservoir

namespace reservoir::testing {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

AllocatorConfig config_of(const PolicyInfo& policy, const std::string& more = "") {
  std::string text = fmt::format("policy:{}", policy.name);
  if (!more.empty()) text += "," + more;
  return AllocatorConfig::parse(text);
}

class EveryPolicy : public ::testing::TestWithParam<PolicyInfo> {};

// A policy's allocator on `capacity` bytes of real host memory.
struct OnHost {
  OnHost(const PolicyInfo& policy, std::size_t capacity)
      : device(HostDeviceOptions{capacity, std::size_t{2} << 20}), a(device, config_of(policy)) {}
  // Empties the cache: the device must then hold nothing.
  void expect_all_back() {
    a.empty_cache();
    a.validate();
    EXPECT_EQ(device.used_bytes(), 0u);
  }
  HostDevice device;
  CachingAllocator a;
};

std::string policy_test_name(const ::testing::TestParamInfo<PolicyInfo>& info) {
  return std::string(info.param.name);
}

TEST(PolicyTable, ListsEachPolicyOnceNativeFirst) {
  const auto all = policies();
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[0].policy, Policy::native);
  EXPECT_FALSE(all[0].needs_virtual_memory);
  EXPECT_TRUE(all[0].native_layout);
  std::vector<std::string_view> names;
  for (const PolicyInfo& p : all) {
    EXPECT_EQ(to_string(p.policy), p.name);
    EXPECT_FALSE(p.summary.empty()) << p.name;
    names.push_back(p.name);
    // The config key takes each name and writes it back.
    const AllocatorConfig c = AllocatorConfig::parse(fmt::format("policy:{}", p.name));
    EXPECT_EQ(c.policy, p.policy);
    EXPECT_EQ(AllocatorConfig::parse(c.to_string()), c) << p.name;
  }
  EXPECT_EQ(names,
            (std::vector<std::string_view>{"native", "expandable", "paging", "native_paged"}));
}

TEST(PolicyTable, AnUnknownPolicyIsRefusedWithEveryName) {
  try {
    (void)AllocatorConfig::parse("policy:buddy");
    FAIL() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "key 'policy': value 'buddy' is not accepted; accepted: native, expandable, "
                  "paging or native_paged"),
              std::string::npos)
        << e.what();
  }
}

TEST_P(EveryPolicy, NeedsVirtualMemoryOnlyWhereItSaysSo) {
  HostDevice host;
  FaultyDevice no_vm(host, /*virtual_memory=*/false);
  if (GetParam().needs_virtual_memory) {
    try {
      CachingAllocator a(no_vm, config_of(GetParam()));
      FAIL() << "constructed";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("has no virtual-memory support"), std::string::npos)
          << e.what();
    }
  } else {
    CachingAllocator a(no_vm, config_of(GetParam()));
    void* p = a.allocate(3 * kMiB);
    a.deallocate(p);
    a.empty_cache();
    EXPECT_EQ(host.used_bytes(), 0u);
  }
}

struct Live {
  unsigned char* p;
  std::size_t size;
  StreamId stream;
  unsigned char tag;
};

TEST_P(EveryPolicy, ARandomProgramKeepsContentsStatisticsAndInvariants) {
  HostDeviceOptions options;
  options.capacity = std::size_t{1} << 30;
  HostDevice device(options);
  CachingAllocator a(device, config_of(GetParam()));
  std::uint64_t seed = 0x9e3779b97f4a7c15ULL;
  auto next = [&seed] {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return seed >> 33;
  };
  std::vector<Live> live;
  auto check = [](const Live& l) {
    for (std::size_t i = 0; i < l.size; i += 4093) ASSERT_EQ(l.p[i], l.tag) << i;
    ASSERT_EQ(l.p[l.size - 1], l.tag);
  };
  for (int step = 0; step < 1200; ++step) {
    const std::uint64_t r = next() % 100;
    if (r < 55 || live.empty()) {
      const std::uint64_t kind = next() % 10;
      const std::size_t size = kind < 6   ? 1 + next() % kMiB           // small
                               : kind < 9 ? kMiB + next() % (12 * kMiB)  // mid-sized
                                          : 12 * kMiB + next() % (24 * kMiB);
      const StreamId stream = next() % 4 == 0 ? 7 : 0;
      auto* p = static_cast<unsigned char*>(a.allocate(size, stream));
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(p) % 512, 0u);
      const auto tag = static_cast<unsigned char>(next());
      std::memset(p, tag, size);
      live.push_back({p, size, stream, tag});
    } else if (r < 98) {
      const std::size_t k = next() % live.size();
      check(live[k]);
      a.deallocate(live[k].p);
      live[k] = live.back();
      live.pop_back();
    } else {
      a.empty_cache();
    }
    if (step % 60 == 0 || r >= 98) {
      a.validate();
      // No two live allocations overlap; each block holds its bytes and
      // lies on its allocation's stream.
      std::map<std::uintptr_t, std::size_t> by_address;
      std::size_t requested = 0;
      for (const Live& l : live) {
        by_address.emplace(reinterpret_cast<std::uintptr_t>(l.p), l.size);
        requested += l.size;
        check(l);
      }
      std::uintptr_t end = 0;
      for (const auto& [p, size] : by_address) {
        ASSERT_GE(p, end);
        end = p + size;
      }
      const DeviceStats s = a.stats();
      EXPECT_EQ(s.requested_bytes[0].current, static_cast<std::int64_t>(requested));
      EXPECT_EQ(s.allocation[0].current, static_cast<std::int64_t>(live.size()));
      EXPECT_EQ(s.active[0].current, static_cast<std::int64_t>(live.size()));
      EXPECT_GE(s.allocated_bytes[0].current, s.requested_bytes[0].current);
      EXPECT_GE(s.reserved_bytes[0].current, s.allocated_bytes[0].current);
      EXPECT_EQ(static_cast<std::size_t>(s.reserved_bytes[0].current), device.used_bytes());
      std::map<std::uintptr_t, StreamId> stream_of;
      for (const Live& l : live) stream_of[reinterpret_cast<std::uintptr_t>(l.p)] = l.stream;
      for (const SegmentInfo& seg : a.snapshot().segments) {
        for (const BlockInfo& b : seg.blocks) {
          if (b.state != BlockState::active_allocated) continue;
          ASSERT_EQ(stream_of.count(b.address), 1u) << b.address;
          EXPECT_EQ(seg.stream, stream_of[b.address]);
        }
      }
    }
  }
  for (const Live& l : live) {
    check(l);
    a.deallocate(l.p);
  }
  const DeviceStats s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.requested_bytes[0].current, 0);
  EXPECT_EQ(s.active[0].current, 0);
  a.empty_cache();
  a.validate();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
  EXPECT_EQ(device.used_bytes(), 0u);
}

TEST_P(EveryPolicy, ACachedBlockServesItsOwnStreamWithoutADeviceCall) {
  OnHost host(GetParam(), std::size_t{8} << 30);
  CachingAllocator& a = host.a;
  void* first = a.allocate(6 * kMiB, 1);
  a.deallocate(first);
  const std::int64_t device_allocs = a.stats().num_device_alloc;
  void* again = a.allocate(6 * kMiB, 1);
  EXPECT_EQ(again, first);
  EXPECT_EQ(a.stats().num_device_alloc, device_allocs);
  void* other = a.allocate(6 * kMiB, 2);  // another stream never gets stream 1's block
  EXPECT_NE(other, first);
  a.deallocate(again);
  a.deallocate(other);
  host.expect_all_back();
}

TEST_P(EveryPolicy, TheMemoryFractionBoundsReservedMemory) {
  OnHost host(GetParam(), std::size_t{512} << 20);
  CachingAllocator& a = host.a;
  a.set_memory_fraction(0.25);  // 128 MiB
  std::vector<void*> held;
  bool ran_out = false;
  for (int i = 0; i < 64 && !ran_out; ++i) {
    try {
      held.push_back(a.allocate(9 * kMiB));
    } catch (const OutOfMemoryError&) {
      ran_out = true;
    }
  }
  EXPECT_TRUE(ran_out);
  EXPECT_LE(a.stats().reserved_bytes[0].peak, std::int64_t{128} << 20);
  EXPECT_GE(held.size(), 10u);  // 10 x 9 MiB fit in 128 MiB under any policy
  a.validate();
  for (void* p : held) a.deallocate(p);
  held.clear();
  void* p = a.allocate(100 * kMiB);  // the cache gives way to a request that fits
  a.deallocate(p);
  host.expect_all_back();
}

TEST_P(EveryPolicy, CachedMemoryGoesBackBeforeRunningOut) {
  OnHost host(GetParam(), std::size_t{64} << 20);
  CachingAllocator& a = host.a;
  void* p = a.allocate(40 * kMiB);
  a.deallocate(p);
  void* q = a.allocate(50 * kMiB);  // fits only once the 40 MiB go back
  EXPECT_NE(q, nullptr);
  a.validate();
  try {
    (void)a.allocate(60 * kMiB);
    FAIL() << "60 MiB beside 50 MiB on a 64 MiB device";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
  a.validate();
  a.deallocate(q);
  host.expect_all_back();
}

TEST_P(EveryPolicy, AFailingDeviceCallIsReportedAndUndone) {
  // Each call a policy makes to get memory, failed in turn (an error, not
  // out of memory): DeviceError, nothing held, and the next request served.
  for (const CallKind kind : {CallKind::allocate_segment, CallKind::reserve,
                              CallKind::create_physical, CallKind::map, CallKind::set_access}) {
    SCOPED_TRACE(to_string(kind));
    HostDevice host;
    FaultyDevice device(host);
    CachingAllocator a(device, config_of(GetParam()));
    device.fail_nth(kind, 1, Status::device_error);
    bool failed = false;
    try {
      a.deallocate(a.allocate(5 * kMiB));
    } catch (const DeviceError& e) {
      failed = true;
      EXPECT_EQ(e.call(), kind);
    }
    a.validate();
    EXPECT_EQ(failed, device.calls(kind) > 0);
    EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
    device.clear();
    void* p = a.allocate(5 * kMiB);
    a.deallocate(p);
    a.empty_cache();
    a.validate();
    EXPECT_EQ(host.used_bytes(), 0u);
  }
}

// PyTorch's expandable segments serve private pools too (from PyTorch 2.5);
// reservoir's own policies keep them on classic segments.
TEST_P(EveryPolicy, PrivatePoolsTakeTheSegmentsThePolicySays) {
  OnHost host(GetParam(), std::size_t{8} << 30);
  CachingAllocator& a = host.a;
  const PoolId pool{1, 1};
  a.begin_allocate_to_pool(pool, [](StreamId) { return true; });
  void* p = a.allocate(3 * kMiB);
  a.end_allocate_to_pool(pool);
  const Snapshot snap = a.snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].is_expandable, GetParam().policy == Policy::expandable);
  EXPECT_EQ(snap.segments[0].pool_id, pool);
  a.deallocate(p);
  a.release_pool(pool);
  host.expect_all_back();
}

TEST_P(EveryPolicy, ItsSegmentsAreTheKindItSays) {
  HostDevice device;
  CachingAllocator a(device, config_of(GetParam()));
  void* p = a.allocate(3 * kMiB);
  const Snapshot snap = a.snapshot();
  ASSERT_FALSE(snap.segments.empty());
  for (const SegmentInfo& s : snap.segments) {
    // A policy with the native layout has the native policy's segments
    // (whatever backs them); the others' are virtual-memory arenas.
    EXPECT_EQ(s.is_expandable, GetParam().needs_virtual_memory && !GetParam().native_layout);
  }
  EXPECT_EQ(a.config().policy, GetParam().policy);
  a.deallocate(p);
}

INSTANTIATE_TEST_SUITE_P(Registered, EveryPolicy, ::testing::ValuesIn(policies()),
                         policy_test_name);

}  // namespace
}  // namespace reservoir::testing
