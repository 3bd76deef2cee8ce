// A fake CUDA driver and runtime for CPU tests of the CUDA backends: the
// entry points of src/device/cuda_api.hpp over bookkeeping only (no memory
// behind device addresses), with CUDA's answers to misuse, a call log, the
// arguments of the last cuMemCreate and cuMemSetAccess, the current context,
// and injected failures (the n-th call of a function returns a given error).
//
// Function pointers cannot capture, so the fake is one process-wide object;
// tests reset() it.
#pragma once

#include <cstddef>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cuda_api.hpp"

namespace reservoir::testing {

struct FakeCuda {
  static FakeCuda& get();
  void reset(std::size_t capacity, std::size_t granularity = std::size_t{2} << 20,
             bool vmm = true, bool rdma = true);
  static CudaDriverApi driver();
  static CudaRuntimeApi runtime();    // CUDA 12's capture calls
  static CudaRuntimeApi runtime13();  // CUDA 13's

  // Makes the n-th next call (1 = the next) of `function` fail with `result`
  // (a CUresult or cudaError_t value).
  void fail(const std::string& function, int nth, int result) { failures[function] = {nth, result}; }
  // Whether the call fails now (counts the call and logs it).
  bool failing(const char* function, int* result);
  std::size_t count(const std::string& function) const;

  struct Handle {
    std::size_t bytes;
    bool released = false;
    int mappings = 0;
  };
  struct Mapping {
    std::size_t bytes;
    CUmemGenericAllocationHandle handle;
    bool accessible = false;
  };

  std::size_t capacity = 0;
  std::size_t granularity = 0;
  std::size_t used = 0;
  bool vmm = true;
  bool rdma = true;
  int sticky_error = 0;  // the runtime's last error
  CUcontext current = nullptr;  // this thread's context (the fake has one thread)
  int runtime_device = 0;
  std::uintptr_t next_address = 0x7f0000000000;
  std::uintptr_t next_reservation = 0x500000000000;
  CUmemGenericAllocationHandle next_handle = 1;
  std::uintptr_t next_event = 0x1000;
  std::uintptr_t next_stream = 0x9000;
  std::map<std::uintptr_t, std::size_t> allocations;   // cuMemAlloc and cudaMalloc
  std::map<std::uintptr_t, std::size_t> reservations;
  std::map<CUmemGenericAllocationHandle, Handle> handles;
  std::map<std::uintptr_t, Mapping> mappings;
  std::set<std::uintptr_t> events;
  std::set<std::uintptr_t> capturing;  // streams under graph capture
  // A capture's graph (capture id 77): each capturing stream's last nodes,
  // each node's dependencies; `invalidated` invalidates the capture.
  std::map<std::uintptr_t, std::vector<std::uintptr_t>> frontiers;
  std::map<std::uintptr_t, std::vector<std::uintptr_t>> node_deps;
  bool invalidated = false;
  int capture_mode = 0;                // the thread's (cudaStreamCaptureModeGlobal)
  std::vector<int> malloc_modes;       // the capture mode at each cudaMalloc
  std::vector<std::string> calls;
  std::map<std::string, int> counts;
  std::map<std::string, std::pair<int, int>> failures;
  CUmemAllocationProp last_prop{};
  std::vector<CUmemAccessDesc> last_access;
  std::vector<CUcontext> contexts_seen;  // current context at each memory call
};

// The primary context the fake hands out.
inline CUcontext fake_primary_context() { return reinterpret_cast<CUcontext>(0xc0); }

}  // namespace reservoir::testing
