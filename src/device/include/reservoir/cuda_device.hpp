// The CUDA backends.
//
// CudaRuntimeDevice serves segments with cudaMalloc/cudaFree (what PyTorch's
// native allocator calls); it has no virtual memory. CudaVmmDevice uses the
// driver's virtual-memory API (cuMemAddressReserve, cuMemCreate, cuMemMap,
// cuMemSetAccess, cuMemUnmap, cuMemRelease) for the expandable and paging
// policies, cuMemAlloc for classic segments, and asks for GPUDirect-RDMA-
// capable memory where the device supports it.
//
// Both load CUDA at run time: nothing links against libcuda or libcudart, so
// the library loads on a machine without a GPU, where open() throws
// DeviceUnavailableError saying why. Streams are CUDA streams
// (StreamId = the cudaStream_t / CUstream value; 0 is the legacy default
// stream) and events are CUDA events created without timing.
//
// One device object (and one allocator) per GPU. Each call makes its GPU
// current on the calling thread for its duration (runtime: cudaSetDevice;
// driver: the device's primary context) and restores what was current.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "reservoir/detail/vmm_ledger.hpp"
#include "reservoir/device.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/pinned_memory.hpp"

namespace reservoir {

struct CudaDriverApi;   // tables of CUDA entry points (src/device/cuda_api.hpp);
struct CudaRuntimeApi;  // tests pass fakes

// Why CUDA cannot be used in this process ("" when it can).
std::string cuda_unavailable_reason();

class CudaRuntimeDevice final : public Device {
 public:
  // Throws DeviceUnavailableError when the CUDA runtime or driver is missing.
  static std::unique_ptr<CudaRuntimeDevice> open(int device = 0);
  CudaRuntimeDevice(const CudaRuntimeApi& api, int device);

  std::string_view name() const noexcept override { return "cuda-runtime"; }
  int device() const noexcept { return device_; }

  Status allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept override;
  Status allocate_segment_on(std::size_t bytes, StreamId stream, DevicePtr* addr) noexcept override;
  Status free_segment(DevicePtr addr) noexcept override;
  bool supports_virtual_memory() const noexcept override { return false; }
  std::size_t granularity() const noexcept override { return 0; }
  Status reserve(std::size_t, std::size_t, DevicePtr*) noexcept override { return Status::not_supported; }
  Status unreserve(DevicePtr, std::size_t) noexcept override { return Status::not_supported; }
  Status create_physical(std::size_t, PhysicalHandle*) noexcept override { return Status::not_supported; }
  Status release_physical(PhysicalHandle) noexcept override { return Status::not_supported; }
  Status map(DevicePtr, std::size_t, PhysicalHandle, std::size_t) noexcept override {
    return Status::not_supported;
  }
  Status unmap(DevicePtr, std::size_t) noexcept override { return Status::not_supported; }
  Status set_access(DevicePtr, std::size_t) noexcept override { return Status::not_supported; }
  Status memory_info(MemoryInfo* info) noexcept override;
  Status running_processes(std::vector<ProcessMemory>* out) noexcept override;
  Status create_event(EventId* event) noexcept override;
  Status destroy_event(EventId event) noexcept override;
  Status record_event(EventId event, StreamId stream) noexcept override;
  Status query_event(EventId event) noexcept override;
  Status synchronize_event(EventId event) noexcept override;
  Status synchronize_stream(StreamId stream) noexcept override;
  Status synchronize_device() noexcept override;
  Status create_stream(StreamId* stream) noexcept override;
  Status destroy_stream(StreamId stream) noexcept override;
  Status capture_frontier(StreamId stream, CaptureFrontier* out) noexcept override;
  Status node_dependencies(GraphNode node, std::vector<GraphNode>* out) noexcept override;
  Status copy_to_host(void* dst, DevicePtr src, std::size_t bytes, StreamId stream) noexcept override;
  Status copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                        StreamId stream) noexcept override;

