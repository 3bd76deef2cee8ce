// VmmLedger: the bookkeeping of the device contract's virtual-memory
// operations, shared by every backend that implements them on its own
// (SimDevice, HostDevice, CudaVmmDevice): reservations, physical handles and
// mappings, and the preconditions device.hpp writes beside each operation.
//
// Each operation is one call here: the ledger checks the preconditions, runs
// the backend's work (nothing, mmap, or the CUDA driver) and records the
// result only when the work succeeded, so a backend cannot check without
// recording or record what failed.
//
// Thread safety: none; the owning device's mutex guards it.
#pragma once

#include <cstddef>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "reservoir/device.hpp"

namespace reservoir::detail {

class VmmLedger {
 public:
  explicit VmmLedger(std::size_t granularity) : granularity_(granularity) {}

  std::size_t granularity() const noexcept { return granularity_; }
  void set_granularity(std::size_t g) noexcept { granularity_ = g; }

  // ---- the operations: check, work, record ----
  // work: Status(DevicePtr* va) sets the reservation's address.
  template <typename Work>
  Status reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va, Work&& work) {
    if (Status s = check_reserve(bytes, alignment); s != Status::ok) return s;
    const Status s = work(va);
    if (s == Status::ok) add_reservation(*va, bytes);
    return s;
  }
  template <typename Work>
  Status unreserve(DevicePtr va, std::size_t bytes, Work&& work) {
    if (Status s = check_unreserve(va, bytes); s != Status::ok) return s;
    const Status s = work();
    if (s == Status::ok) remove_reservation(va);
    return s;
  }
  // On success *handle is the new handle; the backend keeps what its work
  // made under it.
  template <typename Work>
  Status create(std::size_t bytes, PhysicalHandle* handle, Work&& work) {
    if (Status s = check_create(bytes); s != Status::ok) return s;
    const Status s = work();
    if (s == Status::ok) *handle = add_physical(bytes);
    return s;
  }
  template <typename Work>
  Status release_handle(PhysicalHandle handle, Work&& work) {
    if (Status s = check_release(handle); s != Status::ok) return s;
    const Status s = work();
    if (s == Status::ok) release(handle);
    return s;
  }
  template <typename Work>
  Status map(DevicePtr va, std::size_t bytes, PhysicalHandle handle, std::size_t offset, Work&& work) {
    if (Status s = check_map(va, bytes, handle, offset); s != Status::ok) return s;
    const Status s = work();
    if (s == Status::ok) add_mapping(va, bytes, handle);
    return s;
  }
  // work: Status(DevicePtr va, std::size_t bytes), once per mapping in the
  // range, in address order; the mappings undone before a failure stay undone.
  template <typename Work>
  Status unmap(DevicePtr va, std::size_t bytes, Work&& work) {
    if (Status s = check_unmap(va, bytes); s != Status::ok) return s;
    for (const auto& [a, n] : mappings_in(va, bytes)) {
      if (Status s = work(a, n); s != Status::ok) return s;
      remove_mappings(a, n);
    }
    return Status::ok;
  }
  // work: as for unmap, once per mapping of the (wholly mapped) range.
  template <typename Work>
  Status set_access(DevicePtr va, std::size_t bytes, Work&& work) {
    if (Status s = check_mapped(va, bytes); s != Status::ok) return s;
    for (const auto& [a, n] : mappings_in(va, bytes)) {
      if (Status s = work(a, n); s != Status::ok) return s;
    }
    return Status::ok;
  }

  // ---- the checks and records the operations are made of ----

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

  // map: aligned, inside one reservation, unmapped, from the handle's start
  // (offset 0: CUDA refuses any other with not_supported) and within it.
  Status check_map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                   std::size_t offset) const noexcept;
  void add_mapping(DevicePtr va, std::size_t bytes, PhysicalHandle handle);
  // unmap: the range is a run of whole, adjacent mappings.
  Status check_unmap(DevicePtr va, std::size_t bytes) const noexcept;
  // Removes the mappings; returns the bytes of released handles this dropped.
  std::size_t remove_mappings(DevicePtr va, std::size_t bytes);
  // The mappings lying in [va, va + bytes), in address order.
  std::vector<std::pair<DevicePtr, std::size_t>> mappings_in(DevicePtr va, std::size_t bytes) const {
    std::vector<std::pair<DevicePtr, std::size_t>> out;
    for (auto it = mappings_.lower_bound(va); it != mappings_.end() && it->first < va + bytes; ++it) {
      out.emplace_back(it->first, it->second.bytes);
    }
    return out;
  }
  // set_access: every byte of the range is mapped.
  Status check_mapped(DevicePtr va, std::size_t bytes) const noexcept;

  // Bytes of physical memory still held (created, and not yet both released and unmapped).
  std::size_t physical_bytes() const noexcept { return physical_bytes_; }
  // The bytes of a live handle, 0 for one this ledger does not hold.
  std::size_t handle_bytes(PhysicalHandle handle) const noexcept {
    auto it = physical_.find(handle);
    return it == physical_.end() ? 0 : it->second.bytes;
  }
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
