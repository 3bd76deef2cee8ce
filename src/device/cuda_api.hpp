// The CUDA entry points the CUDA backends use, as tables of function
// pointers. The real tables are loaded at run time (dlopen of the CUDA
// runtime, and of the driver, libcuda.so.1), so nothing links against CUDA
// and the library loads on a machine without a driver; tests pass fake tables
// that implement the same functions on the CPU.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "reservoir/device.hpp"

namespace reservoir {

// The driver API (CudaVmmDevice). Names are the versioned symbols cuda.h maps
// its macros to (cuMemGetInfo is cuMemGetInfo_v2, and so on).
struct CudaDriverApi {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuMemGetInfo)(size_t*, size_t*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                            CUmemAllocationGranularity_flags);
  CUresult (*cuEventCreate)(CUevent*, unsigned int);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamCreate)(CUstream*, unsigned int);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
};

// The runtime API (CudaRuntimeDevice: what PyTorch's allocator calls).
struct CudaRuntimeApi {
  cudaError_t (*cudaSetDevice)(int);
  cudaError_t (*cudaGetDevice)(int*);
  cudaError_t (*cudaGetLastError)();
  const char* (*cudaGetErrorName)(cudaError_t);
  cudaError_t (*cudaMalloc)(void**, size_t);
  cudaError_t (*cudaFree)(void*);
  cudaError_t (*cudaMemGetInfo)(size_t*, size_t*);
  cudaError_t (*cudaEventCreateWithFlags)(cudaEvent_t*, unsigned int);
  cudaError_t (*cudaEventDestroy)(cudaEvent_t);
  cudaError_t (*cudaEventRecord)(cudaEvent_t, cudaStream_t);
  cudaError_t (*cudaEventQuery)(cudaEvent_t);
  cudaError_t (*cudaEventSynchronize)(cudaEvent_t);
  cudaError_t (*cudaStreamSynchronize)(cudaStream_t);
  cudaError_t (*cudaStreamCreateWithFlags)(cudaStream_t*, unsigned int);
  cudaError_t (*cudaStreamDestroy)(cudaStream_t);
  cudaError_t (*cudaDeviceSynchronize)();
  cudaError_t (*cudaMemcpyAsync)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);
  cudaError_t (*cudaHostAlloc)(void**, size_t, unsigned int);
  cudaError_t (*cudaFreeHost)(void*);
  // Null where the runtime lacks them (then nothing captures).
  cudaError_t (*cudaStreamIsCapturing)(cudaStream_t, cudaStreamCaptureStatus*);
  cudaError_t (*cudaThreadExchangeStreamCaptureMode)(cudaStreamCaptureMode*);
  // Null where the runtime lacks it (then no process is listed).
  cudaError_t (*cudaDeviceGetPCIBusId)(char*, int, int);
  // A capture's graph: CUDA 11's and 12's query (_v2) and dependencies,
  // without edges, or CUDA 13's, with them (the edges' arrays hold
  // cudaGraphEdgeData, 8 bytes each). One pair or the other is set; where
  // neither is, nothing is seen to capture.
  cudaError_t (*cudaStreamGetCaptureInfo_v2)(cudaStream_t, cudaStreamCaptureStatus*, unsigned long long*,
                                             cudaGraph_t*, const cudaGraphNode_t**, size_t*);
  cudaError_t (*cudaGraphNodeGetDependencies)(cudaGraphNode_t, cudaGraphNode_t*, size_t*);
  cudaError_t (*cudaStreamGetCaptureInfo13)(cudaStream_t, cudaStreamCaptureStatus*, unsigned long long*,
                                            cudaGraph_t*, const cudaGraphNode_t**, const void**, size_t*);
  cudaError_t (*cudaGraphNodeGetDependencies13)(cudaGraphNode_t, cudaGraphNode_t*, void*, size_t*);
};

// The process's tables, loaded once; null with *why set when CUDA cannot be
// loaded here (no driver, no runtime library, a symbol missing).
const CudaDriverApi* load_cuda_driver(std::string* why);
const CudaRuntimeApi* load_cuda_runtime(std::string* why);

// The processes NVML lists on the device with CUDA ordinal `device` (its PCI
// bus id from the runtime, as PyTorch finds it). not_supported where NVML
// (libnvidia-ml.so.1) or the call is missing; device_error where it fails.
Status nvml_running_processes(int device, std::vector<ProcessMemory>* out) noexcept;

// Device::capture_frontier and node_dependencies through the runtime's
// table (both CUDA devices: streams and captures are the runtime's).
Status runtime_capture_frontier(const CudaRuntimeApi& api, StreamId stream, CaptureFrontier* out) noexcept;
Status runtime_node_dependencies(const CudaRuntimeApi& api, GraphNode node,
                                 std::vector<GraphNode>* out) noexcept;

// Status for a driver or runtime result.
Status status_of(CUresult r) noexcept;
Status status_of(cudaError_t r) noexcept;

}  // namespace reservoir
