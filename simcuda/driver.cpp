// The simulated CUDA driver (libcuda.so.1): the driver calls PyTorch makes,
// served from the simulated device (sim.hpp). Every other name the real
// driver exports is a weak stub that refuses the call, naming it.
#include <cuda.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "sim.hpp"

using reservoir::simcuda::Sim;
namespace sc = reservoir::simcuda;

namespace {

// One primary context per device; a context is its device's index + 1.
struct Ctx {
  int device;
};
Ctx contexts[64];
thread_local CUcontext current = nullptr;

CUcontext context_of(int device) {
  contexts[device].device = device;
  return reinterpret_cast<CUcontext>(&contexts[device]);
}
int device_of(CUcontext ctx) { return reinterpret_cast<Ctx*>(ctx)->device; }
// A context this driver handed out (a primary context of a device).
bool known_context(CUcontext ctx) {
  const auto* c = reinterpret_cast<const Ctx*>(ctx);
  return c >= contexts && c < contexts + 64 && Sim::get().valid(static_cast<int>(c - contexts));
}

CUresult code(int c) { return static_cast<CUresult>(c); }

#define ENTER(name, alloc)                                       \
  if (const int injected = Sim::get().enter(name, alloc)) return code(injected)

int current_device() {
  return current != nullptr ? device_of(current) : Sim::current_device();
}

}  // namespace

// Resolves a driver entry point by name, as cuGetProcAddress does: the
// newest versioned export of the name (name_v3, name_v2, then name).
extern "C" SIMCUDA_API void* reservoir_simcuda_driver_symbol(const char* symbol) {
  static void* self = [] {
    Dl_info info{};
    dladdr(reinterpret_cast<void*>(&reservoir_simcuda_driver_symbol), &info);
    return dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }();
  if (self == nullptr || symbol == nullptr) return nullptr;
  for (const char* suffix : {"_v3", "_v2", ""}) {
    if (void* p = dlsym(self, (std::string(symbol) + suffix).c_str())) return p;
  }
  return nullptr;
}

