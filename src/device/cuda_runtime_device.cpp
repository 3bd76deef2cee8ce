// CudaRuntimeDevice: cudaMalloc/cudaFree segments, CUDA events and streams.
#include <fmt/format.h>

#include "cuda_api.hpp"
#include "reservoir/cuda_device.hpp"

namespace reservoir {
namespace {

cudaStream_t stream_of(StreamId s) { return reinterpret_cast<cudaStream_t>(s); }
cudaEvent_t event_of(EventId e) { return reinterpret_cast<cudaEvent_t>(e); }

}  // namespace

std::string cuda_unavailable_reason() {
  std::string why;
  if (load_cuda_runtime(&why) == nullptr) return why;
  if (load_cuda_driver(&why) == nullptr) return why;
  return "";
}

// Makes the device current on this thread for one call.
class CudaRuntimeDevice::Current {
 public:
  explicit Current(const CudaRuntimeDevice& d) : api_(d.api_) {
    if (api_.cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != d.device_) {
      status_ = status_of(api_.cudaSetDevice(d.device_));
      switched_ = status_ == Status::ok;
    }
  }
  ~Current() {
    if (switched_ && previous_ >= 0) (void)api_.cudaSetDevice(previous_);
  }
  Status status() const { return status_; }

 private:
  const CudaRuntimeApi& api_;
  int previous_ = -1;
  bool switched_ = false;
  Status status_ = Status::ok;
};

std::unique_ptr<CudaRuntimeDevice> CudaRuntimeDevice::open(int device) {
  std::string why;
  const CudaRuntimeApi* api = load_cuda_runtime(&why);
  if (api == nullptr) throw DeviceUnavailableError(why);
  // The runtime needs the driver; cuInit tells whether a GPU is there.
  if (load_cuda_driver(&why) == nullptr) throw DeviceUnavailableError(why);
  return std::make_unique<CudaRuntimeDevice>(*api, device);
}

CudaRuntimeDevice::CudaRuntimeDevice(const CudaRuntimeApi& api, int device)
    : api_(api), device_(device) {
  Current current(*this);
  if (current.status() != Status::ok) {
    throw DeviceUnavailableError(
        fmt::format("cuda-runtime: cudaSetDevice({}) failed: {}", device, to_string(current.status())));
  }
}

Status CudaRuntimeDevice::allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept {
  if (bytes == 0 || addr == nullptr) return Status::invalid_argument;
  Current current(*this);
  if (current.status() != Status::ok) return current.status();
  void* p = nullptr;
  const cudaError_t r = api_.cudaMalloc(&p, bytes);
  if (r != cudaSuccess) {
    (void)api_.cudaGetLastError();  // an out-of-memory error must not stay sticky
    return status_of(r);
  }
  std::lock_guard lock(mutex_);
  *addr = reinterpret_cast<DevicePtr>(p);
  segments_.emplace(*addr, bytes);
  return Status::ok;
}

// While `stream` captures, cudaMalloc is made in the relaxed capture mode
// (PyTorch's cudaMallocMaybeCapturing): in the global mode CUDA refuses it
// and invalidates the capture. The thread's own mode comes back after.
Status CudaRuntimeDevice::allocate_segment_on(std::size_t bytes, StreamId stream, DevicePtr* addr) noexcept {
  if (api_.cudaStreamIsCapturing == nullptr) return allocate_segment(bytes, addr);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (Status s = status_of(api_.cudaStreamIsCapturing(stream_of(stream), &capturing)); s != Status::ok) {
    (void)api_.cudaGetLastError();
    return s;
  }
  if (capturing == cudaStreamCaptureStatusNone) return allocate_segment(bytes, addr);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (Status s = status_of(api_.cudaThreadExchangeStreamCaptureMode(&mode)); s != Status::ok) return s;
  const Status s = allocate_segment(bytes, addr);
  (void)api_.cudaThreadExchangeStreamCaptureMode(&mode);
  return s;
}

Status CudaRuntimeDevice::free_segment(DevicePtr addr) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (segments_.count(addr) == 0) return Status::invalid_argument;
  }
  Current current(*this);
  if (current.status() != Status::ok) return current.status();
  const Status s = status_of(api_.cudaFree(reinterpret_cast<void*>(addr)));
  if (s == Status::ok) {
    std::lock_guard lock(mutex_);
    segments_.erase(addr);
  }
  return s;
}

Status CudaRuntimeDevice::memory_info(MemoryInfo* info) noexcept {
  Current current(*this);
  if (current.status() != Status::ok) return current.status();
  return status_of(api_.cudaMemGetInfo(&info->free, &info->total));
}

Status CudaRuntimeDevice::running_processes(std::vector<ProcessMemory>* out) noexcept {
  return nvml_running_processes(device_, out);
}

bool CudaRuntimeDevice::live_event(EventId event) const {
  std::lock_guard lock(mutex_);
  return events_.count(event) != 0;
}

