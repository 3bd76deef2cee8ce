#include "tag_device.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "reservoir/errors.hpp"

namespace reservoir::detail {

// ---- RangeIndex --------------------------------------------------------------

namespace {

template <typename Ranges>
auto first_after(Ranges& ranges, DevicePtr addr) {
  return std::upper_bound(ranges.begin(), ranges.end(), addr,
                          [](DevicePtr a, const auto& r) { return a < r.begin; });
}

}  // namespace

void RangeIndex::insert(DevicePtr begin, std::size_t bytes, void* owner) {
  LockGuard lock(mutex_);
  auto it = first_after(ranges_, begin);
  if (it != ranges_.begin() && std::prev(it)->begin == begin) {
    *std::prev(it) = Range{begin, begin + bytes, owner};
  } else {
    ranges_.insert(it, Range{begin, begin + bytes, owner});
  }
  count_.store(ranges_.size(), std::memory_order_relaxed);
  update_span();
}

void RangeIndex::update_span() {
  DevicePtr low = ~DevicePtr{0};
  DevicePtr high = 0;
  for (const Range& r : ranges_) {
    low = std::min(low, r.begin);
    high = std::max(high, r.end);
  }
  low_.store(low, std::memory_order_relaxed);
  high_.store(high, std::memory_order_relaxed);
}

void RangeIndex::erase(DevicePtr begin) {
  LockGuard lock(mutex_);
  auto it = first_after(ranges_, begin);
  if (it != ranges_.begin() && std::prev(it)->begin == begin) ranges_.erase(std::prev(it));
  count_.store(ranges_.size(), std::memory_order_relaxed);
  update_span();
}

void* RangeIndex::find(DevicePtr addr) const {
  SharedLock lock(mutex_);
  auto it = first_after(ranges_, addr);
  if (it == ranges_.begin()) return nullptr;
  --it;
  return addr < it->end ? it->owner : nullptr;
}

// ---- TagDevice ---------------------------------------------------------------

TagDevice::TagDevice(Device& base, RangeIndex& index, void* owner,
                     const std::atomic<std::size_t>* margin)
    : base_(base), index_(index), owner_(owner), margin_(margin) {}

Status TagDevice::check_margin(std::size_t bytes) noexcept {
  const std::size_t margin = margin_ != nullptr ? margin_->load(std::memory_order_relaxed) : 0;
  if (margin == 0) return Status::ok;
  MemoryInfo info;
  if (Status s = base_.memory_info(&info); s != Status::ok) return s;
  return info.free >= bytes && info.free - bytes >= margin ? Status::ok : Status::out_of_memory;
}

TagDevice::~TagDevice() {
  (void)retry_releases();
}

Status TagDevice::allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept {
  if (bytes == 0 || addr == nullptr) return Status::invalid_argument;
  const std::size_t g = base_.granularity();
  const std::size_t size = (bytes + g - 1) / g * g;
  std::lock_guard lock(mutex_);
  if (paused_) return Status::invalid_argument;
  if (Status s = check_margin(size); s != Status::ok) return s;
  DevicePtr va = 0;
  if (Status s = base_.reserve(size, 0, &va); s != Status::ok) return s;
  PhysicalHandle device = 0;
  Status s = base_.create_physical(size, &device);
  if (s == Status::ok) {
    s = base_.map(va, size, device, 0);
    if (s == Status::ok) {
      s = base_.set_access(va, size);
      if (s == Status::ok) {
        const PhysicalHandle h = next_handle_++;
        handles_[h] = {device, size};
        mappings_[va] = {size, h, 0};
        reservations_[va] = size;
        segments_[va] = h;
        index_.insert(va, size, owner_);
        *addr = va;
        return Status::ok;
      }
      (void)base_.unmap(va, size);
    }
    if (base_.release_physical(device) != Status::ok) unreleased_.push_back(device);
  }
  (void)base_.unreserve(va, size);
  return s;
}

Status TagDevice::free_segment(DevicePtr addr) noexcept {
  std::lock_guard lock(mutex_);
  auto it = segments_.find(addr);
  if (it == segments_.end()) return Status::invalid_argument;
  const std::size_t bytes = reservations_.at(addr);
  if (Status s = unmap_locked(addr, bytes); s != Status::ok) return s;
  if (Status s = release_locked(it->second); s != Status::ok) return s;
  if (Status s = base_.unreserve(addr, bytes); s != Status::ok) return s;
  reservations_.erase(addr);
  segments_.erase(it);
  index_.erase(addr);
  return Status::ok;
}

Status TagDevice::reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept {
  std::lock_guard lock(mutex_);
  const Status s = base_.reserve(bytes, alignment, va);
  if (s == Status::ok) {
    reservations_[*va] = bytes;
    index_.insert(*va, bytes, owner_);
  }
  return s;
}

Status TagDevice::unreserve(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second != bytes || segments_.count(va) != 0) {
    return Status::invalid_argument;
  }
  const Status s = base_.unreserve(va, bytes);
  if (s == Status::ok) {
    reservations_.erase(it);
    index_.erase(va);
  }
  return s;
}

