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

#include <cstring>
#include <mutex>
#include <new>
#include <unordered_set>

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

// The handles alive (a destroyed or foreign one is not initialized, as cuBLAS says).
std::mutex handles_mutex;
std::unordered_set<const void*>& live() {
  static std::unordered_set<const void*> handles;
  return handles;
}

Handle* handle_of(cublasHandle_t h) {
  std::lock_guard<std::mutex> lock(handles_mutex);
  return live().count(h) != 0 ? reinterpret_cast<Handle*>(h) : nullptr;
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
SIMCUDA_API int reservoir_simcublas_refuse(const char* name) {
  if (Sim::get().allow_kernels()) return CUBLAS_STATUS_SUCCESS;
  (void)Sim::get().refuse(name);
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

SIMCUDA_API cublasStatus_t cublasCreate_v2(cublasHandle_t* out) {
  if (out == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* h = new (std::nothrow) Handle;
  if (h == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
  std::lock_guard<std::mutex> lock(handles_mutex);
  live().insert(h);
  *out = reinterpret_cast<cublasHandle_t>(h);
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  std::lock_guard<std::mutex> lock(handles_mutex);
  if (live().erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete reinterpret_cast<Handle*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t* stream) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = h->stream;
  return CUBLAS_STATUS_SUCCESS;
}
// The workspace is the caller's memory, kept by the handle (cuBLAS asks for
// 256-byte alignment).
SIMCUDA_API cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes != 0 && (workspace == nullptr || reinterpret_cast<std::uintptr_t>(workspace) % 256 != 0)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  h->workspace = workspace;
  h->workspace_bytes = bytes;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = h->math;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->pointer = mode;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t* mode) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = h->pointer;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasSetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t mode) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->atomics = mode;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasSetSmCountTarget(cublasHandle_t handle, int target) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (target < 0) return CUBLAS_STATUS_INVALID_VALUE;
  h->sm_count_target = target;
  return CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasGetSmCountTarget(cublasHandle_t handle, int* target) {
  Handle* h = handle_of(handle);
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (target == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *target = h->sm_count_target;
  return CUBLAS_STATUS_SUCCESS;
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