extern "C" {

SIMCUDA_API CUresult cuInit(unsigned int flags) {
  ENTER("cuInit", false);
  return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIMCUDA_API CUresult cuDriverGetVersion(int* version) {
  ENTER("cuDriverGetVersion", false);
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = 13020;
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuDeviceGetCount(int* count) {
  ENTER("cuDeviceGetCount", false);
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = Sim::get().device_count();
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  ENTER("cuDeviceGet", false);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!Sim::get().valid(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuDeviceGetName(char* name, int len, CUdevice device) {
  ENTER("cuDeviceGetName", false);
  if (!Sim::get().valid(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  std::snprintf(name, static_cast<std::size_t>(len), "%s", Sim::get().name().c_str());
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuDeviceTotalMem(size_t* bytes, CUdevice device) {
  ENTER("cuDeviceTotalMem_v2", false);
  if (!Sim::get().valid(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *bytes = Sim::get().capacity(device);
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  ENTER("cuDeviceGetAttribute", false);
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  return code(reservoir_simcuda_attribute(static_cast<int>(attribute), device, value));
}

SIMCUDA_API CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice device) {
  ENTER("cuDeviceGetUuid_v2", false);
  if (!Sim::get().valid(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (uuid == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::memset(uuid->bytes, 0, sizeof uuid->bytes);
  std::memcpy(uuid->bytes, "reservoirsim", 12);
  uuid->bytes[15] = static_cast<char>(device);
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
  ENTER("cuDevicePrimaryCtxRetain", false);
  if (!Sim::get().valid(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *ctx = context_of(device);
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuDevicePrimaryCtxRelease(CUdevice device) {
  ENTER("cuDevicePrimaryCtxRelease_v2", false);
  return Sim::get().valid(device) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

SIMCUDA_API CUresult cuDevicePrimaryCtxGetState(CUdevice device, unsigned int* flags, int* active) {
  ENTER("cuDevicePrimaryCtxGetState", false);
  if (!Sim::get().valid(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (flags != nullptr) *flags = 0;
  if (active != nullptr) *active = 1;
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuCtxGetCurrent(CUcontext* ctx) {
  ENTER("cuCtxGetCurrent", false);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  // A thread that used the runtime has its device's primary context current.
  *ctx = current != nullptr || !Sim::runtime_thread() ? current : context_of(Sim::current_device());
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuCtxSetCurrent(CUcontext ctx) {
  ENTER("cuCtxSetCurrent", false);
  current = ctx;
  if (ctx != nullptr) Sim::current_device() = device_of(ctx);
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuCtxPushCurrent(CUcontext ctx) {
  ENTER("cuCtxPushCurrent_v2", false);
  current = ctx;
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuCtxPopCurrent(CUcontext* ctx) {
  ENTER("cuCtxPopCurrent_v2", false);
  if (ctx != nullptr) *ctx = current;
  current = nullptr;
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuCtxGetDevice(CUdevice* device) {
  ENTER("cuCtxGetDevice", false);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *device = current_device();
  return CUDA_SUCCESS;
}

// CUDA 13's form: the device of a given context (the current one for null).
SIMCUDA_API CUresult cuCtxGetDevice_v2(CUdevice* device, CUcontext ctx) {
  ENTER("cuCtxGetDevice_v2", false);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ctx != nullptr && !known_context(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  *device = ctx == nullptr ? current_device() : device_of(ctx);
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuCtxSynchronize(void) {
  ENTER("cuCtxSynchronize", false);
  Sim::get().device_synchronize(current_device());
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuGetErrorString(CUresult error, const char** text) {
  if (text == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
    case CUDA_SUCCESS: *text = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *text = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *text = "out of memory"; break;
    case CUDA_ERROR_INVALID_DEVICE: *text = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_HANDLE: *text = "invalid resource handle"; break;
    case CUDA_ERROR_NOT_READY: *text = "device not ready"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *text = "invalid device context"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *text = "an illegal memory access was encountered"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *text = Sim::get().refused_text(); break;
    default: *text = "unknown error"; break;
  }
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuGetErrorName(CUresult error, const char** text) {
  if (text == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
    case CUDA_SUCCESS: *text = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *text = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *text = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_DEVICE: *text = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_HANDLE: *text = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_READY: *text = "CUDA_ERROR_NOT_READY"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *text = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *text = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *text = "CUDA_ERROR_NOT_SUPPORTED"; break;
    default: *text = "CUDA_ERROR_UNKNOWN"; break;
  }
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                                      CUdriverProcAddressQueryResult* status) {
  (void)cudaVersion, (void)flags;
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pfn = reservoir_simcuda_driver_symbol(symbol);
  if (status != nullptr) *status = *pfn != nullptr ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return *pfn != nullptr ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

SIMCUDA_API CUresult cuMemGetInfo(size_t* free, size_t* total) {
  ENTER("cuMemGetInfo_v2", false);
  if (free == nullptr || total == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const int d = current_device();
  *total = Sim::get().capacity(d);
  *free = *total - Sim::get().used(d);
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuMemAlloc(CUdeviceptr* ptr, size_t bytes) {
  ENTER("cuMemAlloc_v2", true);
  if (ptr == nullptr) return CUDA_ERROR_INVALID_VALUE;
  void* p = nullptr;
  const int rc = Sim::get().malloc_device(current_device(), bytes, &p);
  *ptr = reinterpret_cast<CUdeviceptr>(p);
  return code(rc);
}

SIMCUDA_API CUresult cuMemFree(CUdeviceptr ptr) {
  ENTER("cuMemFree_v2", false);
  return code(Sim::get().free_device(reinterpret_cast<void*>(ptr)));
}

SIMCUDA_API CUresult cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr ptr) {
  ENTER("cuMemGetAddressRange_v2", false);
  std::uintptr_t b = 0;
  std::size_t s = 0;
  int device = 0;
  if (!Sim::get().device_range(reinterpret_cast<void*>(ptr), &b, &s, &device)) return CUDA_ERROR_NOT_FOUND;
  if (base != nullptr) *base = b;
  if (size != nullptr) *size = s;
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                                   CUmemAllocationGranularity_flags option) {
  ENTER("cuMemGetAllocationGranularity", false);
  (void)option;
  if (granularity == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *granularity = Sim::kGranularity;
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                         unsigned long long flags) {
  ENTER("cuMemAddressReserve", true);
  (void)addr, (void)flags;  // a hint, which the simulation may ignore as CUDA may
  std::uintptr_t va = 0;
  const int rc = Sim::get().reserve(size, alignment, &va);
  if (rc == 0 && ptr != nullptr) *ptr = va;
  return code(rc);
}

SIMCUDA_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  ENTER("cuMemAddressFree", false);
  return code(Sim::get().unreserve(ptr, size));
}

SIMCUDA_API CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                                 const CUmemAllocationProp* prop, unsigned long long flags) {
  ENTER("cuMemCreate", true);
  (void)flags;
  if (handle == nullptr || prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::uint64_t h = 0;
  const int rc = Sim::get().create_physical(prop->location.id, size, &h);
  if (rc == 0) *handle = h;
  return code(rc);
}

SIMCUDA_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  ENTER("cuMemRelease", false);
  return code(Sim::get().release_physical(handle));
}

SIMCUDA_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags) {
  ENTER("cuMemMap", false);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  return code(Sim::get().map(ptr, size, offset, handle));
}

SIMCUDA_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  ENTER("cuMemUnmap", false);
  return code(Sim::get().unmap(ptr, size));
}

SIMCUDA_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  ENTER("cuMemSetAccess", false);
  if (desc == nullptr || count == 0) return CUDA_ERROR_INVALID_VALUE;
  bool rw = false;
  for (size_t i = 0; i < count; ++i) rw |= desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return code(Sim::get().set_access(ptr, size, rw));
}

SIMCUDA_API CUresult cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                                  CUmemAllocationHandleType type, unsigned long long flags) {
  ENTER("cuMemExportToShareableHandle", false);
  (void)flags;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || shareable == nullptr) {
    return code(Sim::get().refuse("cuMemExportToShareableHandle (a handle type other than a POSIX file descriptor)"));
  }
  return code(Sim::get().export_fd(handle, static_cast<int*>(shareable)));
}

SIMCUDA_API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* shareable,
                                                    CUmemAllocationHandleType type) {
  ENTER("cuMemImportFromShareableHandle", false);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || handle == nullptr) {
    return code(Sim::get().refuse("cuMemImportFromShareableHandle (a handle type other than a POSIX file descriptor)"));
  }
  // The descriptor travels in the pointer's value, as CUDA takes it.
  const int fd = static_cast<int>(reinterpret_cast<std::intptr_t>(shareable));
  std::uint64_t h = 0;
  const int rc = Sim::get().import_fd(fd, current_device(), &h);
  if (rc == 0) *handle = h;
  return code(rc);
}

SIMCUDA_API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle* handle, void* addr) {
  ENTER("cuMemRetainAllocationHandle", false);
  if (handle == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t h = 0;
  const int rc = Sim::get().retain(addr, &h);
  if (rc == 0) *handle = h;
  return code(rc);
}

SIMCUDA_API CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* prop,
                                                            CUmemGenericAllocationHandle handle) {
  ENTER("cuMemGetAllocationPropertiesFromHandle", false);
  if (prop == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::size_t size = 0;
  int device = 0;
  if (const int rc = Sim::get().physical_size(handle, &size, &device)) return code(rc);
  std::memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = device;
  prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return CUDA_SUCCESS;
}

// ---- streams, events and copies (in their streams' order: Sim::run) -------

SIMCUDA_API CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  ENTER("cuStreamCreate", false);
  if (stream == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *stream = reinterpret_cast<CUstream>(Sim::get().create_stream(current_device(), 0, flags));
  return CUDA_SUCCESS;
}
SIMCUDA_API CUresult cuStreamDestroy(CUstream stream) {
  ENTER("cuStreamDestroy_v2", false);
  return code(Sim::get().destroy_stream(reinterpret_cast<sc::Stream*>(stream)));
}
SIMCUDA_API CUresult cuStreamSynchronize(CUstream stream) {
  ENTER("cuStreamSynchronize", false);
  const auto handle = reinterpret_cast<std::uintptr_t>(stream);
  const int device = handle <= 2 ? current_device() : reinterpret_cast<sc::Stream*>(stream)->device;
  return code(Sim::get().stream_synchronize(stream, device));
}
SIMCUDA_API CUresult cuEventCreate(CUevent* event, unsigned int flags) {
  ENTER("cuEventCreate", false);
  (void)flags;
  if (event == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *event = reinterpret_cast<CUevent>(Sim::get().create_event(current_device()));
  return CUDA_SUCCESS;
}
SIMCUDA_API CUresult cuEventDestroy(CUevent event) {
  ENTER("cuEventDestroy_v2", false);
  return code(Sim::get().destroy_event(reinterpret_cast<sc::Event*>(event)));
}
SIMCUDA_API CUresult cuEventRecord(CUevent event, CUstream stream) {
  ENTER("cuEventRecord", false);
  return code(Sim::get().record(reinterpret_cast<sc::Event*>(event), stream));
}
SIMCUDA_API CUresult cuEventQuery(CUevent event) {
  ENTER("cuEventQuery", false);
  return code(Sim::get().query(reinterpret_cast<sc::Event*>(event)));
}
SIMCUDA_API CUresult cuEventSynchronize(CUevent event) {
  ENTER("cuEventSynchronize", false);
  return code(Sim::get().synchronize(reinterpret_cast<sc::Event*>(event)));
}
SIMCUDA_API CUresult cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t bytes) {
  ENTER("cuMemcpyDtoH_v2", false);
  return code(Sim::get().copy(dst, reinterpret_cast<const void*>(src), bytes));
}
SIMCUDA_API CUresult cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t bytes) {
  ENTER("cuMemcpyHtoD_v2", false);
  return code(Sim::get().copy(reinterpret_cast<void*>(dst), src, bytes));
}
SIMCUDA_API CUresult cuMemsetD8(CUdeviceptr dst, unsigned char value, size_t count) {
  ENTER("cuMemsetD8_v2", false);
  return code(Sim::get().fill(reinterpret_cast<void*>(dst), value, count));
}
SIMCUDA_API CUresult cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  ENTER("cuMemcpyDtoHAsync_v2", false);
  (void)stream;
  return code(Sim::get().copy(dst, reinterpret_cast<const void*>(src), bytes));
}
SIMCUDA_API CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  ENTER("cuMemcpyHtoDAsync_v2", false);
  (void)stream;
  return code(Sim::get().copy(reinterpret_cast<void*>(dst), src, bytes));
}

// The driver's log messages: the simulation writes none, so a callback
// registered is never called.
SIMCUDA_API CUresult cuLogsRegisterCallback(CUlogsCallback callback, void* data, CUlogsCallbackHandle* handle) {
  ENTER("cuLogsRegisterCallback", false);
  (void)callback, (void)data;
  if (handle != nullptr) *handle = nullptr;
  return CUDA_SUCCESS;
}
SIMCUDA_API CUresult cuLogsUnregisterCallback(CUlogsCallbackHandle handle) {
  ENTER("cuLogsUnregisterCallback", false);
  (void)handle;
  return CUDA_SUCCESS;
}

SIMCUDA_API CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                                    unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                                    CUstream stream, void** params, void** extra) {
  (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared, (void)stream,
      (void)params, (void)extra;
  if (!Sim::get().allow_kernels()) return code(Sim::get().refuse("cuLaunchKernel"));
  ENTER("cuLaunchKernel", false);
  return CUDA_SUCCESS;
}

}  // extern "C"
