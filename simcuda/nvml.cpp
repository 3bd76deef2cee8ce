// The simulated NVML (libnvidia-ml.so.1): the device queries PyTorch makes
// through NVML, answered from the simulated device. NVML's header is not
// part of the CUDA toolkit: its types are written here as NVML defines
// them (return codes, opaque device handles, the memory and process
// records). Any other NVML call is refused (NVML_ERROR_NOT_SUPPORTED).
#include <strings.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "sim.hpp"

using reservoir::simcuda::Sim;

namespace {

constexpr int kSuccess = 0;
constexpr int kInvalidArgument = 2;
constexpr int kNotSupported = 3;
constexpr int kNotFound = 6;
constexpr int kInsufficientSize = 7;

struct NvmlDevice {
  int index;
};
NvmlDevice devices[64];

int index_of(void* device) { return static_cast<NvmlDevice*>(device)->index; }

struct Memory {  // nvmlMemory_t
  unsigned long long total, free, used;
};
struct Process {  // nvmlProcessInfo_t (v2 and later)
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId, computeInstanceId;
};

}  // namespace

extern "C" {

SIMCUDA_API int nvmlInit_v2(void) { return Sim::get().enter("nvmlInit_v2"); }
SIMCUDA_API int nvmlInitWithFlags(unsigned int flags) {
  (void)flags;
  return Sim::get().enter("nvmlInitWithFlags");
}
SIMCUDA_API int nvmlShutdown(void) { return Sim::get().enter("nvmlShutdown"); }

SIMCUDA_API const char* nvmlErrorString(int result) {
  switch (result) {
    case kSuccess: return "Success";
    case kInvalidArgument: return "Invalid Argument";
    case kNotSupported: return Sim::get().refused_text();
    case kNotFound: return "Not Found";
    case kInsufficientSize: return "Insufficient Size";
    default: return "Unknown Error";
  }
}

SIMCUDA_API int nvmlSystemGetCudaDriverVersion_v2(int* version) {
  if (version == nullptr) return kInvalidArgument;
  *version = 13020;
  return Sim::get().enter("nvmlSystemGetCudaDriverVersion_v2");
}
SIMCUDA_API int nvmlSystemGetCudaDriverVersion(int* version) { return nvmlSystemGetCudaDriverVersion_v2(version); }

SIMCUDA_API int nvmlDeviceGetCount_v2(unsigned int* count) {
  if (count == nullptr) return kInvalidArgument;
  *count = static_cast<unsigned int>(Sim::get().device_count());
  return Sim::get().enter("nvmlDeviceGetCount_v2");
}

SIMCUDA_API int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void** device) {
  if (device == nullptr || !Sim::get().valid(static_cast<int>(index))) return kInvalidArgument;
  devices[index].index = static_cast<int>(index);
  *device = &devices[index];
  return Sim::get().enter("nvmlDeviceGetHandleByIndex_v2");
}

// The bus ids cudaDeviceGetPCIBusId gives: 00000000:18:00.0 for device 0.
SIMCUDA_API int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  if (bus_id == nullptr || device == nullptr) return kInvalidArgument;
  for (int d = 0; d < Sim::get().device_count(); ++d) {
    char id[32];
    std::snprintf(id, sizeof id, "00000000:%02X:00.0", 0x18 + d);
    if (strcasecmp(id, bus_id) == 0) return nvmlDeviceGetHandleByIndex_v2(static_cast<unsigned>(d), device);
  }
  return kNotFound;
}

SIMCUDA_API int nvmlDeviceGetUUID(void* device, char* uuid, unsigned int length) {
  if (device == nullptr || uuid == nullptr) return kInvalidArgument;
  const int n = std::snprintf(uuid, length, "GPU-72657365-7276-6f69-7273-696d%08x", index_of(device));
  return n < 0 || static_cast<unsigned>(n) >= length ? kInsufficientSize : Sim::get().enter("nvmlDeviceGetUUID");
}

SIMCUDA_API int nvmlDeviceGetMemoryInfo(void* device, Memory* memory) {
  if (device == nullptr || memory == nullptr) return kInvalidArgument;
  const int d = index_of(device);
  memory->total = Sim::get().capacity(d) + Sim::kDriverReserved;
  memory->used = Sim::get().used(d) + Sim::kDriverReserved;
  memory->free = memory->total - memory->used;
  return Sim::get().enter("nvmlDeviceGetMemoryInfo");
}

// One process uses the simulated device: this one.
SIMCUDA_API int nvmlDeviceGetComputeRunningProcesses_v3(void* device, unsigned int* count, Process* infos) {
  if (device == nullptr || count == nullptr) return kInvalidArgument;
  if (*count < 1 || infos == nullptr) {
    *count = 1;
    return kInsufficientSize;
  }
  *count = 1;
  infos[0] = Process{static_cast<unsigned>(getpid()), Sim::get().used(index_of(device)), 0xFFFFFFFFu,
                     0xFFFFFFFFu};
  return Sim::get().enter("nvmlDeviceGetComputeRunningProcesses_v3");
}

SIMCUDA_API int nvmlDeviceGetComputeRunningProcesses(void* device, unsigned int* count, Process* infos) {
  return nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos);
}
SIMCUDA_API int nvmlDeviceGetHandleByPciBusId(const char* bus_id, void** device) {
  return nvmlDeviceGetHandleByPciBusId_v2(bus_id, device);
}

// The device's place in an NVLink fabric (nvmlGpuFabricInfo_v2/v3: the
// version word holds the record's size): none, as on a GPU outside one,
// which NVML answers with success and the state NOT_SUPPORTED (0). PyTorch
// 2.13 and later ask it before choosing IPC handles for expandable
// segments, and stop at any other answer.
SIMCUDA_API int nvmlDeviceGetGpuFabricInfoV(void* device, unsigned int* info) {
  if (device == nullptr || info == nullptr) return kInvalidArgument;
  const unsigned int size = *info & 0xFFFFFFu;
  constexpr unsigned int kV2Size = 36;  // version, uuid[16], status, cliqueId, state, healthMask
  if (size < kV2Size) return kInvalidArgument;
  std::memset(reinterpret_cast<unsigned char*>(info) + sizeof(unsigned int), 0, size - sizeof(unsigned int));
  return kSuccess;  // status 0 (success), state 0 (not supported), healthMask 0
}

// What the simulated device has no answer for (NVLink, P2P status).
#define SIMCUDA_NVML_REFUSED(name)       \
  SIMCUDA_API int name(void) {           \
    Sim::get().refuse(#name);            \
    return kNotSupported;                \
  }
SIMCUDA_NVML_REFUSED(nvmlDeviceGetHandleByUUID)
SIMCUDA_NVML_REFUSED(nvmlDeviceGetNvLinkRemoteDeviceType)
SIMCUDA_NVML_REFUSED(nvmlDeviceGetNvLinkRemotePciInfo_v2)
SIMCUDA_NVML_REFUSED(nvmlDeviceGetP2PStatus)

}  // extern "C"
