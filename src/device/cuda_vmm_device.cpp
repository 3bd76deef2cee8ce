// CudaVmmDevice: the driver's virtual-memory API, checked against a ledger
// first so every backend answers misuse the same way, whatever the driver
// would have done with it.
#include <fmt/format.h>

#include "cuda_api.hpp"
#include "reservoir/cuda_device.hpp"

namespace reservoir {
namespace {

CUstream stream_of(StreamId s) { return reinterpret_cast<CUstream>(s); }
CUevent event_of(EventId e) { return reinterpret_cast<CUevent>(e); }

std::string error_name(const CudaDriverApi& api, CUresult r) {
  const char* name = nullptr;
  api.cuGetErrorName(r, &name);
  return name != nullptr ? name : fmt::format("CUresult {}", static_cast<int>(r));
}

CUmemAllocationProp allocation_prop(int device, bool rdma) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  return prop;
}

}  // namespace

// Makes the device's primary context current on this thread for one call.
class CudaVmmDevice::Current {
 public:
  explicit Current(const CudaVmmDevice& d) : api_(d.api_) {
    if (api_.cuCtxGetCurrent(&previous_) != CUDA_SUCCESS) previous_ = nullptr;
    auto* mine = static_cast<CUcontext>(d.context_);
    if (previous_ != mine) {
      status_ = status_of(api_.cuCtxSetCurrent(mine));
      switched_ = status_ == Status::ok;
    }
  }
  ~Current() {
    if (switched_) (void)api_.cuCtxSetCurrent(previous_);
  }
  Status status() const { return status_; }

 private:
  const CudaDriverApi& api_;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
  Status status_ = Status::ok;
};

#define RESERVOIR_CURRENT()                                      \
  Current current(*this);                                        \
  if (current.status() != Status::ok) return current.status()

std::unique_ptr<CudaVmmDevice> CudaVmmDevice::open(const CudaVmmOptions& options) {
  std::string why;
  const CudaDriverApi* api = load_cuda_driver(&why);
  if (api == nullptr) throw DeviceUnavailableError(why);
  return std::make_unique<CudaVmmDevice>(*api, options);
}

CudaVmmDevice::CudaVmmDevice(const CudaDriverApi& api, const CudaVmmOptions& options)
    : api_(api), options_(options) {
  auto check = [&](CUresult r, const char* what) {
    if (r != CUDA_SUCCESS) {
      throw DeviceUnavailableError(fmt::format("cuda-vmm: device {}: {} failed with {}",
                                               options.device, what, error_name(api_, r)));
    }
  };
  CUdevice dev = 0;
  check(api_.cuDeviceGet(&dev, options.device), "cuDeviceGet");
  cu_device_ = dev;
  int vmm = 0;
  check(api_.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
        "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
  if (vmm == 0) {
    throw DeviceUnavailableError(fmt::format(
        "cuda-vmm: device {} does not support virtual memory management", options.device));
  }
  int rdma = 0;
  check(api_.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                  dev),
        "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)");
  rdma_ = options.gpu_direct_rdma && rdma != 0;
  CUcontext ctx = nullptr;
  check(api_.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  context_ = ctx;
  const CUmemAllocationProp prop = allocation_prop(cu_device_, rdma_);
  std::size_t g = 0;
  const CUresult r = api_.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS || g == 0) {
    (void)api_.cuDevicePrimaryCtxRelease(dev);
    check(r == CUDA_SUCCESS ? CUDA_ERROR_UNKNOWN : r, "cuMemGetAllocationGranularity");
  }
  granularity_ = g;
  ledger_.set_granularity(g);
}

CudaVmmDevice::~CudaVmmDevice() { (void)api_.cuDevicePrimaryCtxRelease(cu_device_); }

Status CudaVmmDevice::allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept {
  if (bytes == 0 || addr == nullptr) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  CUdeviceptr p = 0;
  const Status s = status_of(api_.cuMemAlloc(&p, bytes));
  if (s != Status::ok) return s;
  std::lock_guard lock(mutex_);
  *addr = static_cast<DevicePtr>(p);
  segments_.emplace(*addr, bytes);
  return Status::ok;
}

Status CudaVmmDevice::free_segment(DevicePtr addr) noexcept {
  std::lock_guard lock(mutex_);
  if (segments_.count(addr) == 0) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  const Status s = status_of(api_.cuMemFree(static_cast<CUdeviceptr>(addr)));
  if (s == Status::ok) segments_.erase(addr);
  return s;
}

Status CudaVmmDevice::reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept {
  std::lock_guard lock(mutex_);
  return ledger_.reserve(bytes, alignment, va, [&](DevicePtr* out) {
    RESERVOIR_CURRENT();
    CUdeviceptr p = 0;
    const Status s = status_of(api_.cuMemAddressReserve(&p, bytes, alignment, 0, 0));
    if (s == Status::ok) *out = static_cast<DevicePtr>(p);
    return s;
  });
}

Status CudaVmmDevice::unreserve(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  return ledger_.unreserve(va, bytes, [&] {
    RESERVOIR_CURRENT();
    return status_of(api_.cuMemAddressFree(static_cast<CUdeviceptr>(va), bytes));
  });
}

Status CudaVmmDevice::create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept {
  std::lock_guard lock(mutex_);
  CUmemGenericAllocationHandle h = 0;
  const Status s = ledger_.create(bytes, handle, [&] {
    RESERVOIR_CURRENT();
    const CUmemAllocationProp prop = allocation_prop(cu_device_, rdma_);
    return status_of(api_.cuMemCreate(&h, bytes, &prop, 0));
  });
  if (s == Status::ok) handles_.emplace(*handle, h);
  return s;
}

