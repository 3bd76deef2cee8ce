#include "reservoir/sim_device.hpp"

#include <unistd.h>

#include <algorithm>

#include "reservoir/detail/free_list.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::size_t index(CallKind kind) {
  return static_cast<std::size_t>(kind);
}

}  // namespace

LatencyModel LatencyModel::defaults() {
  // Fitted to one NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0: each
  // call timed alone, medians, at 2 MiB, 64 MiB, 1 GiB and 8 GiB
  // (call_costs in tests/data/gpu/h100-2026-11-25/cuda_behaviour.json;
  // docs/config.md).
  LatencyModel m;
  auto set = [&m](CallKind k, double ns, double ns_per_mib = 0) {
    m.ns_per_call[index(k)] = ns;
    m.ns_per_mib[index(k)] = ns_per_mib;
  };
  set(CallKind::allocate_segment, 36'000, 83);
  set(CallKind::free_segment, 31'000, 440);
  // Address space only: 2.4 us at 2 MiB to 11 us at 8 GiB, not extrapolated
  // to the policies' very large reservations (paging reserves 1.125 PiB).
  set(CallKind::reserve, 4'000);
  set(CallKind::unreserve, 3'500);
  set(CallKind::create_physical, 11'000, 8);
  set(CallKind::release_physical, 10'000, 335);
  set(CallKind::map, 2'700, 1.2);
  set(CallKind::unmap, 17'000, 12);
  set(CallKind::set_access, 24'000, 34);
  set(CallKind::memory_info, 5'500);
  set(CallKind::create_event, 900);
  set(CallKind::destroy_event, 800);
  set(CallKind::record_event, 900);
  set(CallKind::query_event, 900);
  set(CallKind::synchronize_event, 900);
  set(CallKind::synchronize_stream, 900);
  set(CallKind::synchronize_device, 1'000);
  return m;
}

SimDevice::SimDevice(SimDeviceOptions options)
    : options_(options), next_address_(options.base_address), ledger_(options.granularity) {
}

SimDevice::~SimDevice() = default;

Status SimDevice::enter(CallKind kind, std::size_t bytes) {
  estimated_ns_ += options_.latency.ns_per_call[index(kind)] +
                   options_.latency.ns_per_mib[index(kind)] * static_cast<double>(bytes) / kMiB;
  return faults_.enter(kind);
}

DevicePtr SimDevice::next_address(std::size_t bytes, std::size_t alignment) {
  alignment = std::max<std::size_t>(alignment, 512);
  DevicePtr addr = (next_address_ + alignment - 1) & ~(DevicePtr{alignment} - 1);
  next_address_ = addr + bytes;
  return addr;
}

Status SimDevice::allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::allocate_segment, bytes); s != Status::ok) return s;
  if (bytes == 0 || addr == nullptr) return Status::invalid_argument;
  if (bytes > options_.capacity - std::min(used(), options_.capacity)) return Status::out_of_memory;
  DevicePtr result = 0;
  if (address_source_) {
    if (Status s = address_source_(bytes, &result); s != Status::ok) return s;
    if (segments_.count(result) != 0) return Status::invalid_argument;
  } else if (!options_.reuse_freed_addresses || !reuse_freed_range(bytes, &result)) {
    result = next_address(bytes, options_.segment_alignment);
  }
  segments_.emplace(result, bytes);
  segment_bytes_ += bytes;
  *addr = result;
  return Status::ok;
}

Status SimDevice::free_segment(DevicePtr addr) noexcept {
  std::lock_guard lock(mutex_);
  auto it = segments_.find(addr);
  if (Status s = enter(CallKind::free_segment, it == segments_.end() ? 0 : it->second);
      s != Status::ok) {
    return s;
  }
  if (it == segments_.end()) return Status::invalid_argument;
  segment_bytes_ -= it->second;
  if (options_.reuse_freed_addresses && !address_source_) detail::give_back(freed_ranges_, it->first, it->second);
  segments_.erase(it);
  return Status::ok;
}

bool SimDevice::reuse_freed_range(std::size_t bytes, DevicePtr* addr) {
  const std::size_t alignment = std::max<std::size_t>(options_.segment_alignment, 512);
  return detail::take_first_fit(freed_ranges_, bytes, alignment, addr);
}

Status SimDevice::reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::reserve, bytes); s != Status::ok) return s;
  if (va == nullptr) return Status::invalid_argument;
  return ledger_.reserve(bytes, alignment, va, [&](DevicePtr* out) {
    if (reservation_source_) return reservation_source_(bytes, out);
    *out = next_address(bytes, std::max(alignment, options_.granularity));
    return Status::ok;
  });
}

Status SimDevice::unreserve(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::unreserve, bytes); s != Status::ok) return s;
  return ledger_.unreserve(va, bytes, [] { return Status::ok; });
}

Status SimDevice::create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::create_physical, bytes); s != Status::ok) return s;
  if (handle == nullptr) return Status::invalid_argument;
  return ledger_.create(bytes, handle, [&] {
    if (physical_gate_) {
      if (Status s = physical_gate_(bytes); s != Status::ok) return s;
    }
    return bytes > options_.capacity - std::min(used(), options_.capacity) ? Status::out_of_memory
                                                                            : Status::ok;
  });
}

