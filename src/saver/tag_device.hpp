// TagDevice: the view of a device one tag's allocator runs on.
//
// It serves the whole Device contract from the device below, with two
// differences that make pause and resume possible:
//   - classic segments are virtual memory: allocate_segment reserves address
//     space, creates one physical handle and maps it (cudaMalloc's semantics,
//     cuMemCreate's mechanism), so every byte of the tag can be unmapped and
//     mapped again at the same address, whatever the allocator's policy;
//   - physical handles the allocator sees are this view's own numbers, so the
//     device handles behind them can be released on pause and recreated on
//     resume while the allocator keeps its bookkeeping untouched.
// It records every reservation (in the saver's RangeIndex, so frees find
// their tag), every handle and every mapping.
//
// While paused, calls that need physical memory (create_physical, map,
// set_access, allocate_segment, copies) fail with invalid_argument; unmap,
// release_physical and free_segment only update the records (the memory is
// already gone), so an allocator may give up cached segments of a paused tag.
//
// Thread safety: every member may be called from any thread (one mutex);
// release_all and restore_all expect the tag's allocator to be idle.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "reservoir/detail/shared_spin_mutex.hpp"
#include "reservoir/device.hpp"

namespace reservoir::detail {

// Address ranges of every tag, for routing a free to its tag.
class RangeIndex {
 public:
  void insert(DevicePtr begin, std::size_t bytes, void* owner);
  void erase(DevicePtr begin);
  // The owner of the range holding addr, or nullptr.
  void* find(DevicePtr addr) const;
  bool empty() const noexcept { return count_.load(std::memory_order_relaxed) == 0; }
  // False when addr lies outside the span of every range (then find is
  // nullptr), without the lock: a pointer handed out in a range was handed
  // out after its range went in.
  bool may_hold(DevicePtr addr) const noexcept {
    return addr >= low_.load(std::memory_order_relaxed) &&
           addr < high_.load(std::memory_order_relaxed);
  }

 private:
  mutable SharedSpinMutex mutex_;
  struct Range {
    DevicePtr begin;
    DevicePtr end;
    void* owner;
  };
  // By begin; reservations are few and change rarely, frees look them up.
  std::vector<Range> ranges_ RESERVOIR_GUARDED_BY(mutex_);
  void update_span() RESERVOIR_REQUIRES(mutex_);
  std::atomic<DevicePtr> low_{~DevicePtr{0}};  // the ranges' span: [low_, high_)
  std::atomic<DevicePtr> high_{0};
  std::atomic<std::size_t> count_{0};
};

// Why a pause or resume step failed: the call and its status.
struct StepFailure {
  CallKind call = CallKind::map;
  Status status = Status::ok;
  bool failed() const noexcept { return status != Status::ok; }
};

class TagDevice final : public Device {
 public:
  // `margin` (may be null): device bytes that must stay free after each new
  // physical allocation while running (Saver::set_memory_margin).
  TagDevice(Device& base, RangeIndex& index, void* owner,
            const std::atomic<std::size_t>* margin = nullptr);
  ~TagDevice() override;  // retries releases that failed before

