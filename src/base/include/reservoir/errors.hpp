// The exceptions reservoir throws. Backends never throw; the allocator and the
// tools turn failures into these, with a message that says what was wrong and
// where.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "reservoir/status.hpp"

namespace reservoir {

// Base of every reservoir error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A malformed allocator configuration string; names the key, the value and
// what is accepted.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A device call failed for a reason other than lack of memory.
class DeviceError : public Error {
 public:
  DeviceError(CallKind call, Status status, const std::string& context);
  CallKind call() const noexcept { return call_; }
  Status status() const noexcept { return status_; }

 private:
  CallKind call_;
  Status status_;
};

// The allocator could not satisfy a request after the whole retry ladder.
// The message carries PyTorch's fields.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(const std::string& message, std::size_t requested, std::size_t device_free,
                   std::size_t device_total)
      : Error(message), requested_(requested), free_(device_free), total_(device_total) {}
  std::size_t requested_bytes() const noexcept { return requested_; }
  std::size_t device_free() const noexcept { return free_; }
  std::size_t device_total() const noexcept { return total_; }

 private:
  std::size_t requested_;
  std::size_t free_;
  std::size_t total_;
};

// A pointer the allocator does not own (unknown, or already freed).
class InvalidPointerError : public Error {
 public:
  using Error::Error;
};

// A misuse of the API (unknown pool id, unsupported option, ...).
class UsageError : public Error {
 public:
  using Error::Error;
};

// A backend that cannot run here (no GPU, no driver, no virtual memory
// management); the message says what is missing.
class DeviceUnavailableError : public Error {
 public:
  using Error::Error;
};

// A broken internal invariant found by the validator.
class InvariantError : public Error {
 public:
  using Error::Error;
};

// A trace or pickle that cannot be read; the message names the byte offset or
// line number.
class TraceError : public Error {
 public:
  using Error::Error;
};

}  // namespace reservoir