Status SimDevice::release_physical(PhysicalHandle handle) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::release_physical, ledger_.handle_bytes(handle)); s != Status::ok) {
    return s;
  }
  return ledger_.release_handle(handle, [] { return Status::ok; });
}

Status SimDevice::map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
                      std::size_t offset) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::map, bytes); s != Status::ok) return s;
  return ledger_.map(va, bytes, handle, offset, [] { return Status::ok; });
}

Status SimDevice::unmap(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::unmap, bytes); s != Status::ok) return s;
  return ledger_.unmap(va, bytes, [](DevicePtr, std::size_t) { return Status::ok; });
}

Status SimDevice::set_access(DevicePtr va, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::set_access, bytes); s != Status::ok) return s;
  return ledger_.set_access(va, bytes, [](DevicePtr, std::size_t) { return Status::ok; });
}

Status SimDevice::memory_info(MemoryInfo* info) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::memory_info); s != Status::ok) return s;
  if (info == nullptr) return Status::invalid_argument;
  info->total = options_.capacity;
  info->free = options_.capacity - std::min(used(), options_.capacity);
  return Status::ok;
}

Status SimDevice::running_processes(std::vector<ProcessMemory>* out) noexcept {
  if (!options_.lists_processes) return Status::not_supported;
  if (out == nullptr) return Status::invalid_argument;
  std::lock_guard lock(mutex_);
  out->assign(1, ProcessMemory{static_cast<unsigned int>(getpid()), used()});
  return Status::ok;
}

Status SimDevice::create_event(EventId* event) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::create_event); s != Status::ok) return s;
  if (event == nullptr) return Status::invalid_argument;
  EventId id = next_event_++;
  events_.emplace(id, EventState{});
  *event = id;
  return Status::ok;
}

Status SimDevice::destroy_event(EventId event) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::destroy_event); s != Status::ok) return s;
  return events_.erase(event) == 1 ? Status::ok : Status::invalid_argument;
}

Status SimDevice::record_event(EventId event, StreamId stream) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::record_event); s != Status::ok) return s;
  auto it = events_.find(event);
  if (it == events_.end()) return Status::invalid_argument;
  it->second = EventState{stream, true, options_.auto_complete_events};
  return Status::ok;
}

Status SimDevice::query_event(EventId event) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::query_event); s != Status::ok) return s;
  auto it = events_.find(event);
  if (it == events_.end()) return Status::invalid_argument;
  return it->second.done ? Status::ok : Status::not_ready;
}

Status SimDevice::synchronize_event(EventId event) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::synchronize_event); s != Status::ok) return s;
  auto it = events_.find(event);
  if (it == events_.end()) return Status::invalid_argument;
  it->second.done = true;
  return Status::ok;
}

void SimDevice::complete_locked(const StreamId* stream) {
  for (auto& [id, e] : events_) {
    if (stream == nullptr || e.stream == *stream) e.done = true;
  }
}

