#include "cuda_api.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "reservoir/device.hpp"

namespace reservoir {
namespace {

template <typename Table>
struct Loaded {
  std::once_flag once;
  Table table{};
  const Table* ok = nullptr;
  std::string why;
};

// Opens the first library of `names` the process has loaded already (the
// runtime PyTorch built with CUDA 12 or 11 brought, say, where a CUDA 13 one is
// installed too: one process, one runtime), else the first that loads;
// resolves every entry of the table with `bind`, which returns false (with
// *why) on a missing symbol.
template <typename Table, typename Bind>
void load(Loaded<Table>& l, std::initializer_list<const char*> names, Bind&& bind) {
  void* lib = nullptr;
  for (const char* name : names) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib != nullptr) break;
  }
  std::string tried;
  for (const char* name : names) {
    if (lib != nullptr) break;
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    const char* err = dlerror();
    tried += fmt::format("{}{}", tried.empty() ? "" : "; ", err != nullptr ? err : name);
  }
  if (lib == nullptr) {
    l.why = tried;
    return;
  }
  if (bind(lib, l.table, &l.why)) l.ok = &l.table;  // the library stays open for the process
}

// The stream-capture calls, where the runtime has them (a runtime without
// them captures nothing, and allocate_segment_on needs none then): both or
// neither.
bool optional_capture_calls(void* lib, CudaRuntimeApi& t) {
  t.cudaStreamIsCapturing =
      reinterpret_cast<decltype(t.cudaStreamIsCapturing)>(dlsym(lib, "cudaStreamIsCapturing"));
  t.cudaThreadExchangeStreamCaptureMode = reinterpret_cast<decltype(t.cudaThreadExchangeStreamCaptureMode)>(
      dlsym(lib, "cudaThreadExchangeStreamCaptureMode"));
  if (t.cudaStreamIsCapturing == nullptr || t.cudaThreadExchangeStreamCaptureMode == nullptr) {
    t.cudaStreamIsCapturing = nullptr;
    t.cudaThreadExchangeStreamCaptureMode = nullptr;
  }
  return true;
}

// A capture's graph, where the runtime can tell it: CUDA 11's and 12's
// calls (the query's _v2 is 12's unsuffixed name), else CUDA 13's, which
// has no _v2 and returns edges too.
bool optional_capture_graph(void* lib, CudaRuntimeApi& t) {
  t.cudaStreamGetCaptureInfo_v2 = reinterpret_cast<decltype(t.cudaStreamGetCaptureInfo_v2)>(
      dlsym(lib, "cudaStreamGetCaptureInfo_v2"));
  void* dependencies = dlsym(lib, "cudaGraphNodeGetDependencies");
  if (t.cudaStreamGetCaptureInfo_v2 != nullptr) {
    t.cudaGraphNodeGetDependencies = reinterpret_cast<decltype(t.cudaGraphNodeGetDependencies)>(dependencies);
    if (t.cudaGraphNodeGetDependencies == nullptr) t.cudaStreamGetCaptureInfo_v2 = nullptr;
    return true;
  }
  t.cudaStreamGetCaptureInfo13 = reinterpret_cast<decltype(t.cudaStreamGetCaptureInfo13)>(
      dlsym(lib, "cudaStreamGetCaptureInfo"));
  t.cudaGraphNodeGetDependencies13 =
      reinterpret_cast<decltype(t.cudaGraphNodeGetDependencies13)>(dependencies);
  if (t.cudaStreamGetCaptureInfo13 == nullptr || t.cudaGraphNodeGetDependencies13 == nullptr) {
    t.cudaStreamGetCaptureInfo13 = nullptr;
    t.cudaGraphNodeGetDependencies13 = nullptr;
  }
  return true;
}

bool optional_bus_id(void* lib, CudaRuntimeApi& t) {
  t.cudaDeviceGetPCIBusId =
      reinterpret_cast<decltype(t.cudaDeviceGetPCIBusId)>(dlsym(lib, "cudaDeviceGetPCIBusId"));
  return true;
}

template <typename F>
bool sym(void* lib, F*& out, const char* name, std::string* why) {
  out = reinterpret_cast<F*>(dlsym(lib, name));
  if (out == nullptr) *why = fmt::format("symbol {} not found", name);
  return out != nullptr;
}

}  // namespace

