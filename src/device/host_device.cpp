#include "reservoir/host_device.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace reservoir {
namespace {

void* as_ptr(DevicePtr p) {
  return reinterpret_cast<void*>(p);
}

}  // namespace

HostDevice::HostDevice(HostDeviceOptions options) : options_(options), ledger_(0) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  if (options_.granularity == 0 || options_.granularity % page != 0) {
    options_.granularity = std::max(page, options_.granularity / page * page);
  }
  ledger_.set_granularity(options_.granularity);
}

HostDevice::~HostDevice() {
  for (auto& [addr, bytes] : segments_) munmap(as_ptr(addr), bytes);
  ledger_.for_each_reservation([](DevicePtr va, std::size_t bytes) { munmap(as_ptr(va), bytes); });
  for (auto& [h, fd] : fds_) close(fd);
}

Status HostDevice::allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept {
  std::lock_guard lock(mutex_);
  if (bytes == 0 || addr == nullptr) return Status::invalid_argument;
  if (bytes > options_.capacity - std::min(used(), options_.capacity)) return Status::out_of_memory;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Status::out_of_memory;
  *addr = reinterpret_cast<DevicePtr>(p);
  segments_.emplace(*addr, bytes);
  segment_bytes_ += bytes;
  return Status::ok;
}

Status HostDevice::free_segment(DevicePtr addr) noexcept {
  std::lock_guard lock(mutex_);
  auto it = segments_.find(addr);
  if (it == segments_.end()) return Status::invalid_argument;
  if (munmap(as_ptr(addr), it->second) != 0) return Status::device_error;
  segment_bytes_ -= it->second;
  segments_.erase(it);
  return Status::ok;
}

Status HostDevice::reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept {
  std::lock_guard lock(mutex_);
  if (va == nullptr) return Status::invalid_argument;
  return ledger_.reserve(bytes, alignment, va, [&](DevicePtr* out) {
    const std::size_t align = std::max(alignment, options_.granularity);
    const std::size_t span = bytes + align;
    void* p = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return Status::out_of_memory;
    auto base = reinterpret_cast<DevicePtr>(p);
    const DevicePtr aligned = (base + align - 1) & ~(DevicePtr{align} - 1);
    if (aligned > base) munmap(p, aligned - base);
    const DevicePtr end = base + span;
    if (end > aligned + bytes) munmap(as_ptr(aligned + bytes), end - (aligned + bytes));
    *out = aligned;
    return Status::ok;
  });
}

Status HostDevice::unreserve(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  return ledger_.unreserve(va, bytes, [&] {
    return munmap(as_ptr(va), bytes) == 0 ? Status::ok : Status::device_error;
  });
}

Status HostDevice::create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept {
  std::lock_guard lock(mutex_);
  if (handle == nullptr) return Status::invalid_argument;
  int fd = -1;
  const Status s = ledger_.create(bytes, handle, [&] {
    if (bytes > options_.capacity - std::min(used(), options_.capacity)) return Status::out_of_memory;
    fd = memfd_create("reservoir-physical", MFD_CLOEXEC);
    if (fd < 0) return Status::device_error;
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      return Status::out_of_memory;
    }
    return Status::ok;
  });
  if (s == Status::ok) fds_.emplace(*handle, fd);
  return s;
}

Status HostDevice::release_physical(PhysicalHandle handle) noexcept {
  std::lock_guard lock(mutex_);
  // Mappings keep the memory alive; it is freed once the last one goes.
  return ledger_.release_handle(handle, [&] {
    close(fds_.at(handle));
    fds_.erase(handle);
    return Status::ok;
  });
}

Status HostDevice::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                       std::size_t offset) noexcept {
  std::lock_guard lock(mutex_);
  return ledger_.map(va, bytes, handle, offset, [&] {
    void* m = mmap(as_ptr(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, fds_.at(handle),
                   static_cast<off_t>(offset));
    return m == MAP_FAILED ? Status::device_error : Status::ok;
  });
}

Status HostDevice::unmap(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  // Each mapping becomes inaccessible reserved address space again.
  return ledger_.unmap(va, bytes, [](DevicePtr a, std::size_t n) {
    void* m = mmap(as_ptr(a), n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                   -1, 0);
    return m == MAP_FAILED ? Status::device_error : Status::ok;
  });
}

Status HostDevice::set_access(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  return ledger_.set_access(va, bytes, [](DevicePtr a, std::size_t n) {
    if (mprotect(as_ptr(a), n, PROT_READ | PROT_WRITE) != 0) return Status::device_error;
    // Give the range its pages now, as a GPU's physical memory is there once
    // mapped: in one call, rather than a fault per page at first touch.
    // Kernels before 5.14 refuse the advice; the pages then come at first touch.
    (void)madvise(as_ptr(a), n, MADV_POPULATE_WRITE);
    return Status::ok;
  });
}

Status HostDevice::memory_info(MemoryInfo* info) noexcept {
  std::lock_guard lock(mutex_);
  if (info == nullptr) return Status::invalid_argument;
  info->total = options_.capacity;
  info->free = options_.capacity - std::min(used(), options_.capacity);
  return Status::ok;
}

Status HostDevice::create_event(EventId* event) noexcept {
  std::lock_guard lock(mutex_);
  if (event == nullptr) return Status::invalid_argument;
  *event = next_event_++;
  events_.emplace(*event, true);
  return Status::ok;
}

Status HostDevice::destroy_event(EventId event) noexcept {
  std::lock_guard lock(mutex_);
  return events_.erase(event) == 1 ? Status::ok : Status::invalid_argument;
}

Status HostDevice::record_event(EventId event, StreamId /*stream*/) noexcept {
  std::lock_guard lock(mutex_);
  return events_.count(event) == 1 ? Status::ok : Status::invalid_argument;
}

Status HostDevice::query_event(EventId event) noexcept {
  std::lock_guard lock(mutex_);
  return events_.count(event) == 1 ? Status::ok : Status::invalid_argument;
}

Status HostDevice::synchronize_event(EventId event) noexcept {
  std::lock_guard lock(mutex_);
  return events_.count(event) == 1 ? Status::ok : Status::invalid_argument;
}

Status HostDevice::synchronize_stream(StreamId /*stream*/) noexcept {
  return Status::ok;
}
Status HostDevice::synchronize_device() noexcept {
  return Status::ok;
}

Status HostDevice::copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                                StreamId /*stream*/) noexcept {
  if (bytes == 0) return Status::ok;
  if (dst == nullptr || src == 0) return Status::invalid_argument;
  std::memcpy(dst, as_ptr(src), bytes);
  return Status::ok;
}

Status HostDevice::copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                                  StreamId /*stream*/) noexcept {
  if (bytes == 0) return Status::ok;
  if (src == nullptr || dst == 0) return Status::invalid_argument;
  std::memcpy(as_ptr(dst), src, bytes);
  return Status::ok;
}

std::size_t HostDevice::used_bytes() const {
  std::lock_guard lock(mutex_);
  return used();
}

std::size_t current_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0;
  unsigned long resident = 0;
  int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  if (n != 2) return 0;
  return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace reservoir
