// Replay: traces compiled to allocator operations and replayed on a simulated
// device, with peaks and device calls.
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

}  // namespace
}  // namespace reservoir
