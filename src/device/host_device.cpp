#include "reservoir/host_device.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace reservoir {
namespace {

bool is_multiple(std::size_t value, std::size_t unit) {
  return unit != 0 && value % unit == 0;
}

void* as_ptr(DevicePtr p) {
  return reinterpret_cast<void*>(p);
}

}  // namespace

HostDevice::HostDevice(HostDeviceOptions options) : options_(options) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  if (options_.granularity == 0 || options_.granularity % page != 0) {
    options_.granularity = std::max(page, options_.granularity / page * page);
  }
}

HostDevice::~HostDevice() {
  for (auto& [addr, bytes] : segments_) munmap(as_ptr(addr), bytes);
  for (auto& [va, bytes] : reservations_) munmap(as_ptr(va), bytes);
  for (auto& [h, p] : physical_) {
    if (p.fd >= 0) close(p.fd);
  }
}

Status HostDevice::allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept {
  std::lock_guard lock(mutex_);
  if (bytes == 0 || addr == nullptr) return Status::invalid_argument;
  if (bytes > options_.capacity - std::min(used_, options_.capacity)) return Status::out_of_memory;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return Status::out_of_memory;
  *addr = reinterpret_cast<DevicePtr>(p);
  segments_.emplace(*addr, bytes);
  used_ += bytes;
  return Status::ok;
}

Status HostDevice::free_segment(DevicePtr addr) noexcept {
  std::lock_guard lock(mutex_);
  auto it = segments_.find(addr);
  if (it == segments_.end()) return Status::invalid_argument;
  if (munmap(as_ptr(addr), it->second) != 0) return Status::device_error;
  used_ -= it->second;
  segments_.erase(it);
  return Status::ok;
}

Status HostDevice::reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept {
  std::lock_guard lock(mutex_);
  if (bytes == 0 || va == nullptr || !is_multiple(bytes, options_.granularity) ||
      (alignment & (alignment - 1)) != 0) {
    return Status::invalid_argument;
  }
  alignment = std::max(alignment, options_.granularity);
  const std::size_t span = bytes + alignment;
  void* p = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return Status::out_of_memory;
  auto base = reinterpret_cast<DevicePtr>(p);
  DevicePtr aligned = (base + alignment - 1) & ~(DevicePtr{alignment} - 1);
  if (aligned > base) munmap(p, aligned - base);
  const DevicePtr end = base + span;
  if (end > aligned + bytes) munmap(as_ptr(aligned + bytes), end - (aligned + bytes));
  reservations_.emplace(aligned, bytes);
  *va = aligned;
  return Status::ok;
}

Status HostDevice::unreserve(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second != bytes) return Status::invalid_argument;
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.end() && m->first < va + bytes) return Status::invalid_argument;
  if (munmap(as_ptr(va), bytes) != 0) return Status::device_error;
  reservations_.erase(it);
  return Status::ok;
}

Status HostDevice::create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept {
  std::lock_guard lock(mutex_);
  if (bytes == 0 || handle == nullptr || !is_multiple(bytes, options_.granularity)) {
    return Status::invalid_argument;
  }
  if (bytes > options_.capacity - std::min(used_, options_.capacity)) return Status::out_of_memory;
  int fd = memfd_create("reservoir-physical", MFD_CLOEXEC);
  if (fd < 0) return Status::device_error;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return Status::out_of_memory;
  }
  PhysicalHandle h = next_handle_++;
  physical_.emplace(h, Physical{fd, bytes, 0});
  used_ += bytes;
  *handle = h;
  return Status::ok;
}

void HostDevice::drop_physical_if_unused(PhysicalHandle handle) {
  auto it = physical_.find(handle);
  if (it != physical_.end() && it->second.fd < 0 && it->second.mappings == 0) {
    used_ -= it->second.bytes;
    physical_.erase(it);
  }
}

Status HostDevice::release_physical(PhysicalHandle handle) noexcept {
  std::lock_guard lock(mutex_);
  auto it = physical_.find(handle);
  if (it == physical_.end() || it->second.fd < 0) return Status::invalid_argument;
  close(it->second.fd);
  it->second.fd = -1;
  drop_physical_if_unused(handle);
  return Status::ok;
}

Status HostDevice::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                       std::size_t offset) noexcept {
  std::lock_guard lock(mutex_);
  const std::size_t g = options_.granularity;
  if (bytes == 0 || !is_multiple(va, g) || !is_multiple(bytes, g) || !is_multiple(offset, g)) {
    return Status::invalid_argument;
  }
  auto p = physical_.find(handle);
  if (p == physical_.end() || p->second.fd < 0 || offset > p->second.bytes ||
      bytes > p->second.bytes - offset) {
    return Status::invalid_argument;
  }
  auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin()) return Status::invalid_argument;
  --r;
  if (va + bytes > r->first + r->second) return Status::invalid_argument;
  auto next = mappings_.lower_bound(va);
  if (next != mappings_.end() && next->first < va + bytes) return Status::invalid_argument;
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > va) return Status::invalid_argument;
  }
  void* m = mmap(as_ptr(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, p->second.fd,
                 static_cast<off_t>(offset));
  if (m == MAP_FAILED) return Status::device_error;
  mappings_.emplace(va, Mapping{bytes, handle});
  ++p->second.mappings;
  return Status::ok;
}

Status HostDevice::unmap(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  auto it = mappings_.find(va);
  DevicePtr cursor = va;
  const DevicePtr end = va + bytes;
  auto scan = it;
  while (scan != mappings_.end() && cursor < end) {
    if (scan->first != cursor) return Status::invalid_argument;
    cursor += scan->second.bytes;
    ++scan;
  }
  if (it == mappings_.end() || cursor != end) return Status::invalid_argument;
  // Replace the mapping with inaccessible reserved address space.
  void* m = mmap(as_ptr(va), bytes, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return Status::device_error;
  while (it != scan) {
    PhysicalHandle h = it->second.handle;
    --physical_.at(h).mappings;
    it = mappings_.erase(it);
    drop_physical_if_unused(h);
  }
  return Status::ok;
}

Status HostDevice::set_access(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  DevicePtr cursor = va;
  auto it = mappings_.upper_bound(va);
  if (it == mappings_.begin()) return Status::invalid_argument;
  --it;
  while (cursor < va + bytes) {
    if (it == mappings_.end() || it->first > cursor || it->first + it->second.bytes <= cursor) {
      return Status::invalid_argument;
    }
    cursor = it->first + it->second.bytes;
    ++it;
  }
  if (mprotect(as_ptr(va), bytes, PROT_READ | PROT_WRITE) != 0) return Status::device_error;
  return Status::ok;
}

Status HostDevice::memory_info(MemoryInfo* info) noexcept {
  std::lock_guard lock(mutex_);
  if (info == nullptr) return Status::invalid_argument;
  info->total = options_.capacity;
  info->free = options_.capacity - std::min(used_, options_.capacity);
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
  return used_;
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
