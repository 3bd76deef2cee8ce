// The cache-hit allocate+free pair, next to glibc malloc+free of the same
// sizes in the same run; and the same pair through a Saver (untagged with no
// tag, untagged with a tag present, inside a tag's region), to show what
// routing by tag costs. Run: build/bin/allocator_bench
#include <benchmark/benchmark.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/saver.hpp"
#include "reservoir/sim_device.hpp"
#include "spin_mutex.hpp"

namespace {

using reservoir::AllocatorConfig;
using reservoir::CachingAllocator;
using reservoir::SimDevice;

constexpr std::array<std::size_t, 8> kMixed = {512,     4096,    65536,   300000,
                                               1048576, 2097152, 5000000, 8388608};

struct Shared {
  SimDevice device;
  CachingAllocator allocator{device, AllocatorConfig{}};
};
Shared& shared() {
  static Shared s;
  return s;
}

// Warm the cache so every timed request is a hit.
void warm(CachingAllocator& a, std::size_t size, std::uint64_t streams) {
  for (std::uint64_t s = 0; s < streams; ++s) {
    void* p = a.allocate(size, s);
    a.deallocate(p);
  }
}

void BM_Reservoir_OneSize(benchmark::State& state) {
  auto& a = shared().allocator;
  if (state.thread_index() == 0) warm(a, 4096, 1);
  for (auto _ : state) {
    void* p = a.allocate(4096);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
}
BENCHMARK(BM_Reservoir_OneSize)->Threads(1)->Threads(2)->UseRealTime();

void BM_Glibc_OneSize(benchmark::State& state) {
  for (auto _ : state) {
    void* p = std::malloc(4096);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}
BENCHMARK(BM_Glibc_OneSize)->Threads(1)->Threads(2)->UseRealTime();

void BM_Reservoir_MixedSizes(benchmark::State& state) {
  auto& a = shared().allocator;
  if (state.thread_index() == 0) {
    for (std::size_t s : kMixed) warm(a, s, 1);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    void* p = a.allocate(kMixed[i++ & 7]);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
}
BENCHMARK(BM_Reservoir_MixedSizes)->Threads(1)->Threads(2)->UseRealTime();

void BM_Glibc_MixedSizes(benchmark::State& state) {
  std::size_t i = 0;
  for (auto _ : state) {
    void* p = std::malloc(kMixed[i++ & 7]);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}
BENCHMARK(BM_Glibc_MixedSizes)->Threads(1)->Threads(2)->UseRealTime();

// The least any allocator pays whose decisions for one device happen in one
// order, as PyTorch's do (one lock per device): a pair is two decisions, each
// taking the allocator's lock and writing one word of shared state, with no
// work inside. With two threads the lock's cache line travels between cores
// at every decision; this is the floor under the 2-thread reservoir rows.
struct alignas(64) SharedDecisions {
  reservoir::detail::SpinMutex lock;
  std::uint64_t state = 0;
};
SharedDecisions& shared_decisions() {
  static SharedDecisions d;
  return d;
}

void BM_Floor_SerializedPair(benchmark::State& state) {
  auto& d = shared_decisions();
  for (auto _ : state) {
    d.lock.lock();
    benchmark::DoNotOptimize(++d.state);
    d.lock.unlock();
    d.lock.lock();
    benchmark::DoNotOptimize(--d.state);
    d.lock.unlock();
  }
}
BENCHMARK(BM_Floor_SerializedPair)->Threads(1)->Threads(2)->UseRealTime();

void BM_Reservoir_FourStreams(benchmark::State& state) {
  auto& a = shared().allocator;
  if (state.thread_index() == 0) {
    for (std::size_t s : kMixed) warm(a, s, 4);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    void* p = a.allocate(kMixed[i & 7], (i >> 3) & 3);
    ++i;
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
}
BENCHMARK(BM_Reservoir_FourStreams)->Threads(1)->Threads(2)->UseRealTime();

// Tensor-sized requests (32 to 256 MiB), typical of activations and weights.
// glibc serves these with mmap/munmap (they exceed its 32 MiB mmap threshold
// limit), so this pair is not the cache-hit comparison above; it shows what a
// host allocator pays for GPU-sized buffers.
constexpr std::array<std::size_t, 4> kTensors = {std::size_t{32} << 20, std::size_t{64} << 20,
                                                 std::size_t{128} << 20, std::size_t{256} << 20};

void BM_Reservoir_TensorSizes(benchmark::State& state) {
  auto& a = shared().allocator;
  if (state.thread_index() == 0) {
    for (std::size_t s : kTensors) warm(a, s, 1);
  }
  std::size_t i = 0;
  for (auto _ : state) {
    void* p = a.allocate(kTensors[i++ & 3]);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
}
BENCHMARK(BM_Reservoir_TensorSizes)->Threads(1)->UseRealTime();

void BM_Glibc_TensorSizes(benchmark::State& state) {
  std::size_t i = 0;
  for (auto _ : state) {
    void* p = std::malloc(kTensors[i++ & 3]);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}
BENCHMARK(BM_Glibc_TensorSizes)->Threads(1)->UseRealTime();

}  // namespace

// Through a Saver. arg 0: no tag exists; 1: a tag exists (frees look the
// pointer up among the tags' ranges, every change of the statistics is
// published to the combined ones); 2: inside that tag's region; 3: as 1
// with SaverOptions::exact_peaks off.
void BM_Saver_OneSize(benchmark::State& state) {
  SimDevice device;
  reservoir::SaverOptions o;
  o.config = AllocatorConfig{};
  o.exact_peaks = state.range(0) != 3;
  reservoir::Saver saver(device, o);
  if (state.range(0) >= 1) {
    auto r = saver.region("kv_cache");
    saver.deallocate(saver.allocate(4096));
  }
  std::uint64_t token = 0;
  if (state.range(0) == 2) token = saver.push_region("kv_cache");
  saver.deallocate(saver.allocate(4096));
  for (auto _ : state) {
    void* p = saver.allocate(4096);
    benchmark::DoNotOptimize(p);
    saver.deallocate(p);
  }
  if (state.range(0) == 2) saver.pop_region(token);
}
BENCHMARK(BM_Saver_OneSize)->Arg(0)->Arg(1)->Arg(2)->Arg(3)->UseRealTime();

BENCHMARK_MAIN();
