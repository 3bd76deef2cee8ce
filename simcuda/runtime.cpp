// The simulated CUDA runtime (libcudart.so.13): the runtime calls PyTorch
// makes, served from the simulated device (sim.hpp). Every other name the
// real runtime exports is a weak stub that refuses the call, naming it; the
// version script gives each the version node PyTorch's libraries bind to.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "graphs.hpp"
#include "sim.hpp"

using reservoir::simcuda::Event;
using reservoir::simcuda::Sim;
using reservoir::simcuda::Stream;

extern "C" void* reservoir_simcuda_driver_symbol(const char* symbol);

namespace capture = reservoir::simcuda::capture;

namespace {

thread_local cudaError_t last_error = cudaSuccess;

// Every call's result passes here: failures stick as the last error.
cudaError_t result(int code) {
  const auto e = static_cast<cudaError_t>(code);
  if (e != cudaSuccess && e != cudaErrorNotReady) last_error = e;
  return e;
}

#define ENTER(name, alloc)                                         \
  Sim::runtime_thread() = true;                                    \
  if (const int injected = Sim::get().enter(name, alloc)) return result(injected)

int device() { return Sim::current_device(); }
// The device of a stream: its own, or the current one for the default streams.
int stream_device(cudaStream_t s) {
  const auto handle = reinterpret_cast<std::uintptr_t>(s);
  return handle <= 2 ? device() : reinterpret_cast<Stream*>(s)->device;
}

// Launch configurations pushed by <<<>>> and popped by the stub that
// launches.
struct LaunchConfig {
  dim3 grid, block;
  size_t shared = 0;
  void* stream = nullptr;
};
thread_local LaunchConfig pushed;

}  // namespace

// The same, for the runtime's other sources (graphs.cpp).
cudaError_t reservoir_simcudart_result(int code) { return result(code); }

extern "C" {

// What each runtime name the simulation does not serve calls (the stubs
// gen_stubs.py writes): the refusal, as the call's last error.
int reservoir_simcudart_refuse(const char* name) { return result(Sim::get().refuse(name)); }

// ---- fat binaries and launches ----------------------------------------

SIMCUDA_API void** __cudaRegisterFatBinary(void* fat) {
  static void* handle[1];
  handle[0] = fat;
  return handle;
}
SIMCUDA_API void __cudaRegisterFatBinaryEnd(void** handle) { (void)handle; }
SIMCUDA_API void __cudaUnregisterFatBinary(void** handle) { (void)handle; }
SIMCUDA_API void __cudaRegisterFunction(void** handle, const char* host, char* device, const char* name,
                                        int limit, uint3* tid, uint3* bid, dim3* bdim, dim3* gdim, int* wsize) {
  (void)handle, (void)device, (void)tid, (void)bid, (void)bdim, (void)gdim, (void)wsize;
  Sim::get().register_function(host, name, limit);  // which kernel a launch of the stub is
}
SIMCUDA_API void __cudaRegisterVar(void** handle, char* host, char* device, const char* name, int ext,
                                   size_t size, int constant, int global) {
  (void)handle, (void)host, (void)device, (void)name, (void)ext, (void)size, (void)constant, (void)global;
}
SIMCUDA_API void __cudaRegisterManagedVar(void** handle, void** host, char* device, const char* name, int ext,
                                          size_t size, int constant, int global) {
  (void)handle, (void)host, (void)device, (void)name, (void)ext, (void)size, (void)constant, (void)global;
}
SIMCUDA_API char __cudaInitModule(void** handle) {
  (void)handle;
  return 0;
}
SIMCUDA_API unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared, void* stream) {
  pushed = LaunchConfig{grid, block, shared, stream};
  return 0;
}
SIMCUDA_API cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shared, void* stream) {
  if (grid != nullptr) *grid = pushed.grid;
  if (block != nullptr) *block = pushed.block;
  if (shared != nullptr) *shared = pushed.shared;
  if (stream != nullptr) *static_cast<void**>(stream) = pushed.stream;
  return cudaSuccess;
}

#if CUDART_VERSION >= 12000
// A kernel's handle for its host stub: the stub itself (nothing runs it).
SIMCUDA_API cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* func) {
  if (kernel == nullptr) return result(cudaErrorInvalidValue);
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(func));
  return cudaSuccess;
}
#endif

