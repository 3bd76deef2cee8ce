// The CUDA backends when reservoir was built without CUDA's headers: they
// exist, and say why they cannot be used.
#include "reservoir/cuda_device.hpp"

namespace reservoir {

namespace {
constexpr const char* kWhy = "reservoir was built without CUDA (cuda.h was not found at build time)";
}

std::string cuda_unavailable_reason() { return kWhy; }
std::unique_ptr<CudaRuntimeDevice> CudaRuntimeDevice::open(int) { throw DeviceUnavailableError(kWhy); }
std::unique_ptr<CudaPinnedMemory> CudaPinnedMemory::open() { throw DeviceUnavailableError(kWhy); }
std::unique_ptr<CudaVmmDevice> CudaVmmDevice::open(const CudaVmmOptions&) {
  throw DeviceUnavailableError(kWhy);
}

}  // namespace reservoir
