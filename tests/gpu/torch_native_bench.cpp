// PyTorch's native CUDA caching allocator measured from C++, beside reservoir
// (libreservoir_torch.so, called through the entry points PyTorch's pluggable
// allocator calls) and CUDA's own cudaMalloc/cudaFree and
// cudaMallocAsync/cudaFreeAsync, in one process, one timing loop each,
// rounds interleaved so that drift hits every kind alike. No Python runs
// inside a timed loop. Built on the GPU machine by torch_native_bench.py with
// PyTorch's C++ extension loader (PyTorch's headers are not on the build
// machine).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <sys/types.h>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Plugin {
  void* (*malloc)(ssize_t, int, cudaStream_t) = nullptr;
  void (*free)(void*, ssize_t, int, cudaStream_t) = nullptr;
  void (*empty_cache)() = nullptr;
};

Plugin& plugin() {
  static Plugin p;
  return p;
}

void load_plugin(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) throw std::runtime_error(std::string("dlopen: ") + dlerror());
  Plugin& p = plugin();
  p.malloc = reinterpret_cast<decltype(p.malloc)>(dlsym(lib, "reservoir_torch_malloc"));
  p.free = reinterpret_cast<decltype(p.free)>(dlsym(lib, "reservoir_torch_free"));
  p.empty_cache = reinterpret_cast<decltype(p.empty_cache)>(dlsym(lib, "reservoir_torch_empty_cache"));
  if (p.malloc == nullptr || p.free == nullptr || p.empty_cache == nullptr) {
    throw std::runtime_error(path + " lacks the reservoir_torch_* entry points");
  }
}

void check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string(what) + " failed");
}

// One allocate+free pair of `size` bytes by `kind`; with `miss`, the cache is
// emptied after it, so the next allocation reaches the device.
std::function<void()> pair_of(const std::string& kind, std::size_t size, bool miss) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (kind == "torch") {
    return [=] {
      void* p = alloc::raw_alloc(size);
      check(p != nullptr, "raw_alloc");
      alloc::raw_delete(p);
      if (miss) alloc::emptyCache();
    };
  }
  if (kind == "reservoir") {
    const int device = c10::cuda::current_device();
    return [=] {
      void* p = plugin().malloc(static_cast<ssize_t>(size), device, stream);
      check(p != nullptr, "reservoir_torch_malloc");
      plugin().free(p, static_cast<ssize_t>(size), device, stream);
      if (miss) plugin().empty_cache();
    };
  }
  if (kind == "cudaMalloc") {
    return [=] {
      void* p = nullptr;
      check(cudaMalloc(&p, size) == cudaSuccess, "cudaMalloc");
      check(cudaFree(p) == cudaSuccess, "cudaFree");
    };
  }
  if (kind == "cudaMallocAsync") {
    return [=] {
      void* p = nullptr;
      check(cudaMallocAsync(&p, size, stream) == cudaSuccess, "cudaMallocAsync");
      check(cudaFreeAsync(p, stream) == cudaSuccess, "cudaFreeAsync");
      if (miss) {
        // Give the pool's memory back, so the next allocation is a real one.
        int device = 0;
        cudaMemPool_t pool = nullptr;
        check(cudaStreamSynchronize(stream) == cudaSuccess, "cudaStreamSynchronize");
        check(cudaGetDevice(&device) == cudaSuccess, "cudaGetDevice");
        check(cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess, "cudaDeviceGetDefaultMemPool");
        check(cudaMemPoolTrimTo(pool, 0) == cudaSuccess, "cudaMemPoolTrimTo");
      }
    };
  }
  throw std::runtime_error("unknown kind " + kind);
}

// For each kind: `rounds` timings of `iters` pairs, in ns per pair; the
// kinds take turns within every round.
std::map<std::string, std::vector<double>> measure(const std::vector<std::string>& kinds,
                                                   std::size_t size, bool miss, int iters,
                                                   int rounds) {
  std::vector<std::function<void()>> bodies;
  for (const auto& k : kinds) {
    bodies.push_back(pair_of(k, size, miss));
    bodies.back()();  // warm: the first pair creates contexts, pools and segments
  }
  check(cudaDeviceSynchronize() == cudaSuccess, "cudaDeviceSynchronize");
  std::map<std::string, std::vector<double>> out;
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t k = 0; k < kinds.size(); ++k) {
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) bodies[k]();
      const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
      out[kinds[k]].push_back(ns / iters);
    }
  }
  check(cudaDeviceSynchronize() == cudaSuccess, "cudaDeviceSynchronize");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("load_plugin", &load_plugin, "dlopen libreservoir_torch.so");
  m.def("measure", &measure, "ns per allocate+free pair, per kind and round");
}
