#include "reservoir/detail/vmm_ledger.hpp"

#include <iterator>

namespace reservoir::detail {

Status VmmLedger::check_reserve(std::size_t bytes, std::size_t alignment) const noexcept {
  if (bytes == 0 || !multiple(bytes) || (alignment & (alignment - 1)) != 0) {
    return Status::invalid_argument;
  }
  return Status::ok;
}

Status VmmLedger::check_unreserve(DevicePtr va, std::size_t bytes) const noexcept {
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second != bytes) return Status::invalid_argument;
  // A mapping belongs to the reservation with the greatest base at or below
  // it (reservations never overlap on a device; a simulation may let them).
  for (auto m = mappings_.lower_bound(va); m != mappings_.end() && m->first < va + bytes; ++m) {
    auto owner = reservations_.upper_bound(m->first);
    if (std::prev(owner)->first == va) return Status::invalid_argument;
  }
  return Status::ok;
}

Status VmmLedger::check_create(std::size_t bytes) const noexcept {
  return bytes == 0 || !multiple(bytes) ? Status::invalid_argument : Status::ok;
}

PhysicalHandle VmmLedger::add_physical(std::size_t bytes) {
  const PhysicalHandle h = next_handle_++;
  physical_.emplace(h, Physical{bytes});
  physical_bytes_ += bytes;
  return h;
}

Status VmmLedger::check_release(PhysicalHandle handle) const noexcept {
  auto it = physical_.find(handle);
  return it == physical_.end() || it->second.released ? Status::invalid_argument : Status::ok;
}

bool VmmLedger::release(PhysicalHandle handle) {
  physical_.at(handle).released = true;
  return drop_if_unused(handle) != 0;
}

std::size_t VmmLedger::drop_if_unused(PhysicalHandle handle) {
  auto it = physical_.find(handle);
  if (it == physical_.end() || !it->second.released || it->second.mappings != 0) return 0;
  const std::size_t bytes = it->second.bytes;
  physical_bytes_ -= bytes;
  physical_.erase(it);
  return bytes;
}

Status VmmLedger::check_map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                            std::size_t offset) const noexcept {
  if (bytes == 0 || !multiple(va) || !multiple(bytes)) return Status::invalid_argument;
  // CUDA maps a handle from its start only (CUDA_ERROR_NOT_SUPPORTED for any
  // other offset, aligned or not), and no further than its end (the same
  // error): measured on an H100, driver 580 (tests/data/gpu).
  if (offset != 0) return Status::not_supported;
  auto p = physical_.find(handle);
  if (p == physical_.end() || p->second.released) return Status::invalid_argument;
  if (bytes > p->second.bytes) return Status::not_supported;
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
  return Status::ok;
}

void VmmLedger::add_mapping(DevicePtr va, std::size_t bytes, PhysicalHandle handle) {
  mappings_.emplace(va, Mapping{bytes, handle});
  ++physical_.at(handle).mappings;
}

Status VmmLedger::check_unmap(DevicePtr va, std::size_t bytes) const noexcept {
  auto it = mappings_.find(va);
  if (it == mappings_.end()) return Status::invalid_argument;
  DevicePtr cursor = va;
  const DevicePtr end = va + bytes;
  for (; it != mappings_.end() && cursor < end; ++it) {
    if (it->first != cursor) return Status::invalid_argument;
    cursor += it->second.bytes;
  }
  return cursor == end ? Status::ok : Status::invalid_argument;
}

std::size_t VmmLedger::remove_mappings(DevicePtr va, std::size_t bytes) {
  std::size_t dropped = 0;
  auto it = mappings_.find(va);
  while (it != mappings_.end() && it->first < va + bytes) {
    const PhysicalHandle h = it->second.handle;
    --physical_.at(h).mappings;
    it = mappings_.erase(it);
    dropped += drop_if_unused(h);
  }
  return dropped;
}

Status VmmLedger::check_mapped(DevicePtr va, std::size_t bytes) const noexcept {
  auto it = mappings_.upper_bound(va);
  if (it == mappings_.begin()) return Status::invalid_argument;
  --it;
  for (DevicePtr cursor = va; cursor < va + bytes; ++it) {
    if (it == mappings_.end() || it->first > cursor || it->first + it->second.bytes <= cursor) {
      return Status::invalid_argument;
    }
    cursor = it->first + it->second.bytes;
  }
  return Status::ok;
}

}  // namespace reservoir::detail
