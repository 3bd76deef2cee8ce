#include "native_shadow.hpp"

namespace reservoir::detail {

namespace {

SimDeviceOptions unlimited() {
  SimDeviceOptions o;
  o.capacity = std::size_t{1} << 50;  // no capacity pressure: the bound holds without it
  o.auto_complete_events = true;      // streams taken as caught up when the allocator looks
  return o;
}

// The native policy's part of a configuration: everything but the policy,
// its keys, and the memory fraction (the model has no capacity limit).
AllocatorConfig native_part(const AllocatorConfig& config) {
  AllocatorConfig native = config.with_native_policy();
  native.per_process_memory_fraction = 1.0;
  return native;
}

}  // namespace

NativeShadow::NativeShadow(const AllocatorConfig& config)
    : device_(unlimited()), native_(device_, native_part(config)) {
  // Validation mode checks the allocator it was asked for; the model is
  // checked by its own tests.
  native_.set_validate_each_call(false);
}

void NativeShadow::configure(const AllocatorConfig& config) {
  flush();
  native_.set_config(native_part(config));
}

void NativeShadow::begin_request(std::size_t size, StreamId stream) {
  flush();  // pairs a request begun before with its pointer
  if (pending_) {
    if (pending_->size == size && pending_->stream == stream) return;  // the same request, retried
    abandon_request();
  }
  streams_.insert(stream);
  pending_ = Pending{native_.allocate(size, stream), size, stream};
}

void NativeShadow::abandon_request() {
  if (!pending_) return;
  native_.deallocate(pending_->block);
  pending_.reset();
}

std::size_t NativeShadow::reserved() {
  flush();
  return static_cast<std::size_t>(native_.stats().reserved_bytes[0].current);
}

void NativeShadow::flush() {
  for (const Op& op : log_) apply(op);
  log_.clear();
}

void NativeShadow::apply(const Op& op) {
  switch (op.kind) {
    case Kind::alloc:
      if (pending_) {
        block_of_[op.ptr] = pending_->block;
        pending_.reset();
      } else {
        streams_.insert(op.stream);
        block_of_[op.ptr] = native_.allocate(op.size, op.stream);
      }
      break;
    case Kind::free:
      if (auto it = block_of_.find(op.ptr); it != block_of_.end()) {
        native_.deallocate(it->second);
        block_of_.erase(it);
      }
      break;
    case Kind::stream_use:
      if (auto it = block_of_.find(op.ptr); it != block_of_.end()) {
        native_.record_stream(it->second, op.stream);
      }
      break;
    case Kind::empty_cache: native_.empty_cache(); break;
  }
}

}  // namespace reservoir::detail
