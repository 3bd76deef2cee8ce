// The runtime's kernel attribute and occupancy calls (cudaFunc*,
// cudaOccupancy*, cudaGetFuncBySymbol, cudaGetKernel), on the driver's one
// state of each kernel (kernels.hpp). A pointer that is no registered
// kernel is an invalid device function, as CUDA says.
#include <cuda_runtime_api.h>

#include "kernels.hpp"

using reservoir::simcuda::KernelCall;
using reservoir::simcuda::Sim;

cudaError_t reservoir_simcudart_result(int code);

namespace {

cudaError_t runtime_code(KernelCall c) {
  switch (c) {
    case KernelCall::kOk: return cudaSuccess;
    case KernelCall::kUnknownKernel:
      return reservoir_simcudart_result(cudaErrorInvalidDeviceFunction);
    case KernelCall::kInvalidValue: return reservoir_simcudart_result(cudaErrorInvalidValue);
  }
  return reservoir_simcudart_result(cudaErrorUnknown);
}

#define ENTER(name)                                       \
  Sim::runtime_thread() = true;                           \
  if (const int injected = Sim::get().enter(name, false)) \
  return reservoir_simcudart_result(injected)

int get(const void* f, int a) {
  int v = 0;
  (void)reservoir_simcuda_kernel_get(f, a, &v);
  return v;
}

}  // namespace

extern "C" {

SIMCUDA_API cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* f) {
  ENTER("cudaFuncGetAttributes");
  if (attr == nullptr) return reservoir_simcudart_result(cudaErrorInvalidValue);
  if (Sim::get().kernel(f) == nullptr) return runtime_code(KernelCall::kUnknownKernel);
  *attr = cudaFuncAttributes{};
  attr->maxThreadsPerBlock = get(f, reservoir::simcuda::kMaxThreadsPerBlock);
  attr->sharedSizeBytes = static_cast<size_t>(get(f, reservoir::simcuda::kSharedSizeBytes));
  attr->constSizeBytes = static_cast<size_t>(get(f, reservoir::simcuda::kConstSizeBytes));
  attr->localSizeBytes = static_cast<size_t>(get(f, reservoir::simcuda::kLocalSizeBytes));
  attr->numRegs = get(f, reservoir::simcuda::kNumRegs);
  attr->ptxVersion = get(f, reservoir::simcuda::kPtxVersion);
  attr->binaryVersion = get(f, reservoir::simcuda::kBinaryVersion);
  attr->cacheModeCA = get(f, reservoir::simcuda::kCacheModeCa);
  attr->maxDynamicSharedSizeBytes = get(f, cudaFuncAttributeMaxDynamicSharedMemorySize);
  attr->preferredShmemCarveout = get(f, cudaFuncAttributePreferredSharedMemoryCarveout);
#if CUDART_VERSION >= 11080
  attr->clusterDimMustBeSet = get(f, cudaFuncAttributeClusterDimMustBeSet);
  attr->requiredClusterWidth = get(f, cudaFuncAttributeRequiredClusterWidth);
  attr->requiredClusterHeight = get(f, cudaFuncAttributeRequiredClusterHeight);
  attr->requiredClusterDepth = get(f, cudaFuncAttributeRequiredClusterDepth);
  attr->clusterSchedulingPolicyPreference =
      get(f, cudaFuncAttributeClusterSchedulingPolicyPreference);
  attr->nonPortableClusterSizeAllowed = get(f, cudaFuncAttributeNonPortableClusterSizeAllowed);
#endif
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaFuncSetAttribute(const void* f, cudaFuncAttribute attribute,
                                             int value) {
  ENTER("cudaFuncSetAttribute");
  return runtime_code(reservoir_simcuda_kernel_set(f, attribute, value));
}

SIMCUDA_API cudaError_t cudaFuncSetCacheConfig(const void* f, cudaFuncCache config) {
  ENTER("cudaFuncSetCacheConfig");
  if (config < cudaFuncCachePreferNone || config > cudaFuncCachePreferEqual) {
    return reservoir_simcudart_result(cudaErrorInvalidValue);
  }
  return runtime_code(Sim::get().kernel(f) != nullptr ? KernelCall::kOk
                                                      : KernelCall::kUnknownKernel);
}

#if CUDART_VERSION < 13000  // removed from CUDA 13: the bank size is fixed
SIMCUDA_API cudaError_t cudaFuncSetSharedMemConfig(const void* f, cudaSharedMemConfig config) {
  ENTER("cudaFuncSetSharedMemConfig");
  if (config < cudaSharedMemBankSizeDefault || config > cudaSharedMemBankSizeEightByte) {
    return reservoir_simcudart_result(cudaErrorInvalidValue);
  }
  return runtime_code(Sim::get().kernel(f) != nullptr ? KernelCall::kOk
                                                      : KernelCall::kUnknownKernel);
}
#endif

#if CUDART_VERSION >= 12030
SIMCUDA_API cudaError_t cudaFuncGetName(const char** name, const void* f) {
  ENTER("cudaFuncGetName");
  return runtime_code(reservoir_simcuda_kernel_name(f, name));
}
#endif

SIMCUDA_API cudaError_t cudaGetFuncBySymbol(cudaFunction_t* out, const void* f) {
  ENTER("cudaGetFuncBySymbol");
  if (out == nullptr) return reservoir_simcudart_result(cudaErrorInvalidValue);
  if (Sim::get().kernel(f) == nullptr) return runtime_code(KernelCall::kUnknownKernel);
  *out = reinterpret_cast<cudaFunction_t>(const_cast<void*>(f));
  return cudaSuccess;
}

#if CUDART_VERSION >= 12000
SIMCUDA_API cudaError_t cudaGetKernel(cudaKernel_t* out, const void* f) {
  ENTER("cudaGetKernel");
  if (out == nullptr) return reservoir_simcudart_result(cudaErrorInvalidValue);
  if (Sim::get().kernel(f) == nullptr) return runtime_code(KernelCall::kUnknownKernel);
  *out = reinterpret_cast<cudaKernel_t>(const_cast<void*>(f));
  return cudaSuccess;
}
#endif

#if CUDART_VERSION >= 12000 && CUDART_VERSION < 13000
SIMCUDA_API cudaError_t cudaKernelSetAttributeForDevice(cudaKernel_t kernel,
                                                        cudaFuncAttribute attribute, int value,
                                                        int device) {
  ENTER("cudaKernelSetAttributeForDevice");
  if (!Sim::get().valid(device)) return reservoir_simcudart_result(cudaErrorInvalidDevice);
  return runtime_code(reservoir_simcuda_kernel_set(kernel, attribute, value));
}
#endif

SIMCUDA_API cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    int* blocks, const void* f, int threads, size_t shared, unsigned int flags) {
  ENTER("cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if ((flags & ~static_cast<unsigned>(cudaOccupancyDisableCachingOverride)) != 0) {
    return reservoir_simcudart_result(cudaErrorInvalidValue);
  }
  return runtime_code(reservoir_simcuda_occupancy(f, threads, shared, blocks));
}
SIMCUDA_API cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void* f,
                                                                      int threads, size_t shared) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(blocks, f, threads, shared, 0);
}
SIMCUDA_API cudaError_t cudaOccupancyAvailableDynamicSMemPerBlock(size_t* bytes, const void* f,
                                                                  int blocks, int threads) {
  ENTER("cudaOccupancyAvailableDynamicSMemPerBlock");
  return runtime_code(reservoir_simcuda_available_shared(f, blocks, threads, bytes));
}

}  // extern "C"
