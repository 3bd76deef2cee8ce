// The cache-hit allocate+free pair on the simulated CUDA device, side by
// side in one run: reservoir under each policy (native on the CUDA runtime
// backend, expandable and paging on the virtual-memory backend), PyTorch's
// own caching allocator from the installed wheel (libc10_cuda.so, called
// from C++ as raw_alloc/raw_delete), and glibc. One size (4 KiB) and a mix
// of sizes from 512 B to 8 MiB, one and two threads. Built when `make deps`
// has installed PyTorch; run on the simulated device:
//   LD_PRELOAD=build/simcuda/libcudart.so.13 build/bin/torch_pair_bench
#include <benchmark/benchmark.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <array>
#include <cstdlib>
#include <memory>
#include <string>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/open_device.hpp"

namespace {

using reservoir::AllocatorConfig;
using reservoir::CachingAllocator;
using reservoir::DeviceKind;

constexpr std::array<std::size_t, 8> kMixed = {512,     4096,    65536,   300000,
                                               1048576, 2097152, 5000000, 8388608};

// One reservoir allocator per policy, on the device that policy needs.
struct Reservoir {
  std::unique_ptr<reservoir::Device> device;
  std::unique_ptr<CachingAllocator> allocator;
};
CachingAllocator& reservoir_for(int policy) {
  static Reservoir all[3];
  Reservoir& r = all[policy];
  if (!r.allocator) {
    static const char* kConfigs[] = {"", "expandable_segments:True", "policy:paging"};
    r.device = reservoir::open_device(policy == 0 ? DeviceKind::cuda_runtime : DeviceKind::cuda_vmm);
    r.allocator = std::make_unique<CachingAllocator>(*r.device, AllocatorConfig::parse(kConfigs[policy]));
  }
  return *r.allocator;
}

void label(benchmark::State& state, int policy) {
  static const char* kNames[] = {"native", "expandable_segments", "paging"};
  state.SetLabel(kNames[policy]);
}

void BM_Reservoir_OneSize(benchmark::State& state) {
  const int policy = static_cast<int>(state.range(0));
  CachingAllocator& a = reservoir_for(policy);
  if (state.thread_index() == 0) a.deallocate(a.allocate(4096));
  for (auto _ : state) {
    void* p = a.allocate(4096);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
  label(state, policy);
}
BENCHMARK(BM_Reservoir_OneSize)->DenseRange(0, 2)->Threads(1)->Threads(2)->UseRealTime();

// PyTorch's allocator, initialized as torch.cuda's lazy init does.
void pytorch_ready() {
  static const bool ready = [] {
    c10::cuda::CUDACachingAllocator::init(1);
    return true;
  }();
  (void)ready;
}

void BM_PyTorch_OneSize(benchmark::State& state) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  pytorch_ready();
  if (state.thread_index() == 0) alloc::raw_delete(alloc::raw_alloc(4096));
  for (auto _ : state) {
    void* p = alloc::raw_alloc(4096);
    benchmark::DoNotOptimize(p);
    alloc::raw_delete(p);
  }
}
BENCHMARK(BM_PyTorch_OneSize)->Threads(1)->Threads(2)->UseRealTime();

void BM_Glibc_OneSize(benchmark::State& state) {
  for (auto _ : state) {
    void* p = std::malloc(4096);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}
BENCHMARK(BM_Glibc_OneSize)->Threads(1)->Threads(2)->UseRealTime();

void BM_Reservoir_MixedSizes(benchmark::State& state) {
  const int policy = static_cast<int>(state.range(0));
  CachingAllocator& a = reservoir_for(policy);
  if (state.thread_index() == 0) {
    for (std::size_t s : kMixed) a.deallocate(a.allocate(s));
  }
  std::size_t i = 0;
  for (auto _ : state) {
    void* p = a.allocate(kMixed[i++ % kMixed.size()]);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
  label(state, policy);
}
BENCHMARK(BM_Reservoir_MixedSizes)->DenseRange(0, 2)->Threads(1)->Threads(2)->UseRealTime();

void BM_PyTorch_MixedSizes(benchmark::State& state) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  pytorch_ready();
  if (state.thread_index() == 0) {
    for (std::size_t s : kMixed) alloc::raw_delete(alloc::raw_alloc(s));
  }
  std::size_t i = 0;
  for (auto _ : state) {
    void* p = alloc::raw_alloc(kMixed[i++ % kMixed.size()]);
    benchmark::DoNotOptimize(p);
    alloc::raw_delete(p);
  }
}
BENCHMARK(BM_PyTorch_MixedSizes)->Threads(1)->Threads(2)->UseRealTime();

void BM_Glibc_MixedSizes(benchmark::State& state) {
  std::size_t i = 0;
  for (auto _ : state) {
    void* p = std::malloc(kMixed[i++ % kMixed.size()]);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
}
BENCHMARK(BM_Glibc_MixedSizes)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
