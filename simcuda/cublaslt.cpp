// The simulated device's cuBLASLt (libcublasLt.so.13): handles, versions and
// the heuristic's answer, which a program must have before it can ask for a
// matmul; the matmul itself and every other call are refused unless kernels
// are allowed, then taken without computing (see cublas.cpp).
#include <cublasLt.h>

#include <cstring>

#include "handles.hpp"
#include "sim.hpp"

using reservoir::simcuda::Sim;

namespace {

struct LtHandle {};

reservoir::simcuda::Handles<LtHandle>& handles() {
  static reservoir::simcuda::Handles<LtHandle> all;
  return all;
}

constexpr size_t kVersion = 130400;

}  // namespace

extern "C" {

SIMCUDA_API int reservoir_simcublaslt_refuse(const char* name) { return reservoir::simcuda::skipped_or_refused(name); }

SIMCUDA_API cublasStatus_t cublasLtCreate(cublasLtHandle_t* out) {
  if (out == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *out = reinterpret_cast<cublasLtHandle_t>(handles().make());
  return *out == nullptr ? CUBLAS_STATUS_ALLOC_FAILED : CUBLAS_STATUS_SUCCESS;
}
SIMCUDA_API cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
  return handles().destroy(handle) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
SIMCUDA_API size_t cublasLtGetVersion(void) { return kVersion; }
SIMCUDA_API size_t cublasLtGetCudartVersion(void) { return 13000; }
SIMCUDA_API cublasStatus_t cublasLtGetProperty(libraryPropertyType type, int* value) {
  if (value == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (type) {
    case MAJOR_VERSION: *value = static_cast<int>(kVersion / 10000); break;
    case MINOR_VERSION: *value = static_cast<int>(kVersion / 100 % 100); break;
    case PATCH_LEVEL: *value = static_cast<int>(kVersion % 100); break;
    default: return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}
// One algorithm that needs no workspace, when kernels are allowed (the
// matmul it leads to is a skipped kernel); refused otherwise.
SIMCUDA_API cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t op,
                                                          cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                          cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                                          cublasLtMatmulPreference_t preference, int requested,
                                                          cublasLtMatmulHeuristicResult_t results[], int* returned) {
  (void)handle, (void)op, (void)a, (void)b, (void)c, (void)d, (void)preference;
  if (!Sim::get().allow_kernels()) {
    return static_cast<cublasStatus_t>(reservoir_simcublaslt_refuse("cublasLtMatmulAlgoGetHeuristic"));
  }
  if (returned == nullptr || (requested > 0 && results == nullptr)) return CUBLAS_STATUS_INVALID_VALUE;
  *returned = requested > 0 ? 1 : 0;
  if (requested > 0) {
    std::memset(&results[0], 0, sizeof results[0]);
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0F;
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