  std::string_view name() const noexcept override { return base_.name(); }
  Status allocate_segment(std::size_t bytes, DevicePtr* addr) noexcept override;
  Status free_segment(DevicePtr addr) noexcept override;
  bool supports_virtual_memory() const noexcept override { return true; }
  std::size_t granularity() const noexcept override { return base_.granularity(); }
  Status reserve(std::size_t bytes, std::size_t alignment, DevicePtr* va) noexcept override;
  Status unreserve(DevicePtr va, std::size_t bytes) noexcept override;
  Status create_physical(std::size_t bytes, PhysicalHandle* handle) noexcept override;
  Status release_physical(PhysicalHandle handle) noexcept override;
  Status map(DevicePtr va, std::size_t bytes, PhysicalHandle handle,
             std::size_t offset) noexcept override;
  Status unmap(DevicePtr va, std::size_t bytes) noexcept override;
  Status set_access(DevicePtr va, std::size_t bytes) noexcept override;
  Status memory_info(MemoryInfo* info) noexcept override { return base_.memory_info(info); }
  Status create_event(EventId* event) noexcept override { return base_.create_event(event); }
  Status destroy_event(EventId event) noexcept override { return base_.destroy_event(event); }
  Status record_event(EventId event, StreamId stream) noexcept override {
    return base_.record_event(event, stream);
  }
  Status query_event(EventId event) noexcept override { return base_.query_event(event); }
  Status synchronize_event(EventId event) noexcept override {
    return base_.synchronize_event(event);
  }
  Status synchronize_stream(StreamId stream) noexcept override {
    return base_.synchronize_stream(stream);
  }
  Status synchronize_device() noexcept override { return base_.synchronize_device(); }
  Status create_stream(StreamId* stream) noexcept override { return base_.create_stream(stream); }
  Status destroy_stream(StreamId stream) noexcept override { return base_.destroy_stream(stream); }
  Status capture_frontier(StreamId stream, CaptureFrontier* out) noexcept override {
    return base_.capture_frontier(stream, out);
  }
  Status node_dependencies(GraphNode node, std::vector<GraphNode>* out) noexcept override {
    return base_.node_dependencies(node, out);
  }
  Status copy_to_host(void* dst, DevicePtr src, std::size_t bytes,
                      StreamId stream) noexcept override;
  Status copy_to_device(DevicePtr dst, const void* src, std::size_t bytes,
                        StreamId stream) noexcept override;

  // ---- pause and resume (the tag's allocator idle) ------------------------
  // Unmaps every mapping, then releases every device handle. All or nothing
  // up to the first release: a failed unmap maps back what was unmapped and
  // returns the failure. A failed release is kept and retried later (the
  // memory is unmapped either way). Returns the physical bytes released.
  StepFailure release_all(std::size_t* released_bytes);
  // Creates the device handles and maps every mapping again, in address
  // order. After each mapping it calls on_mapped(frontier): every mapping
  // below `frontier` is mapped and open, so the caller may start copying
  // there while the rest is mapped. All or nothing: when a step or
  // on_mapped fails, before_undo() is called (to wait for work on the
  // memory), whatever was mapped and created is given back, and the view
  // stays paused.
  StepFailure restore_all(const std::function<StepFailure(DevicePtr)>& on_mapped,
                          const std::function<void()>& before_undo);
  bool paused() const;
  // Physical bytes held now.
  std::size_t physical_bytes() const;
  // Mapped ranges [va, va + bytes), in address order.
  std::vector<std::pair<DevicePtr, std::size_t>> mapped_ranges() const;
  // Retries device releases that failed; true when none is left.
  bool retry_releases() noexcept;
  // Checks the records against each other; throws InvariantError.
  void validate() const;

 private:
  struct Handle {
    PhysicalHandle device = 0;  // 0 while paused
    std::size_t bytes = 0;
  };
  struct Mapping {
    std::size_t bytes = 0;
    PhysicalHandle handle = 0;  // this view's number
    std::size_t offset = 0;
  };
  Status unmap_locked(DevicePtr va, std::size_t bytes) noexcept;
  Status release_locked(PhysicalHandle handle) noexcept;
  // Maps and opens one recorded mapping on the device.
  Status map_one(DevicePtr va, const Mapping& m, CallKind* failed) noexcept;
  // out_of_memory when `bytes` more would leave less than the margin free.
  Status check_margin(std::size_t bytes) noexcept;

  Device& base_;
  RangeIndex& index_;
  void* owner_;
  const std::atomic<std::size_t>* margin_;
  mutable std::mutex mutex_;
  bool paused_ = false;
  PhysicalHandle next_handle_ = 1;
  std::unordered_map<PhysicalHandle, Handle> handles_;
  std::map<DevicePtr, Mapping> mappings_;
  std::map<DevicePtr, std::size_t> reservations_;  // va -> bytes
  // Classic segments: their handle (their size is their reservation's).
  std::unordered_map<DevicePtr, PhysicalHandle> segments_;
  std::vector<PhysicalHandle> unreleased_;  // device handles whose release failed
};

}  // namespace reservoir::detail