Status SimDevice::synchronize_stream(StreamId stream) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::synchronize_stream); s != Status::ok) return s;
  complete_locked(&stream);
  return Status::ok;
}

Status SimDevice::create_stream(StreamId* stream) noexcept {
  if (stream == nullptr) return Status::invalid_argument;
  std::lock_guard lock(mutex_);
  *stream = next_stream_++;
  return Status::ok;
}

Status SimDevice::destroy_stream(StreamId stream) noexcept {
  return stream >= (StreamId{1} << 40) ? Status::ok : Status::invalid_argument;
}

Status SimDevice::synchronize_device() noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::synchronize_device); s != Status::ok) return s;
  complete_locked(nullptr);
  return Status::ok;
}

Status SimDevice::copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                               StreamId /*stream*/) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::copy_to_host); s != Status::ok) return s;
  // Accounting only: no contents exist. Validate the arguments.
  return (dst == nullptr && bytes != 0) || (src == 0 && bytes != 0) ? Status::invalid_argument
                                                                    : Status::ok;
}

Status SimDevice::copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                                 StreamId /*stream*/) noexcept {
  std::lock_guard lock(mutex_);
  if (Status s = enter(CallKind::copy_to_device); s != Status::ok) return s;
  return (src == nullptr && bytes != 0) || (dst == 0 && bytes != 0) ? Status::invalid_argument
                                                                    : Status::ok;
}

void SimDevice::set_capacity(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  options_.capacity = bytes;
}

void SimDevice::set_address_source(AddressSource source) {
  std::lock_guard lock(mutex_);
  address_source_ = std::move(source);
}

void SimDevice::set_reservation_source(AddressSource source) {
  std::lock_guard lock(mutex_);
  reservation_source_ = std::move(source);
}

void SimDevice::set_physical_gate(PhysicalGate gate) {
  std::lock_guard lock(mutex_);
  physical_gate_ = std::move(gate);
}

void SimDevice::fail_nth(CallKind kind, std::uint64_t n, Status status) {
  std::lock_guard lock(mutex_);
  faults_.fail_nth(kind, n, status);
}

void SimDevice::fail_fraction(CallKind kind, double fraction, std::uint64_t seed, Status status) {
  std::lock_guard lock(mutex_);
  faults_.fail_fraction(kind, fraction, seed, status);
}

void SimDevice::clear_faults() {
  std::lock_guard lock(mutex_);
  faults_.clear();
}

void SimDevice::complete_event(EventId event) {
  std::lock_guard lock(mutex_);
  auto it = events_.find(event);
  if (it != events_.end()) it->second.done = true;
}

void SimDevice::complete_stream(StreamId stream) {
  std::lock_guard lock(mutex_);
  complete_locked(&stream);
}

void SimDevice::complete_all_events() {
  std::lock_guard lock(mutex_);
  complete_locked(nullptr);
}

void SimDevice::set_auto_complete_events(bool on) {
  std::lock_guard lock(mutex_);
  options_.auto_complete_events = on;
}

std::uint64_t SimDevice::calls(CallKind kind) const {
  std::lock_guard lock(mutex_);
  return faults_.calls(kind);
}

std::uint64_t SimDevice::failures(CallKind kind) const {
  std::lock_guard lock(mutex_);
  return faults_.failures(kind);
}

std::size_t SimDevice::used_bytes() const {
  std::lock_guard lock(mutex_);
  return used();
}

std::size_t SimDevice::live_segments() const {
  std::lock_guard lock(mutex_);
  return segments_.size();
}

std::size_t SimDevice::live_physical() const {
  std::lock_guard lock(mutex_);
  return ledger_.physical_count();
}

std::size_t SimDevice::live_reservations() const {
  std::lock_guard lock(mutex_);
  return ledger_.reservation_count();
}

std::size_t SimDevice::live_events() const {
  std::lock_guard lock(mutex_);
  return events_.size();
}

double SimDevice::estimated_ns() const {
  std::lock_guard lock(mutex_);
  return estimated_ns_;
}

void SimDevice::reset_counters() {
  std::lock_guard lock(mutex_);
  faults_.reset_counters();
  estimated_ns_ = 0.0;
}

}  // namespace reservoir