const CudaDriverApi* load_cuda_driver(std::string* why) {
  static Loaded<CudaDriverApi> l;
  std::call_once(l.once, [] {
    load(l, {"libcuda.so.1", "libcuda.so"}, [](void* lib, CudaDriverApi& t, std::string* w) {
      return sym(lib, t.cuInit, "cuInit", w) && sym(lib, t.cuDeviceGet, "cuDeviceGet", w) &&
             sym(lib, t.cuDeviceGetAttribute, "cuDeviceGetAttribute", w) &&
             sym(lib, t.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", w) &&
             sym(lib, t.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", w) &&
             sym(lib, t.cuCtxGetCurrent, "cuCtxGetCurrent", w) &&
             sym(lib, t.cuCtxSetCurrent, "cuCtxSetCurrent", w) &&
             sym(lib, t.cuCtxSynchronize, "cuCtxSynchronize", w) &&
             sym(lib, t.cuGetErrorName, "cuGetErrorName", w) &&
             sym(lib, t.cuMemGetInfo, "cuMemGetInfo_v2", w) &&
             sym(lib, t.cuMemAlloc, "cuMemAlloc_v2", w) && sym(lib, t.cuMemFree, "cuMemFree_v2", w) &&
             sym(lib, t.cuMemAddressReserve, "cuMemAddressReserve", w) &&
             sym(lib, t.cuMemAddressFree, "cuMemAddressFree", w) &&
             sym(lib, t.cuMemCreate, "cuMemCreate", w) && sym(lib, t.cuMemRelease, "cuMemRelease", w) &&
             sym(lib, t.cuMemMap, "cuMemMap", w) && sym(lib, t.cuMemUnmap, "cuMemUnmap", w) &&
             sym(lib, t.cuMemSetAccess, "cuMemSetAccess", w) &&
             sym(lib, t.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", w) &&
             sym(lib, t.cuEventCreate, "cuEventCreate", w) &&
             sym(lib, t.cuEventDestroy, "cuEventDestroy_v2", w) &&
             sym(lib, t.cuEventRecord, "cuEventRecord", w) &&
             sym(lib, t.cuEventQuery, "cuEventQuery", w) &&
             sym(lib, t.cuEventSynchronize, "cuEventSynchronize", w) &&
             sym(lib, t.cuStreamSynchronize, "cuStreamSynchronize", w) &&
             sym(lib, t.cuStreamCreate, "cuStreamCreate", w) &&
             sym(lib, t.cuStreamDestroy, "cuStreamDestroy_v2", w) &&
             sym(lib, t.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", w) &&
             sym(lib, t.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", w);
    });
    if (l.ok != nullptr) {
      // cuInit fails where the library exists but no driver or device does.
      if (const CUresult r = l.ok->cuInit(0); r != CUDA_SUCCESS) {
        const char* name = nullptr;
        l.ok->cuGetErrorName(r, &name);
        l.why = fmt::format("cuInit failed with {}", name != nullptr ? name : "an unknown error");
        l.ok = nullptr;
      }
    }
  });
  if (l.ok == nullptr && why != nullptr) *why = "CUDA driver unavailable: " + l.why;
  return l.ok;
}

const CudaRuntimeApi* load_cuda_runtime(std::string* why) {
  static Loaded<CudaRuntimeApi> l;
  std::call_once(l.once, [] {
    load(l, {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"},
         [](void* lib, CudaRuntimeApi& t, std::string* w) {
           return sym(lib, t.cudaSetDevice, "cudaSetDevice", w) &&
                  sym(lib, t.cudaGetDevice, "cudaGetDevice", w) &&
                  sym(lib, t.cudaGetLastError, "cudaGetLastError", w) &&
                  sym(lib, t.cudaGetErrorName, "cudaGetErrorName", w) &&
                  sym(lib, t.cudaMalloc, "cudaMalloc", w) && sym(lib, t.cudaFree, "cudaFree", w) &&
                  sym(lib, t.cudaMemGetInfo, "cudaMemGetInfo", w) &&
                  sym(lib, t.cudaEventCreateWithFlags, "cudaEventCreateWithFlags", w) &&
                  sym(lib, t.cudaEventDestroy, "cudaEventDestroy", w) &&
                  sym(lib, t.cudaEventRecord, "cudaEventRecord", w) &&
                  sym(lib, t.cudaEventQuery, "cudaEventQuery", w) &&
                  sym(lib, t.cudaEventSynchronize, "cudaEventSynchronize", w) &&
                  sym(lib, t.cudaStreamSynchronize, "cudaStreamSynchronize", w) &&
                  sym(lib, t.cudaStreamCreateWithFlags, "cudaStreamCreateWithFlags", w) &&
                  sym(lib, t.cudaStreamDestroy, "cudaStreamDestroy", w) &&
                  sym(lib, t.cudaDeviceSynchronize, "cudaDeviceSynchronize", w) &&
                  sym(lib, t.cudaMemcpyAsync, "cudaMemcpyAsync", w) &&
                  sym(lib, t.cudaHostAlloc, "cudaHostAlloc", w) &&
                  sym(lib, t.cudaFreeHost, "cudaFreeHost", w) && optional_capture_calls(lib, t) &&
                  optional_capture_graph(lib, t) && optional_bus_id(lib, t);
         });
  });
  if (l.ok == nullptr && why != nullptr) *why = "CUDA runtime unavailable: " + l.why;
  return l.ok;
}

Status runtime_capture_frontier(const CudaRuntimeApi& api, StreamId stream, CaptureFrontier* out) noexcept {
  out->id = 0;
  out->nodes.clear();
  auto* s = reinterpret_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaGraphNode_t* nodes = nullptr;
  size_t count = 0;
  cudaError_t r = cudaSuccess;
  if (api.cudaStreamGetCaptureInfo_v2 != nullptr) {
    r = api.cudaStreamGetCaptureInfo_v2(s, &status, &id, nullptr, &nodes, &count);
  } else if (api.cudaStreamGetCaptureInfo13 != nullptr) {
    const void* edges = nullptr;
    r = api.cudaStreamGetCaptureInfo13(s, &status, &id, nullptr, &nodes, &edges, &count);
  } else {
    return Status::ok;  // this runtime cannot tell: nothing is seen to capture
  }
  if (r != cudaSuccess) return status_of(r);
  if (status == cudaStreamCaptureStatusInvalidated) return Status::device_error;
  if (status != cudaStreamCaptureStatusActive) return Status::ok;
  try {
    out->nodes.reserve(count);
    for (size_t i = 0; i < count; ++i) out->nodes.push_back(reinterpret_cast<GraphNode>(nodes[i]));
  } catch (...) {
    out->nodes.clear();
    return Status::device_error;
  }
  out->id = id;
  return Status::ok;
}

Status runtime_node_dependencies(const CudaRuntimeApi& api, GraphNode node,
                                 std::vector<GraphNode>* out) noexcept {
  out->clear();
  auto* n = reinterpret_cast<cudaGraphNode_t>(node);
  const bool v12 = api.cudaStreamGetCaptureInfo_v2 != nullptr;
  if (!v12 && api.cudaGraphNodeGetDependencies13 == nullptr) return Status::not_supported;
  size_t count = 0;
  cudaError_t r = v12 ? api.cudaGraphNodeGetDependencies(n, nullptr, &count)
                      : api.cudaGraphNodeGetDependencies13(n, nullptr, nullptr, &count);
  if (r != cudaSuccess || count == 0) return status_of(r);
  try {
    // Given an array, CUDA fills at most its size and says how many it filled.
    std::vector<cudaGraphNode_t> deps(count);
    std::vector<std::uint64_t> edges(count);  // cudaGraphEdgeData: 8 bytes each
    r = v12 ? api.cudaGraphNodeGetDependencies(n, deps.data(), &count)
            : api.cudaGraphNodeGetDependencies13(n, deps.data(), edges.data(), &count);
    if (r != cudaSuccess) return status_of(r);
    for (size_t i = 0; i < count && i < deps.size(); ++i) out->push_back(reinterpret_cast<GraphNode>(deps[i]));
  } catch (...) {
    out->clear();
    return Status::device_error;
  }
  return Status::ok;
}

Status status_of(CUresult r) noexcept {
  switch (r) {
    case CUDA_SUCCESS: return Status::ok;
    case CUDA_ERROR_OUT_OF_MEMORY: return Status::out_of_memory;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_NOT_MAPPED:
    case CUDA_ERROR_ALREADY_MAPPED: return Status::invalid_argument;
    case CUDA_ERROR_NOT_SUPPORTED: return Status::not_supported;
    case CUDA_ERROR_NOT_READY: return Status::not_ready;
    default: return Status::device_error;
  }
}

Status status_of(cudaError_t r) noexcept {
  switch (r) {
    case cudaSuccess: return Status::ok;
    case cudaErrorMemoryAllocation: return Status::out_of_memory;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle: return Status::invalid_argument;
    case cudaErrorNotSupported: return Status::not_supported;
    case cudaErrorNotReady: return Status::not_ready;
    default: return Status::device_error;
  }
}

}  // namespace reservoir
