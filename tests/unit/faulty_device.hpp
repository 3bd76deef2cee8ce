// FaultyDevice: forwards to a real device (HostDevice: real memory) and fails
// chosen calls with the library's FaultInjector (as SimDevice does), so
// failure paths can be tested with real contents. It also logs the stream of
// every copy and the order of the calls, and can hide virtual memory.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "reservoir/detail/fault_injector.hpp"
#include "reservoir/device.hpp"

namespace reservoir::testing {

class FaultyDevice final : public Device {
 public:
  explicit FaultyDevice(Device& base, bool virtual_memory = true)
      : base_(base), vm_(virtual_memory) {}

  // Fail the nth (1-based) call of `kind` from now with `status`.
  void fail_nth(CallKind kind, int n, Status status) {
    std::lock_guard lock(mutex_);
    faults_.fail_nth(kind, static_cast<std::uint64_t>(n), status);
  }
  void clear() {
    std::lock_guard lock(mutex_);
    faults_.clear();
  }
  int calls(CallKind kind) const {
    std::lock_guard lock(mutex_);
    return static_cast<int>(faults_.calls(kind));
  }
  std::vector<StreamId> copy_streams() const {
    std::lock_guard lock(mutex_);
    return copy_streams_;
  }
  std::vector<std::size_t> copy_sizes() const {
    std::lock_guard lock(mutex_);
    return copy_sizes_;
  }
  // The order of every call, by kind.
  std::vector<CallKind> order() const {
    std::lock_guard lock(mutex_);
    return order_;
  }
  void reset_log() {
    std::lock_guard lock(mutex_);
    copy_streams_.clear();
    copy_sizes_.clear();
    order_.clear();
    faults_.reset_counters();
  }

  std::string_view name() const noexcept override { return base_.name(); }
  Status allocate_segment(std::size_t b, DevicePtr* a) noexcept override {
    return guard(CallKind::allocate_segment, [&] { return base_.allocate_segment(b, a); });
  }
  Status free_segment(DevicePtr a) noexcept override {
    return guard(CallKind::free_segment, [&] { return base_.free_segment(a); });
  }
  bool supports_virtual_memory() const noexcept override { return vm_; }
  std::size_t granularity() const noexcept override { return base_.granularity(); }
  Status reserve(std::size_t b, std::size_t al, DevicePtr* va) noexcept override {
    return guard(CallKind::reserve, [&] { return base_.reserve(b, al, va); });
  }
  Status unreserve(DevicePtr va, std::size_t b) noexcept override {
    return guard(CallKind::unreserve, [&] { return base_.unreserve(va, b); });
  }
  Status create_physical(std::size_t b, PhysicalHandle* h) noexcept override {
    return guard(CallKind::create_physical, [&] { return base_.create_physical(b, h); });
  }
  Status release_physical(PhysicalHandle h) noexcept override {
    return guard(CallKind::release_physical, [&] { return base_.release_physical(h); });
  }
  Status map(DevicePtr va, std::size_t b, PhysicalHandle h, std::size_t o) noexcept override {
    return guard(CallKind::map, [&] { return base_.map(va, b, h, o); });
  }
  Status unmap(DevicePtr va, std::size_t b) noexcept override {
    return guard(CallKind::unmap, [&] { return base_.unmap(va, b); });
  }
  Status set_access(DevicePtr va, std::size_t b) noexcept override {
    return guard(CallKind::set_access, [&] { return base_.set_access(va, b); });
  }
  Status memory_info(MemoryInfo* i) noexcept override {
    return guard(CallKind::memory_info, [&] { return base_.memory_info(i); });
  }
  Status create_event(EventId* e) noexcept override { return base_.create_event(e); }
  Status destroy_event(EventId e) noexcept override { return base_.destroy_event(e); }
  Status record_event(EventId e, StreamId s) noexcept override { return base_.record_event(e, s); }
  Status query_event(EventId e) noexcept override { return base_.query_event(e); }
  Status synchronize_event(EventId e) noexcept override { return base_.synchronize_event(e); }
  Status synchronize_stream(StreamId s) noexcept override {
    return guard(CallKind::synchronize_stream, [&] { return base_.synchronize_stream(s); });
  }
  Status synchronize_device() noexcept override {
    return guard(CallKind::synchronize_device, [&] { return base_.synchronize_device(); });
  }
  // Streams: numbered from 100 (the base need not have any).
  Status create_stream(StreamId* s) noexcept override {
    std::lock_guard lock(mutex_);
    *s = next_stream_++;
    return Status::ok;
  }
  Status destroy_stream(StreamId) noexcept override { return Status::ok; }
  // A capture's graph, as a test lays it out: what stream `s` would make
  // its next work depend on (set_capture; id 0: not capturing), and each
  // node's dependencies (add_node).
  void set_capture(StreamId s, std::uint64_t id, std::vector<GraphNode> frontier) {
    std::lock_guard lock(mutex_);
    captures_[s] = CaptureFrontier{id, std::move(frontier)};
  }
  void add_node(GraphNode node, std::vector<GraphNode> deps) {
    std::lock_guard lock(mutex_);
    nodes_[node] = std::move(deps);
  }
  Status capture_frontier(StreamId s, CaptureFrontier* out) noexcept override {
    return guard(CallKind::capture_frontier, [&] {
      std::lock_guard lock(mutex_);
      auto it = captures_.find(s);
      *out = it == captures_.end() ? CaptureFrontier{} : it->second;
      return Status::ok;
    });
  }
  Status node_dependencies(GraphNode node, std::vector<GraphNode>* out) noexcept override {
    return guard(CallKind::node_dependencies, [&] {
      std::lock_guard lock(mutex_);
      auto it = nodes_.find(node);
      if (it == nodes_.end()) return Status::invalid_argument;
      *out = it->second;
      return Status::ok;
    });
  }
  Status copy_to_host(void* d, DevicePtr s, std::size_t b, StreamId st) noexcept override {
    log(st, b);
    return guard(CallKind::copy_to_host, [&] { return base_.copy_to_host(d, s, b, st); });
  }
  Status copy_to_device(DevicePtr d, const void* s, std::size_t b, StreamId st) noexcept override {
    log(st, b);
    return guard(CallKind::copy_to_device, [&] { return base_.copy_to_device(d, s, b, st); });
  }

 private:
  // Counts the call; fails it when a fault is due, else makes it on the base.
  template <typename Call>
  Status guard(CallKind kind, Call&& call) noexcept {
    Status s = Status::ok;
    {
      std::lock_guard lock(mutex_);
      order_.push_back(kind);
      s = faults_.enter(kind);
    }
    return s != Status::ok ? s : call();
  }
  void log(StreamId s, std::size_t b) noexcept {
    std::lock_guard lock(mutex_);
    copy_streams_.push_back(s);
    copy_sizes_.push_back(b);
  }

  Device& base_;
  bool vm_;
  mutable std::mutex mutex_;
  detail::FaultInjector faults_;
  StreamId next_stream_ = 100;
  std::vector<StreamId> copy_streams_;
  std::vector<std::size_t> copy_sizes_;
  std::vector<CallKind> order_;
  std::map<StreamId, CaptureFrontier> captures_;
  std::map<GraphNode, std::vector<GraphNode>> nodes_;
};

}  // namespace reservoir::testing
