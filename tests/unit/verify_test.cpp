// verify: replaying a recording exactly and comparing every device request
// and address; the real snapshots in ../shared/traces.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <filesystem>
#include <random>

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

TEST(Verify, ReservoirsOwnPoliciesAreNamedAsWhatItCannotVerify) {
  for (const std::string policy : {"native_paged", "paging"}) {
    Recorder r("policy:" + policy);
    void* a = r.alloc(8 * kMiB);
    r.alloc(3 * kMiB);
    r.allocator.deallocate(a);
    const VerifyResult v = verify(pickled(r.finish()));
    EXPECT_TRUE(v.cannot_verify) << policy;
    EXPECT_EQ(v.divergence, "cannot verify: recorded under reservoir's policy:" + policy +
                                ", whose page maps verify does not model (it checks PyTorch's native "
                                "and expandable segments); replay, summary and advise read it");
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
