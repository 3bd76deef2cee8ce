// The CUDA backends when reservoir was built without CUDA's headers: they
// exist, so every program and library that names them links and loads, and
// open() says why they cannot be used. No object of them can be made
// without CUDA's entry points, so their members are never reached; they
// answer not_supported all the same.
#include "reservoir/cuda_device.hpp"

namespace reservoir {

namespace {
constexpr const char* kWhy = "reservoir was built without CUDA (cuda.h was not found at build time)";
}

std::string cuda_unavailable_reason() { return kWhy; }
std::unique_ptr<CudaRuntimeDevice> CudaRuntimeDevice::open(int) { throw DeviceUnavailableError(kWhy); }
std::unique_ptr<CudaPinnedMemory> CudaPinnedMemory::open() { throw DeviceUnavailableError(kWhy); }
std::unique_ptr<CudaVmmDevice> CudaVmmDevice::open(const CudaVmmOptions&) {
  throw DeviceUnavailableError(kWhy);
}

CudaRuntimeDevice::CudaRuntimeDevice(const CudaRuntimeApi& api, int device) : api_(api), device_(device) {}
CudaVmmDevice::CudaVmmDevice(const CudaDriverApi& api, const CudaVmmOptions& options)
    : api_(api), options_(options) {}
CudaVmmDevice::~CudaVmmDevice() = default;

Status CudaPinnedMemory::allocate(std::size_t, void**) noexcept { return Status::not_supported; }
Status CudaPinnedMemory::free(void*) noexcept { return Status::not_supported; }

// The members both device backends define out of line.
#define RESERVOIR_UNAVAILABLE_DEVICE(Device)                                                        \
  Status Device::allocate_segment(std::size_t, DevicePtr*) noexcept { return Status::not_supported; } \
  Status Device::free_segment(DevicePtr) noexcept { return Status::not_supported; }                 \
  Status Device::memory_info(MemoryInfo*) noexcept { return Status::not_supported; }                \
  Status Device::running_processes(std::vector<ProcessMemory>*) noexcept { return Status::not_supported; } \
  Status Device::create_event(EventId*) noexcept { return Status::not_supported; }                  \
  Status Device::destroy_event(EventId) noexcept { return Status::not_supported; }                  \
  Status Device::record_event(EventId, StreamId) noexcept { return Status::not_supported; }         \
  Status Device::query_event(EventId) noexcept { return Status::not_supported; }                    \
  Status Device::synchronize_event(EventId) noexcept { return Status::not_supported; }              \
  Status Device::synchronize_stream(StreamId) noexcept { return Status::not_supported; }            \
  Status Device::synchronize_device() noexcept { return Status::not_supported; }                    \
  Status Device::create_stream(StreamId*) noexcept { return Status::not_supported; }                \
  Status Device::destroy_stream(StreamId) noexcept { return Status::not_supported; }                \
  Status Device::capture_frontier(StreamId, CaptureFrontier*) noexcept { return Status::not_supported; } \
  Status Device::node_dependencies(GraphNode, std::vector<GraphNode>*) noexcept {                    \
    return Status::not_supported;                                                                    \
  }                                                                                                  \
  Status Device::copy_to_host(void*, DevicePtr, std::size_t, StreamId) noexcept {                    \
    return Status::not_supported;                                                                    \
  }                                                                                                  \
  Status Device::copy_to_device(DevicePtr, const void*, std::size_t, StreamId) noexcept {            \
    return Status::not_supported;                                                                    \
  }

RESERVOIR_UNAVAILABLE_DEVICE(CudaRuntimeDevice)
Status CudaRuntimeDevice::allocate_segment_on(std::size_t, StreamId, DevicePtr*) noexcept {
  return Status::not_supported;
}
RESERVOIR_UNAVAILABLE_DEVICE(CudaVmmDevice)
#undef RESERVOIR_UNAVAILABLE_DEVICE

Status CudaVmmDevice::reserve(std::size_t, std::size_t, DevicePtr*) noexcept { return Status::not_supported; }
Status CudaVmmDevice::unreserve(DevicePtr, std::size_t) noexcept { return Status::not_supported; }
Status CudaVmmDevice::create_physical(std::size_t, PhysicalHandle*) noexcept { return Status::not_supported; }
Status CudaVmmDevice::release_physical(PhysicalHandle) noexcept { return Status::not_supported; }
Status CudaVmmDevice::map(DevicePtr, std::size_t, PhysicalHandle, std::size_t) noexcept {
  return Status::not_supported;
}
Status CudaVmmDevice::unmap(DevicePtr, std::size_t) noexcept { return Status::not_supported; }
Status CudaVmmDevice::set_access(DevicePtr, std::size_t) noexcept { return Status::not_supported; }

}  // namespace reservoir
