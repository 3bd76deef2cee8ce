#include "reservoir/status.hpp"

namespace reservoir {

std::string_view to_string(Status status) noexcept {
  switch (status) {
    case Status::ok: return "ok";
    case Status::out_of_memory: return "out_of_memory";
    case Status::invalid_argument: return "invalid_argument";
    case Status::not_supported: return "not_supported";
    case Status::not_ready: return "not_ready";
    case Status::device_error: return "device_error";
  }
  return "unknown";
}

std::string_view to_string(CallKind kind) noexcept {
  switch (kind) {
    case CallKind::allocate_segment: return "allocate_segment";
    case CallKind::free_segment: return "free_segment";
    case CallKind::reserve: return "reserve";
    case CallKind::unreserve: return "unreserve";
    case CallKind::create_physical: return "create_physical";
    case CallKind::release_physical: return "release_physical";
    case CallKind::map: return "map";
    case CallKind::unmap: return "unmap";
    case CallKind::set_access: return "set_access";
    case CallKind::memory_info: return "memory_info";
    case CallKind::create_event: return "create_event";
    case CallKind::destroy_event: return "destroy_event";
    case CallKind::record_event: return "record_event";
    case CallKind::query_event: return "query_event";
    case CallKind::synchronize_event: return "synchronize_event";
    case CallKind::synchronize_stream: return "synchronize_stream";
    case CallKind::synchronize_device: return "synchronize_device";
    case CallKind::copy_to_host: return "copy_to_host";
    case CallKind::copy_to_device: return "copy_to_device";
    case CallKind::capture_frontier: return "capture_frontier";
    case CallKind::node_dependencies: return "node_dependencies";
    case CallKind::count_: break;
  }
  return "unknown";
}

}  // namespace reservoir
