// verify: replaying a recording exactly and comparing every device request
// and address; the real snapshots in ../shared/traces.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <filesystem>
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "shared_traces.hpp"
#include "trace_fixture.hpp"

namespace reservoir {
namespace {

TEST(Verify, AgreesWithARecordingOfTheNativeRules) {
  const Trace t = record(7, 3000);
  const std::string pickled = write_pytorch_snapshot(t);
  const Trace back = read_pytorch_snapshot(
      std::span(reinterpret_cast<const std::uint8_t*>(pickled.data()), pickled.size()), "rec");
  ASSERT_EQ(back.events.size(), t.events.size());
  const VerifyResult r = verify(back);
  EXPECT_TRUE(r.agreed) << r.divergence;
  EXPECT_GT(r.segment_allocs_checked, 20u);
  EXPECT_TRUE(r.final_state_checked);
}

TEST(Verify, ReconstructsTracesThatStartMidRun) {
  const Trace full = record(11, 4000);
  for (std::size_t cut : {500u, 1500u, 2500u}) {
    Trace t = full;
    t.events.erase(t.events.begin(), t.events.begin() + static_cast<std::ptrdiff_t>(cut));
    const VerifyResult r = verify(t);
    EXPECT_TRUE(r.agreed) << "cut " << cut << ": " << r.divergence;
    EXPECT_GT(r.initial_live_blocks, 0u);
  }
}

TEST(Verify, ReportsTheFirstDivergence) {
  Trace t = record(7, 400);
  std::size_t target = 0;
  for (std::size_t i = 100; i < t.events.size(); ++i) {
    if (t.events[i].action == TraceAction::alloc) {
      target = i;
      break;
    }
  }
  ASSERT_GT(target, 0u);
  const DevicePtr recorded = t.events[target].addr;
  t.events[target].addr += 512;
  for (std::size_t i = target + 1; i < t.events.size(); ++i) {
    if (t.events[i].addr != recorded) continue;
    if (t.events[i].action == TraceAction::alloc) break;  // a later block at that address
    t.events[i].addr += 512;                              // this block's own free events
  }
  const VerifyResult r = verify(t);
  EXPECT_FALSE(r.agreed);
  EXPECT_EQ(r.divergence_event, target);
  EXPECT_NE(r.divergence.find(fmt::format("expected {:#x}, got {:#x}", recorded + 512, recorded)),
            std::string::npos)
      << r.divergence;
  EXPECT_NE(r.divergence.find("free blocks of the pool that fit"), std::string::npos);
}

// Two cached blocks of one size, the newer segment at the lower address: from
// PyTorch 2.13 the older segment's block serves the next request, before it
// the lower address. A recording that names its release (pytorch_version, as
// reservoir's allocator installed into PyTorch writes its own) is verified
// under that release's rules, and disagrees under the other's.
Trace equal_sizes_recorded_under(const std::string& release) {
  // Each new segment below the one before: the newer block has the lower address.
  DevicePtr next = DevicePtr{1} << 40;
  Recorder r("pytorch_version:" + release);
  r.device.set_address_source([&next](std::size_t bytes, DevicePtr* addr) {
    next -= bytes;
    *addr = next;
    return Status::ok;
  });
  void* older = r.alloc(24 * kMiB);
  void* newer = r.alloc(24 * kMiB);
  r.allocator.deallocate(older);
  r.allocator.deallocate(newer);
  r.alloc(20 * kMiB);
  return pickled(r.finish());
}

TEST(Verify, ARecordingThatNamesItsReleaseIsVerifiedUnderItsRules) {
  for (const auto& [release, other] : {std::pair<std::string, std::string>{"2.11", "2.15"}, {"2.15", "2.11"}}) {
    const Trace t = equal_sizes_recorded_under(release);
    EXPECT_EQ(t.settings.pytorch_version, release);
    const VerifyResult r = verify(t);
    EXPECT_TRUE(r.agreed) << release << ": " << r.divergence;
    EXPECT_EQ(r.pytorch_rules, release);
    // The same events under the other release's rules take the other block.
    Trace as_other = t;
    as_other.settings.set_pytorch_version(other);
    EXPECT_FALSE(verify(as_other).agreed) << release;
  }
}

// A program of reservoir's own under one of its page policies, on a device
// of `capacity`: allocations of a byte to 300 MiB on two streams, frees in
// random order, empty_cache() now and then, and out-of-memory errors caught
// (about half of what is held freed after each), recorded from the start.
Trace page_policy_program(const std::string& policy, std::uint32_t seed, std::size_t capacity) {
  Recorder r("policy:" + policy, capacity);
  std::mt19937 rng(seed);
  std::vector<void*> live;
  for (int step = 0; step < 400; ++step) {
    const std::uint32_t what = rng() % 100;
    if (what < 55 || live.empty()) {
      const auto bytes = static_cast<std::size_t>(std::exp2(std::uniform_real_distribution<double>(0, 28.2)(rng)));
      try {
        live.push_back(r.alloc(std::max<std::size_t>(bytes, 1), rng() % 2));
      } catch (const OutOfMemoryError&) {
        std::shuffle(live.begin(), live.end(), rng);
        for (std::size_t k = live.size() / 2; k < live.size(); ++k) r.allocator.deallocate(live[k]);
        live.resize(live.size() / 2);
      }
    } else if (what < 97) {
      const std::size_t k = rng() % live.size();
      r.allocator.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      r.allocator.empty_cache();
    }
  }
  return pickled(r.finish());
}

TEST(Verify, ReservoirsPagePoliciesVerifyOnTheDeviceTheyRanOn) {
  constexpr std::size_t kDevice = 1536 * kMiB;
  for (const std::string policy : {"native_paged", "paging"}) {
    std::size_t ooms = 0;
    for (std::uint32_t seed = 1; seed <= 400; ++seed) {
      const Trace t = page_policy_program(policy, seed, kDevice);
      const auto n = [&](TraceAction a) {
        return static_cast<std::uint64_t>(std::count_if(
            t.events.begin(), t.events.end(), [a](const TraceEvent& e) { return e.action == a; }));
      };
      ooms += n(TraceAction::oom);
      VerifyOptions given;
      given.device_memory = kDevice;
      const VerifyResult v = verify(t, given);

      EXPECT_TRUE(v.agreed) << policy << " seed " << seed << ": event " << v.divergence_event << ": "
                            << v.divergence;
      EXPECT_EQ(v.pages_of, "policy:" + policy + "'s pages");
      EXPECT_EQ(v.allocs_checked, n(TraceAction::alloc)) << policy << " seed " << seed;
      EXPECT_EQ(v.segment_maps_checked, n(TraceAction::segment_map)) << policy << " seed " << seed;
      EXPECT_EQ(v.segment_unmaps_checked, n(TraceAction::segment_unmap)) << policy << " seed " << seed;
      EXPECT_EQ(v.ooms_checked, n(TraceAction::oom)) << policy << " seed " << seed;
      EXPECT_TRUE(v.final_state_checked);
      EXPECT_GT(v.segment_maps_checked, 0u);
      if (n(TraceAction::oom) > 0) {
        // Without the device's size: taken from the recorded errors.
        const VerifyResult inferred = verify(t);
        EXPECT_TRUE(inferred.agreed) << policy << " seed " << seed << ": " << inferred.divergence;
        EXPECT_TRUE(inferred.device_memory_inferred);
        EXPECT_EQ(inferred.device_memory, kDevice);
      }
    }
    EXPECT_GT(ooms, 0u) << policy << ": the programs are to run out of memory";
  }
}

TEST(Verify, APagePolicysMapThatDiffersIsADivergence) {
  Trace t = page_policy_program("native_paged", 3, std::size_t{1} << 34);
  auto map = std::find_if(t.events.begin(), t.events.end(),
                          [](const TraceEvent& e) { return e.action == TraceAction::segment_map; });
  ASSERT_NE(map, t.events.end());
  map->size += 2 * kMiB;
  VerifyOptions given;
  given.device_memory = std::size_t{1} << 34;
  const VerifyResult v = verify(t, given);
  EXPECT_FALSE(v.agreed);
  EXPECT_FALSE(v.cannot_verify) << v.divergence;
  EXPECT_EQ(v.divergence_event, static_cast<std::uint64_t>(map - t.events.begin()) + 1);
  EXPECT_NE(v.divergence.find(fmt::format("the recording maps {} bytes", map->size)), std::string::npos)
      << v.divergence;
}

TEST(Verify, APagePolicysRecordingThatStartsLateIsNamedAsNotVerifiable) {
  for (const std::string policy : {"native_paged", "paging"}) {
    Recorder r("policy:" + policy);
    r.on = false;
    void* a = r.alloc(8 * kMiB);
    r.on = true;
    r.alloc(3 * kMiB);
    r.allocator.deallocate(a);
    const VerifyResult v = verify(pickled(r.finish()));
    EXPECT_TRUE(v.cannot_verify) << policy;
    EXPECT_EQ(v.divergence_event, 0u);
    EXPECT_EQ(v.divergence.rfind("cannot verify: recorded under reservoir's policy:" + policy +
                                     ", which verify replays from an empty allocator, but the "
                                     "recording starts with memory held (event 1: a free of",
                                 0),
              0u)
        << v.divergence;
  }
}

TEST(Verify, RefusesTracesWithoutAddresses) {
  const Trace t = read_text_trace("reservoir-trace 1\nalloc 1 5\n", "x.trace");
  EXPECT_THROW(verify(t), TraceError);
}

TEST(SharedTraces, EveryRealSnapshotVerifies) {
  if (!std::filesystem::exists(testing::shared_trace_dir())) {
    GTEST_SKIP() << "no real traces at " << testing::shared_trace_dir();
  }
  const auto paths = testing::shared_traces();
  EXPECT_FALSE(paths.empty()) << "no .pickle in " << testing::shared_trace_dir();
  for (const auto& path : paths) {
    const Trace t = read_trace_file(path.string());
    const VerifyResult r = verify(t);
    EXPECT_TRUE(r.agreed) << path << ": " << r.divergence;
    EXPECT_EQ(r.allocs_checked, static_cast<std::uint64_t>(std::count_if(
                                    t.events.begin(), t.events.end(), [](const TraceEvent& e) {
                                      return e.action == TraceAction::alloc;
                                    })));
  }
}

}  // namespace
}  // namespace reservoir
