// reservoir's entry points, as reservoir_torch.cpp exports them, looked up
// by the per-release libraries (torch_hooks.cpp: the pluggable allocator
// with every hook; torch_allocator.hpp: reservoir as PyTorch's own
// CUDAAllocator). Internal to those libraries.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <sys/types.h>

#include <functional>
#include <string>

namespace reservoir_torch_hooks {

using StreamFilter = int (*)(void*, cudaStream_t);
// The StreamFilter of a pool's route whose context is the route's
// std::function<bool(cudaStream_t)> (PyTorch's filter, kept by the caller).
inline int call_stream_filter(void* context, cudaStream_t stream) {
  return (*static_cast<std::function<bool(cudaStream_t)>*>(context))(stream) ? 1 : 0;
}
// A MemPool's own allocator, as reservoir_torch_set_pool_allocator takes it.
using PoolAllocFn = void* (*)(void*, size_t, cudaStream_t, const char**);
using PoolFreeFn = int (*)(void*, void*, size_t, cudaStream_t, const char**);
using PoolDropFn = void (*)(void*);
using TraceFn = void (*)(void*, int, const char*, size_t, unsigned long long, unsigned long long, void*,
                         long long);

struct Entry {
  void* (*malloc)(ssize_t, int, cudaStream_t) = nullptr;
  void (*free)(void*, ssize_t, int, cudaStream_t) = nullptr;
  void (*init)(int) = nullptr;
  void (*reset)() = nullptr;
  int (*set_memory_fraction)(double, int) = nullptr;
  void (*record_stream)(void*, cudaStream_t) = nullptr;
  int (*begin_allocate_to_pool)(int, unsigned long long, unsigned long long, StreamFilter, void*) = nullptr;
  int (*end_allocate_to_pool)(int, unsigned long long, unsigned long long) = nullptr;
  int (*release_pool)(int, unsigned long long, unsigned long long) = nullptr;
  const char* (*error)() = nullptr;
  int (*error_is_oom)() = nullptr;
  char* (*stats_json)(int) = nullptr;
  int (*reset_peak_stats)(int) = nullptr;
  int (*reset_accumulated_stats)(int) = nullptr;
  char* (*snapshot_json)(int) = nullptr;
  int (*record_history)(int, int, size_t, int) = nullptr;
  int (*attach_trace_tracker)(int, TraceFn, void*) = nullptr;
  int (*set_pool_option)(int, unsigned long long, unsigned long long, int, int) = nullptr;
  int (*empty_pool_cache)(int, unsigned long long, unsigned long long) = nullptr;
  int (*set_pool_allocator)(int, unsigned long long, unsigned long long, PoolAllocFn, PoolFreeFn,
                            PoolDropFn, void*) = nullptr;
  char* (*checkpoint_pool)(int, unsigned long long, unsigned long long) = nullptr;
  char* (*restore_pool)(int, unsigned long long, unsigned long long, const char*) = nullptr;
  int (*configured_fraction)(double*) = nullptr;
  int (*apply_settings)(const char*, char**) = nullptr;
  int (*usage)(int, void*, unsigned long long, unsigned long long*, unsigned long long*, unsigned long long*) =
      nullptr;
};

// The entry points, once load() found them.
Entry& entry();

// Checks that PyTorch is the release these libraries were built for
// (RESERVOIR_TORCH_RELEASE), dlopens the library holding reservoir's entry
// points (libreservoir_torch.so or the Python module) and finds every one;
// std::runtime_error saying what is wrong otherwise.
void load(const char* path, const char* release);

// set_per_process_memory_fraction for both integrations: PyTorch's own
// check and words (its native allocator's, which NaN does not pass), then
// reservoir's; c10::Error when either refuses.
void set_memory_fraction(double fraction, int device);

// The message of this thread's last failed call, for Python and for
// reservoir (a pool allocator's error).
std::string& last_error();

// Runs f for an exported C function: 0, or -1 with PyTorch's or the
// library's message in last_error().
template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const c10::Error& e) {
    last_error() = e.what_without_backtrace();
  } catch (const std::exception& e) {
    last_error() = e.what();
  }
  return -1;
}

}  // namespace reservoir_torch_hooks
