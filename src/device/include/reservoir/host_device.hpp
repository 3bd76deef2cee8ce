// HostDevice: real host memory driven through the CUDA virtual-memory protocol.
//
//   reserve          mmap(PROT_NONE, MAP_NORESERVE): address space only
//   create_physical  memfd_create + ftruncate: physical memory with a handle
//   map              mmap(MAP_FIXED | MAP_SHARED) of the memfd into a reservation
//   set_access       mprotect(PROT_READ | PROT_WRITE), then the pages are
//                    populated at once (MADV_POPULATE_WRITE), as mapped GPU
//                    memory exists before it is touched
//   unmap            mmap(MAP_FIXED, PROT_NONE) over the range: reserved again
//   allocate_segment mmap of private anonymous memory (cudaMalloc)
//
// Contents are real, so tests can write through returned pointers and check
// them later, and the process's resident memory really falls when memory is
// released. Work is synchronous: every event is complete once recorded.
//
// Thread safety: all members are safe to call concurrently (one internal mutex).
#pragma once

#include <mutex>
#include <unordered_map>

#include "reservoir/detail/vmm_ledger.hpp"
#include "reservoir/device.hpp"

namespace reservoir {

struct HostDeviceOptions {
  std::size_t capacity = std::size_t{8} << 30;     // what memory_info reports as total
  std::size_t granularity = std::size_t{2} << 20;  // multiple of the page size
};

class HostDevice final : public Device {
 public:
  explicit HostDevice(HostDeviceOptions options = {});
  ~HostDevice() override;  // unmaps and closes whatever is still live
  HostDevice(const HostDevice&) = delete;
  HostDevice& operator=(const HostDevice&) = delete;

  std::string_view name() const noexcept override { return "host"; }
  Status allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept override;
  Status free_segment(DevicePtr addr) noexcept override;
  bool supports_virtual_memory() const noexcept override { return true; }
  std::size_t granularity() const noexcept override { return options_.granularity; }
  Status reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept override;
  Status unreserve(DevicePtr va, std::size_t bytes) noexcept override;
  Status create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept override;
  Status release_physical(PhysicalHandle handle) noexcept override;
  Status map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
             std::size_t offset) noexcept override;
  Status unmap(DevicePtr va, std::size_t bytes) noexcept override;
  Status set_access(DevicePtr va, std::size_t bytes) noexcept override;
  Status memory_info(MemoryInfo* info) noexcept override;
  Status create_event(EventId* event) noexcept override;
  Status destroy_event(EventId event) noexcept override;
  Status record_event(EventId event, StreamId stream) noexcept override;
  Status query_event(EventId event) noexcept override;
  Status synchronize_event(EventId event) noexcept override;
  Status synchronize_stream(StreamId stream) noexcept override;
  Status synchronize_device() noexcept override;
  Status copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                      StreamId stream) noexcept override;
  Status copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                        StreamId stream) noexcept override;

  std::size_t used_bytes() const;

 private:
  std::size_t used() const noexcept { return segment_bytes_ + ledger_.physical_bytes(); }

  HostDeviceOptions options_;
  mutable std::mutex mutex_;
  std::size_t segment_bytes_ = 0;
  std::unordered_map<DevicePtr, std::size_t> segments_;
  detail::VmmLedger ledger_;
  std::unordered_map<PhysicalHandle, int> fds_;  // memfd of each unreleased handle
  std::unordered_map<EventId, bool> events_;
  EventId next_event_ = 1;
};

// Resident set size of this process in bytes, read from /proc/self/statm.
std::size_t current_rss_bytes();

}  // namespace reservoir
