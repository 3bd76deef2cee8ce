// What recording history costs on the cache-hit allocate+free pair: off,
// on without stacks (annotations only), on with native stacks, side by side
// in one run; and the price of an annotation push+pop.
// Run: build/bin/history_bench
#include <benchmark/benchmark.h>

#include <memory>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/history.hpp"
#include "reservoir/sim_device.hpp"

namespace {

using reservoir::AllocatorConfig;
using reservoir::CachingAllocator;
using reservoir::HistoryOptions;
using reservoir::SimDevice;

enum Mode { kNeverOn, kOff, kOn, kOnWithStacks };

void BM_Pair(benchmark::State& state) {
  SimDevice device;
  CachingAllocator a(device, AllocatorConfig{});
  const auto mode = static_cast<Mode>(state.range(0));
  if (mode == kOff) {
    a.record_history({});
    a.record_history({.enabled = false});
  } else if (mode == kOn) {
    a.record_history({.max_entries = 100'000});
  } else if (mode == kOnWithStacks) {
    a.record_history({.max_entries = 100'000, .stacks = true});
  }
  reservoir::ScopedAnnotation step("step");
  reservoir::ScopedAnnotation phase("forward");
  a.deallocate(a.allocate(4096));  // warm: every timed request is a cache hit
  for (auto _ : state) {
    void* p = a.allocate(4096);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
}
BENCHMARK(BM_Pair)
    ->ArgName("history")
    ->Arg(kNeverOn)
    ->Arg(kOff)
    ->Arg(kOn)
    ->Arg(kOnWithStacks)
    ->UseRealTime();

void BM_AnnotationPushPop(benchmark::State& state) {
  reservoir::ScopedAnnotation outer("step");
  for (auto _ : state) {
    reservoir::push_annotation("forward");
    reservoir::pop_annotation();
  }
}
BENCHMARK(BM_AnnotationPushPop)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
