// The simulated device's cuDNN (libcudnn.so.9): handles and their streams,
// versions and error strings, and the legacy descriptor API PyTorch calls
// (tensors, filters, convolutions, activations, pooling, dropout, RNNs and
// their data, spatial transformers, CTC loss), with the size queries that
// decide what PyTorch asks its allocator for (cudnn_model.hpp). The backend
// (graph) API is cudnn_backend.cpp. No math: a call that computes is a
// kernel here, taken without computing when kernels are allowed
// (RESERVOIR_SIMCUDA_KERNELS=skip) and otherwise refused, naming the call
// (CUDNN_STATUS_NOT_SUPPORTED), as a launch is. Every other name the real
// library exports refuses so too (gen_stubs.py: exports/cudnn.txt). The
// runtime loads it with itself, so PyTorch binds to it by soname.
#include <cudnn.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cudnn_internal.hpp"
#include "cudnn_model.hpp"
#include "handles.hpp"

namespace model = reservoir::simcuda::cudnn;
using reservoir::simcuda::Handles;
using reservoir::simcuda::Sim;

namespace {

struct Handle {
  cudaStream_t stream = nullptr;
};
struct TensorDesc {
  model::Shape shape;
  bool set = false;
};
struct FilterDesc {
  int data_type = 0;
  int format = 0;
  std::vector<int> dims;
  bool set = false;
};
struct ConvDesc {
  std::vector<int> pads, strides, dilations;
  int mode = 0, compute = 0, groups = 1, math = 0;
};
struct ActivationDesc {
  int mode = 0, nan = 0;
  double coef = 0;
};
struct PoolingDesc {
  int mode = 0;
};
struct DropoutDesc {
  float dropout = 0;
  void* states = nullptr;
  std::size_t state_bytes = 0;
  unsigned long long seed = 0;
};
struct RnnDesc {
  model::Rnn rnn;
  bool set = false;
};
struct RnnDataDesc {
  int data_type = 0, layout = 0, max_sequence = 0, batch = 0, vector = 0;
  bool set = false;
};
struct OpaqueDesc {};  // spatial transformers, CTC loss: accepted, never read

template <typename T>
Handles<T>& all() {
  static Handles<T> h;
  return h;
}

// Makes a descriptor of type T into *out, as cudnnCreate* does.
template <typename T, typename Out>
cudnnStatus_t create(Out* out) {
  if (out == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  T* made = all<T>().make();
  if (made == nullptr) return CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED;
  *out = reinterpret_cast<Out>(made);
  return CUDNN_STATUS_SUCCESS;
}
template <typename T>
cudnnStatus_t destroy(const void* d) {
  if (d == nullptr) return CUDNN_STATUS_SUCCESS;  // cuDNN takes a null descriptor
  return all<T>().destroy(d) ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_BAD_PARAM;
}
template <typename T>
T* find(const void* d) {
  return d == nullptr ? nullptr : all<T>().find(d);
}

thread_local std::string last_error;

cudnnStatus_t fail(cudnnStatus_t status, const std::string& what) {
  last_error = what;
  return status;
}

std::vector<std::int64_t> to64(const int* a, int n) {
  return std::vector<std::int64_t>(a, a + n);
}

model::Shape shape_of(cudnnTensorDescriptor_t t) {
  const TensorDesc* d = find<TensorDesc>(t);
  return d != nullptr ? d->shape : model::Shape{};
}

const char* status_name(cudnnStatus_t s) {
  switch (s) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH:
      return "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_BAD_PARAM_NULL_POINTER: return "CUDNN_STATUS_BAD_PARAM_NULL_POINTER";
    case CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER:
      return "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER";
    case CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED: return "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED";
    case CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND: return "CUDNN_STATUS_BAD_PARAM_OUT_OF_BOUND";
    case CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT:
      return "CUDNN_STATUS_BAD_PARAM_SIZE_INSUFFICIENT";
    case CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH: return "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH";
    case CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES:
      return "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES";
    case CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE: return "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE";
    case CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE: return "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE";
    case CUDNN_STATUS_NOT_SUPPORTED:
      return "CUDNN_STATUS_NOT_SUPPORTED (reservoir's simulated CUDA device: see "
             "cudnnGetLastErrorString)";
    case CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN:
      return "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN";
    case CUDNN_STATUS_NOT_SUPPORTED_SHAPE: return "CUDNN_STATUS_NOT_SUPPORTED_SHAPE";
    case CUDNN_STATUS_INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
    case CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED:
      return "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
    default: return "CUDNN_STATUS_UNKNOWN";
  }
}

// The exported calls that compute: the forward and backward passes of every
// layer cuDNN has, its tensor operations, and the Find* calls (which time
// kernels). Their arguments are never read: each is a kernel launch.
bool computes(const std::string& name) {
  static const char* const kSuffixes[] = {
      "Forward",           "Backward",        "ForwardInference",   "ForwardTraining",
      "ForwardTrainingEx", "BackwardEx",      "BackwardData",       "BackwardFilter",
      "BackwardBias",      "BackwardData_v8", "BackwardWeights_v8", "BackwardWeights"};
  static const char* const kNames[] = {"cudnnAddTensor",
                                       "cudnnOpTensor",
                                       "cudnnReduceTensor",
                                       "cudnnScaleTensor",
                                       "cudnnSetTensor",
                                       "cudnnTransformTensor",
                                       "cudnnTransformTensorEx",
                                       "cudnnTransformFilter",
                                       "cudnnIm2Col",
                                       "cudnnCTCLoss",
                                       "cudnnCTCLoss_v8",
                                       "cudnnFusedOpsExecute",
                                       "cudnnReorderFilterAndBias"};
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  if (name.rfind("cudnnFind", 0) == 0) return true;
  for (const char* suffix : kSuffixes) {
    const std::size_t n = std::strlen(suffix);
    if (name.size() > n && name.compare(name.size() - n, n, suffix) == 0) return true;
  }
  return false;
}

// A size query's answer: a live handle and somewhere to write it, or a bad
// parameter.
template <typename F>
cudnnStatus_t sized(cudnnHandle_t h, size_t* bytes, F&& size) {
  if (!reservoir::simcuda::cudnn::valid_handle(h) || bytes == nullptr)
    return CUDNN_STATUS_BAD_PARAM;
  *bytes = size();
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace

namespace reservoir::simcuda::cudnn {

cudnnStatus_t kernel(const char* name) {
  if (Sim::get().allow_kernels()) return CUDNN_STATUS_SUCCESS;
  (void)Sim::get().refuse(name);
  return fail(CUDNN_STATUS_NOT_SUPPORTED,
              std::string(name) +
                  " computes: a kernel, refused by reservoir's simulated CUDA device "
                  "(RESERVOIR_SIMCUDA_KERNELS=skip takes it without computing)");
}

bool valid_handle(cudnnHandle_t h) {
  return find<Handle>(h) != nullptr;
}

void set_last_error(const std::string& what) {
  last_error = what;
}

}  // namespace reservoir::simcuda::cudnn

using model::kernel;

extern "C" {

// What the generated stubs call: a call that computes is a kernel
// (computes()); every other name the simulation does not serve is refused,
// naming it.
SIMCUDA_API int reservoir_simcudnn_refuse(const char* name) {
  if (computes(name)) return kernel(name);
  (void)Sim::get().refuse(name);
  (void)fail(CUDNN_STATUS_NOT_SUPPORTED,
             std::string(name) + " is not served by reservoir's simulated CUDA device");
  return CUDNN_STATUS_NOT_SUPPORTED;
}

// ---- the library and its handles -----------------------------------------

SIMCUDA_API size_t cudnnGetVersion(void) {
  return model::version();
}
SIMCUDA_API size_t cudnnGetMaxDeviceVersion(void) {
  return CUDNN_MAX_DEVICE_VERSION;
}
SIMCUDA_API size_t cudnnGetCudartVersion(void) {
  return CUDART_VERSION;
}
SIMCUDA_API cudnnStatus_t cudnnGetProperty(libraryPropertyType type, int* value) {
  if (value == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  const auto v = static_cast<int>(model::version());
  switch (type) {
    case MAJOR_VERSION: *value = v / 10000; break;
    case MINOR_VERSION: *value = v / 100 % 100; break;
    case PATCH_LEVEL: *value = v % 100; break;
    default: return CUDNN_STATUS_BAD_PARAM;
  }
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API const char* cudnnGetErrorString(cudnnStatus_t status) {
  return status_name(status);
}
SIMCUDA_API void cudnnGetLastErrorString(char* message, size_t max_size) {
  if (message == nullptr || max_size == 0) return;
  std::snprintf(message, max_size, "%s", last_error.c_str());
  last_error.clear();
}
// The sub-libraries are this one library: their versions always agree.
SIMCUDA_API cudnnStatus_t cudnnGraphVersionCheck(void) {
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnOpsVersionCheck(void) {
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnCnnVersionCheck(void) {
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnAdvVersionCheck(void) {
  return CUDNN_STATUS_SUCCESS;
}

SIMCUDA_API cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) {
  if (const int injected = Sim::get().enter("cudnnCreate", false)) {
    (void)injected;
    return fail(CUDNN_STATUS_NOT_INITIALIZED, "cudnnCreate: injected failure");
  }
  return create<Handle>(handle);
}
SIMCUDA_API cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
  return all<Handle>().destroy(handle) ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_BAD_PARAM;
}
SIMCUDA_API cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream) {
  Handle* h = find<Handle>(handle);
  if (h == nullptr) return CUDNN_STATUS_BAD_PARAM;
  h->stream = stream;
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnGetStream(cudnnHandle_t handle, cudaStream_t* stream) {
  Handle* h = find<Handle>(handle);
  if (h == nullptr) return CUDNN_STATUS_BAD_PARAM;
  if (stream == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  *stream = h->stream;
  return CUDNN_STATUS_SUCCESS;
}

// ---- tensors and filters ---------------------------------------------------

SIMCUDA_API cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d) {
  return create<TensorDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) {
  return destroy<TensorDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetTensorNdDescriptor(cudnnTensorDescriptor_t desc,
                                                     cudnnDataType_t type, int n, const int dims[],
                                                     const int strides[]) {
  TensorDesc* d = find<TensorDesc>(desc);
  if (d == nullptr) return CUDNN_STATUS_BAD_PARAM;
  if (n < 0 || n > CUDNN_DIM_MAX || (n > 0 && (dims == nullptr || strides == nullptr))) {
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetTensorNdDescriptor: bad dimensions");
  }
  for (int i = 0; i < n; ++i) {
    if (dims[i] <= 0 || strides[i] <= 0) {
      return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetTensorNdDescriptor: dimension " +
                                              std::to_string(i) + " or its stride is not positive");
    }
  }
  d->shape = model::Shape{type, to64(dims, n), to64(strides, n)};
  d->set = true;
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t desc,
                                                     cudnnTensorFormat_t format,
                                                     cudnnDataType_t type, int n, int c, int h,
                                                     int w) {
  const int dims[4] = {n, c, h, w};
  const int nchw[4] = {c * h * w, h * w, w, 1};
  const int nhwc[4] = {c * h * w, 1, w * c, c};
  return cudnnSetTensorNdDescriptor(desc, type, 4, dims, format == CUDNN_TENSOR_NHWC ? nhwc : nchw);
}
SIMCUDA_API cudnnStatus_t cudnnGetTensorNdDescriptor(const cudnnTensorDescriptor_t desc,
                                                     int requested, cudnnDataType_t* type, int* n,
                                                     int dims[], int strides[]) {
  const TensorDesc* d = find<TensorDesc>(desc);
  if (d == nullptr) return CUDNN_STATUS_BAD_PARAM;
  if (type != nullptr) *type = static_cast<cudnnDataType_t>(d->shape.data_type);
  if (n != nullptr) *n = static_cast<int>(d->shape.dims.size());
  for (int i = 0; i < requested && i < static_cast<int>(d->shape.dims.size()); ++i) {
    if (dims != nullptr) dims[i] = static_cast<int>(d->shape.dims[static_cast<std::size_t>(i)]);
    if (strides != nullptr)
      strides[i] = static_cast<int>(d->shape.strides[static_cast<std::size_t>(i)]);
  }
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnGetTensorSizeInBytes(const cudnnTensorDescriptor_t desc,
                                                    size_t* bytes) {
  const TensorDesc* d = find<TensorDesc>(desc);
  if (d == nullptr || bytes == nullptr) return CUDNN_STATUS_BAD_PARAM;
  std::size_t span = 1;
  for (std::size_t i = 0; i < d->shape.dims.size(); ++i) {
    span += static_cast<std::size_t>((d->shape.dims[i] - 1) * d->shape.strides[i]);
  }
  *bytes = d->shape.dims.empty() ? 0 : span * model::element_bytes(d->shape.data_type);
  return CUDNN_STATUS_SUCCESS;
}

SIMCUDA_API cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d) {
  return create<FilterDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) {
  return destroy<FilterDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetFilterNdDescriptor(cudnnFilterDescriptor_t desc,
                                                     cudnnDataType_t type,
                                                     cudnnTensorFormat_t format, int n,
                                                     const int dims[]) {
  FilterDesc* d = find<FilterDesc>(desc);
  if (d == nullptr) return CUDNN_STATUS_BAD_PARAM;
  if (n < 0 || n > CUDNN_DIM_MAX || (n > 0 && dims == nullptr)) return CUDNN_STATUS_BAD_PARAM;
  d->data_type = type, d->format = format, d->dims.assign(dims, dims + n), d->set = true;
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnGetFilterNdDescriptor(const cudnnFilterDescriptor_t desc,
                                                     int requested, cudnnDataType_t* type,
                                                     cudnnTensorFormat_t* format, int* n,
                                                     int dims[]) {
  const FilterDesc* d = find<FilterDesc>(desc);
  if (d == nullptr) return CUDNN_STATUS_BAD_PARAM;
  if (type != nullptr) *type = static_cast<cudnnDataType_t>(d->data_type);
  if (format != nullptr) *format = static_cast<cudnnTensorFormat_t>(d->format);
  if (n != nullptr) *n = static_cast<int>(d->dims.size());
  for (int i = 0; i < requested && i < static_cast<int>(d->dims.size()) && dims != nullptr; ++i) {
    dims[i] = d->dims[static_cast<std::size_t>(i)];
  }
  return CUDNN_STATUS_SUCCESS;
}

// ---- convolutions (the legacy API: PyTorch's TORCH_CUDNN_V8_API_DISABLED path) ----

SIMCUDA_API cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d) {
  return create<ConvDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) {
  return destroy<ConvDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetConvolutionNdDescriptor(cudnnConvolutionDescriptor_t desc, int n,
                                                          const int pads[], const int strides[],
                                                          const int dilations[],
                                                          cudnnConvolutionMode_t mode,
                                                          cudnnDataType_t compute) {
  ConvDesc* d = find<ConvDesc>(desc);
  if (d == nullptr || n <= 0 || pads == nullptr || strides == nullptr || dilations == nullptr) {
    return CUDNN_STATUS_BAD_PARAM;
  }
  d->pads.assign(pads, pads + n), d->strides.assign(strides, strides + n),
      d->dilations.assign(dilations, dilations + n);
  d->mode = mode, d->compute = compute;
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t desc,
                                                        int groups) {
  ConvDesc* d = find<ConvDesc>(desc);
  if (d == nullptr || groups <= 0) return CUDNN_STATUS_BAD_PARAM;
  d->groups = groups;
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t desc,
                                                      cudnnMathType_t math) {
  ConvDesc* d = find<ConvDesc>(desc);
  if (d == nullptr) return CUDNN_STATUS_BAD_PARAM;
  d->math = math;
  return CUDNN_STATUS_SUCCESS;
}

}  // extern "C"

namespace {

// The legacy algorithms map onto the backend's two engines: implicit
// precomputed GEMM is the tensor-core one (its workspace), implicit GEMM
// the CUDA-core one (none).
model::GraphSummary legacy_graph(cudnnTensorDescriptor_t x, cudnnFilterDescriptor_t w,
                                 cudnnTensorDescriptor_t y) {
  model::GraphSummary g;
  g.convolutions_forward = 1;
  g.x = shape_of(x);
  g.y = shape_of(y);
  if (const FilterDesc* f = find<FilterDesc>(w)) {
    g.w.data_type = f->data_type;
    g.w.dims.assign(f->dims.begin(), f->dims.end());
  }
  g.data_type = g.x.data_type;
  return g;
}

template <typename Perf, typename Algo>
cudnnStatus_t legacy_algorithms(cudnnHandle_t h, const model::GraphSummary& g, Algo tensor_core,
                                Algo cuda_core, int requested, int* returned, Perf* results) {
  if (!model::valid_handle(h)) return CUDNN_STATUS_BAD_PARAM;
  if (returned == nullptr || results == nullptr || requested <= 0) return CUDNN_STATUS_BAD_PARAM;
  const Algo algos[2] = {tensor_core, cuda_core};
  const std::int64_t engines[2] = {0, 1};
  int n = 0;
  for (int i = 0; i < 2 && n < requested; ++i, ++n) {
    results[n] = Perf{};
    results[n].algo = algos[i];
    results[n].status = CUDNN_STATUS_SUCCESS;
    results[n].time = -1;
    results[n].memory = model::plan_workspace(g, engines[i]);
    results[n].determinism = CUDNN_DETERMINISTIC;
    results[n].mathType = i == 0 ? CUDNN_TENSOR_OP_MATH : CUDNN_DEFAULT_MATH;
  }
  *returned = n;
  return CUDNN_STATUS_SUCCESS;
}

template <typename Algo>
std::size_t legacy_workspace(const model::GraphSummary& g, Algo algo, Algo tensor_core) {
  return model::plan_workspace(g, algo == tensor_core ? 0 : 1);
}

}  // namespace

extern "C" {

SIMCUDA_API cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(
    cudnnHandle_t h, const cudnnTensorDescriptor_t x, const cudnnFilterDescriptor_t w,
    const cudnnConvolutionDescriptor_t conv, const cudnnTensorDescriptor_t y, const int requested,
    int* returned, cudnnConvolutionFwdAlgoPerf_t* out) {
  (void)conv;
  return legacy_algorithms(h, legacy_graph(x, w, y),
                           CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
                           CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, requested, returned, out);
}
SIMCUDA_API cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t h, const cudnnFilterDescriptor_t w, const cudnnTensorDescriptor_t dy,
    const cudnnConvolutionDescriptor_t conv, const cudnnTensorDescriptor_t dx, const int requested,
    int* returned, cudnnConvolutionBwdDataAlgoPerf_t* out) {
  (void)conv;
  return legacy_algorithms(h, legacy_graph(dx, w, dy), CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
                           CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, requested, returned, out);
}
SIMCUDA_API cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t h, const cudnnTensorDescriptor_t x, const cudnnTensorDescriptor_t dy,
    const cudnnConvolutionDescriptor_t conv, const cudnnFilterDescriptor_t dw, const int requested,
    int* returned, cudnnConvolutionBwdFilterAlgoPerf_t* out) {
  (void)conv;
  return legacy_algorithms(h, legacy_graph(x, dw, dy), CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
                           CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, requested, returned, out);
}
SIMCUDA_API cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(
    cudnnHandle_t h, const cudnnTensorDescriptor_t x, const cudnnFilterDescriptor_t w,
    const cudnnConvolutionDescriptor_t conv, const cudnnTensorDescriptor_t y,
    cudnnConvolutionFwdAlgo_t algo, size_t* bytes) {
  (void)conv;
  return sized(h, bytes, [&] {
    return legacy_workspace(legacy_graph(x, w, y), algo,
                            CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM);
  });
}
SIMCUDA_API cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(
    cudnnHandle_t h, const cudnnFilterDescriptor_t w, const cudnnTensorDescriptor_t dy,
    const cudnnConvolutionDescriptor_t conv, const cudnnTensorDescriptor_t dx,
    cudnnConvolutionBwdDataAlgo_t algo, size_t* bytes) {
  (void)conv;
  return sized(h, bytes, [&] {
    return legacy_workspace(legacy_graph(dx, w, dy), algo, CUDNN_CONVOLUTION_BWD_DATA_ALGO_1);
  });
}
SIMCUDA_API cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t h, const cudnnTensorDescriptor_t x, const cudnnTensorDescriptor_t dy,
    const cudnnConvolutionDescriptor_t conv, const cudnnFilterDescriptor_t dw,
    cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
  (void)conv;
  return sized(h, bytes, [&] {
    return legacy_workspace(legacy_graph(x, dw, dy), algo, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1);
  });
}

// ---- activations, pooling, spatial transformers, CTC loss -----------------

SIMCUDA_API cudnnStatus_t cudnnCreateActivationDescriptor(cudnnActivationDescriptor_t* d) {
  return create<ActivationDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyActivationDescriptor(cudnnActivationDescriptor_t d) {
  return destroy<ActivationDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetActivationDescriptor(cudnnActivationDescriptor_t desc,
                                                       cudnnActivationMode_t mode,
                                                       cudnnNanPropagation_t nan, double coef) {
  ActivationDesc* d = find<ActivationDesc>(desc);
  if (d == nullptr) return CUDNN_STATUS_BAD_PARAM;
  d->mode = mode, d->nan = nan, d->coef = coef;
  return CUDNN_STATUS_SUCCESS;
}

SIMCUDA_API cudnnStatus_t cudnnCreatePoolingDescriptor(cudnnPoolingDescriptor_t* d) {
  return create<PoolingDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyPoolingDescriptor(cudnnPoolingDescriptor_t d) {
  return destroy<PoolingDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetPooling2dDescriptor(cudnnPoolingDescriptor_t desc,
                                                      cudnnPoolingMode_t mode,
                                                      cudnnNanPropagation_t nan, int wh, int ww,
                                                      int ph, int pw, int sh, int sw) {
  (void)nan, (void)ph, (void)pw;
  PoolingDesc* d = find<PoolingDesc>(desc);
  if (d == nullptr || wh <= 0 || ww <= 0 || sh <= 0 || sw <= 0) return CUDNN_STATUS_BAD_PARAM;
  d->mode = mode;
  return CUDNN_STATUS_SUCCESS;
}

SIMCUDA_API cudnnStatus_t
cudnnCreateSpatialTransformerDescriptor(cudnnSpatialTransformerDescriptor_t* d) {
  return create<OpaqueDesc>(d);
}
SIMCUDA_API cudnnStatus_t
cudnnDestroySpatialTransformerDescriptor(cudnnSpatialTransformerDescriptor_t d) {
  return destroy<OpaqueDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetSpatialTransformerNdDescriptor(
    cudnnSpatialTransformerDescriptor_t desc, cudnnSamplerType_t sampler, cudnnDataType_t type,
    const int n, const int dims[]) {
  (void)sampler, (void)type, (void)dims;
  return find<OpaqueDesc>(desc) != nullptr && n > 0 ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_BAD_PARAM;
}

SIMCUDA_API cudnnStatus_t cudnnCreateCTCLossDescriptor(cudnnCTCLossDescriptor_t* d) {
  return create<OpaqueDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyCTCLossDescriptor(cudnnCTCLossDescriptor_t d) {
  return destroy<OpaqueDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetCTCLossDescriptorEx(cudnnCTCLossDescriptor_t desc,
                                                      cudnnDataType_t type,
                                                      cudnnLossNormalizationMode_t norm,
                                                      cudnnNanPropagation_t nan) {
  (void)type, (void)norm, (void)nan;
  return find<OpaqueDesc>(desc) != nullptr ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_BAD_PARAM;
}
SIMCUDA_API cudnnStatus_t cudnnSetCTCLossDescriptor_v9(cudnnCTCLossDescriptor_t desc,
                                                       cudnnDataType_t type,
                                                       cudnnLossNormalizationMode_t norm,
                                                       cudnnCTCGradMode_t grad, int max_label) {
  (void)type, (void)norm, (void)grad, (void)max_label;
  return find<OpaqueDesc>(desc) != nullptr ? CUDNN_STATUS_SUCCESS : CUDNN_STATUS_BAD_PARAM;
}

// ---- batch normalization ---------------------------------------------------

SIMCUDA_API cudnnStatus_t cudnnDeriveBNTensorDescriptor(cudnnTensorDescriptor_t derived,
                                                        const cudnnTensorDescriptor_t x,
                                                        cudnnBatchNormMode_t mode) {
  const model::Shape s = shape_of(x);
  if (s.dims.size() < 3) return CUDNN_STATUS_BAD_PARAM;
  std::vector<int> dims(s.dims.size(), 1), strides(s.dims.size(), 1);
  dims[1] = static_cast<int>(s.dims[1]);
  if (mode == CUDNN_BATCHNORM_PER_ACTIVATION) {
    for (std::size_t i = 2; i < s.dims.size(); ++i) dims[i] = static_cast<int>(s.dims[i]);
  }
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) {
    strides[static_cast<std::size_t>(i)] =
        strides[static_cast<std::size_t>(i) + 1] * dims[static_cast<std::size_t>(i) + 1];
  }
  const int type = s.data_type == CUDNN_DATA_HALF || s.data_type == CUDNN_DATA_BFLOAT16
                       ? CUDNN_DATA_FLOAT
                       : s.data_type;
  return cudnnSetTensorNdDescriptor(derived, static_cast<cudnnDataType_t>(type),
                                    static_cast<int>(dims.size()), dims.data(), strides.data());
}
SIMCUDA_API cudnnStatus_t cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
    cudnnHandle_t h, cudnnBatchNormMode_t mode, cudnnBatchNormOps_t ops,
    const cudnnTensorDescriptor_t x, const cudnnTensorDescriptor_t z,
    const cudnnTensorDescriptor_t y, const cudnnTensorDescriptor_t scale,
    const cudnnActivationDescriptor_t activation, size_t* bytes) {
  (void)ops, (void)z, (void)y, (void)scale, (void)activation;
  return sized(h, bytes, [&] { return model::batch_norm_workspace(mode, shape_of(x), false); });
}
SIMCUDA_API cudnnStatus_t cudnnGetBatchNormalizationBackwardExWorkspaceSize(
    cudnnHandle_t h, cudnnBatchNormMode_t mode, cudnnBatchNormOps_t ops,
    const cudnnTensorDescriptor_t x, const cudnnTensorDescriptor_t y,
    const cudnnTensorDescriptor_t dy, const cudnnTensorDescriptor_t dz,
    const cudnnTensorDescriptor_t dx, const cudnnTensorDescriptor_t dscale,
    const cudnnActivationDescriptor_t activation, size_t* bytes) {
  (void)ops, (void)y, (void)dy, (void)dz, (void)dx, (void)dscale, (void)activation;
  return sized(h, bytes, [&] { return model::batch_norm_workspace(mode, shape_of(x), true); });
}
SIMCUDA_API cudnnStatus_t cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
    cudnnHandle_t h, cudnnBatchNormMode_t mode, cudnnBatchNormOps_t ops,
    const cudnnActivationDescriptor_t activation, const cudnnTensorDescriptor_t x, size_t* bytes) {
  (void)activation;
  return sized(h, bytes, [&] { return model::batch_norm_reserve(mode, ops, shape_of(x)); });
}

// ---- dropout -------------------------------------------------------------

SIMCUDA_API cudnnStatus_t cudnnCreateDropoutDescriptor(cudnnDropoutDescriptor_t* d) {
  return create<DropoutDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyDropoutDescriptor(cudnnDropoutDescriptor_t d) {
  return destroy<DropoutDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDropoutGetStatesSize(cudnnHandle_t h, size_t* bytes) {
  return sized(h, bytes, [&] { return model::dropout_states_bytes(); });
}
SIMCUDA_API cudnnStatus_t cudnnDropoutGetReserveSpaceSize(cudnnTensorDescriptor_t x,
                                                          size_t* bytes) {
  const model::Shape s = shape_of(x);
  if (bytes == nullptr || s.dims.empty()) return CUDNN_STATUS_BAD_PARAM;
  std::size_t n = 1;
  for (const std::int64_t d : s.dims) n *= static_cast<std::size_t>(d);
  *bytes = n;  // a byte an element: whether it was kept
  return CUDNN_STATUS_SUCCESS;
}
namespace {
cudnnStatus_t set_dropout(const char* call, cudnnDropoutDescriptor_t desc, cudnnHandle_t h,
                          float dropout, void* states, size_t bytes, unsigned long long seed,
                          bool initializes) {
  DropoutDesc* d = find<DropoutDesc>(desc);
  if (d == nullptr || !model::valid_handle(h) || dropout < 0 || dropout > 1)
    return CUDNN_STATUS_BAD_PARAM;
  if (states != nullptr && bytes < model::dropout_states_bytes()) {
    return fail(CUDNN_STATUS_BAD_PARAM,
                std::string(call) + ": the states are smaller than cudnnDropoutGetStatesSize");
  }
  // Initializing the generators' states is a kernel; restoring them is not.
  if (initializes && states != nullptr) {
    if (const cudnnStatus_t k = kernel(call); k != CUDNN_STATUS_SUCCESS) return k;
  }
  d->dropout = dropout, d->states = states, d->state_bytes = bytes, d->seed = seed;
  return CUDNN_STATUS_SUCCESS;
}
}  // namespace
SIMCUDA_API cudnnStatus_t cudnnSetDropoutDescriptor(cudnnDropoutDescriptor_t desc, cudnnHandle_t h,
                                                    float dropout, void* states, size_t bytes,
                                                    unsigned long long seed) {
  return set_dropout("cudnnSetDropoutDescriptor", desc, h, dropout, states, bytes, seed, true);
}
SIMCUDA_API cudnnStatus_t cudnnRestoreDropoutDescriptor(cudnnDropoutDescriptor_t desc,
                                                        cudnnHandle_t h, float dropout,
                                                        void* states, size_t bytes,
                                                        unsigned long long seed) {
  return set_dropout("cudnnRestoreDropoutDescriptor", desc, h, dropout, states, bytes, seed, false);
}

// ---- RNNs ----------------------------------------------------------------

SIMCUDA_API cudnnStatus_t cudnnCreateRNNDescriptor(cudnnRNNDescriptor_t* d) {
  return create<RnnDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyRNNDescriptor(cudnnRNNDescriptor_t d) {
  return destroy<RnnDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetRNNDescriptor_v8(
    cudnnRNNDescriptor_t desc, cudnnRNNAlgo_t algo, cudnnRNNMode_t cell, cudnnRNNBiasMode_t bias,
    cudnnDirectionMode_t direction, cudnnRNNInputMode_t input, cudnnDataType_t type,
    cudnnDataType_t math_precision, cudnnMathType_t math, int32_t input_size, int32_t hidden_size,
    int32_t proj_size, int32_t layers, cudnnDropoutDescriptor_t dropout, uint32_t aux) {
  (void)algo, (void)math_precision, (void)math, (void)dropout, (void)aux;
  RnnDesc* d = find<RnnDesc>(desc);
  if (d == nullptr) return CUDNN_STATUS_BAD_PARAM;
  if (cell < CUDNN_RNN_RELU || cell > CUDNN_GRU || input_size <= 0 || hidden_size <= 0 ||
      layers <= 0 || proj_size < 0 ||
      (proj_size > 0 && (cell != CUDNN_LSTM || proj_size > hidden_size)) ||
      model::element_bytes(type) == 0) {
    return fail(CUDNN_STATUS_BAD_PARAM,
                "cudnnSetRNNDescriptor_v8: invalid cell, sizes or data type");
  }
  model::Rnn& r = d->rnn;
  r.cell = cell, r.bias = bias, r.directions = direction == CUDNN_BIDIRECTIONAL ? 2 : 1;
  r.skip_input = input == CUDNN_SKIP_INPUT, r.data_type = type;
  r.input_size = input_size, r.hidden_size = hidden_size;
  r.proj_size =
      proj_size == hidden_size ? 0 : proj_size;  // cuDNN: a projection as wide as the cell is none
  r.layers = layers;
  d->set = true;
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnCreateRNNDataDescriptor(cudnnRNNDataDescriptor_t* d) {
  return create<RnnDataDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnDestroyRNNDataDescriptor(cudnnRNNDataDescriptor_t d) {
  return destroy<RnnDataDesc>(d);
}
SIMCUDA_API cudnnStatus_t cudnnSetRNNDataDescriptor(cudnnRNNDataDescriptor_t desc,
                                                    cudnnDataType_t type,
                                                    cudnnRNNDataLayout_t layout, int max_sequence,
                                                    int batch, int vector, const int lengths[],
                                                    void* padding) {
  (void)padding;
  RnnDataDesc* d = find<RnnDataDesc>(desc);
  if (d == nullptr || max_sequence <= 0 || batch <= 0 || vector <= 0 || lengths == nullptr) {
    return CUDNN_STATUS_BAD_PARAM;
  }
  for (int i = 0; i < batch; ++i) {
    if (lengths[i] < 0 || lengths[i] > max_sequence) {
      return fail(CUDNN_STATUS_BAD_PARAM,
                  "cudnnSetRNNDataDescriptor: a sequence length is outside [0, maxSeqLength]");
    }
  }
  d->data_type = type, d->layout = layout, d->max_sequence = max_sequence, d->batch = batch,
  d->vector = vector;
  d->set = true;
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnGetRNNWeightSpaceSize(cudnnHandle_t h, cudnnRNNDescriptor_t desc,
                                                     size_t* bytes) {
  const RnnDesc* d = find<RnnDesc>(desc);
  if (!model::valid_handle(h) || d == nullptr || !d->set || bytes == nullptr)
    return CUDNN_STATUS_BAD_PARAM;
  *bytes = model::rnn_weight_space_bytes(d->rnn);
  return CUDNN_STATUS_SUCCESS;
}
SIMCUDA_API cudnnStatus_t cudnnGetRNNTempSpaceSizes(cudnnHandle_t h, cudnnRNNDescriptor_t desc,
                                                    cudnnForwardMode_t mode,
                                                    cudnnRNNDataDescriptor_t x, size_t* workspace,
                                                    size_t* reserve) {
  const RnnDesc* d = find<RnnDesc>(desc);
  const RnnDataDesc* data = find<RnnDataDesc>(x);
  if (!model::valid_handle(h) || d == nullptr || !d->set || data == nullptr || !data->set) {
    return CUDNN_STATUS_BAD_PARAM;
  }
  const bool training = mode == CUDNN_FWD_MODE_TRAINING;
  if (workspace != nullptr) {
    *workspace = model::rnn_workspace_bytes(d->rnn, data->max_sequence, data->batch, training);
  }
  if (reserve != nullptr)
    *reserve = model::rnn_reserve_bytes(d->rnn, data->max_sequence, data->batch, training);
  return CUDNN_STATUS_SUCCESS;
}
// Where a matrix or bias lies in the weight space, with a 3-d descriptor of
// it ([1, rows, columns], packed); a part the cell has none of is a null
// address and a descriptor of no dimensions.
SIMCUDA_API cudnnStatus_t cudnnGetRNNWeightParams(cudnnHandle_t h, cudnnRNNDescriptor_t desc,
                                                  int32_t pseudo_layer, size_t space_bytes,
                                                  const void* space, int32_t linear_id,
                                                  cudnnTensorDescriptor_t m_desc, void** m_addr,
                                                  cudnnTensorDescriptor_t b_desc, void** b_addr) {
  const RnnDesc* d = find<RnnDesc>(desc);
  if (!model::valid_handle(h) || d == nullptr || !d->set) return CUDNN_STATUS_BAD_PARAM;
  const model::Rnn& r = d->rnn;
  if (pseudo_layer < 0 || pseudo_layer >= r.layers * r.directions || linear_id < 0 ||
      linear_id >= r.linear_layers() || space_bytes < model::rnn_weight_space_bytes(r)) {
    return fail(
        CUDNN_STATUS_BAD_PARAM,
        "cudnnGetRNNWeightParams: pseudo-layer, linLayerID or weight space size out of range");
  }
  const std::size_t e = model::element_bytes(r.data_type);
  auto answer = [&](bool exists, const model::WeightPart& part, cudnnTensorDescriptor_t t,
                    void** addr) {
    if (addr != nullptr) {
      *addr = exists ? const_cast<char*>(static_cast<const char*>(space) +
                                         static_cast<std::size_t>(part.offset) * e)
                     : nullptr;
    }
    if (TensorDesc* td = find<TensorDesc>(t)) {
      td->shape = exists ? model::Shape{r.data_type,
                                        {1, part.rows, part.columns},
                                        {part.rows * part.columns, part.columns, 1}}
                         : model::Shape{r.data_type, {}, {}};
      td->set = true;
    }
  };
  model::WeightPart m, b;
  answer(model::rnn_matrix(r, pseudo_layer, linear_id, &m), m, m_desc, m_addr);
  answer(model::rnn_bias(r, pseudo_layer, linear_id, &b), b, b_desc, b_addr);
  return CUDNN_STATUS_SUCCESS;
}

}  // extern "C"
