// Reading PyTorch snapshots (pickle) and our JSON export: corrupt fields and
// corrupt JSON get exact errors.
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

// Records what the allocator does, as PyTorch's history would.
Trace record(std::uint64_t seed, int steps) {
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

// Every error here is a TraceError.
template <typename F>
std::string error_of(F&& f) {
  return testing::error_of<TraceError>(std::forward<F>(f));
}

TEST(Snapshot, CorruptFieldsGetExactErrors) {
  Trace t = record(3, 50);
  std::string good = write_pytorch_snapshot(t);
  auto read = [](const std::string& data) -> std::string {
    try {
      (void)read_pytorch_snapshot(
          std::span(reinterpret_cast<const std::uint8_t*>(data.data()), data.size()), "s.pickle");
    } catch (const TraceError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(read(good), "no error");
  EXPECT_EQ(read(good.substr(0, good.size() / 2)).substr(0, 31), "snapshot s.pickle: pickle: byte");
  const auto pos = good.find("free_requested");
  ASSERT_NE(pos, std::string::npos);
  std::string renamed = good;
  renamed.replace(pos, 14, "free_requestex");
  EXPECT_EQ(read(renamed).substr(0, 60).find("snapshot s.pickle: device_traces[0]["), 0u);
  EXPECT_NE(read(renamed).find("unknown action 'free_requestex'"), std::string::npos);
}

TEST(Export, CorruptJsonGetsExactErrors) {
  const Trace t = recorded_workload(6, 50);
  const std::string good = write_snapshot_json(t);
  auto read = [](const std::string& s) { return error_of([&] { (void)read_snapshot_json(s, "s.json"); }); };
  EXPECT_EQ(read(good), "no error");
  EXPECT_EQ(read("{\"segments\": [1, 2"),
            "snapshot s.json: byte 18: invalid JSON: [json.exception.parse_error.101] parse error "
            "at line 1, column 19: syntax error while parsing array - unexpected end of input; "
            "expected ']'");
  EXPECT_EQ(read("{\"segments\": []}"), "snapshot s.json: top level: 'device_traces' is missing");
  EXPECT_EQ(read("{\"segments\": [], \"device_traces\": [[{\"action\": \"alloc\", \"addr\": -1, "
                 "\"size\": 1, \"stream\": 0}]]}"),
            "snapshot s.json: device_traces[0][0]: 'addr' is negative (-1)");
  EXPECT_EQ(read("{\"segments\": [], \"device_traces\": [[{\"action\": \"alloc\", \"addr\": 1, "
                 "\"size\": 1, \"stream\": 0, \"frames\": [{\"filename\": \"f\", \"line\": 1.5, "
                 "\"name\": \"g\"}]}]]}"),
            "snapshot s.json: device_traces[0][0].frames[0]: 'line' should be an int, found float");
  EXPECT_EQ(read("{\"segments\": [1e999]}"),
            "snapshot s.json: invalid JSON: [json.exception.out_of_range.406] number overflow "
            "parsing '1e999'");
  EXPECT_EQ(read(std::string(100, '[') + std::string(100, ']')),
            "snapshot s.json: JSON nested deeper than 64");
  EXPECT_EQ(read("{\"segments\": [], \"device_traces\": [[{\"action\": \"alloc\", \"addr\": 1, "
                 "\"size\": 1, \"stream\": 0, \"frames\": [{\"filename\": \"<annotation>\", "
                 "\"line\": 0, \"name\": \"a\"}, {\"filename\": \"f.py\", \"line\": 3, \"name\": "
                 "\"g\"}]}]]}"),
            "snapshot s.json: device_traces[0][0].frames[1]: a stack frame follows an annotation "
            "frame (annotations come last)");
}

// ---- RMM's CSV log ---------------------------------------------------------------

}  // namespace
}  // namespace reservoir