// A kernel runs in its stream's order and takes no time, but for a kernel
// that spins for its first argument's cycles (torch.cuda._sleep's
// spin_kernel), which keeps the stream busy that long (Sim::run).
cudaError_t launch(const char* name, const void* f, void** args, cudaStream_t stream) {
  if (!Sim::get().allow_kernels()) {
    // Refused; in a capture, the capture is invalidated too.
    const int refused = capture::capture_refuses(stream, name);
    return result(refused != capture::kNotCapturing ? refused : Sim::get().refuse(name));
  }
  ENTER(name, false);
  double ms = 0.0;
  if (f != nullptr && args != nullptr && args[0] != nullptr &&
      Sim::get().function_name(f).find("spin_kernel") != std::string::npos) {
    std::int64_t cycles = 0;
    std::memcpy(&cycles, args[0], sizeof cycles);
    if (cycles > 0) ms = static_cast<double>(cycles) / reservoir::simcuda::kSimulatedCyclesPerMs;
  }
  if (const int implicit = capture::legacy_use(stream, stream_device(stream))) return result(implicit);
  const int captured = capture::capture_kernel(stream, f, ms);
  if (captured != capture::kNotCapturing) return result(captured);
  Sim::get().run(stream, stream_device(stream), ms);
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaLaunchKernel(const void* f, dim3 grid, dim3 block, void** args, size_t shared,
                                         cudaStream_t stream) {
  (void)grid, (void)block, (void)shared;
  return launch("cudaLaunchKernel", f, args, stream);
}
SIMCUDA_API cudaError_t __cudaLaunchKernel(const void* f, dim3 grid, dim3 block, void** args, size_t shared,
                                           cudaStream_t stream) {
  (void)grid, (void)block, (void)shared;
  return launch("__cudaLaunchKernel", f, args, stream);
}
#if CUDART_VERSION >= 11080  // cudaLaunchConfig_t's
SIMCUDA_API cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* f, void** args) {
  return launch("cudaLaunchKernelExC", f, args, config != nullptr ? config->stream : nullptr);
}
#endif

// ---- errors and versions ------------------------------------------------

SIMCUDA_API cudaError_t cudaGetLastError(void) {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
SIMCUDA_API cudaError_t cudaPeekAtLastError(void) { return last_error; }

SIMCUDA_API const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureMerge: return "cudaErrorStreamCaptureMerge";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorGraphExecUpdateFailure: return "cudaErrorGraphExecUpdateFailure";
    default: return "cudaErrorUnknown";
  }
}

SIMCUDA_API const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorNotSupported: return Sim::get().refused_text();
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureMerge: return "operation would result in a merge of separate capture sequences";
    case cudaErrorStreamCaptureUnmatched: return "capture was not ended in the same stream as it began";
    case cudaErrorStreamCaptureUnjoined: return "capturing stream has unjoined work";
    case cudaErrorStreamCaptureIsolation:
      return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorGraphExecUpdateFailure:
      return "the graph update was not performed because it included changes which violated constraints "
             "specific to instantiated graph update";
    default: return "unknown error";
  }
}

SIMCUDA_API cudaError_t cudaDriverGetVersion(int* version) {
  ENTER("cudaDriverGetVersion", false);
  if (version == nullptr) return result(cudaErrorInvalidValue);
  *version = 13020;
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaRuntimeGetVersion(int* version) {
  ENTER("cudaRuntimeGetVersion", false);
  if (version == nullptr) return result(cudaErrorInvalidValue);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

#if CUDART_VERSION >= 12000
SIMCUDA_API cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version,
                                                         unsigned long long flags,
                                                         cudaDriverEntryPointQueryResult* status) {
  (void)version, (void)flags;
  if (symbol == nullptr || fn == nullptr) return result(cudaErrorInvalidValue);
  *fn = reservoir_simcuda_driver_symbol(symbol);
  if (status != nullptr) *status = *fn != nullptr ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags,
                                                cudaDriverEntryPointQueryResult* status) {
  return cudaGetDriverEntryPointByVersion(symbol, fn, CUDART_VERSION, flags, status);
}
#else
// CUDA 11's: no query result (a missing symbol is an error).
SIMCUDA_API cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags) {
  (void)flags;
  if (symbol == nullptr || fn == nullptr) return result(cudaErrorInvalidValue);
  *fn = reservoir_simcuda_driver_symbol(symbol);
  return *fn != nullptr ? cudaSuccess : result(cudaErrorSymbolNotFound);
}
#endif

