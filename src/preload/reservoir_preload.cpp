// libreservoir_preload.so: reservoir's caching allocator under any CUDA
// program, by LD_PRELOAD.
//
//   RESERVOIR_ALLOC_CONF=max_split_size_mb:128 LD_PRELOAD=libreservoir_preload.so ./program
//
// Intercepted: cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync (the
// runtime calls frameworks and programs linked against the shared CUDA
// runtime make). Each GPU gets one CachingAllocator on a CudaRuntimeDevice,
// which calls the runtime's own functions (looked up in libcudart itself, so
// never these). Pointers reservoir did not hand out go to the real cudaFree /
// cudaFreeAsync. Not intercepted, and why: the driver API (cuMemAlloc and
// friends: its callers manage their own contexts, which the runtime's
// primary-context memory would not match), cudaMallocManaged / cudaMallocHost
// / cudaMallocPitch (other kinds of memory), and programs linked against the
// static CUDA runtime (nvcc's default: their calls never reach the dynamic
// linker; build with -cudart shared).
//
// Semantics: cudaMalloc memory is served on the legacy default stream, so a
// block freed with cudaFree is reused in that stream's order (which the
// legacy stream keeps with every blocking stream); cudaFree itself does not
// synchronize the device as the real one does. Work on non-blocking streams
// that still uses a freed pointer must be synchronized by the program first,
// or freed with cudaFreeAsync on its stream. RESERVOIR_PRELOAD_SUMMARY=1
// prints each device's memory summary at exit; RESERVOIR_PRELOAD_STATS=FILE
// writes each device's statistics there at exit, as JSON
// ({"0": {torch.cuda.memory_stats() keys}, ...}).
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/cuda_device.hpp"
#include "reservoir/errors.hpp"

namespace {

constexpr int kMaxDevices = 64;

struct Real {
  cudaError_t (*free)(void*) = nullptr;
  cudaError_t (*free_async)(void*, cudaStream_t) = nullptr;
  cudaError_t (*get_device)(int*) = nullptr;
};

struct State {
  std::mutex mutex;
  std::array<std::unique_ptr<reservoir::CudaRuntimeDevice>, kMaxDevices> devices;
  std::array<std::unique_ptr<reservoir::CachingAllocator>, kMaxDevices> allocators;
  Real real;
  bool real_loaded = false;

  // Keys are torch.cuda.memory_stats()'s: plain ASCII, nothing to escape.
  void write_stats(const char* path) const {
    std::FILE* f = std::fopen(path, "w");
    if (f == nullptr) {
      std::fprintf(stderr, "reservoir preload: cannot write RESERVOIR_PRELOAD_STATS=%s\n", path);
      return;
    }
    const char* sep = "";
    std::fprintf(f, "{");
    for (std::size_t d = 0; d < allocators.size(); ++d) {
      if (!allocators[d]) continue;
      std::fprintf(f, "%s\"%zu\": {", sep, d);
      const char* inner = "";
      for (const auto& [key, value] : allocators[d]->stats_map()) {
        std::fprintf(f, "%s\"%s\": %lld", inner, key.c_str(), static_cast<long long>(value));
        inner = ", ";
      }
      std::fprintf(f, "}");
      sep = ", ";
    }
    std::fprintf(f, "}\n");
    std::fclose(f);
  }

  ~State() {
    if (const char* s = std::getenv("RESERVOIR_PRELOAD_SUMMARY"); s != nullptr && *s == '1') {
      for (const auto& a : allocators) {
        if (a) std::fprintf(stderr, "%s", a->memory_summary().c_str());
      }
    }
    if (const char* path = std::getenv("RESERVOIR_PRELOAD_STATS"); path != nullptr && *path != '\0') {
      write_stats(path);
    }
    // Allocators go first: they return their segments through the devices.
    for (auto& a : allocators) a.reset();
  }
};

State& state() {
  static State s;
  return s;
}

// A runtime entry point: the next definition after this library; else, when
// the runtime is not in the global scope (a library loaded it with
// RTLD_LOCAL, as Python extension modules are), the runtime's own.
void* runtime_symbol(const char* name) {
  if (void* f = dlsym(RTLD_NEXT, name)) return f;
  for (const char* lib : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
    void* handle = dlopen(lib, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (handle == nullptr) handle = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) continue;
    if (void* f = dlsym(handle, name)) return f;  // the library stays open for the process
  }
  return nullptr;
}

// The runtime's own entry points.
const Real& real() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.real_loaded) {
    s.real.free = reinterpret_cast<cudaError_t (*)(void*)>(runtime_symbol("cudaFree"));
    s.real.free_async =
        reinterpret_cast<cudaError_t (*)(void*, cudaStream_t)>(runtime_symbol("cudaFreeAsync"));
    s.real.get_device = reinterpret_cast<cudaError_t (*)(int*)>(runtime_symbol("cudaGetDevice"));
    s.real_loaded = true;
  }
  return s.real;
}

int current_device() {
  int d = 0;
  if (real().get_device == nullptr || real().get_device(&d) != cudaSuccess) return 0;
  return d;
}

// The allocator of the current GPU, created on first use; null when CUDA
// cannot be opened (the message goes to stderr once).
reservoir::CachingAllocator* allocator() {
  const int device = current_device();
  if (device < 0 || device >= kMaxDevices) return nullptr;
  State& s = state();
  std::lock_guard lock(s.mutex);
  auto& a = s.allocators[static_cast<std::size_t>(device)];
  if (!a) {
    try {
      s.devices[static_cast<std::size_t>(device)] = reservoir::CudaRuntimeDevice::open(device);
      a = std::make_unique<reservoir::CachingAllocator>(*s.devices[static_cast<std::size_t>(device)],
                                                        reservoir::AllocatorConfig::from_env(), device);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "reservoir preload: %s\n", e.what());
      return nullptr;
    }
  }
  return a.get();
}

cudaError_t allocate(void** ptr, size_t size, cudaStream_t stream) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  reservoir::CachingAllocator* a = allocator();
  if (a == nullptr) return cudaErrorInitializationError;
  try {
    *ptr = a->allocate(size, reinterpret_cast<reservoir::StreamId>(stream));
    return cudaSuccess;
  } catch (const reservoir::OutOfMemoryError&) {
    *ptr = nullptr;
    return cudaErrorMemoryAllocation;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reservoir preload: %s\n", e.what());
    *ptr = nullptr;
    return cudaErrorUnknown;
  }
}

// Frees a pointer reservoir holds; false when it is not reservoir's.
bool release(void* ptr, cudaStream_t stream, bool async) {
  reservoir::CachingAllocator* a = allocator();
  if (a == nullptr) return false;
  try {
    if (async && stream != nullptr) {
      a->record_stream(ptr, reinterpret_cast<reservoir::StreamId>(stream));
    }
    a->deallocate(ptr);
    return true;
  } catch (const reservoir::InvalidPointerError&) {
    return false;
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** ptr, size_t size) {
  return allocate(ptr, size, nullptr);
}

__attribute__((visibility("default"))) cudaError_t cudaMallocAsync(void** ptr, size_t size,
                                                                   cudaStream_t stream) {
  return allocate(ptr, size, stream);
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* ptr) {
  if (ptr != nullptr && release(ptr, nullptr, false)) return cudaSuccess;
  return real().free != nullptr ? real().free(ptr) : cudaErrorInitializationError;
}

__attribute__((visibility("default"))) cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (ptr != nullptr && release(ptr, stream, true)) return cudaSuccess;
  return real().free_async != nullptr ? real().free_async(ptr, stream)
                                      : cudaErrorInitializationError;
}

}  // extern "C"