Status CudaRuntimeDevice::create_event(EventId* event) noexcept {
  Current current(*this);
  if (current.status() != Status::ok) return current.status();
  cudaEvent_t e = nullptr;
  const Status s = status_of(api_.cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  if (s != Status::ok) return s;
  std::lock_guard lock(mutex_);
  *event = reinterpret_cast<EventId>(e);
  events_.emplace(*event, true);
  return Status::ok;
}

Status CudaRuntimeDevice::destroy_event(EventId event) noexcept {
  if (!live_event(event)) return Status::invalid_argument;
  Current current(*this);
  const Status s = status_of(api_.cudaEventDestroy(event_of(event)));
  if (s == Status::ok) {
    std::lock_guard lock(mutex_);
    events_.erase(event);
  }
  return s;
}

Status CudaRuntimeDevice::record_event(EventId event, StreamId stream) noexcept {
  if (!live_event(event)) return Status::invalid_argument;
  Current current(*this);
  return status_of(api_.cudaEventRecord(event_of(event), stream_of(stream)));
}

Status CudaRuntimeDevice::query_event(EventId event) noexcept {
  if (!live_event(event)) return Status::invalid_argument;
  Current current(*this);
  return status_of(api_.cudaEventQuery(event_of(event)));
}

Status CudaRuntimeDevice::synchronize_event(EventId event) noexcept {
  if (!live_event(event)) return Status::invalid_argument;
  Current current(*this);
  return status_of(api_.cudaEventSynchronize(event_of(event)));
}

Status CudaRuntimeDevice::synchronize_stream(StreamId stream) noexcept {
  Current current(*this);
  return status_of(api_.cudaStreamSynchronize(stream_of(stream)));
}

Status CudaRuntimeDevice::synchronize_device() noexcept {
  Current current(*this);
  return status_of(api_.cudaDeviceSynchronize());
}

Status CudaRuntimeDevice::create_stream(StreamId* stream) noexcept {
  if (stream == nullptr) return Status::invalid_argument;
  Current current(*this);
  cudaStream_t s = nullptr;
  const Status st = status_of(api_.cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (st == Status::ok) *stream = reinterpret_cast<StreamId>(s);
  return st;
}

Status CudaRuntimeDevice::destroy_stream(StreamId stream) noexcept {
  if (stream == 0) return Status::invalid_argument;
  Current current(*this);
  return status_of(api_.cudaStreamDestroy(stream_of(stream)));
}

Status CudaRuntimeDevice::capture_frontier(StreamId stream, CaptureFrontier* out) noexcept {
  return runtime_capture_frontier(api_, stream, out);
}

Status CudaRuntimeDevice::node_dependencies(GraphNode node, std::vector<GraphNode>* out) noexcept {
  return runtime_node_dependencies(api_, node, out);
}

Status CudaRuntimeDevice::copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                                       StreamId stream) noexcept {
  if (dst == nullptr || src == 0) return Status::invalid_argument;
  Current current(*this);
  return status_of(api_.cudaMemcpyAsync(dst, reinterpret_cast<const void*>(src), bytes,
                                        cudaMemcpyDeviceToHost, stream_of(stream)));
}

Status CudaRuntimeDevice::copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                                         StreamId stream) noexcept {
  if (src == nullptr || dst == 0) return Status::invalid_argument;
  Current current(*this);
  return status_of(api_.cudaMemcpyAsync(reinterpret_cast<void*>(dst), src, bytes,
                                        cudaMemcpyHostToDevice, stream_of(stream)));
}

std::unique_ptr<CudaPinnedMemory> CudaPinnedMemory::open() {
  std::string why;
  const CudaRuntimeApi* api = load_cuda_runtime(&why);
  if (api == nullptr) throw DeviceUnavailableError(why);
  if (load_cuda_driver(&why) == nullptr) throw DeviceUnavailableError(why);
  return std::make_unique<CudaPinnedMemory>(*api);
}

Status CudaPinnedMemory::allocate(std::size_t bytes, void** ptr) noexcept {
  if (bytes == 0 || ptr == nullptr) return Status::invalid_argument;
  void* p = nullptr;
  const cudaError_t r = api_.cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (r != cudaSuccess) {
    (void)api_.cudaGetLastError();
    return status_of(r);
  }
  std::lock_guard lock(mutex_);
  live_.emplace(p, bytes);
  *ptr = p;
  return Status::ok;
}

Status CudaPinnedMemory::free(void* ptr) noexcept {
  {
    std::lock_guard lock(mutex_);
    if (live_.count(ptr) == 0) return Status::invalid_argument;
  }
  const Status s = status_of(api_.cudaFreeHost(ptr));
  if (s == Status::ok) {
    std::lock_guard lock(mutex_);
    live_.erase(ptr);
  }
  return s;
}

}  // namespace reservoir
