// Opening a device by name, as the integrations (C API, PyTorch plug-in,
// Python module) and the tools let a user choose one: "sim", "host",
// "cuda-runtime" or "cuda-vmm".
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "reservoir/device.hpp"

namespace reservoir {

enum class DeviceKind { sim, host, cuda_runtime, cuda_vmm };

// "sim", "host", "cuda-runtime", "cuda-vmm".
std::string_view to_string(DeviceKind kind) noexcept;
// Throws UsageError naming the text and the accepted kinds.
DeviceKind parse_device_kind(std::string_view text);

struct OpenDeviceOptions {
  int index = 0;                // the GPU (cuda-*)
  std::size_t capacity = 0;     // sim, host: 0 for the backend's default
  std::size_t granularity = 0;  // sim, host: 0 for the backend's default
};

// A simulated device completes its events at once (nothing runs on it to
// wait for). Throws DeviceUnavailableError where a CUDA backend cannot be
// opened, UsageError for a bad option.
std::unique_ptr<Device> open_device(DeviceKind kind, const OpenDeviceOptions& options = {});
std::unique_ptr<Device> open_device(std::string_view kind, const OpenDeviceOptions& options = {});

}  // namespace reservoir