Status TagDevice::create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept {
  if (handle == nullptr) return Status::invalid_argument;
  std::lock_guard lock(mutex_);
  if (paused_) return Status::invalid_argument;
  if (Status s = check_margin(bytes); s != Status::ok) return s;
  PhysicalHandle device = 0;
  const Status s = base_.create_physical(bytes, &device);
  if (s == Status::ok) {
    *handle = next_handle_++;
    handles_[*handle] = {device, bytes};
  }
  return s;
}

Status TagDevice::release_locked(PhysicalHandle handle) noexcept {
  auto it = handles_.find(handle);
  if (it == handles_.end()) return Status::invalid_argument;
  if (it->second.device != 0) {
    if (Status s = base_.release_physical(it->second.device); s != Status::ok) return s;
  }
  handles_.erase(it);
  return Status::ok;
}

Status TagDevice::release_physical(PhysicalHandle handle) noexcept {
  std::lock_guard lock(mutex_);
  return release_locked(handle);
}

Status TagDevice::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                      std::size_t offset) noexcept {
  std::lock_guard lock(mutex_);
  auto it = handles_.find(handle);
  if (paused_ || it == handles_.end()) return Status::invalid_argument;
  const Status s = base_.map(va, bytes, it->second.device, offset);
  if (s == Status::ok) mappings_[va] = {bytes, handle, offset};
  return s;
}

Status TagDevice::unmap_locked(DevicePtr va, std::size_t bytes) noexcept {
  if (!paused_) {
    if (Status s = base_.unmap(va, bytes); s != Status::ok) return s;
  }
  mappings_.erase(mappings_.lower_bound(va), mappings_.lower_bound(va + bytes));
  return Status::ok;
}

Status TagDevice::unmap(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  return unmap_locked(va, bytes);
}

Status TagDevice::set_access(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  if (paused_) return Status::invalid_argument;
  return base_.set_access(va, bytes);
}

Status TagDevice::copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                               StreamId stream) noexcept {
  if (paused()) return Status::invalid_argument;
  return base_.copy_to_host(dst, src, bytes, stream);
}

Status TagDevice::copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                                 StreamId stream) noexcept {
  if (paused()) return Status::invalid_argument;
  return base_.copy_to_device(dst, src, bytes, stream);
}

// ---- pause and resume --------------------------------------------------------

Status TagDevice::map_one(DevicePtr va, const Mapping& m, CallKind* failed) noexcept {
  const PhysicalHandle device = handles_.at(m.handle).device;
  if (Status s = base_.map(va, m.bytes, device, m.offset); s != Status::ok) {
    *failed = CallKind::map;
    return s;
  }
  if (Status s = base_.set_access(va, m.bytes); s != Status::ok) {
    *failed = CallKind::set_access;
    (void)base_.unmap(va, m.bytes);
    return s;
  }
  return Status::ok;
}

StepFailure TagDevice::release_all(std::size_t* released_bytes) {
  std::lock_guard lock(mutex_);
  if (paused_) return {CallKind::unmap, Status::invalid_argument};
  for (auto it = mappings_.begin(); it != mappings_.end(); ++it) {
    if (Status s = base_.unmap(it->first, it->second.bytes); s != Status::ok) {
      // Map back what was unmapped: the tag stays as it was. The handles are
      // live, so this fails only with the device itself, and the first
      // failure is what gets reported.
      for (auto back = mappings_.begin(); back != it; ++back) {
        CallKind ignored{};
        (void)map_one(back->first, back->second, &ignored);
      }
      return {CallKind::unmap, s};
    }
  }
  std::size_t released = 0;
  for (auto& [id, h] : handles_) {
    if (base_.release_physical(h.device) != Status::ok) unreleased_.push_back(h.device);
    released += h.bytes;
    h.device = 0;
  }
  paused_ = true;
  if (released_bytes != nullptr) *released_bytes = released;
  return {};
}

