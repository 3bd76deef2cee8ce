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
