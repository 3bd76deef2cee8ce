// CombinedDevice: ordinary segments, events, streams and copies from one
// device, virtual memory from another, as PyTorch's own allocator calls
// them: cudaMalloc for ordinary segments (the CUDA runtime, which knows
// about stream capture) and the driver's virtual-memory API for expandable
// segments. With it an allocator can change its kind of segments at run
// time (torch.cuda.memory._set_allocator_settings("expandable_segments:True"))
// whatever it was made with.
//
// Neither device is owned; both outlive this one and serve the same GPU.
#pragma once

#include "reservoir/device.hpp"

namespace reservoir {

class CombinedDevice final : public Device {
 public:
  CombinedDevice(Device& segments, Device& virtual_memory) noexcept
      : segments_(segments), vm_(virtual_memory) {}

  std::string_view name() const noexcept override { return segments_.name(); }
  Status allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept override;
  Status allocate_segment_on(std::size_t bytes, StreamId stream, DevicePtr* addr) noexcept override;
  Status free_segment(DevicePtr addr) noexcept override;
  bool supports_virtual_memory() const noexcept override { return vm_.supports_virtual_memory(); }
  std::size_t granularity() const noexcept override { return vm_.granularity(); }
  Status reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept override;
  Status unreserve(DevicePtr va, std::size_t bytes) noexcept override;
  Status create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept override;
  Status release_physical(PhysicalHandle handle) noexcept override;
  Status map(DevicePtr va, std::size_t bytes, PhysicalHandle handle, std::size_t offset) noexcept override;
  Status unmap(DevicePtr va, std::size_t bytes) noexcept override;
  Status set_access(DevicePtr va, std::size_t bytes) noexcept override;
  Status memory_info(MemoryInfo* info) noexcept override;
  Status running_processes(std::vector<ProcessMemory>* out) noexcept override {
    return segments_.running_processes(out);
  }
  Status create_event(EventId* event) noexcept override;
  Status destroy_event(EventId event) noexcept override;
  Status record_event(EventId event, StreamId stream) noexcept override;
  Status query_event(EventId event) noexcept override;
  Status synchronize_event(EventId event) noexcept override;
  Status synchronize_stream(StreamId stream) noexcept override;
  Status synchronize_device() noexcept override;
  Status create_stream(StreamId* stream) noexcept override;
  Status destroy_stream(StreamId stream) noexcept override;
  // Streams and their captures are the segment device's (the runtime's).
  Status capture_frontier(StreamId stream, CaptureFrontier* out) noexcept override {
    return segments_.capture_frontier(stream, out);
  }
  Status node_dependencies(GraphNode node, std::vector<GraphNode>* out) noexcept override {
    return segments_.node_dependencies(node, out);
  }
  Status copy_to_host(void* dst, DevicePtr src, std::size_t bytes, StreamId stream) noexcept override;
  Status copy_to_device(DevicePtr dst, const void* src, std::size_t bytes, StreamId stream) noexcept override;

 private:
  Device& segments_;
  Device& vm_;
};

}  // namespace reservoir