StepFailure TagDevice::restore_all(const std::function<StepFailure(DevicePtr)>& on_mapped,
                                   const std::function<void()>& before_undo) {
  std::lock_guard lock(mutex_);
  if (!paused_) return {CallKind::map, Status::invalid_argument};
  // Gives back the mappings before `mapped_end` and every handle created.
  auto undo = [&](std::map<DevicePtr, Mapping>::iterator mapped_end) {
    before_undo();
    for (auto it = mappings_.begin(); it != mapped_end; ++it) {
      (void)base_.unmap(it->first, it->second.bytes);
    }
    for (auto& [id, h] : handles_) {
      if (h.device != 0 && base_.release_physical(h.device) != Status::ok) {
        unreleased_.push_back(h.device);
      }
      h.device = 0;
    }
  };
  auto create = [&](Handle& h) -> Status {
    if (h.device != 0) return Status::ok;
    const Status s = base_.create_physical(h.bytes, &h.device);
    if (s != Status::ok) h.device = 0;
    return s;
  };
  for (auto it = mappings_.begin(); it != mappings_.end(); ++it) {
    if (Status s = create(handles_.at(it->second.handle)); s != Status::ok) {
      undo(it);
      return {CallKind::create_physical, s};
    }
    CallKind failed{};
    if (Status s = map_one(it->first, it->second, &failed); s != Status::ok) {
      undo(it);
      return {failed, s};
    }
    const auto next = std::next(it);
    const DevicePtr frontier = next == mappings_.end() ? ~DevicePtr{0} : next->first;
    if (StepFailure f = on_mapped(frontier); f.failed()) {
      undo(next);
      return f;
    }
  }
  // Handles no mapping uses (the allocator holds them unmapped) come back too.
  for (auto& [id, h] : handles_) {
    if (Status s = create(h); s != Status::ok) {
      undo(mappings_.end());
      return {CallKind::create_physical, s};
    }
  }
  paused_ = false;
  return {};
}

bool TagDevice::paused() const {
  std::lock_guard lock(mutex_);
  return paused_;
}

std::size_t TagDevice::physical_bytes() const {
  std::lock_guard lock(mutex_);
  std::size_t total = 0;
  for (const auto& [id, h] : handles_) {
    if (h.device != 0) total += h.bytes;
  }
  return total;
}

std::vector<std::pair<DevicePtr, std::size_t>> TagDevice::mapped_ranges() const {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<DevicePtr, std::size_t>> out;
  out.reserve(mappings_.size());
  for (const auto& [va, m] : mappings_) out.emplace_back(va, m.bytes);
  return out;
}

bool TagDevice::retry_releases() noexcept {
  std::lock_guard lock(mutex_);
  std::vector<PhysicalHandle> still;
  for (PhysicalHandle h : unreleased_) {
    if (base_.release_physical(h) != Status::ok) still.push_back(h);
  }
  unreleased_.swap(still);
  return unreleased_.empty();
}

void TagDevice::validate() const {
  std::lock_guard lock(mutex_);
  for (const auto& [va, m] : mappings_) {
    auto h = handles_.find(m.handle);
    if (h == handles_.end()) {
      throw InvariantError(
          fmt::format("tag device: mapping at {:#x} names released handle {}", va, m.handle));
    }
    if (m.offset + m.bytes > h->second.bytes) {
      throw InvariantError(fmt::format("tag device: mapping at {:#x} runs past its handle", va));
    }
    if ((h->second.device == 0) != paused_) {
      throw InvariantError(fmt::format("tag device: handle {} is {} while the tag is {}", m.handle,
                                       h->second.device == 0 ? "released" : "live",
                                       paused_ ? "paused" : "running"));
    }
    auto r = reservations_.upper_bound(va);
    if (r == reservations_.begin() || va + m.bytes > std::prev(r)->first + std::prev(r)->second) {
      throw InvariantError(
          fmt::format("tag device: mapping at {:#x} lies outside its reservation", va));
    }
  }
  for (const auto& [va, handle] : segments_) {
    if (reservations_.count(va) == 0 || handles_.count(handle) == 0) {
      throw InvariantError(
          fmt::format("tag device: segment at {:#x} lost its reservation or handle", va));
    }
  }
}

}  // namespace reservoir::detail