// ---- devices --------------------------------------------------------------

SIMCUDA_API cudaError_t cudaGetDeviceCount(int* count) {
  ENTER("cudaGetDeviceCount", false);
  if (count == nullptr) return result(cudaErrorInvalidValue);
  *count = Sim::get().device_count();
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaGetDevice(int* d) {
  ENTER("cudaGetDevice", false);
  if (d == nullptr) return result(cudaErrorInvalidValue);
  *d = device();
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaSetDevice(int d) {
  ENTER("cudaSetDevice", false);
  if (!Sim::get().valid(d)) return result(cudaErrorInvalidDevice);
  Sim::current_device() = d;
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaDeviceSynchronize(void) {
  ENTER("cudaDeviceSynchronize", false);
  if (const int refused = capture::device_sync(device())) return result(refused);
  Sim::get().device_synchronize(device());
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int d) {
  ENTER("cudaDeviceGetAttribute", false);
  if (value == nullptr) return result(cudaErrorInvalidValue);
  return result(reservoir_simcuda_attribute(static_cast<int>(attr), d, value));
}
SIMCUDA_API cudaError_t cudaDeviceGetPCIBusId(char* id, int len, int d) {
  ENTER("cudaDeviceGetPCIBusId", false);
  if (!Sim::get().valid(d)) return result(cudaErrorInvalidDevice);
  if (id == nullptr || len <= 0) return result(cudaErrorInvalidValue);
  std::snprintf(id, static_cast<size_t>(len), "00000000:%02X:00.0", 0x18 + d);
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  ENTER("cudaDeviceGetStreamPriorityRange", false);
  if (least != nullptr) *least = 0;
  if (greatest != nullptr) *greatest = -5;
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaDeviceCanAccessPeer(int* can, int d, int peer) {
  ENTER("cudaDeviceCanAccessPeer", false);
  if (can == nullptr) return result(cudaErrorInvalidValue);
  if (!Sim::get().valid(d) || !Sim::get().valid(peer)) return result(cudaErrorInvalidDevice);
  *can = d != peer ? 1 : 0;
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  ENTER("cudaDeviceEnablePeerAccess", false);
  (void)flags;
  return Sim::get().valid(peer) ? cudaSuccess : result(cudaErrorInvalidDevice);
}

SIMCUDA_API cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  ENTER("cudaGetDeviceProperties", false);
  if (p == nullptr) return result(cudaErrorInvalidValue);
  if (!Sim::get().valid(d)) return result(cudaErrorInvalidDevice);
  std::memset(p, 0, sizeof *p);
  std::snprintf(p->name, sizeof p->name, "%s", Sim::get().name().c_str());
  std::memcpy(p->uuid.bytes, "reservoirsim", 12);
  p->uuid.bytes[15] = static_cast<char>(d);
  auto attr = [d](cudaDeviceAttr a) {
    int v = 0;
    reservoir_simcuda_attribute(static_cast<int>(a), d, &v);
    return v;
  };
  p->totalGlobalMem = Sim::get().capacity(d);
  p->sharedMemPerBlock = static_cast<size_t>(attr(cudaDevAttrMaxSharedMemoryPerBlock));
  p->regsPerBlock = attr(cudaDevAttrMaxRegistersPerBlock);
  p->warpSize = attr(cudaDevAttrWarpSize);
  p->memPitch = 2147483647;
  p->maxThreadsPerBlock = attr(cudaDevAttrMaxThreadsPerBlock);
  p->maxThreadsDim[0] = 1024, p->maxThreadsDim[1] = 1024, p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647, p->maxGridSize[1] = 65535, p->maxGridSize[2] = 65535;
  p->totalConstMem = 65536;
  p->major = attr(cudaDevAttrComputeCapabilityMajor);
  p->minor = attr(cudaDevAttrComputeCapabilityMinor);
  p->textureAlignment = 512;
  p->texturePitchAlignment = 32;
  p->multiProcessorCount = attr(cudaDevAttrMultiProcessorCount);
  p->integrated = 0;
  p->canMapHostMemory = 1;
  p->concurrentKernels = 1;
  p->ECCEnabled = 1;
  p->pciBusID = 0x18 + d;
  p->asyncEngineCount = 2;
  p->unifiedAddressing = 1;
  p->memoryBusWidth = attr(cudaDevAttrGlobalMemoryBusWidth);
  p->l2CacheSize = attr(cudaDevAttrL2CacheSize);
  p->persistingL2CacheMaxSize = attr(cudaDevAttrMaxPersistingL2CacheSize);
  p->maxThreadsPerMultiProcessor = attr(cudaDevAttrMaxThreadsPerMultiProcessor);
  p->streamPrioritiesSupported = 1;
  p->globalL1CacheSupported = 1;
  p->localL1CacheSupported = 1;
  p->sharedMemPerMultiprocessor = static_cast<size_t>(attr(cudaDevAttrMaxSharedMemoryPerMultiprocessor));
  p->regsPerMultiprocessor = 65536;
  p->managedMemory = 1;
  p->concurrentManagedAccess = 1;
  p->pageableMemoryAccess = 0;
  p->sharedMemPerBlockOptin = static_cast<size_t>(attr(cudaDevAttrMaxSharedMemoryPerBlockOptin));
  p->maxBlocksPerMultiProcessor = 32;
  p->accessPolicyMaxWindowSize = 134213632;
  p->reservedSharedMemPerBlock = 1024;
  return cudaSuccess;
}

// ---- memory -----------------------------------------------------------------

SIMCUDA_API cudaError_t cudaMalloc(void** ptr, size_t size) {
  ENTER("cudaMalloc", true);
  if (const int refused = capture::unsafe_call()) return result(refused);
  return result(Sim::get().malloc_device(device(), size, ptr));
}
SIMCUDA_API cudaError_t cudaFree(void* ptr) {
  ENTER("cudaFree", false);
  if (const int refused = capture::unsafe_call()) return result(refused);
  return result(Sim::get().free_device(ptr));
}
// Stream-ordered allocation: work on a stream is done when issued here, so
// the memory is the device's as cudaMalloc places it, given and taken back
// at once.
SIMCUDA_API cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  ENTER("cudaMallocAsync", true);
  const int captured = capture::capture_refuses(stream, "cudaMallocAsync (during stream capture)");
  if (captured != capture::kNotCapturing) return result(captured);
  return result(Sim::get().malloc_device(device(), size, ptr));
}
SIMCUDA_API cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  ENTER("cudaFreeAsync", false);
  const int captured = capture::capture_refuses(stream, "cudaFreeAsync (during stream capture)");
  if (captured != capture::kNotCapturing) return result(captured);
  return result(Sim::get().free_device(ptr));
}
SIMCUDA_API cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  ENTER("cudaMemGetInfo", false);
  if (free == nullptr || total == nullptr) return result(cudaErrorInvalidValue);
  *total = Sim::get().capacity(device());
  *free = *total - Sim::get().used(device());
  return cudaSuccess;
}
// Managed memory: flags cudaMemAttachGlobal or cudaMemAttachHost, as the
// runtime takes; a prefetch or an advice on it is taken (ordered in its
// stream), on anything else refused with the runtime's invalid value.
SIMCUDA_API cudaError_t cudaMallocManaged(void** ptr, size_t size, unsigned int flags) {
  ENTER("cudaMallocManaged", true);
  if (flags != cudaMemAttachGlobal && flags != cudaMemAttachHost) return result(cudaErrorInvalidValue);
  return result(Sim::get().managed_alloc(size, ptr));
}
SIMCUDA_API cudaError_t SIMCUDA_12_NAME(cudaMemPrefetchAsync, _v2)(const void* ptr, size_t count,
                                                                  cudaMemLocation location, unsigned int flags,
                                                                  cudaStream_t stream) {
  ENTER("cudaMemPrefetchAsync", false);
  (void)count, (void)location, (void)flags;
  if (!Sim::get().is_managed(ptr)) return result(cudaErrorInvalidValue);
  Sim::get().run(stream, stream_device(stream), 0.0);
  return cudaSuccess;
}
SIMCUDA_API cudaError_t SIMCUDA_12_NAME(cudaMemAdvise, _v2)(const void* ptr, size_t count,
                                                           cudaMemoryAdvise advice, cudaMemLocation location) {
  ENTER("cudaMemAdvise", false);
  (void)count, (void)advice, (void)location;
  return Sim::get().is_managed(ptr) ? cudaSuccess : result(cudaErrorInvalidValue);
}
SIMCUDA_API cudaError_t cudaMallocHost(void** ptr, size_t size) {
  ENTER("cudaMallocHost", true);
  return result(Sim::get().host_alloc(size, ptr));
}
SIMCUDA_API cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int flags) {
  ENTER("cudaHostAlloc", true);
  (void)flags;
  return result(Sim::get().host_alloc(size, ptr));
}
SIMCUDA_API cudaError_t cudaFreeHost(void* ptr) {
  ENTER("cudaFreeHost", false);
  if (const int refused = capture::unsafe_call()) return result(refused);
  return result(Sim::get().host_free(ptr));
}
// Host memory is the device's memory here: registering a range only makes
// it pinned memory (cudaPointerGetAttributes answers cudaMemoryTypeHost) until
// it is unregistered; a range that overlaps one registered, or an unknown
// pointer to unregister, gets the runtime's error.
SIMCUDA_API cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags) {
  ENTER("cudaHostRegister", false);
  (void)flags;
  return result(Sim::get().host_register(ptr, size));
}
SIMCUDA_API cudaError_t cudaHostUnregister(void* ptr) {
  ENTER("cudaHostUnregister", false);
  return result(Sim::get().host_unregister(ptr));
}
SIMCUDA_API cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* ptr) {
  ENTER("cudaPointerGetAttributes", false);
  if (a == nullptr) return result(cudaErrorInvalidValue);
  std::memset(a, 0, sizeof *a);
  std::uintptr_t base = 0;
  size_t size = 0;
  int d = 0;
  if (Sim::get().device_range(ptr, &base, &size, &d)) {
    a->type = cudaMemoryTypeDevice;
    a->device = d;
    a->devicePointer = const_cast<void*>(ptr);
  } else if (Sim::get().is_managed(ptr)) {
    a->type = cudaMemoryTypeManaged;
    a->device = device();
    a->devicePointer = const_cast<void*>(ptr);
    a->hostPointer = const_cast<void*>(ptr);
  } else if (Sim::get().is_host(ptr)) {
    a->type = cudaMemoryTypeHost;
    a->device = device();
    a->devicePointer = const_cast<void*>(ptr);
    a->hostPointer = const_cast<void*>(ptr);
  } else {
    a->type = cudaMemoryTypeUnregistered;
    a->device = -2;
    a->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}

// Copies take no time; a synchronous one waits for the legacy stream's work
// (and so every blocking stream's) first, an asynchronous one runs in its
// stream's order.
SIMCUDA_API cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  ENTER("cudaMemcpy", false);
  (void)kind;
  if (const int implicit = capture::legacy_use(nullptr, device())) return result(implicit);
  if (const int refused = capture::unsafe_call()) return result(refused);
  Sim::get().stream_synchronize(nullptr, device());
  return result(Sim::get().copy(dst, src, count));
}
SIMCUDA_API cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                        cudaStream_t stream) {
  ENTER("cudaMemcpyAsync", false);
  (void)kind;
  if (const int implicit = capture::legacy_use(stream, stream_device(stream))) return result(implicit);
  const int captured = capture::capture_copy(stream, dst, src, count);
  if (captured != capture::kNotCapturing) return result(captured);
  if (const int fault = Sim::get().copy(dst, src, count)) return result(fault);
  Sim::get().run(stream, stream_device(stream), 0.0);
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device,
                                            size_t count, cudaStream_t stream) {
  ENTER("cudaMemcpyPeerAsync", false);
  (void)dst_device, (void)src_device;
  if (const int implicit = capture::legacy_use(stream, stream_device(stream))) return result(implicit);
  const int captured = capture::capture_copy(stream, dst, src, count);
  if (captured != capture::kNotCapturing) return result(captured);
  return result(Sim::get().copy(dst, src, count));
}
SIMCUDA_API cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                          size_t height, cudaMemcpyKind kind, cudaStream_t stream) {
  ENTER("cudaMemcpy2DAsync", false);
  (void)kind;
  if (const int implicit = capture::legacy_use(stream, stream_device(stream))) return result(implicit);
  const int captured = capture::capture_copy_2d(stream, dst, dpitch, src, spitch, width, height);
  if (captured != capture::kNotCapturing) return result(captured);
  for (size_t row = 0; row < height; ++row) {
    const int fault = Sim::get().copy(static_cast<char*>(dst) + row * dpitch,
                                      static_cast<const char*>(src) + row * spitch, width);
    if (fault != 0) return result(fault);
  }
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  ENTER("cudaMemset", false);
  if (const int implicit = capture::legacy_use(nullptr, device())) return result(implicit);
  if (const int refused = capture::unsafe_call()) return result(refused);
  return result(Sim::get().fill(ptr, value, count));
}
SIMCUDA_API cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  ENTER("cudaMemsetAsync", false);
  if (const int implicit = capture::legacy_use(stream, stream_device(stream))) return result(implicit);
  const int captured = capture::capture_fill(stream, ptr, value, count);
  if (captured != capture::kNotCapturing) return result(captured);
  if (const int fault = Sim::get().fill(ptr, value, count)) return result(fault);
  Sim::get().run(stream, stream_device(stream), 0.0);
  return cudaSuccess;
}

