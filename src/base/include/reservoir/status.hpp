// The words every layer speaks about the device: addresses, streams and
// events, what a device call returned (Status) and which call it was
// (CallKind). The device contract (device.hpp) and the errors (errors.hpp)
// are written in them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace reservoir {

using DevicePtr = std::uintptr_t;
using StreamId = std::uint64_t;
using EventId = std::uint64_t;
using PhysicalHandle = std::uint64_t;

enum class Status : std::uint8_t {
  ok = 0,
  out_of_memory,     // the device has not enough free memory
  invalid_argument,  // a precondition written beside the operation was broken
  not_supported,     // the backend lacks this capability
  not_ready,         // query_event: the event has not completed yet
  device_error,      // any other failure of the device or driver
};

std::string_view to_string(Status status) noexcept;

// Kinds of device calls, used by counters, latency models and fault injection.
enum class CallKind : std::uint8_t {
  allocate_segment,
  free_segment,
  reserve,
  unreserve,
  create_physical,
  release_physical,
  map,
  unmap,
  set_access,
  memory_info,
  create_event,
  destroy_event,
  record_event,
  query_event,
  synchronize_event,
  synchronize_stream,
  synchronize_device,
  copy_to_host,
  copy_to_device,
  capture_frontier,   // a stream's capture and its last nodes
  node_dependencies,  // a captured node's dependencies
  count_,             // number of kinds, not a kind
};
inline constexpr std::size_t kCallKindCount = static_cast<std::size_t>(CallKind::count_);
std::string_view to_string(CallKind kind) noexcept;

}  // namespace reservoir
