// VmmLedger: the bookkeeping of the device contract's virtual-memory
// operations, shared by every backend that implements them on its own
// (SimDevice, HostDevice): reservations, physical handles and mappings, and
// the preconditions device.hpp writes beside each operation. A backend checks
// with the ledger, does its own work (nothing, or mmap), then records it.
//
// Thread safety: none; the owning device's mutex guards it.
#pragma once

#include <cstddef>
#include <map>
#include <unordered_map>

#include "reservoir/device.hpp"

namespace reservoir::detail {

class VmmLedger {
 public:
  explicit VmmLedger(std::size_t granularity) : granularity_(granularity) {}

  std::size_t granularity() const noexcept { return granularity_; }
  void set_granularity(std::size_t g) noexcept { granularity_ = g; }

  // reserve: bytes a positive multiple of granularity, alignment 0 or a power of two.
  Status check_reserve(std::size_t bytes, std::size_t alignment) const noexcept;
  void add_reservation(DevicePtr va, std::size_t bytes) { reservations_.emplace(va, bytes); }
  // unreserve: exactly one reservation with no mapping left in it.
  Status check_unreserve(DevicePtr va, std::size_t bytes) const noexcept;
  void remove_reservation(DevicePtr va) { reservations_.erase(va); }

  // create_physical: bytes a positive multiple of granularity.
  Status check_create(std::size_t bytes) const noexcept;
  PhysicalHandle add_physical(std::size_t bytes);
  // release_physical: a live, unreleased handle. Returns true when it is gone
  // at once (no mapping holds it), so its bytes are no longer in use.
  Status check_release(PhysicalHandle handle) const noexcept;
  bool release(PhysicalHandle handle);

  // map: aligned, inside one reservation, unmapped, within the handle.
  Status check_map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                   std::size_t offset) const noexcept;
  void add_mapping(DevicePtr va, std::size_t bytes, PhysicalHandle handle);
  // unmap: the range is a run of whole, adjacent mappings.
  Status check_unmap(DevicePtr va, std::size_t bytes) const noexcept;
  // Removes the mappings; returns the bytes of released handles this dropped.
  std::size_t remove_mappings(DevicePtr va, std::size_t bytes);
  // The mappings lying in [va, va + bytes), in address order: f(va, bytes).
  template <typename F>
  void for_each_mapping_in(DevicePtr va, std::size_t bytes, F&& f) const {
    for (auto it = mappings_.lower_bound(va); it != mappings_.end() && it->first < va + bytes; ++it) {
      f(it->first, it->second.bytes);
    }
  }
  // set_access: every byte of the range is mapped.
  Status check_mapped(DevicePtr va, std::size_t bytes) const noexcept;

  // Bytes of physical memory still held (created, and not yet both released and unmapped).
  std::size_t physical_bytes() const noexcept { return physical_bytes_; }
  std::size_t physical_count() const noexcept { return physical_.size(); }
  std::size_t reservation_count() const noexcept { return reservations_.size(); }
  template <typename F>
  void for_each_reservation(F&& f) const {
    for (const auto& [va, bytes] : reservations_) f(va, bytes);
  }

 private:
  struct Physical {
    std::size_t bytes;
    std::size_t mappings = 0;
    bool released = false;
  };
  struct Mapping {
    std::size_t bytes;
    PhysicalHandle handle;
  };
  bool multiple(std::size_t value) const noexcept {
    return granularity_ != 0 && value % granularity_ == 0;
  }
  // Drops a released handle with no mapping left; returns its bytes (or 0).
  std::size_t drop_if_unused(PhysicalHandle handle);

  std::size_t granularity_;
  std::map<DevicePtr, std::size_t> reservations_;
  std::map<DevicePtr, Mapping> mappings_;
  std::unordered_map<PhysicalHandle, Physical> physical_;
  PhysicalHandle next_handle_ = 1;
  std::size_t physical_bytes_ = 0;
};

}  // namespace reservoir::detail