 private:
  class Current;
  bool live_event(EventId event) const;
  const CudaRuntimeApi& api_;
  const int device_;
  mutable std::mutex mutex_;  // guards the sets below
  std::unordered_map<DevicePtr, std::size_t> segments_;
  std::unordered_map<EventId, bool> events_;
};

// Pinned host memory from cudaHostAlloc, for HostCachingAllocator.
class CudaPinnedMemory final : public PinnedMemorySource {
 public:
  // Throws DeviceUnavailableError when the CUDA runtime or driver is missing.
  static std::unique_ptr<CudaPinnedMemory> open();
  explicit CudaPinnedMemory(const CudaRuntimeApi& api) : api_(api) {}
  Status allocate(std::size_t bytes, void** ptr) noexcept override;
  Status free(void* ptr) noexcept override;

 private:
  const CudaRuntimeApi& api_;
  std::mutex mutex_;
  std::unordered_map<void*, std::size_t> live_;
};

struct CudaVmmOptions {
  int device = 0;
  // Devices that get read/write access to this device's mappings (peer
  // access must be possible between them).
  std::vector<int> peers;
  // Ask for GPUDirect-RDMA-capable physical memory where supported.
  bool gpu_direct_rdma = true;
};

class CudaVmmDevice final : public Device {
 public:
  // Throws DeviceUnavailableError when the CUDA driver is missing or the
  // device lacks virtual memory management.
  static std::unique_ptr<CudaVmmDevice> open(const CudaVmmOptions& options = {});
  CudaVmmDevice(const CudaDriverApi& api, const CudaVmmOptions& options);
  ~CudaVmmDevice() override;

  std::string_view name() const noexcept override { return "cuda-vmm"; }
  // Whether cuMemCreate is asked for GPUDirect-RDMA-capable memory.
  bool gpu_direct_rdma() const noexcept { return rdma_; }

  Status allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept override;
  Status free_segment(DevicePtr addr) noexcept override;
  bool supports_virtual_memory() const noexcept override { return true; }
  std::size_t granularity() const noexcept override { return granularity_; }
  Status reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept override;
  Status unreserve(DevicePtr va, std::size_t bytes) noexcept override;
  Status create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept override;
  Status release_physical(PhysicalHandle handle) noexcept override;
  Status map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
             std::size_t offset) noexcept override;
  Status unmap(DevicePtr va, std::size_t bytes) noexcept override;
  Status set_access(DevicePtr va, std::size_t bytes) noexcept override;
  Status memory_info(MemoryInfo* info) noexcept override;
  Status running_processes(std::vector<ProcessMemory>* out) noexcept override;
  Status create_event(EventId* event) noexcept override;
  Status destroy_event(EventId event) noexcept override;
  Status record_event(EventId event, StreamId stream) noexcept override;
  Status query_event(EventId event) noexcept override;
  Status synchronize_event(EventId event) noexcept override;
  Status synchronize_stream(StreamId stream) noexcept override;
  Status synchronize_device() noexcept override;
  Status create_stream(StreamId* stream) noexcept override;
  Status destroy_stream(StreamId stream) noexcept override;
  Status capture_frontier(StreamId stream, CaptureFrontier* out) noexcept override;
  Status node_dependencies(GraphNode node, std::vector<GraphNode>* out) noexcept override;
  Status copy_to_host(void* dst, DevicePtr src, std::size_t bytes, StreamId stream) noexcept override;
  Status copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                        StreamId stream) noexcept override;

 private:
  class Current;
  bool live_event(EventId event) const;
  const CudaDriverApi& api_;
  CudaVmmOptions options_;
  int cu_device_ = 0;
  void* context_ = nullptr;  // the primary context (CUcontext)
  bool rdma_ = false;
  std::size_t granularity_ = 0;
  mutable std::mutex mutex_;  // guards the ledger and the maps below
  detail::VmmLedger ledger_{0};
  std::unordered_map<PhysicalHandle, unsigned long long> handles_;  // ledger id -> CUDA handle
  std::unordered_map<DevicePtr, std::size_t> segments_;
  std::unordered_map<EventId, bool> events_;
};

}  // namespace reservoir