// ---- streams and events -----------------------------------------------------

SIMCUDA_API cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int priority) {
  ENTER("cudaStreamCreateWithPriority", false);
  if (s == nullptr) return result(cudaErrorInvalidValue);
  *s = reinterpret_cast<cudaStream_t>(Sim::get().create_stream(device(), priority, flags));
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  return cudaStreamCreateWithPriority(s, flags, 0);
}
SIMCUDA_API cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithPriority(s, 0, 0); }
SIMCUDA_API cudaError_t cudaStreamDestroy(cudaStream_t s) {
  ENTER("cudaStreamDestroy", false);
  capture::forget_stream(s);
  return result(Sim::get().destroy_stream(reinterpret_cast<Stream*>(s)));
}
SIMCUDA_API cudaError_t cudaStreamGetPriority(cudaStream_t s, int* priority) {
  ENTER("cudaStreamGetPriority", false);
  if (priority == nullptr) return result(cudaErrorInvalidValue);
  *priority = s != nullptr ? reinterpret_cast<Stream*>(s)->priority : 0;
  return cudaSuccess;
}
// A stream is busy while the work queued on it has not ended (Sim::run).
SIMCUDA_API cudaError_t cudaStreamQuery(cudaStream_t s) {
  ENTER("cudaStreamQuery", false);
  if (const int refused = capture::stream_sync(s, stream_device(s))) return result(refused);
  return result(Sim::get().stream_query(s, stream_device(s)));
}
SIMCUDA_API cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  ENTER("cudaStreamSynchronize", false);
  if (const int refused = capture::stream_sync(s, stream_device(s))) return result(refused);
  return result(Sim::get().stream_synchronize(s, stream_device(s)));
}
SIMCUDA_API cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  ENTER("cudaStreamWaitEvent", false);
  (void)flags;
  if (e == nullptr) return result(cudaErrorInvalidResourceHandle);
  const int captured = capture::capture_wait(s, e);
  if (captured != capture::kNotCapturing) return result(captured);
  return result(Sim::get().stream_wait_event(s, stream_device(s), reinterpret_cast<Event*>(e)));
}
SIMCUDA_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  ENTER("cudaEventCreateWithFlags", false);
  if (e == nullptr) return result(cudaErrorInvalidValue);
  Event* event = Sim::get().create_event(device());
  event->interprocess = (flags & cudaEventInterprocess) != 0;
  *e = reinterpret_cast<cudaEvent_t>(event);
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }

// Interprocess memory and events (Sim::ipc_*). An event's handle names its
// process; the event opened from it is a new one of the opening process,
// complete, as all work is here once issued.
SIMCUDA_API cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* ptr) {
  ENTER("cudaIpcGetMemHandle", false);
  static_assert(sizeof(cudaIpcMemHandle_t) == Sim::kIpcHandleSize);
  if (handle == nullptr) return result(cudaErrorInvalidValue);
  return result(Sim::get().ipc_get_handle(ptr, reinterpret_cast<unsigned char*>(handle->reserved)));
}
SIMCUDA_API cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned int flags) {
  ENTER("cudaIpcOpenMemHandle", false);
  (void)flags;  // cudaIpcMemLazyEnablePeerAccess: every device reaches every other here
  return result(Sim::get().ipc_open(reinterpret_cast<const unsigned char*>(handle.reserved), ptr));
}
SIMCUDA_API cudaError_t cudaIpcCloseMemHandle(void* ptr) {
  ENTER("cudaIpcCloseMemHandle", false);
  return result(Sim::get().ipc_close(ptr));
}
namespace {
constexpr char kEventMagic[8] = {'r', 's', 'v', 's', 'i', 'm', 'E', 'V'};
}  // namespace
SIMCUDA_API cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t e) {
  ENTER("cudaIpcGetEventHandle", false);
  static_assert(sizeof(cudaIpcEventHandle_t) == 64);
  const auto* event = reinterpret_cast<const Event*>(e);
  if (handle == nullptr || event == nullptr) return result(cudaErrorInvalidValue);
  if (!event->interprocess) return result(cudaErrorInvalidResourceHandle);
  std::memset(handle->reserved, 0, sizeof handle->reserved);
  std::memcpy(handle->reserved, kEventMagic, sizeof kEventMagic);
  const std::int32_t pid = ::getpid();
  std::memcpy(handle->reserved + 8, &pid, 4);
  std::memcpy(handle->reserved + 12, &e, sizeof e);
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* e, cudaIpcEventHandle_t handle) {
  ENTER("cudaIpcOpenEventHandle", false);
  if (e == nullptr) return result(cudaErrorInvalidValue);
  if (std::memcmp(handle.reserved, kEventMagic, sizeof kEventMagic) != 0) {
    return result(cudaErrorInvalidResourceHandle);
  }
  std::int32_t pid = 0;
  std::memcpy(&pid, handle.reserved + 8, 4);
  if (pid == ::getpid()) return result(cudaErrorDeviceUninitialized);  // other processes only
  Event* event = Sim::get().create_event(device());
  event->interprocess = true;
  *e = reinterpret_cast<cudaEvent_t>(event);
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaEventDestroy(cudaEvent_t e) {
  ENTER("cudaEventDestroy", false);
  capture::forget_event(e);
  return result(Sim::get().destroy_event(reinterpret_cast<Event*>(e)));
}
SIMCUDA_API cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  ENTER("cudaEventRecord", false);
  if (e == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (const int implicit = capture::legacy_use(s, stream_device(s))) return result(implicit);
  const int captured = capture::capture_record(e, s);
  if (captured != capture::kNotCapturing) return result(captured);
  return result(Sim::get().record(reinterpret_cast<Event*>(e), s));
}
SIMCUDA_API cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned int flags) {
  ENTER("cudaEventRecordWithFlags", false);
  (void)flags;
  if (e == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (const int implicit = capture::legacy_use(s, stream_device(s))) return result(implicit);
  const int captured = capture::capture_record(e, s);
  if (captured != capture::kNotCapturing) return result(captured);
  return result(Sim::get().record(reinterpret_cast<Event*>(e), s));
}
SIMCUDA_API cudaError_t cudaEventQuery(cudaEvent_t e) {
  ENTER("cudaEventQuery", false);
  if (e == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (const int refused = capture::event_sync(e)) return result(refused);
  return result(Sim::get().query(reinterpret_cast<Event*>(e)));
}
SIMCUDA_API cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  ENTER("cudaEventSynchronize", false);
  if (e == nullptr) return result(cudaErrorInvalidResourceHandle);
  if (const int refused = capture::event_sync(e)) return result(refused);
  return result(Sim::get().synchronize(reinterpret_cast<Event*>(e)));
}
SIMCUDA_API cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  ENTER("cudaEventElapsedTime", false);
  if (ms == nullptr || start == nullptr || end == nullptr) return result(cudaErrorInvalidValue);
  // Events never recorded have no time: an invalid handle, as the runtime says.
  if (!reinterpret_cast<Event*>(start)->recorded || !reinterpret_cast<Event*>(end)->recorded) {
    return result(cudaErrorInvalidResourceHandle);
  }
  *ms = static_cast<float>(reinterpret_cast<Event*>(end)->time_ms - reinterpret_cast<Event*>(start)->time_ms);
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaProfilerStart(void) { return cudaSuccess; }
SIMCUDA_API cudaError_t cudaProfilerStop(void) { return cudaSuccess; }

}  // extern "C"
