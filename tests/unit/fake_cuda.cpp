#include "fake_cuda.hpp"

#include <algorithm>

namespace reservoir::testing {
namespace {

FakeCuda& f() { return FakeCuda::get(); }

#define FAIL_IF_INJECTED(name, type)       \
  do {                                     \
    int injected = 0;                      \
    if (f().failing(name, &injected)) {    \
      return static_cast<type>(injected);  \
    }                                      \
  } while (0)

std::uintptr_t align_up(std::uintptr_t v, std::size_t a) { return (v + a - 1) / a * a; }

// ---- driver ----
CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0 && ordinal != 1) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice) {
  if (a == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) *v = f().vmm;
  else if (a == CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) *v = f().rdma;
  else *v = 0;
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
  *c = fake_primary_context();
  return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext* c) {
  *c = f().current;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext c) {
  f().current = c;
  return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize() {
  FAIL_IF_INJECTED("cuCtxSynchronize", CUresult);
  return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult r, const char** name) {
  switch (r) {
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    default: *name = "CUDA_ERROR_UNKNOWN";
  }
  return CUDA_SUCCESS;
}
CUresult cuMemGetInfo(size_t* free, size_t* total) {
  FAIL_IF_INJECTED("cuMemGetInfo", CUresult);
  *free = f().capacity - f().used;
  *total = f().capacity;
  return CUDA_SUCCESS;
}
CUresult cuMemAlloc(CUdeviceptr* p, size_t bytes) {
  FAIL_IF_INJECTED("cuMemAlloc", CUresult);
  if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (bytes > f().capacity - f().used) return CUDA_ERROR_OUT_OF_MEMORY;
  f().used += bytes;
  *p = f().next_address;
  f().next_address = align_up(f().next_address + bytes, 2 << 20);
  f().allocations.emplace(*p, bytes);
  return CUDA_SUCCESS;
}
CUresult cuMemFree(CUdeviceptr p) {
  FAIL_IF_INJECTED("cuMemFree", CUresult);
  auto it = f().allocations.find(p);
  if (it == f().allocations.end()) return CUDA_ERROR_INVALID_VALUE;
  f().used -= it->second;
  f().allocations.erase(it);
  return CUDA_SUCCESS;
}
CUresult cuMemAddressReserve(CUdeviceptr* p, size_t bytes, size_t alignment, CUdeviceptr,
                             unsigned long long) {
  FAIL_IF_INJECTED("cuMemAddressReserve", CUresult);
  if (bytes == 0 || bytes % f().granularity != 0) return CUDA_ERROR_INVALID_VALUE;
  *p = align_up(f().next_reservation, alignment != 0 ? alignment : f().granularity);
  f().next_reservation = *p + bytes + f().granularity;
  f().reservations.emplace(*p, bytes);
  return CUDA_SUCCESS;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t bytes) {
  FAIL_IF_INJECTED("cuMemAddressFree", CUresult);
  auto it = f().reservations.find(p);
  if (it == f().reservations.end() || it->second != bytes) return CUDA_ERROR_INVALID_VALUE;
  f().reservations.erase(it);
  return CUDA_SUCCESS;
}
CUresult cuMemCreate(CUmemGenericAllocationHandle* h, size_t bytes, const CUmemAllocationProp* prop,
                     unsigned long long) {
  f().last_prop = *prop;
  f().contexts_seen.push_back(f().current);
  FAIL_IF_INJECTED("cuMemCreate", CUresult);
  if (bytes == 0 || bytes % f().granularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (bytes > f().capacity - f().used) return CUDA_ERROR_OUT_OF_MEMORY;
  f().used += bytes;
  *h = f().next_handle++;
  f().handles.emplace(*h, FakeCuda::Handle{bytes});
  return CUDA_SUCCESS;
}
void drop_if_unused(CUmemGenericAllocationHandle h) {
  auto it = f().handles.find(h);
  if (it != f().handles.end() && it->second.released && it->second.mappings == 0) {
    f().used -= it->second.bytes;
    f().handles.erase(it);
  }
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  FAIL_IF_INJECTED("cuMemRelease", CUresult);
  auto it = f().handles.find(h);
  if (it == f().handles.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  it->second.released = true;
  drop_if_unused(h);
  return CUDA_SUCCESS;
}
CUresult cuMemMap(CUdeviceptr p, size_t bytes, size_t offset, CUmemGenericAllocationHandle h,
                  unsigned long long) {
  FAIL_IF_INJECTED("cuMemMap", CUresult);
  auto it = f().handles.find(h);
  if (it == f().handles.end() || offset + bytes > it->second.bytes) return CUDA_ERROR_INVALID_VALUE;
  ++it->second.mappings;
  f().mappings.emplace(p, FakeCuda::Mapping{bytes, h});
  return CUDA_SUCCESS;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t bytes) {
  FAIL_IF_INJECTED("cuMemUnmap", CUresult);
  auto it = f().mappings.find(p);
  if (it == f().mappings.end() || it->second.bytes != bytes) return CUDA_ERROR_INVALID_VALUE;
  const CUmemGenericAllocationHandle h = it->second.handle;
  f().mappings.erase(it);
  --f().handles.at(h).mappings;
  drop_if_unused(h);
  return CUDA_SUCCESS;
}
CUresult cuMemSetAccess(CUdeviceptr p, size_t bytes, const CUmemAccessDesc* desc, size_t count) {
  f().last_access.assign(desc, desc + count);
  FAIL_IF_INJECTED("cuMemSetAccess", CUresult);
  auto it = f().mappings.find(p);
  if (it == f().mappings.end() || it->second.bytes != bytes) return CUDA_ERROR_INVALID_VALUE;
  it->second.accessible = true;
  return CUDA_SUCCESS;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp*,
                                       CUmemAllocationGranularity_flags) {
  *g = f().granularity;
  return CUDA_SUCCESS;
}
CUresult cuEventCreate(CUevent* e, unsigned int) {
  FAIL_IF_INJECTED("cuEventCreate", CUresult);
  *e = reinterpret_cast<CUevent>(f().next_event++);
  f().events.insert(reinterpret_cast<std::uintptr_t>(*e));
  return CUDA_SUCCESS;
}
CUresult cuEventDestroy(CUevent e) {
  return f().events.erase(reinterpret_cast<std::uintptr_t>(e)) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
CUresult cuEventRecord(CUevent, CUstream) {
  FAIL_IF_INJECTED("cuEventRecord", CUresult);
  return CUDA_SUCCESS;
}
CUresult cuEventQuery(CUevent) { return CUDA_SUCCESS; }
CUresult cuEventSynchronize(CUevent) { return CUDA_SUCCESS; }
CUresult cuStreamSynchronize(CUstream) {
  FAIL_IF_INJECTED("cuStreamSynchronize", CUresult);
  return CUDA_SUCCESS;
}
CUresult cuStreamCreate(CUstream* s, unsigned int) {
  FAIL_IF_INJECTED("cuStreamCreate", CUresult);
  *s = reinterpret_cast<CUstream>(++f().next_stream);
  return CUDA_SUCCESS;
}
CUresult cuStreamDestroy(CUstream) { return CUDA_SUCCESS; }
CUresult cuMemcpyDtoHAsync(void*, CUdeviceptr, size_t, CUstream) { return CUDA_SUCCESS; }
CUresult cuMemcpyHtoDAsync(CUdeviceptr, const void*, size_t, CUstream) { return CUDA_SUCCESS; }

// ---- runtime ----
cudaError_t cudaSetDevice(int d) {
  if (d != 0 && d != 1) return cudaErrorInvalidDevice;
  f().runtime_device = d;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = f().runtime_device;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  f().calls.push_back("cudaGetLastError");
  const int e = f().sticky_error;
  f().sticky_error = 0;
  return static_cast<cudaError_t>(e);
}
const char* cudaGetErrorName(cudaError_t) { return "cudaError"; }
cudaError_t cudaMalloc(void** p, size_t bytes) {
  f().malloc_modes.push_back(f().capture_mode);
  FAIL_IF_INJECTED("cudaMalloc", cudaError_t);
  if (bytes > f().capacity - f().used) {
    f().sticky_error = cudaErrorMemoryAllocation;
    return cudaErrorMemoryAllocation;
  }
  f().used += bytes;
  *p = reinterpret_cast<void*>(f().next_address);
  f().allocations.emplace(f().next_address, bytes);
  f().next_address = align_up(f().next_address + bytes, 2 << 20);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  FAIL_IF_INJECTED("cudaFree", cudaError_t);
  auto it = f().allocations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == f().allocations.end()) return cudaErrorInvalidValue;
  f().used -= it->second;
  f().allocations.erase(it);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  *free = f().capacity - f().used;
  *total = f().capacity;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = reinterpret_cast<cudaEvent_t>(f().next_event++);
  f().events.insert(reinterpret_cast<std::uintptr_t>(*e));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  return f().events.erase(reinterpret_cast<std::uintptr_t>(e)) ? cudaSuccess
                                                                 : cudaErrorInvalidResourceHandle;
}
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  FAIL_IF_INJECTED("cudaStreamCreateWithFlags", cudaError_t);
  *s = reinterpret_cast<cudaStream_t>(++f().next_stream);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) {
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int flags) {
  f().calls.push_back(flags == cudaHostAllocDefault ? "cudaHostAlloc(default)" : "cudaHostAlloc(flags)");
  FAIL_IF_INJECTED("cudaHostAlloc", cudaError_t);
  if (bytes > f().capacity - f().used) return cudaErrorMemoryAllocation;
  f().used += bytes;
  *p = reinterpret_cast<void*>(f().next_address);
  f().allocations.emplace(f().next_address, bytes);
  f().next_address = align_up(f().next_address + bytes, 2 << 20);
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  FAIL_IF_INJECTED("cudaStreamIsCapturing", cudaError_t);
  *status = f().capturing.count(reinterpret_cast<std::uintptr_t>(s)) != 0 ? cudaStreamCaptureStatusActive
                                                                          : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

// A capture's graph as a test lays it out (FakeCuda::frontiers, node_deps):
// CUDA 12's calls and CUDA 13's (with edges, which must be asked for with
// an array as long as the nodes').
cudaError_t capture_info(cudaStream_t s, cudaStreamCaptureStatus* status, unsigned long long* id,
                         const cudaGraphNode_t** nodes, size_t* count) {
  auto it = f().frontiers.find(reinterpret_cast<std::uintptr_t>(s));
  *status = it == f().frontiers.end() ? cudaStreamCaptureStatusNone
            : f().invalidated         ? cudaStreamCaptureStatusInvalidated
                                      : cudaStreamCaptureStatusActive;
  *id = it == f().frontiers.end() ? 0 : 77;
  *nodes = it == f().frontiers.end() || it->second.empty()
               ? nullptr
               : reinterpret_cast<const cudaGraphNode_t*>(it->second.data());
  *count = it == f().frontiers.end() ? 0 : it->second.size();
  return cudaSuccess;
}
cudaError_t cudaStreamGetCaptureInfoV2(cudaStream_t s, cudaStreamCaptureStatus* status, unsigned long long* id,
                                       cudaGraph_t*, const cudaGraphNode_t** nodes, size_t* count) {
  FAIL_IF_INJECTED("cudaStreamGetCaptureInfo", cudaError_t);
  return capture_info(s, status, id, nodes, count);
}
cudaError_t cudaStreamGetCaptureInfo13(cudaStream_t s, cudaStreamCaptureStatus* status, unsigned long long* id,
                                       cudaGraph_t*, const cudaGraphNode_t** nodes, const void** edges,
                                       size_t* count) {
  FAIL_IF_INJECTED("cudaStreamGetCaptureInfo", cudaError_t);
  *edges = nullptr;
  return capture_info(s, status, id, nodes, count);
}
cudaError_t node_dependencies(cudaGraphNode_t node, cudaGraphNode_t* deps, size_t* count) {
  auto it = f().node_deps.find(reinterpret_cast<std::uintptr_t>(node));
  if (it == f().node_deps.end()) return cudaErrorInvalidValue;
  if (deps == nullptr) {
    *count = it->second.size();
    return cudaSuccess;
  }
  const size_t n = std::min(*count, it->second.size());
  for (size_t i = 0; i < n; ++i) deps[i] = reinterpret_cast<cudaGraphNode_t>(it->second[i]);
  *count = n;
  return cudaSuccess;
}
cudaError_t cudaGraphNodeGetDependencies(cudaGraphNode_t node, cudaGraphNode_t* deps, size_t* count) {
  FAIL_IF_INJECTED("cudaGraphNodeGetDependencies", cudaError_t);
  return node_dependencies(node, deps, count);
}
cudaError_t cudaGraphNodeGetDependencies13(cudaGraphNode_t node, cudaGraphNode_t* deps, void* edges, size_t* count) {
  FAIL_IF_INJECTED("cudaGraphNodeGetDependencies", cudaError_t);
  if (deps != nullptr && edges == nullptr) return cudaErrorLossyQuery;
  return node_dependencies(node, deps, count);
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  FAIL_IF_INJECTED("cudaThreadExchangeStreamCaptureMode", cudaError_t);
  const int was = f().capture_mode;
  f().capture_mode = *mode;
  *mode = static_cast<cudaStreamCaptureMode>(was);
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  auto it = f().allocations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == f().allocations.end()) return cudaErrorInvalidValue;
  f().used -= it->second;
  f().allocations.erase(it);
  return cudaSuccess;
}

}  // namespace

FakeCuda& FakeCuda::get() {
  static FakeCuda fake;
  return fake;
}

void FakeCuda::reset(std::size_t cap, std::size_t g, bool with_vmm, bool with_rdma) {
  *this = FakeCuda{};
  capacity = cap;
  granularity = g;
  vmm = with_vmm;
  rdma = with_rdma;
}

bool FakeCuda::failing(const char* function, int* result) {
  calls.emplace_back(function);
  ++counts[function];
  auto it = failures.find(function);
  if (it == failures.end()) return false;
  if (--it->second.first > 0) return false;
  *result = it->second.second;
  failures.erase(it);
  return true;
}

std::size_t FakeCuda::count(const std::string& function) const {
  auto it = counts.find(function);
  return it == counts.end() ? 0 : static_cast<std::size_t>(it->second);
}

CudaDriverApi FakeCuda::driver() {
  return CudaDriverApi{cuInit, cuDeviceGet, cuDeviceGetAttribute, cuDevicePrimaryCtxRetain,
                       cuDevicePrimaryCtxRelease, cuCtxGetCurrent, cuCtxSetCurrent, cuCtxSynchronize,
                       cuGetErrorName, cuMemGetInfo, cuMemAlloc, cuMemFree, cuMemAddressReserve,
                       cuMemAddressFree, cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap,
                       cuMemSetAccess, cuMemGetAllocationGranularity, cuEventCreate, cuEventDestroy,
                       cuEventRecord, cuEventQuery, cuEventSynchronize, cuStreamSynchronize,
                       cuStreamCreate, cuStreamDestroy, cuMemcpyDtoHAsync, cuMemcpyHtoDAsync};
}

CudaRuntimeApi FakeCuda::runtime() {
  return CudaRuntimeApi{cudaSetDevice,   cudaGetDevice,           cudaGetLastError,
                        cudaGetErrorName, cudaMalloc,             cudaFree,
                        cudaMemGetInfo,  cudaEventCreateWithFlags, cudaEventDestroy,
                        cudaEventRecord, cudaEventQuery,          cudaEventSynchronize,
                        cudaStreamSynchronize, cudaStreamCreateWithFlags, cudaStreamDestroy,
                        cudaDeviceSynchronize, cudaMemcpyAsync,
                        cudaHostAlloc,   cudaFreeHost, cudaStreamIsCapturing,
                        cudaThreadExchangeStreamCaptureMode, nullptr,
                        cudaStreamGetCaptureInfoV2, cudaGraphNodeGetDependencies, nullptr, nullptr};
}

CudaRuntimeApi FakeCuda::runtime13() {
  CudaRuntimeApi api = runtime();
  api.cudaStreamGetCaptureInfo_v2 = nullptr;
  api.cudaGraphNodeGetDependencies = nullptr;
  api.cudaStreamGetCaptureInfo13 = cudaStreamGetCaptureInfo13;
  api.cudaGraphNodeGetDependencies13 = cudaGraphNodeGetDependencies13;
  return api;
}

}  // namespace reservoir::testing
