// SimDevice: an accounting-only device. No memory is touched.
//
// - Addresses are fake, deterministic and never overlap; a replay may instead
//   dictate the address of each new segment through an AddressSource.
// - Capacity and granularity are settings.
// - Fault injection: fail the Nth call of a kind, or a seeded fraction of calls.
// - Events complete only when the caller says so (or at synchronize), unless
//   auto_complete_events is set.
// - Every call is counted per kind, and a latency model (nanoseconds per call
//   kind) gives an estimate of the time a real device would have spent.
//
// Thread safety: all members are safe to call concurrently (one internal mutex).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "reservoir/detail/fault_injector.hpp"
#include "reservoir/detail/vmm_ledger.hpp"
#include "reservoir/device.hpp"

namespace reservoir {

// A call's estimated cost in nanoseconds: ns_per_call[kind] +
// ns_per_mib[kind] * MiB the call covers (the segment, reservation, handle or
// range). The defaults are fitted to an H100's measured call times;
// docs/config.md lists them beside the readings.
struct LatencyModel {
  std::array<double, kCallKindCount> ns_per_call{};
  std::array<double, kCallKindCount> ns_per_mib{};
  static LatencyModel defaults();
  static LatencyModel zero() { return LatencyModel{}; }
};

struct SimDeviceOptions {
  std::size_t capacity = std::size_t{80} << 30;    // 80 GiB
  std::size_t granularity = std::size_t{2} << 20;  // 2 MiB
  DevicePtr base_address = 0x7f0000000000;         // first fake address
  std::size_t segment_alignment = std::size_t{2} << 20;
  bool auto_complete_events = false;
  // running_processes() lists this process with the bytes the device holds
  // for it (as NVML lists a process on a GPU); false: not_supported, as a
  // device without NVML.
  bool lists_processes = false;
  LatencyModel latency = LatencyModel::defaults();
  // Segments (allocate_segment) take the lowest freed range they fit, as a
  // real driver can give cudaMalloc a lower address after a cudaFree (an
  // H100 on driver 580 did: tests/data/gpu/h100-2026-11-25, malloc_sequence);
  // false: every segment lies above the last, as PyTorch's tie rule before
  // 2.12 is usually pictured.
  bool reuse_freed_addresses = false;
};

class SimDevice final : public Device {
 public:
  // Returns the address the device must give a segment of `bytes`, or a
  // non-ok status the device must fail the call with.
  using AddressSource = std::function<Status(std::size_t bytes, DevicePtr* addr)>;

  explicit SimDevice(SimDeviceOptions options = {});
  ~SimDevice() override;

  std::string_view name() const noexcept override { return "sim"; }

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
  Status running_processes(std::vector<ProcessMemory>* out) noexcept override;
  Status create_event(EventId* event) noexcept override;
  Status destroy_event(EventId event) noexcept override;
  Status record_event(EventId event, StreamId stream) noexcept override;
  Status query_event(EventId event) noexcept override;
  Status synchronize_event(EventId event) noexcept override;
  Status synchronize_stream(StreamId stream) noexcept override;
  Status synchronize_device() noexcept override;
  // Streams are numbers from 1 << 40 on (events recorded there complete as on any stream).
  Status create_stream(StreamId* stream) noexcept override;
  Status destroy_stream(StreamId stream) noexcept override;
  Status copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                      StreamId stream) noexcept override;
  Status copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                        StreamId stream) noexcept override;

  // ---- test and replay controls -------------------------------------------
  void set_capacity(std::size_t bytes);
  void set_address_source(AddressSource source);
  // The same for reserved address space (virtual-memory policies).
  void set_reservation_source(AddressSource source);
  // Asked before each create_physical (bytes): a status other than ok fails
  // the call with it, as a device out of memory would.
  using PhysicalGate = std::function<Status(std::size_t bytes)>;
  void set_physical_gate(PhysicalGate gate);
  // Fail the nth (1-based) call of `kind` counted from now with `status`.
  void fail_nth(CallKind kind, std::uint64_t n, Status status = Status::out_of_memory);
  // Fail each call of `kind` with probability `fraction` (seeded, repeatable).
  void fail_fraction(CallKind kind, double fraction, std::uint64_t seed,
                     Status status = Status::device_error);
  void clear_faults();
  // Complete one recorded event, every event recorded on a stream, or all.
  void complete_event(EventId event);
  void complete_stream(StreamId stream);
  void complete_all_events();
  void set_auto_complete_events(bool on);

  // ---- observation --------------------------------------------------------
  std::uint64_t calls(CallKind kind) const;
  std::uint64_t failures(CallKind kind) const;
  std::size_t used_bytes() const;  // segments plus physical memory
  std::size_t live_segments() const;
  std::size_t live_physical() const;
  std::size_t live_reservations() const;
  std::size_t live_events() const;
  // Estimated nanoseconds spent in device calls under the latency model.
  double estimated_ns() const;
  void reset_counters();

 private:
  struct EventState {
    StreamId stream = 0;
    bool recorded = false;
    bool done = true;
  };

  // Counts the call and applies injected faults. Returns ok or the fault.
  Status enter(CallKind kind, std::size_t bytes = 0);
  DevicePtr next_address(std::size_t bytes, std::size_t alignment);
  // reuse_freed_addresses: the lowest freed range `bytes` fits (aligned as
  // segments are), taken out of freed_ranges_; false when none.
  bool reuse_freed_range(std::size_t bytes, DevicePtr* addr);
  // Marks complete the events recorded on *stream, or all when stream is null.
  void complete_locked(const StreamId* stream);
  std::size_t used() const noexcept { return segment_bytes_ + ledger_.physical_bytes(); }

  SimDeviceOptions options_;
  mutable std::mutex mutex_;
  AddressSource address_source_;
  AddressSource reservation_source_;
  PhysicalGate physical_gate_;
  DevicePtr next_address_;
  std::size_t segment_bytes_ = 0;
  std::unordered_map<DevicePtr, std::size_t> segments_;
  // reuse_freed_addresses: freed segments' ranges, merged, by start.
  std::map<DevicePtr, std::size_t> freed_ranges_;
  detail::VmmLedger ledger_;
  std::unordered_map<EventId, EventState> events_;
  EventId next_event_ = 1;
  StreamId next_stream_ = StreamId{1} << 40;
  detail::FaultInjector faults_;
  double estimated_ns_ = 0.0;
};

}  // namespace reservoir
