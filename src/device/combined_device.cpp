#include "reservoir/combined_device.hpp"

namespace reservoir {

Status CombinedDevice::allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept {
  return segments_.allocate_segment(bytes, addr);
}
Status CombinedDevice::allocate_segment_on(std::size_t bytes, StreamId stream, DevicePtr* addr) noexcept {
  return segments_.allocate_segment_on(bytes, stream, addr);
}
Status CombinedDevice::free_segment(DevicePtr addr) noexcept { return segments_.free_segment(addr); }

Status CombinedDevice::reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept {
  return vm_.reserve(bytes, alignment, va);
}
Status CombinedDevice::unreserve(DevicePtr va, std::size_t bytes) noexcept { return vm_.unreserve(va, bytes); }
Status CombinedDevice::create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept {
  return vm_.create_physical(bytes, handle);
}
Status CombinedDevice::release_physical(PhysicalHandle handle) noexcept { return vm_.release_physical(handle); }
Status CombinedDevice::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle, std::size_t offset) noexcept {
  return vm_.map(va, bytes, handle, offset);
}
Status CombinedDevice::unmap(DevicePtr va, std::size_t bytes) noexcept { return vm_.unmap(va, bytes); }
Status CombinedDevice::set_access(DevicePtr va, std::size_t bytes) noexcept { return vm_.set_access(va, bytes); }

Status CombinedDevice::memory_info(MemoryInfo* info) noexcept { return segments_.memory_info(info); }
Status CombinedDevice::create_event(EventId* event) noexcept { return segments_.create_event(event); }
Status CombinedDevice::destroy_event(EventId event) noexcept { return segments_.destroy_event(event); }
Status CombinedDevice::record_event(EventId event, StreamId stream) noexcept {
  return segments_.record_event(event, stream);
}
Status CombinedDevice::query_event(EventId event) noexcept { return segments_.query_event(event); }
Status CombinedDevice::synchronize_event(EventId event) noexcept { return segments_.synchronize_event(event); }
Status CombinedDevice::synchronize_stream(StreamId stream) noexcept { return segments_.synchronize_stream(stream); }
Status CombinedDevice::synchronize_device() noexcept { return segments_.synchronize_device(); }
Status CombinedDevice::create_stream(StreamId* stream) noexcept { return segments_.create_stream(stream); }
Status CombinedDevice::destroy_stream(StreamId stream) noexcept { return segments_.destroy_stream(stream); }
Status CombinedDevice::copy_to_host(void* dst, DevicePtr src, std::size_t bytes, StreamId stream) noexcept {
  return segments_.copy_to_host(dst, src, bytes, stream);
}
Status CombinedDevice::copy_to_device(DevicePtr dst, const void* src, std::size_t bytes, StreamId stream) noexcept {
  return segments_.copy_to_device(dst, src, bytes, stream);
}

}  // namespace reservoir