Status CudaVmmDevice::release_physical(PhysicalHandle handle) noexcept {
  std::lock_guard lock(mutex_);
  // As with cuMemRelease itself, the memory stays until its mappings go.
  return ledger_.release_handle(handle, [&] {
    RESERVOIR_CURRENT();
    const Status s = status_of(api_.cuMemRelease(handles_.at(handle)));
    if (s == Status::ok) handles_.erase(handle);
    return s;
  });
}

Status CudaVmmDevice::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                          std::size_t offset) noexcept {
  std::lock_guard lock(mutex_);
  return ledger_.map(va, bytes, handle, offset, [&] {
    RESERVOIR_CURRENT();
    return status_of(
        api_.cuMemMap(static_cast<CUdeviceptr>(va), bytes, offset, handles_.at(handle), 0));
  });
}

Status CudaVmmDevice::unmap(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  // One cuMemUnmap per mapping; on a failure, the mappings already undone
  // leave the ledger with them.
  RESERVOIR_CURRENT();
  return ledger_.unmap(va, bytes, [&](DevicePtr a, std::size_t n) {
    return status_of(api_.cuMemUnmap(static_cast<CUdeviceptr>(a), n));
  });
}

Status CudaVmmDevice::set_access(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  RESERVOIR_CURRENT();
  std::vector<CUmemAccessDesc> access;
  auto grant = [&](int device) {
    CUmemAccessDesc d{};
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = device;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access.push_back(d);
  };
  grant(cu_device_);
  for (const int peer : options_.peers) grant(peer);
  return ledger_.set_access(va, bytes, [&](DevicePtr a, std::size_t n) {
    return status_of(
        api_.cuMemSetAccess(static_cast<CUdeviceptr>(a), n, access.data(), access.size()));
  });
}

Status CudaVmmDevice::memory_info(MemoryInfo* info) noexcept {
  RESERVOIR_CURRENT();
  return status_of(api_.cuMemGetInfo(&info->free, &info->total));
}

Status CudaVmmDevice::running_processes(std::vector<ProcessMemory>* out) noexcept {
  return nvml_running_processes(cu_device_, out);
}

Status CudaVmmDevice::create_event(EventId* event) noexcept {
  RESERVOIR_CURRENT();
  CUevent e = nullptr;
  const Status s = status_of(api_.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  if (s != Status::ok) return s;
  std::lock_guard lock(mutex_);
  *event = reinterpret_cast<EventId>(e);
  events_.emplace(*event, true);
  return Status::ok;
}

bool CudaVmmDevice::live_event(EventId event) const {
  std::lock_guard lock(mutex_);
  return events_.count(event) != 0;
}

Status CudaVmmDevice::destroy_event(EventId event) noexcept {
  std::lock_guard lock(mutex_);
  if (events_.count(event) == 0) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  const Status s = status_of(api_.cuEventDestroy(event_of(event)));
  if (s == Status::ok) events_.erase(event);
  return s;
}

Status CudaVmmDevice::record_event(EventId event, StreamId stream) noexcept {
  if (!live_event(event)) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  return status_of(api_.cuEventRecord(event_of(event), stream_of(stream)));
}

Status CudaVmmDevice::query_event(EventId event) noexcept {
  if (!live_event(event)) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  return status_of(api_.cuEventQuery(event_of(event)));
}

Status CudaVmmDevice::synchronize_event(EventId event) noexcept {
  if (!live_event(event)) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  return status_of(api_.cuEventSynchronize(event_of(event)));
}

Status CudaVmmDevice::synchronize_stream(StreamId stream) noexcept {
  RESERVOIR_CURRENT();
  return status_of(api_.cuStreamSynchronize(stream_of(stream)));
}

Status CudaVmmDevice::create_stream(StreamId* stream) noexcept {
  if (stream == nullptr) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  CUstream s = nullptr;
  const Status st = status_of(api_.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  if (st == Status::ok) *stream = reinterpret_cast<StreamId>(s);
  return st;
}

Status CudaVmmDevice::destroy_stream(StreamId stream) noexcept {
  if (stream == 0) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  return status_of(api_.cuStreamDestroy(stream_of(stream)));
}

// Captures are the runtime's: asked of it where the process has one (a
// program on the driver alone captures nothing the allocator can see).
Status CudaVmmDevice::capture_frontier(StreamId stream, CaptureFrontier* out) noexcept {
  const CudaRuntimeApi* runtime = load_cuda_runtime(nullptr);
  if (runtime == nullptr) return Device::capture_frontier(stream, out);
  return runtime_capture_frontier(*runtime, stream, out);
}

Status CudaVmmDevice::node_dependencies(GraphNode node, std::vector<GraphNode>* out) noexcept {
  const CudaRuntimeApi* runtime = load_cuda_runtime(nullptr);
  if (runtime == nullptr) return Device::node_dependencies(node, out);
  return runtime_node_dependencies(*runtime, node, out);
}

Status CudaVmmDevice::synchronize_device() noexcept {
  RESERVOIR_CURRENT();
  return status_of(api_.cuCtxSynchronize());
}

Status CudaVmmDevice::copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                                   StreamId stream) noexcept {
  if (dst == nullptr || src == 0) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  return status_of(
      api_.cuMemcpyDtoHAsync(dst, static_cast<CUdeviceptr>(src), bytes, stream_of(stream)));
}

Status CudaVmmDevice::copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                                     StreamId stream) noexcept {
  if (src == nullptr || dst == 0) return Status::invalid_argument;
  RESERVOIR_CURRENT();
  return status_of(
      api_.cuMemcpyHtoDAsync(static_cast<CUdeviceptr>(dst), src, bytes, stream_of(stream)));
}

#undef RESERVOIR_CURRENT

}  // namespace reservoir
