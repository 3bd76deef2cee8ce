// Device attributes of the simulated device, as an H100 SXM reports them
// (the driver's and the runtime's attribute numbers agree). An attribute
// not in the table is refused, naming its number: never a made-up zero.
#include <cuda.h>

#include <string>

#include "sim.hpp"

using reservoir::simcuda::Sim;

SIMCUDA_API int reservoir_simcuda_attribute(int attribute, int device, int* value) {
  if (!Sim::get().valid(device)) return reservoir::simcuda::kInvalidDevice;
  int v = 0;
  switch (static_cast<CUdevice_attribute>(attribute)) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = 2147483647; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = 132; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = 0x18 + device; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 52428800; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 2; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: v = 233472; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: v = 232448; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE: v = 32505856; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED: v = 0; break;
    default: {
      // Past the last attribute CUDA knows: an invalid value, as the driver says.
      if (attribute < 0 || attribute >= CU_DEVICE_ATTRIBUTE_MAX)
        return reservoir::simcuda::kInvalidValue;
      const std::string what = "cudaDeviceGetAttribute / cuDeviceGetAttribute of attribute " + std::to_string(attribute);
      return Sim::get().refuse(what.c_str());
    }
  }
  *value = v;
  return reservoir::simcuda::kSuccess;
}
