// Kernels' attributes and occupancy (kernels.hpp): the state each kernel
// carries, and the driver's forms of the calls (cuFunc*, cuKernel*,
// cuOccupancy*). A CUfunction and a CUkernel are the kernel's host stub
// (what the runtime's cudaGetFuncBySymbol and cudaGetKernel hand out).
#include "kernels.hpp"

#include <cuda.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace sc = reservoir::simcuda;
using sc::KernelCall;
using sc::Sim;

namespace {

// What a program sets on a kernel (cuFuncSetAttribute / cudaFuncSetAttribute).
struct Settings {
  int max_dynamic_shared = -1;  // -1: CUDA's default, 48 KiB less the static shared memory
  int carveout = -1;            // cudaSharedmemCarveoutDefault
  int cluster[3] = {0, 0, 0};
  int non_portable_cluster = 0;
  int scheduling_policy = 0;
  int cache_config = 0;
};

struct State {
  std::mutex mu;
  std::unordered_map<const void*, Settings> settings;
};
State& state() {
  static State s;
  return s;
}

constexpr sc::KernelResources kResources{};
constexpr sc::OccupancyLimits kLimits{};

int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

int max_threads(const Sim::Kernel& k) {
  // The register file bounds a block too: 65536 registers at 32 a thread
  // allow 2048 threads, above the 1024 any block may have.
  const int by_registers =
      kLimits.registers_per_sm /
      (ceil_div(kResources.registers * kLimits.warp_size, kLimits.register_unit) *
       kLimits.register_unit) *
      kLimits.warp_size;
  int limit = std::min(kLimits.max_threads_per_block, by_registers);
  if (k.thread_limit > 0) limit = std::min(limit, k.thread_limit);
  return limit;
}

int max_dynamic_shared(const Settings& s) {
  return s.max_dynamic_shared >= 0 ? s.max_dynamic_shared
                                   : kLimits.shared_per_block_default - kResources.static_shared;
}

// Blocks that fit on one multiprocessor, as CUDA's occupancy calculator
// works it out: by warps, by registers and by shared memory (each block
// also takes the 1 KiB the system reserves, in 128-byte units).
int blocks_per_sm(const Sim::Kernel& k, const Settings& s, int threads,
                  std::size_t dynamic_shared) {
  if (threads <= 0 || threads > max_threads(k)) return 0;
  if (dynamic_shared > static_cast<std::size_t>(max_dynamic_shared(s))) return 0;
  const int warps = ceil_div(threads, kLimits.warp_size);
  const int by_warps = kLimits.max_threads_per_sm / kLimits.warp_size / warps;
  const int warp_registers =
      ceil_div(kResources.registers * kLimits.warp_size, kLimits.register_unit) *
      kLimits.register_unit;
  const int by_registers = kLimits.registers_per_sm / warp_registers / warps;
  const int shared = ceil_div(kResources.static_shared + static_cast<int>(dynamic_shared) +
                                  kLimits.shared_reserved_per_block,
                              kLimits.shared_unit) *
                     kLimits.shared_unit;
  const int by_shared = kLimits.shared_per_sm / shared;
  return std::max(0, std::min({kLimits.max_blocks_per_sm, by_warps, by_registers, by_shared}));
}

// `f` on a registered kernel's settings, under the lock.
template <typename F>
KernelCall with(const void* kernel, F&& f) {
  const Sim::Kernel* k = Sim::get().kernel(kernel);
  if (k == nullptr) return KernelCall::kUnknownKernel;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return f(*k, st.settings[kernel]);
}

CUresult driver_code(KernelCall c) {
  switch (c) {
    case KernelCall::kOk: return CUDA_SUCCESS;
    case KernelCall::kUnknownKernel: return CUDA_ERROR_INVALID_HANDLE;
    case KernelCall::kInvalidValue: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_ERROR_UNKNOWN;
}

#define ENTER(name) \
  if (const int injected = Sim::get().enter(name, false)) return static_cast<CUresult>(injected)

}  // namespace

extern "C" {

SIMCUDA_API KernelCall reservoir_simcuda_kernel_get(const void* kernel, int attribute, int* value) {
  if (value == nullptr) return KernelCall::kInvalidValue;
  return with(kernel, [&](const Sim::Kernel& k, Settings& s) {
    switch (static_cast<CUfunction_attribute>(attribute)) {
      case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = max_threads(k); break;
      case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *value = kResources.static_shared; break;
      case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES: *value = kResources.constant; break;
      case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *value = kResources.local; break;
      case CU_FUNC_ATTRIBUTE_NUM_REGS: *value = kResources.registers; break;
      case CU_FUNC_ATTRIBUTE_PTX_VERSION: *value = kResources.ptx_version; break;
      case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *value = kResources.binary_version; break;
      case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA: *value = 0; break;
      case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *value = max_dynamic_shared(s); break;
      case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *value = s.carveout; break;
      case CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET: *value = 0; break;
      case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH: *value = s.cluster[0]; break;
      case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT: *value = s.cluster[1]; break;
      case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH: *value = s.cluster[2]; break;
      case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
        *value = s.non_portable_cluster;
        break;
      case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
        *value = s.scheduling_policy;
        break;
      default: return KernelCall::kInvalidValue;
    }
    return KernelCall::kOk;
  });
}

SIMCUDA_API KernelCall reservoir_simcuda_kernel_set(const void* kernel, int attribute, int value) {
  return with(kernel, [&](const Sim::Kernel&, Settings& s) {
    const int cluster_limit = s.non_portable_cluster != 0 ? 16 : 8;
    switch (static_cast<CUfunction_attribute>(attribute)) {
      case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        // What a block may opt in to, less the kernel's static shared memory.
        if (value < 0 || value > kLimits.shared_per_block_optin - kResources.static_shared) {
          return KernelCall::kInvalidValue;
        }
        s.max_dynamic_shared = value;
        break;
      case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
        if (value < -1 || value > 100) return KernelCall::kInvalidValue;
        s.carveout = value;
        break;
      case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
      case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
      case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
        if (value < 0 || value > cluster_limit) return KernelCall::kInvalidValue;
        s.cluster[attribute - CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH] = value;
        break;
      case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
        if (value != 0 && value != 1) return KernelCall::kInvalidValue;
        s.non_portable_cluster = value;
        break;
      case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
        if (value < 0 || value > 2) return KernelCall::kInvalidValue;
        s.scheduling_policy = value;
        break;
      default: return KernelCall::kInvalidValue;  // the binary's own: read-only
    }
    return KernelCall::kOk;
  });
}

SIMCUDA_API KernelCall reservoir_simcuda_kernel_name(const void* kernel, const char** name) {
  if (name == nullptr) return KernelCall::kInvalidValue;
  const Sim::Kernel* k = Sim::get().kernel(kernel);
  if (k == nullptr) return KernelCall::kUnknownKernel;
  *name = k->name.c_str();
  return KernelCall::kOk;
}

SIMCUDA_API KernelCall reservoir_simcuda_occupancy(const void* kernel, int block_threads,
                                                   std::size_t dynamic_shared, int* blocks) {
  if (blocks == nullptr) return KernelCall::kInvalidValue;
  return with(kernel, [&](const Sim::Kernel& k, Settings& s) {
    *blocks = blocks_per_sm(k, s, block_threads, dynamic_shared);
    return KernelCall::kOk;
  });
}

SIMCUDA_API KernelCall reservoir_simcuda_available_shared(const void* kernel, int blocks,
                                                          int block_threads, std::size_t* bytes) {
  if (bytes == nullptr || blocks <= 0) return KernelCall::kInvalidValue;
  return with(kernel, [&](const Sim::Kernel& k, Settings& s) {
    *bytes = 0;
    if (blocks_per_sm(k, s, block_threads, 0) < blocks)
      return KernelCall::kOk;  // not even without any
    const int per_block =
        kLimits.shared_per_sm / blocks / kLimits.shared_unit * kLimits.shared_unit -
        kLimits.shared_reserved_per_block - kResources.static_shared;
    const int cap = kLimits.shared_per_block_optin - kResources.static_shared;
    *bytes = static_cast<std::size_t>(std::max(0, std::min(per_block, cap)));
    return KernelCall::kOk;
  });
}

// ---- the driver's forms -------------------------------------------------

SIMCUDA_API CUresult cuFuncGetAttribute(int* value, CUfunction_attribute attribute, CUfunction f) {
  ENTER("cuFuncGetAttribute");
  return driver_code(reservoir_simcuda_kernel_get(f, attribute, value));
}
SIMCUDA_API CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attribute, int value) {
  ENTER("cuFuncSetAttribute");
  return driver_code(reservoir_simcuda_kernel_set(f, attribute, value));
}
SIMCUDA_API CUresult cuKernelGetAttribute(int* value, CUfunction_attribute attribute,
                                          CUkernel kernel, CUdevice d) {
  ENTER("cuKernelGetAttribute");
  if (!Sim::get().valid(d)) return CUDA_ERROR_INVALID_DEVICE;
  return driver_code(reservoir_simcuda_kernel_get(kernel, attribute, value));
}
SIMCUDA_API CUresult cuKernelSetAttribute(CUfunction_attribute attribute, int value,
                                          CUkernel kernel, CUdevice d) {
  ENTER("cuKernelSetAttribute");
  if (!Sim::get().valid(d)) return CUDA_ERROR_INVALID_DEVICE;
  return driver_code(reservoir_simcuda_kernel_set(kernel, attribute, value));
}
SIMCUDA_API CUresult cuFuncGetName(const char** name, CUfunction f) {
  ENTER("cuFuncGetName");
  return driver_code(reservoir_simcuda_kernel_name(f, name));
}
SIMCUDA_API CUresult cuKernelGetName(const char** name, CUkernel kernel) {
  ENTER("cuKernelGetName");
  return driver_code(reservoir_simcuda_kernel_name(kernel, name));
}
SIMCUDA_API CUresult cuKernelGetFunction(CUfunction* f, CUkernel kernel) {
  ENTER("cuKernelGetFunction");
  if (f == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (Sim::get().kernel(kernel) == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *f = reinterpret_cast<CUfunction>(kernel);
  return CUDA_SUCCESS;
}
SIMCUDA_API CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache config) {
  ENTER("cuFuncSetCacheConfig");
  if (config < CU_FUNC_CACHE_PREFER_NONE || config > CU_FUNC_CACHE_PREFER_EQUAL)
    return CUDA_ERROR_INVALID_VALUE;
  return driver_code(with(f, [&](const Sim::Kernel&, Settings& s) {
    s.cache_config = config;
    return KernelCall::kOk;
  }));
}
SIMCUDA_API CUresult cuKernelSetCacheConfig(CUkernel kernel, CUfunc_cache config, CUdevice d) {
  ENTER("cuKernelSetCacheConfig");
  if (!Sim::get().valid(d)) return CUDA_ERROR_INVALID_DEVICE;
  return cuFuncSetCacheConfig(reinterpret_cast<CUfunction>(kernel), config);
}
// A registered kernel is loaded with its fat binary.
SIMCUDA_API CUresult cuFuncIsLoaded(CUfunctionLoadingState* loaded, CUfunction f) {
  ENTER("cuFuncIsLoaded");
  if (loaded == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (Sim::get().kernel(f) == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *loaded = CU_FUNCTION_LOADING_STATE_LOADED;
  return CUDA_SUCCESS;
}
SIMCUDA_API CUresult cuFuncLoad(CUfunction f) {
  ENTER("cuFuncLoad");
  return Sim::get().kernel(f) == nullptr ? CUDA_ERROR_INVALID_HANDLE : CUDA_SUCCESS;
}
SIMCUDA_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* blocks, CUfunction f,
                                                                          int threads,
                                                                          size_t shared,
                                                                          unsigned int flags) {
  ENTER("cuOccupancyMaxActiveBlocksPerMultiprocessor");
  if ((flags & ~static_cast<unsigned>(CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  return driver_code(reservoir_simcuda_occupancy(f, threads, shared, blocks));
}
SIMCUDA_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, CUfunction f,
                                                                 int threads, size_t shared) {
  return cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(blocks, f, threads, shared, 0);
}
// The block size that fills a multiprocessor best (the largest among those
// that reach the most threads resident), and the grid that fills the device.
SIMCUDA_API CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int* min_grid, int* block,
                                                               CUfunction f,
                                                               CUoccupancyB2DSize shared_of_block,
                                                               size_t shared, int block_limit,
                                                               unsigned int flags) {
  ENTER("cuOccupancyMaxPotentialBlockSize");
  if (min_grid == nullptr || block == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if ((flags & ~static_cast<unsigned>(CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  int limit = 0;
  if (const CUresult r = driver_code(
          reservoir_simcuda_kernel_get(f, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, &limit));
      r != CUDA_SUCCESS) {
    return r;
  }
  if (block_limit > 0) limit = std::min(limit, block_limit);
  int best_threads = 0;
  int best_block = 0;
  int best_blocks = 0;
  for (int threads = limit / kLimits.warp_size * kLimits.warp_size; threads > 0;
       threads -= kLimits.warp_size) {
    const size_t bytes = shared_of_block != nullptr ? shared_of_block(threads) : shared;
    int blocks = 0;
    (void)reservoir_simcuda_occupancy(f, threads, bytes, &blocks);
    if (blocks * threads > best_threads) {
      best_threads = blocks * threads;
      best_block = threads;
      best_blocks = blocks;
    }
  }
  int sms = 0;
  reservoir_simcuda_attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0, &sms);
  *block = best_block;
  *min_grid = best_blocks * sms;
  return CUDA_SUCCESS;
}
SIMCUDA_API CUresult cuOccupancyMaxPotentialBlockSize(int* min_grid, int* block, CUfunction f,
                                                      CUoccupancyB2DSize shared_of_block,
                                                      size_t shared, int block_limit) {
  return cuOccupancyMaxPotentialBlockSizeWithFlags(min_grid, block, f, shared_of_block, shared,
                                                   block_limit, 0);
}
SIMCUDA_API CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t* bytes, CUfunction f,
                                                             int blocks, int threads) {
  ENTER("cuOccupancyAvailableDynamicSMemPerBlock");
  return driver_code(reservoir_simcuda_available_shared(f, blocks, threads, bytes));
}

}  // extern "C"
