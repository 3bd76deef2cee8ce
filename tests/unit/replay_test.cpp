// Replay: traces compiled to allocator operations and replayed on a simulated
// device, with peaks and device calls.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/generated.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "shared_traces.hpp"
#include "trace_fixture.hpp"

namespace reservoir {
namespace {

TEST(Compile, BlocksLiveAtTheStartComeFirstInAddressOrder) {
  Trace t;
  t.has_addresses = true;
  t.events = {{TraceAction::free_requested, 0x5000, 100, 0},
              {TraceAction::alloc, 0x9000, 200, 0},
              {TraceAction::free_requested, 0x1000, 300, 0},
              {TraceAction::free_requested, 0x9000, 200, 0}};
  SegmentInfo seg;
  seg.address = 0x0;
  seg.blocks = {{0x3000, 1024, 400, BlockState::active_allocated}};
  t.final_state.segments = {seg};
  const ReplayProgram p = compile(t);
  ASSERT_EQ(p.initial.size(), 3u);
  EXPECT_EQ(p.initial[0].size, 300u);  // 0x1000
  EXPECT_EQ(p.initial[1].size, 400u);  // 0x3000, untouched by any event
  EXPECT_EQ(p.initial[2].size, 100u);  // 0x5000
  ASSERT_EQ(p.ops.size(), 4u);
  EXPECT_EQ(p.ops[0].kind, ReplayOp::Kind::free);
  EXPECT_EQ(p.ops[0].id, p.initial[2].id);
}

TEST(Replay, ReportsPeaksAndDeviceCalls) {
  const Trace t = read_text_trace(
      "reservoir-trace 1\nalloc 1 12MiB\nalloc 2 1000\nfree 1\nalloc 3 30MiB\nfree 2\nfree 3\n"
      "empty_cache\n",
      "r");
  const ReplayResult r = replay(compile(t), AllocatorConfig{}, "");
  EXPECT_EQ(r.peak_requested_bytes, 30 * kMiB + 1000);
  EXPECT_EQ(r.peak_allocated_bytes, 30 * kMiB + 1024);
  EXPECT_EQ(r.peak_reserved_bytes, (12 + 2 + 30) * kMiB);
  EXPECT_EQ(r.device_allocs, 3);
  EXPECT_EQ(r.device_frees, 3);
  EXPECT_EQ(r.num_ooms, 0);
  ReplayOptions small;
  small.capacity = 40 * kMiB;
  const ReplayResult s = replay(compile(t), AllocatorConfig{}, "", small);
  EXPECT_EQ(s.peak_reserved_bytes, (2 + 30) * kMiB);  // the 12 MiB segment was released first
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.device_frees, 3);
  small.capacity = 20 * kMiB;
  const ReplayResult o = replay(compile(t), AllocatorConfig{}, "", small);
  EXPECT_EQ(o.num_ooms, 1);
  EXPECT_EQ(o.first_oom.find("op 3: CUDA out of memory. Tried to allocate 30.00 MiB. GPU 0 has a "
                             "total capacity of 20.00 MiB of which 18.00 MiB is free."),
            0u)
      << o.first_oom;
}


TEST(Replay, SaysHowFarAboveNativeAtTheSameCall) {
  // 200 MiB, freed, then 1 MiB on another stream: native reserves 200 MiB,
  // then 202 MiB (a small segment); paging maps room for half another 200
  // MiB request (300 MiB), then 20 MiB ahead in the other stream's arena.
  // With a bound of 3 MiB a stream: 202 MiB (whole pages within 203), then
  // 208 MiB (202 + 2 x 3).
  ReplayProgram p;
  p.name = "two streams";
  p.id_count = 2;
  p.ops = {{ReplayOp::Kind::alloc, 0, 200u << 20, 0},
           {ReplayOp::Kind::free, 0, 0, 0},
           {ReplayOp::Kind::alloc, 1, 1u << 20, 1}};
  ReplayOptions keep;
  keep.keep_reserved = true;
  const ReplayResult native = replay(p, AllocatorConfig::parse(""), "", keep);
  EXPECT_EQ(native.reserved_after_op,
            (std::vector<std::uint64_t>{200u << 20, 200u << 20, 202u << 20}));
  EXPECT_FALSE(native.over_native.has_value());
  ReplayOptions compare;
  compare.native_reserved = &native.reserved_after_op;
  const ReplayResult paging = replay(p, AllocatorConfig::parse("policy:paging"), "paging", compare);
  ASSERT_TRUE(paging.over_native.has_value());
  EXPECT_TRUE(paging.reserved_after_op.empty());
  EXPECT_EQ(paging.over_native->worst_bytes, 118u << 20);
  EXPECT_EQ(paging.over_native->worst_op, 2u);
  EXPECT_EQ(paging.over_native->slack_bytes, kNativeBoundPage);  // none configured: one page
  EXPECT_EQ(paging.over_native->ops_over_bound, 3u);
  // After the third op two streams have allocated: 202 + 2 x 2 MiB allowed.
  EXPECT_EQ(paging.over_native->worst_over_bound_bytes, 114u << 20);
  const ReplayResult bounded = replay(p, AllocatorConfig::parse("policy:paging,paging_slack_mb:3"),
                                      "bounded", compare);
  EXPECT_EQ(bounded.over_native->slack_bytes, 3u << 20);
  EXPECT_EQ(bounded.over_native->ops_over_bound, 0u);
  EXPECT_EQ(bounded.over_native->worst_bytes, 6u << 20);
  EXPECT_EQ(bounded.over_native->worst_op, 2u);
  // The figures are the replay's own: min_capacity's probes do not compare.
  EXPECT_GT(min_capacity(p, AllocatorConfig::parse("policy:paging"), "paging", compare).bytes, 0u);
}

TEST(Generated, TheSameSeedGivesTheSameProgram) {
  const ReplayProgram a = generated_program(42);
  const ReplayProgram b = generated_program(42);
  const ReplayProgram c = generated_program(43);
  ASSERT_EQ(a.ops.size(), b.ops.size());
  for (std::size_t i = 0; i < a.ops.size(); ++i) {
    EXPECT_EQ(a.ops[i].kind, b.ops[i].kind);
    EXPECT_EQ(a.ops[i].id, b.ops[i].id);
    EXPECT_EQ(a.ops[i].size, b.ops[i].size);
    EXPECT_EQ(a.ops[i].stream, b.ops[i].stream);
  }
  EXPECT_EQ(a.name, b.name);
  EXPECT_TRUE(a.name.starts_with("generated #42 (")) << a.name;
  EXPECT_NE(a.name.substr(0, 15), c.name.substr(0, 15));
}

TEST(Generated, ProgramsAreWellFormedAndCoverEveryFamily) {
  std::set<std::string> families;
  int with_uses = 0;
  int with_empty_cache = 0;
  int with_huge = 0;
  for (std::uint64_t seed = 0; seed < 100; ++seed) {
    const ReplayProgram p = generated_program(seed);
    ASSERT_EQ(p.op_events.size(), p.ops.size());
    ASSERT_EQ(p.contexts.size(), p.id_count);
    std::vector<int> state(p.id_count, 0);  // 0 never allocated, 1 live, 2 freed
    std::uint32_t next = 0;
    bool uses = false;
    bool empties = false;
    bool huge = false;
    for (const ReplayOp& op : p.ops) {
      switch (op.kind) {
        case ReplayOp::Kind::alloc:
          ASSERT_EQ(op.id, next++) << p.name;  // dense, in order
          ASSERT_GT(op.size, 0u);
          state[op.id] = 1;
          huge = huge || op.size >= (std::uint64_t{1} << 29);
          break;
        case ReplayOp::Kind::free:
          ASSERT_EQ(state.at(op.id), 1) << p.name;
          state[op.id] = 2;
          break;
        case ReplayOp::Kind::stream_use:
          ASSERT_EQ(state.at(op.id), 1) << p.name;
          uses = true;
          break;
        case ReplayOp::Kind::empty_cache: empties = true; break;
      }
    }
    ASSERT_EQ(next, p.id_count);
    with_uses += uses ? 1 : 0;
    with_empty_cache += empties ? 1 : 0;
    with_huge += huge ? 1 : 0;
    const std::string inside = p.name.substr(p.name.find('(') + 1);
    for (const char* f : {"training", "inference", "huge", "streams"}) {
      if (inside.find(f) != std::string::npos) families.insert(f);
    }
  }
  EXPECT_EQ(families.size(), 4u);
  EXPECT_GT(with_uses, 10);
  EXPECT_GT(with_empty_cache, 10);
  EXPECT_GT(with_huge, 10);
  // A replay of each on the simulated device passes the invariant checks.
  ReplayOptions checked;
  checked.validate_each_step = true;
  for (std::uint64_t seed = 0; seed < 5; ++seed) {
    for (const char* config : {"", "expandable_segments:True", "policy:paging"}) {
      EXPECT_EQ(replay(generated_program(seed), AllocatorConfig::parse(config), config, checked).num_ooms, 0);
    }
  }
}

}  // namespace
}  // namespace reservoir
