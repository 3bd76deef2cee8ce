// The simulated device's cuBLAS and cuBLASLt (libcublas.so.13,
// libcublasLt.so.13): handles as cuBLAS makes them (creation, stream,
// workspace, math and pointer modes, destruction), and no math. A call that
// computes (a GEMM, a dot product, a solve...) is a kernel launch here: with
// kernels allowed (RESERVOIR_SIMCUDA_KERNELS=skip) it succeeds without
// computing, as a skipped kernel does; otherwise it is refused, naming the
// call (CUBLAS_STATUS_NOT_SUPPORTED), as a launch is. Every other name
// either library exports behaves so too (gen_stubs.py: exports/cublas.txt,
// exports/cublasLt.txt). The runtime loads both with itself, so PyTorch's
// libraries bind to them by soname, as to the runtime.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdint>

#include "handles.hpp"
#include "sim.hpp"

using reservoir::simcuda::Sim;

namespace {

struct Handle {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  cublasPointerMode_t pointer = CUBLAS_POINTER_MODE_HOST;
  cublasAtomicsMode_t atomics = CUBLAS_ATOMICS_NOT_ALLOWED;
  int sm_count_target = 0;
};

reservoir::simcuda::Handles<Handle>& handles() {
  static reservoir::simcuda::Handles<Handle> all;
  return all;
}

// `f` on the handle's state; a destroyed or foreign handle is not initialized.
template <typename F>
cublasStatus_t with(cublasHandle_t handle, F&& f) {
  Handle* h = handles().find(handle);
  return h == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : f(*h);
}

// Sets, or reads into *out, one field of a handle's state.
template <typename V>
cublasStatus_t set(cublasHandle_t handle, V Handle::*field, V value) {
  return with(handle, [&](Handle& h) {
    h.*field = value;
    return CUBLAS_STATUS_SUCCESS;
  });
}
template <typename V>
cublasStatus_t get(cublasHandle_t handle, V Handle::*field, V* out) {
  return with(handle, [&](Handle& h) {
    if (out == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *out = h.*field;
    return CUBLAS_STATUS_SUCCESS;
  });
}

constexpr int kVersion = 130400;  // cuBLAS 13.4, as the wheel PyTorch 2.15 ships

const char* status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

}  // namespace

extern "C" {

// What the generated stubs call: a skipped kernel's success, or the refusal.
SIMCUDA_API int reservoir_simcublas_refuse(const char* name) { return reservoir::simcuda::skipped_or_refused(name); }

SIMCUDA_API cublasStatus_t cublasCreate_v2(cublasHandle_t* out) {
  if (out == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *out = reinterpret_cast<cublasHandle_t>(handles().make());
  return *out == nullptr ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  return handles().destroy(handle) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
SIMCUDA_API cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  return set(handle, &Handle::stream, stream);
}
SIMCUDA_API cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
  return get(handle, &Handle::stream, stream);
}
// The workspace is the caller's memory, kept by the handle (cuBLAS asks for
// 256-byte alignment).
SIMCUDA_API cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  return with(handle, [&](Handle& h) {
    if (bytes != 0 && (workspace == nullptr || reinterpret_cast<std::uintptr_t>(workspace) % 256 != 0)) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    h.workspace = workspace;
    h.workspace_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
  });
}
SIMCUDA_API cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  return set(handle, &Handle::math, mode);
}
SIMCUDA_API cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  return get(handle, &Handle::math, mode);
}
SIMCUDA_API cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  return set(handle, &Handle::pointer, mode);
}
SIMCUDA_API cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
  return get(handle, &Handle::pointer, mode);
}
SIMCUDA_API cublasStatus_t cublasSetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t mode) {
  return set(handle, &Handle::atomics, mode);
}
SIMCUDA_API cublasStatus_t cublasSetSmCountTarget(cublasHandle_t handle, int target) {
  return with(handle, [&](Handle& h) {
    if (target < 0) return CUBLAS_STATUS_INVALID_VALUE;
    h.sm_count_target = target;
    return CUBLAS_STATUS_SUCCESS;
  });
}
SIMCUDA_API cublasStatus_t cublasGetSmCountTarget(cublasHandle_t handle, int* target) {
  return get(handle, &Handle::sm_count_target, target);
}
SIMCUDA_API cublasStatus_t cublasGetVersion_v2(cublasHandle_t handle, int* version) {
  (void)handle;
  if (version == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *version = kVersion;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasGetProperty(libraryPropertyType type, int* value) {
  if (value == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (type) {
    case MAJOR_VERSION: *value = kVersion / 10000; break;
    case MINOR_VERSION: *value = kVersion / 100 % 100; break;
    case PATCH_LEVEL: *value = kVersion % 100; break;
    default: return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API size_t cublasGetCudartVersion(void) { return 13000; }
SIMCUDA_API const char* cublasGetStatusName(cublasStatus_t status) { return status_name(status); }
SIMCUDA_API const char* cublasGetStatusString(cublasStatus_t status) { return status_name(status); }

}  // extern "C"
