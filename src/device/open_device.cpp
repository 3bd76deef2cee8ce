#include "reservoir/open_device.hpp"

#include <fmt/format.h>

#include "reservoir/cuda_device.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir {

std::string_view to_string(DeviceKind kind) noexcept {
  switch (kind) {
    case DeviceKind::sim: return "sim";
    case DeviceKind::host: return "host";
    case DeviceKind::cuda_runtime: return "cuda-runtime";
    case DeviceKind::cuda_vmm: return "cuda-vmm";
  }
  return "unknown";
}

DeviceKind parse_device_kind(std::string_view text) {
  for (DeviceKind k : {DeviceKind::sim, DeviceKind::host, DeviceKind::cuda_runtime, DeviceKind::cuda_vmm}) {
    if (text == to_string(k)) return k;
  }
  throw UsageError(
      fmt::format("unknown device kind '{}' (sim, host, cuda-runtime, cuda-vmm)", text));
}

std::unique_ptr<Device> open_device(DeviceKind kind, const OpenDeviceOptions& options) {
  switch (kind) {
    case DeviceKind::sim: {
      SimDeviceOptions o;
      if (options.capacity != 0) o.capacity = options.capacity;
      if (options.granularity != 0) o.granularity = options.granularity;
      o.auto_complete_events = true;
      return std::make_unique<SimDevice>(o);
    }
    case DeviceKind::host: {
      HostDeviceOptions o;
      if (options.capacity != 0) o.capacity = options.capacity;
      if (options.granularity != 0) o.granularity = options.granularity;
      return std::make_unique<HostDevice>(o);
    }
    case DeviceKind::cuda_runtime:
      return CudaRuntimeDevice::open(options.index);
    case DeviceKind::cuda_vmm:
      return CudaVmmDevice::open({.device = options.index, .peers = {}, .gpu_direct_rdma = true});
  }
  throw UsageError(fmt::format("open_device: invalid device kind {}", static_cast<int>(kind)));
}

std::unique_ptr<Device> open_device(std::string_view kind, const OpenDeviceOptions& options) {
  return open_device(parse_device_kind(kind), options);
}

}  // namespace reservoir
