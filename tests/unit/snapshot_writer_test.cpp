// Export: allocator snapshots with history written as PyTorch pickles and
// JSON, read back exactly, and round trips through replay.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "error_text.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "per_call_validation.hpp"
#include "shared_traces.hpp"
#include "trace_fixture.hpp"

namespace reservoir {
namespace {

TEST(Export, HistoryCarriesAnnotationsAndStacks) {
  const Trace t = recorded_workload(5, 400);
  ASSERT_GT(t.events.size(), 400u);
  std::size_t with_frames = 0;
  std::size_t annotated = 0;
  for (const TraceEvent& e : t.events) {
    const Context& c = t.context(e.context);
    if (!c.frames.empty()) {
      ++with_frames;
      if (e.action == TraceAction::alloc) {
        EXPECT_NE(c.frames[0].name.find("allocate_in_layer"), std::string::npos) << c.frames[0].name;
      }
    }
    if (e.action != TraceAction::snapshot) {
      ASSERT_EQ(c.annotations.size(), 2u) << to_string(e.action);
      annotated++;
    }
  }
  EXPECT_GT(with_frames, 100u);  // the first half had stacks
  EXPECT_LT(with_frames, t.events.size());
  EXPECT_EQ(annotated + 1, t.events.size());  // all but the snapshot event
}

TEST(Export, PickleRoundTripIsExact) {
  const Trace t = recorded_workload(1, 1500);
  const std::string data = write_pytorch_snapshot(t);
  const Trace back = read_pytorch_snapshot(bytes(data), "back.pickle");
  expect_same_trace(t, back);
  expect_same_replay(t, back);
  // Written again, byte for byte the same.
  EXPECT_TRUE(write_pytorch_snapshot(back) == data);
  // And it still verifies against the allocator's rules.
  const VerifyResult v = verify(back);
  EXPECT_TRUE(v.agreed) << v.divergence;
}

TEST(Export, JsonRoundTripIsExact) {
  const Trace t = recorded_workload(2, 1500);
  const std::string json = write_snapshot_json(t);
  const Trace back = read_snapshot_json(json, "back.json");
  EXPECT_EQ(back.format, "snapshot-json");
  expect_same_trace(t, back);
  expect_same_replay(t, back);
  EXPECT_TRUE(write_snapshot_json(back) == json);
  // JSON and pickle describe the same snapshot.
  const std::string data = write_pytorch_snapshot(t);
  expect_same_trace(read_pytorch_snapshot(bytes(data), "p"), back);
}

TEST(Export, TextRoundTripReplaysTheSame) {
  const Trace t = recorded_workload(4, 800);
  const Trace back = read_text_trace(write_text_trace(t), "t.trace");
  // Text keeps requests only: the program (and so the replay) is the same
  // when the trace has no blocks live at the start.
  const ReplayProgram a = compile(t);
  const ReplayProgram b = compile(back);
  ASSERT_EQ(a.initial.size(), 0u);
  ASSERT_EQ(a.ops.size(), b.ops.size());
  for (std::size_t i = 0; i < a.ops.size(); ++i) {
    ASSERT_EQ(a.ops[i].kind, b.ops[i].kind);
    ASSERT_EQ(a.ops[i].size, b.ops[i].size);
    ASSERT_EQ(a.ops[i].id, b.ops[i].id);
  }
}

TEST(Export, SharedTracesRoundTrip) {
  if (!std::filesystem::exists(testing::shared_trace_dir())) {
    GTEST_SKIP() << "no real traces at " << testing::shared_trace_dir();
  }
  // The formats are under test; SharedTraces.EveryRealSnapshotVerifies runs
  // the same traces with the allocator validated after every call.
  const testing::WithoutPerCallValidation unvalidated;
  const auto paths = testing::shared_traces();
  EXPECT_FALSE(paths.empty()) << "no .pickle in " << testing::shared_trace_dir();
  for (const auto& path : paths) {
    const Trace t = read_trace_file(path.string());
    const Trace p = read_pytorch_snapshot(bytes(write_pytorch_snapshot(t)), "p");
    const Trace j = read_snapshot_json(write_snapshot_json(t), "j");
    expect_same_trace(t, p);
    expect_same_trace(t, j);
    expect_same_replay(t, p);
    EXPECT_TRUE(verify(j).agreed) << path;
  }
}

// ---- errors ----------------------------------------------------------------

}  // namespace
}  // namespace reservoir
