// GPU benchmarks (the GPU bundle's gpu_bench step runs them): allocate+free
// on a cache hit and on a miss, reservoir vs raw cudaMalloc/cudaFree vs
// cudaMallocAsync/cudaFreeAsync; the cost of the driver's virtual-memory
// calls per 2 MiB page and per large handle; pause and resume of a tag with
// and without backup beside a plain pinned copy (saver_cases.hpp). PyTorch's
// native allocator is measured beside reservoir from C++ by the bundle's
// torch_native_bench (tests/gpu/torch_native_bench.cpp). Without a GPU it
// says so and exits 0.
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <cstdio>
#include <memory>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/cuda_device.hpp"
#include "saver_cases.hpp"

namespace {

using reservoir::AllocatorConfig;
using reservoir::CachingAllocator;
using reservoir::CudaRuntimeDevice;
using reservoir::CudaVmmDevice;
using reservoir::DevicePtr;
using reservoir::PhysicalHandle;
using reservoir::Status;

// The runtime's own allocation calls, for the baselines.
struct Raw {
  int (*malloc)(void**, size_t);
  int (*free)(void*);
  int (*malloc_async)(void**, size_t, void*);
  int (*free_async)(void*, void*);
  int (*sync)();
};
const Raw& raw() {
  static const Raw r = [] {
    void* lib = dlopen("libcudart.so.13", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libcudart.so", RTLD_NOW | RTLD_LOCAL);
    Raw t{};
    t.malloc = reinterpret_cast<int (*)(void**, size_t)>(dlsym(lib, "cudaMalloc"));
    t.free = reinterpret_cast<int (*)(void*)>(dlsym(lib, "cudaFree"));
    t.malloc_async = reinterpret_cast<int (*)(void**, size_t, void*)>(dlsym(lib, "cudaMallocAsync"));
    t.free_async = reinterpret_cast<int (*)(void*, void*)>(dlsym(lib, "cudaFreeAsync"));
    t.sync = reinterpret_cast<int (*)()>(dlsym(lib, "cudaDeviceSynchronize"));
    return t;
  }();
  return r;
}

CudaRuntimeDevice& runtime_device() {
  static auto d = CudaRuntimeDevice::open(0);
  return *d;
}
CudaVmmDevice& vmm_device() {
  static auto d = CudaVmmDevice::open();
  return *d;
}

void BM_Reservoir_CacheHit(benchmark::State& state) {
  CachingAllocator a(runtime_device(), AllocatorConfig{});
  const auto size = static_cast<std::size_t>(state.range(0));
  a.deallocate(a.allocate(size));
  for (auto _ : state) {
    void* p = a.allocate(size);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
}
BENCHMARK(BM_Reservoir_CacheHit)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20)->UseRealTime();

void BM_Reservoir_CacheMiss(benchmark::State& state) {
  CachingAllocator a(runtime_device(), AllocatorConfig{});
  const auto size = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = a.allocate(size);  // a new segment each time
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
    a.empty_cache();
  }
}
BENCHMARK(BM_Reservoir_CacheMiss)->Arg(4096)->Arg(64 << 20)->UseRealTime();

void BM_CudaMalloc_Free(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = nullptr;
    raw().malloc(&p, size);
    benchmark::DoNotOptimize(p);
    raw().free(p);
  }
}
BENCHMARK(BM_CudaMalloc_Free)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20)->UseRealTime();

void BM_CudaMallocAsync_FreeAsync(benchmark::State& state) {
  const auto size = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = nullptr;
    raw().malloc_async(&p, size, nullptr);
    benchmark::DoNotOptimize(p);
    raw().free_async(p, nullptr);
  }
  raw().sync();
}
BENCHMARK(BM_CudaMallocAsync_FreeAsync)->Arg(4096)->Arg(1 << 20)->Arg(64 << 20)->UseRealTime();

// One handle of range(0) bytes: create, map, set access, unmap, release.
void BM_Vmm_CreateMapUnmapRelease(benchmark::State& state) {
  CudaVmmDevice& d = vmm_device();
  const auto bytes = static_cast<std::size_t>(state.range(0));
  DevicePtr va = 0;
  if (d.reserve(bytes, 0, &va) != Status::ok) {
    state.SkipWithError("reserve failed");
    return;
  }
  for (auto _ : state) {
    PhysicalHandle h = 0;
    d.create_physical(bytes, &h);
    d.map(va, bytes, h, 0);
    d.set_access(va, bytes);
    d.unmap(va, bytes);
    d.release_physical(h);
  }
  d.unreserve(va, bytes);
  // A rate inverted is seconds per unit: counting pages in billions makes it
  // nanoseconds per page.
  state.counters["per_2MiB_page_ns"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(bytes >> 21) / 1e9,
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_Vmm_CreateMapUnmapRelease)->Arg(2 << 20)->Arg(64 << 20)->Arg(1 << 30)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  const std::string why = reservoir::cuda_unavailable_reason();
  if (!why.empty()) {
    std::printf("gpu_bench: no usable GPU here: %s\n", why.c_str());
    return 0;
  }
  static std::unique_ptr<CudaVmmDevice> vmm;
  static std::unique_ptr<reservoir::CudaPinnedMemory> pinned;
  // With backup: 1, 4 and 16 GiB against a pinned copy of the same bytes
  // (the native policy: the copies do not depend on it); without: 1 GiB
  // under every policy. Five timed cycles of each setup.
  reservoir::bench::register_saver_benchmarks(
      {[]() -> reservoir::Device& {
         if (!vmm) vmm = CudaVmmDevice::open();
         return *vmm;
       },
       []() -> reservoir::PinnedMemorySource& {
         if (!pinned) pinned = reservoir::CudaPinnedMemory::open();
         return *pinned;
       }},
      reservoir::bench::SaverBenchPlan{{1024, 4096, 16384}, {1024}, false, 5});
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
