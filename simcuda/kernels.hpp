// Kernels' attributes and occupancy on the simulated device, for the
// runtime's cudaFunc*/cudaOccupancy* calls and the driver's cuFunc*,
// cuKernel* and cuOccupancy* forms (one state, in the driver: a runtime
// function, a CUkernel and a CUfunction of a registered kernel are all its
// host stub's address here).
//
// What a kernel's binary holds (registers, static shared, local and constant
// memory) is not read from its cubin: the simulation answers the resources
// in KernelResources below for every kernel, and says so (docs/simcuda.md).
// What a program sets (the dynamic shared memory a launch may use, the
// carveout, cluster requirements) is kept per kernel and checked as CUDA
// checks it against an H100's limits, and occupancy is worked out from
// those limits as CUDA's occupancy calculator does.
#pragma once

#include <cstddef>

#include "sim.hpp"

namespace reservoir::simcuda {

// The resources answered for a kernel's binary (see above): what an sm_90
// cubin of PyTorch's wheels targets on an H100 (ptx and binary version 90),
// no static shared, constant or local memory, and 32 registers a thread
// (the figure CUDA's occupancy calculator starts from).
struct KernelResources {
  int registers = 32;
  int static_shared = 0;
  int constant = 0;
  int local = 0;
  int ptx_version = 90;
  int binary_version = 90;
};

// An H100's (compute capability 9.0) limits that occupancy is worked out from.
struct OccupancyLimits {
  int max_threads_per_sm = 2048;
  int max_blocks_per_sm = 32;
  int max_threads_per_block = 1024;
  int warp_size = 32;
  int registers_per_sm = 65536;
  int register_unit = 256;  // registers are given to a warp in these
  int max_registers_per_thread = 255;
  int shared_per_sm = 233472;  // 228 KiB
  int shared_per_block_optin = 232448;
  int shared_per_block_default = 49152;
  int shared_reserved_per_block = 1024;
  int shared_unit = 128;
};

// The attributes of a kernel by CUfunction_attribute's numbers (CUDA's ABI;
// the runtime's cudaFuncAttribute agree from 8 on).
enum KernelAttribute : int {
  kMaxThreadsPerBlock = 0,
  kSharedSizeBytes = 1,
  kConstSizeBytes = 2,
  kLocalSizeBytes = 3,
  kNumRegs = 4,
  kPtxVersion = 5,
  kBinaryVersion = 6,
  kCacheModeCa = 7,
};

// Results of the calls below; each layer answers them with its own codes.
enum class KernelCall { kOk, kUnknownKernel, kInvalidValue };

}  // namespace reservoir::simcuda

extern "C" {
// `attribute`: CUfunction_attribute's numbers (KernelAttribute).
SIMCUDA_API reservoir::simcuda::KernelCall reservoir_simcuda_kernel_get(const void* kernel,
                                                                        int attribute, int* value);
SIMCUDA_API reservoir::simcuda::KernelCall reservoir_simcuda_kernel_set(const void* kernel,
                                                                        int attribute, int value);
SIMCUDA_API reservoir::simcuda::KernelCall reservoir_simcuda_kernel_name(const void* kernel,
                                                                         const char** name);
// Blocks of `block_threads` that fit on one multiprocessor with `dynamic_shared`
// bytes each (0 where they cannot run at all, as CUDA answers).
SIMCUDA_API reservoir::simcuda::KernelCall reservoir_simcuda_occupancy(const void* kernel,
                                                                       int block_threads,
                                                                       std::size_t dynamic_shared,
                                                                       int* blocks);
// The most dynamic shared memory each of `blocks` blocks of `block_threads`
// can have on one multiprocessor.
SIMCUDA_API reservoir::simcuda::KernelCall reservoir_simcuda_available_shared(const void* kernel,
                                                                              int blocks,
                                                                              int block_threads,
                                                                              std::size_t* bytes);
}
