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
#include "shared_traces.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;


std::span<const std::uint8_t> bytes(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

[[gnu::noinline]] void* allocate_in_layer(CachingAllocator& a, std::size_t size, StreamId s) {
  void* p = a.allocate(size, s);
  asm volatile("" ::: "memory");
  return p;
}

// A recorded workload with annotations, stacks on part of it, two streams,
// frees, empty_cache and blocks left live at the end.
Trace recorded_workload(std::uint64_t seed, int steps) {
  SimDevice device;
  CachingAllocator allocator(device, AllocatorConfig::parse("max_split_size_mb:64"));
  allocator.record_history({.stacks = true, .max_frames = 8});
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  for (int i = 0; i < steps; ++i) {
    if (i == steps / 2) allocator.record_history({.stacks = false});
    ScopedAnnotation step(fmt::format("step{}", i / 100));
    ScopedAnnotation phase(i % 3 == 0 ? "forward" : "backward");
    if (!live.empty() && (rng() % 100 < 45 || live.size() > 60)) {
      const std::size_t k = rng() % live.size();
      allocator.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const std::size_t size = rng() % 4 == 0 ? kMiB + rng() % (90 * kMiB) : 1 + rng() % kMiB;
      live.push_back(allocate_in_layer(allocator, size, rng() % 5 == 0 ? 1 : 0));
    }
    if (i % 700 == 699) allocator.empty_cache();
  }
  return to_trace(allocator.snapshot(), "recorded", "max_split_size_mb:64");
}

void expect_same_trace(const Trace& a, const Trace& b) {
  EXPECT_EQ(a.recorded_config, b.recorded_config);
  EXPECT_EQ(a.has_addresses, b.has_addresses);
  ASSERT_EQ(a.events.size(), b.events.size());
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    const TraceEvent& x = a.events[i];
    const TraceEvent& y = b.events[i];
    ASSERT_EQ(x.action, y.action) << "event " << i;
    ASSERT_EQ(x.addr, y.addr) << "event " << i;
    ASSERT_EQ(x.size, y.size) << "event " << i;
    ASSERT_EQ(x.stream, y.stream) << "event " << i;
    ASSERT_EQ(x.time_us, y.time_us) << "event " << i;
    ASSERT_EQ(a.context(x.context), b.context(y.context)) << "event " << i;
  }
  ASSERT_EQ(a.final_state.segments.size(), b.final_state.segments.size());
  for (std::size_t i = 0; i < a.final_state.segments.size(); ++i) {
    SegmentInfo x = a.final_state.segments[i];
    SegmentInfo y = b.final_state.segments[i];
    ASSERT_EQ(x.blocks.size(), y.blocks.size());
    for (std::size_t j = 0; j < x.blocks.size(); ++j) {
      ASSERT_EQ(a.context(x.blocks[j].context), b.context(y.blocks[j].context));
      x.blocks[j].context = y.blocks[j].context = 0;
    }
    EXPECT_EQ(x, y) << "segment " << i;
  }
}

void expect_same_replay(const Trace& a, const Trace& b) {
  const AllocatorConfig config = AllocatorConfig::parse(a.recorded_config);
  const ReplayResult x = replay(compile(a), config, a.recorded_config);
  const ReplayResult y = replay(compile(b), config, b.recorded_config);
  EXPECT_EQ(x.ops, y.ops);
  EXPECT_EQ(x.peak_requested_bytes, y.peak_requested_bytes);
  EXPECT_EQ(x.peak_allocated_bytes, y.peak_allocated_bytes);
  EXPECT_EQ(x.peak_reserved_bytes, y.peak_reserved_bytes);
  EXPECT_EQ(x.peak_reserved_op, y.peak_reserved_op);
  EXPECT_EQ(x.final_reserved_bytes, y.final_reserved_bytes);
  EXPECT_EQ(x.device_allocs, y.device_allocs);
  EXPECT_EQ(x.device_frees, y.device_frees);
  EXPECT_EQ(x.device_calls, y.device_calls);
}

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
