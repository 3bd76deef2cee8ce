// Address space carved from one reservation: what native_paged's segments
// take instead of a reservation each (the reserve and the free it saves are
// two of the seven device calls a segment's life would otherwise cost).
// Ranges are taken above every range held and merged with free neighbours
// when given back. Written here rather than taken from a library: it is a
// sorted map of free ranges, smaller than any interval library's adapter
// would be. Not thread safe: the allocator's mutex guards it.
#pragma once

#include <cstddef>
#include <iterator>
#include <map>

#include "reservoir/device.hpp"

namespace reservoir::detail {

class AddressArena {
 public:
  // A fresh reservation of `bytes` at `base`, all of it free.
  void reset(DevicePtr base, std::size_t bytes) {
    base_ = base;
    bytes_ = bytes;
    taken_ = 0;
    free_.clear();
    if (bytes != 0) free_.emplace(base, bytes);
  }
  // Forgets the reservation (given back, or never made).
  void clear() { reset(0, 0); }
  bool active() const noexcept { return bytes_ != 0; }
  DevicePtr base() const noexcept { return base_; }
  std::size_t bytes() const noexcept { return bytes_; }
  std::size_t taken() const noexcept { return taken_; }
  bool contains(DevicePtr at) const noexcept { return at >= base_ && at - base_ < bytes_; }
  // The free ranges, by address: disjoint, never adjacent, inside the arena.
  const std::map<DevicePtr, std::size_t>& free_ranges() const noexcept { return free_; }

  // `bytes` just above every range handed out (at the base when none is):
  // so a newer segment lies above every older one still held, the order
  // the device gives segments it allocates one after another, and the one
  // the native policy's choices among blocks of equal size follow. 0 when
  // the space above the highest range held is too small.
  DevicePtr take(std::size_t bytes) {
    if (bytes == 0 || free_.empty()) return 0;
    const auto top = std::prev(free_.end());
    if (top->first + top->second != base_ + bytes_ || top->second < bytes) return 0;
    const DevicePtr at = top->first;
    const std::size_t rest = top->second - bytes;
    free_.erase(top);
    if (rest != 0) free_.emplace(at + bytes, rest);
    taken_ += bytes;
    return at;
  }

  // A range take() handed out, free again. False (and nothing changed) when
  // it is not one: outside the arena, or overlapping a free range.
  bool give(DevicePtr at, std::size_t bytes) {
    if (bytes == 0 || !contains(at) || bytes > bytes_ - (at - base_) || bytes > taken_) {
      return false;
    }
    auto next = free_.lower_bound(at);
    if (next != free_.end() && next->first < at + bytes) return false;
    auto prev = next == free_.begin() ? free_.end() : std::prev(next);
    if (prev != free_.end() && prev->first + prev->second > at) return false;
    taken_ -= bytes;
    DevicePtr from = at;
    std::size_t span = bytes;
    if (prev != free_.end() && prev->first + prev->second == at) {  // merged with the one before
      from = prev->first;
      span += prev->second;
      free_.erase(prev);
    }
    if (next != free_.end() && next->first == at + bytes) {  // and the one after
      span += next->second;
      free_.erase(next);
    }
    free_.emplace(from, span);
    return true;
  }

 private:
  DevicePtr base_ = 0;
  std::size_t bytes_ = 0;
  std::size_t taken_ = 0;  // bytes in ranges handed out
  std::map<DevicePtr, std::size_t> free_;
};

}  // namespace reservoir::detail
