// The processes NVML lists on a device, for the out-of-memory message
// PyTorch writes ("Including non-PyTorch memory, this process has ...").
// NVML is opened at run time (libnvidia-ml.so.1, the driver's), as PyTorch
// opens it; its header is not part of the CUDA toolkit, so the few types
// used are written here as NVML defines them.
#include <dlfcn.h>

#include <mutex>
#include <string>
#include <vector>

#include "cuda_api.hpp"

namespace reservoir {
namespace {

constexpr int kNvmlSuccess = 0;
constexpr int kNvmlInsufficientSize = 7;

// nvmlProcessInfo_t as nvmlDeviceGetComputeRunningProcesses_v3 fills it.
struct NvmlProcessInfo {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};

struct Nvml {
  int (*init)() = nullptr;
  int (*handle_by_bus_id)(const char*, void**) = nullptr;
  int (*running_processes)(void*, unsigned int*, NvmlProcessInfo*) = nullptr;
  bool ok = false;
};

const Nvml& nvml() {
  static Nvml n;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;  // no driver's NVML: nothing listed
    n.init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    n.handle_by_bus_id =
        reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    n.running_processes = reinterpret_cast<int (*)(void*, unsigned int*, NvmlProcessInfo*)>(
        dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
    n.ok = n.init != nullptr && n.handle_by_bus_id != nullptr && n.running_processes != nullptr &&
           n.init() == kNvmlSuccess;
  });
  return n;
}

}  // namespace

Status nvml_running_processes(int device, std::vector<ProcessMemory>* out) noexcept {
  if (out == nullptr) return Status::invalid_argument;
  const CudaRuntimeApi* runtime = load_cuda_runtime(nullptr);
  if (runtime == nullptr || runtime->cudaDeviceGetPCIBusId == nullptr) return Status::not_supported;
  const Nvml& n = nvml();
  if (!n.ok) return Status::not_supported;
  char bus_id[80] = {};
  if (runtime->cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) != cudaSuccess) {
    return Status::device_error;
  }
  void* handle = nullptr;
  if (n.handle_by_bus_id(bus_id, &handle) != kNvmlSuccess) return Status::device_error;
  try {
    std::vector<NvmlProcessInfo> infos(8);
    for (;;) {
      auto count = static_cast<unsigned int>(infos.size());
      const int r = n.running_processes(handle, &count, infos.data());
      if (r == kNvmlInsufficientSize) {
        infos.resize(count + 4);  // processes may start in between
        continue;
      }
      if (r != kNvmlSuccess) return Status::device_error;
      out->clear();
      for (unsigned int i = 0; i < count; ++i) out->push_back({infos[i].pid, infos[i].usedGpuMemory});
      return Status::ok;
    }
  } catch (...) {
    return Status::out_of_memory;  // host memory
  }
}

}  // namespace reservoir
