// Helpers of the trace tests: recorded workloads, comparisons of traces and
// replays, errors as text.
#pragma once

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "error_text.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"
#include "reservoir/pickle.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {

inline constexpr std::size_t kMiB = std::size_t{1} << 20;

// Records what the allocator does, as PyTorch's history would.
inline Trace record(std::uint64_t seed, int steps) {
  SimDevice device;
  CachingAllocator allocator(device, AllocatorConfig{});
  Trace t;
  t.name = "recorded";
  t.format = "pytorch-snapshot";
  t.has_addresses = true;
  allocator.attach_trace_tracker([&](const TraceEvent& e) {
    t.events.push_back({static_cast<TraceAction>(e.action), e.addr, e.size, e.stream});
  });
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  for (int i = 0; i < steps; ++i) {
    if (!live.empty() && (rng() % 100 < 45 || live.size() > 80)) {
      const std::size_t k = rng() % live.size();
      allocator.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const std::size_t kind = rng() % 10;
      const std::size_t size = kind < 5   ? 1 + rng() % kMiB
                               : kind < 9 ? kMiB + rng() % (30 * kMiB)
                                          : 30 * kMiB + rng() % (200 * kMiB);
      live.push_back(allocator.allocate(size, rng() % 4 == 0 ? 1 : 0));
    }
  }
  t.final_state = allocator.snapshot();
  return t;
}

// Internal linkage, as in the test file itself: a stack frame named by
// minimal debug information (-g1) too.
[[gnu::noinline, maybe_unused]] static void* allocate_in_layer(CachingAllocator& a, std::size_t size, StreamId s) {
  void* p = a.allocate(size, s);
  asm volatile("" ::: "memory");
  return p;
}

// A recorded workload with annotations, stacks on part of it, two streams,
// frees, empty_cache and blocks left live at the end.
[[maybe_unused]] static Trace recorded_workload(std::uint64_t seed, int steps) {
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

// Every error here is a TraceError.
template <typename F>
std::string error_of(F&& f) {
  return testing::error_of<TraceError>(std::forward<F>(f));
}

inline std::span<const std::uint8_t> bytes(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

inline void expect_same_trace(const Trace& a, const Trace& b) {
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

inline void expect_same_replay(const Trace& a, const Trace& b) {
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

// Records what an allocator does from the moment `on` is set.
struct Recorder {
  explicit Recorder(const std::string& config, std::size_t capacity = std::size_t{1} << 40)
      : device(options(capacity)), allocator(device, AllocatorConfig::parse(config)) {
    trace.name = "case";
    trace.format = "pytorch-snapshot";
    trace.has_addresses = true;
    set_recorded_config(trace, config);
    allocator.attach_trace_tracker([this](const TraceEvent& e) {
      if (on) trace.events.push_back(e);
    });
  }
  static SimDeviceOptions options(std::size_t capacity) {
    SimDeviceOptions o;
    o.capacity = capacity;
    return o;
  }
  void* alloc(std::size_t bytes, StreamId stream = 0) { return allocator.allocate(bytes, stream); }
  std::size_t count(TraceAction a) const {
    return static_cast<std::size_t>(
        std::count_if(trace.events.begin(), trace.events.end(),
                      [a](const TraceEvent& e) { return e.action == a; }));
  }
  // Calls empty_cache() and returns the segments it freed.
  std::size_t empty_cache() {
    const std::size_t before = count(TraceAction::segment_free);
    allocator.empty_cache();
    return count(TraceAction::segment_free) - before;
  }
  std::size_t unused_segments() const {
    std::size_t n = 0;
    for (const SegmentInfo& s : allocator.snapshot().segments) {
      n += std::none_of(s.blocks.begin(), s.blocks.end(),
                        [](const BlockInfo& b) { return b.state != BlockState::inactive; });
    }
    return n;
  }
  Trace finish() {
    trace.final_state = allocator.snapshot();
    return trace;
  }

  SimDevice device;
  CachingAllocator allocator;
  Trace trace;
  bool on = true;
};

inline Trace pickled(const Trace& t) {
  const std::string data = write_pytorch_snapshot(t);
  return read_pytorch_snapshot(bytes(data), t.name);
}

// The classic fragmentation case: a 256 MiB segment holding 28 MiB
// allocated, 100 MiB free, 28 MiB allocated, 100 MiB free; then a 160 MiB
// request on a 300 MiB device runs out of memory.
// A recording of markers only: one snapshot mark after a 5 MiB block made
// before the history began (its state holds the block).
inline Trace markers_only() {
  Recorder r("");
  r.on = false;
  (void)r.alloc(5 * kMiB);
  Trace t = pickled(r.finish());
  TraceEvent mark;
  mark.action = TraceAction::snapshot;
  t.events.push_back(mark);
  return t;
}

inline Trace fragmented_oom() {
  Recorder r("", 300 * kMiB);
  r.allocator.deallocate(r.alloc(256 * kMiB));
  void* a = r.alloc(28 * kMiB);
  void* hole1 = r.alloc(100 * kMiB);
  void* b = r.alloc(28 * kMiB);
  void* hole2 = r.alloc(100 * kMiB);
  EXPECT_EQ(static_cast<char*>(hole2) - static_cast<char*>(a), static_cast<std::ptrdiff_t>(156 * kMiB));
  r.allocator.deallocate(hole1);
  r.allocator.deallocate(hole2);
  EXPECT_THROW(r.alloc(160 * kMiB), OutOfMemoryError);
  (void)b;
  return pickled(r.finish());
}

}  // namespace reservoir
