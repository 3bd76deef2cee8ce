// The simulated cuDNN's figures (cudnn_model.hpp). Each is a model, stated
// here and in docs/simcuda.md, until the GPU bundle's `cudnn` step has
// recorded what cuDNN asks on an H100 for the same calls.
#include "cudnn_model.hpp"

#include <cudnn.h>

#include <algorithm>
#include <cstdlib>

namespace reservoir::simcuda::cudnn {

std::size_t version() {
  static const std::size_t v = [] {
    const char* env = std::getenv("RESERVOIR_SIMCUDA_CUDNN_VERSION");
    const long parsed = env != nullptr ? std::strtol(env, nullptr, 10) : 0;
    return parsed >= 90000 && parsed < 100000 ? static_cast<std::size_t>(parsed)
                                              : std::size_t{92600};
  }();
  return v;
}

std::size_t element_bytes(int data_type) {
  switch (data_type) {
    case CUDNN_DATA_DOUBLE:
    case CUDNN_DATA_INT64:
    case CUDNN_DATA_COMPLEX_FP32: return 8;
    case CUDNN_DATA_FLOAT:
    case CUDNN_DATA_INT32:
    case CUDNN_DATA_UINT32: return 4;
    case CUDNN_DATA_HALF:
    case CUDNN_DATA_BFLOAT16: return 2;
    case CUDNN_DATA_INT8:
    case CUDNN_DATA_UINT8:
    case CUDNN_DATA_BOOLEAN:
    case CUDNN_DATA_FP8_E4M3:
    case CUDNN_DATA_FP8_E5M2:
    case CUDNN_DATA_FP8_E8M0: return 1;
    case CUDNN_DATA_COMPLEX_FP64: return 16;
    default: return 0;
  }
}

std::size_t Shape::bytes() const {
  if (dims.empty()) return 0;
  std::size_t n = 1;
  for (const std::int64_t d : dims) n *= static_cast<std::size_t>(std::max<std::int64_t>(d, 0));
  return n * element_bytes(data_type);
}

bool Shape::channels_last() const {
  return dims.size() >= 3 && strides.size() == dims.size() && strides[1] == 1 && dims[1] > 1;
}

namespace {

constexpr std::size_t kAlignment = 256;
std::size_t aligned(std::size_t n) {
  return (n + kAlignment - 1) / kAlignment * kAlignment;
}

bool convolution(const GraphSummary& g) {
  return g.convolutions_forward + g.convolutions_backward_data + g.convolutions_backward_filter > 0;
}

// Engine 0: a tensor-core implicit GEMM (for float inputs: TF32, which
// down-converts them); engine 1: the same on CUDA cores, the fallback.
constexpr Engine kTensorCore{0, true, false, false};
constexpr Engine kTensorCoreTf32{0, true, true, false};
constexpr Engine kCudaCore{1, false, false, false};

}  // namespace

std::vector<Engine> engines(const GraphSummary& graph, bool fallback) {
  if (fallback) return {kCudaCore};
  const bool single_precision = graph.data_type == CUDNN_DATA_FLOAT;
  if (graph.data_type == CUDNN_DATA_DOUBLE) return {kCudaCore};  // no tensor-core path for doubles
  return {single_precision ? kTensorCoreTf32 : kTensorCore, kCudaCore};
}

std::int64_t engine_count(const GraphSummary& graph) {
  (void)graph;
  return 2;
}

// The tensor-core engine works on channels-last data: a convolution whose
// tensors are not laid out so has them transposed into its workspace (x, w
// and y, each 256-byte aligned); the CUDA-core engine, and every
// non-convolution graph (matmuls, attention, normalizations: their fused
// engines keep what they need in shared memory), needs none. cuDNN's
// attention backward needs its dQ accumulator, which cudnn-frontend itself
// adds to the workspace it asks for (compiled into PyTorch: not this model).
std::size_t plan_workspace(const GraphSummary& graph, std::int64_t engine) {
  if (engine != kTensorCore.global_index || !convolution(graph)) return 0;
  if (graph.x.channels_last()) return 0;
  return aligned(graph.x.bytes()) + aligned(graph.w.bytes()) + aligned(graph.y.bytes());
}

// cuRAND's XORWOW state (48 bytes) for each thread an H100 keeps resident
// (132 multiprocessors of 2048 threads).
std::size_t dropout_states_bytes() {
  return std::size_t{48} * 132 * 2048;
}

// Batch norm keeps its running sums in fp32, one partial sum and square per
// channel and multiprocessor, in the persistent mode's workspace (the
// spatial mode works in place); the reserve holds the activation's bitmask
// when an activation is fused (one bit an element), else nothing.
std::size_t batch_norm_workspace(int mode, const Shape& x, bool backward) {
  if (mode != CUDNN_BATCHNORM_SPATIAL_PERSISTENT || x.dims.size() < 2) return 0;
  const auto channels = static_cast<std::size_t>(x.dims[1]);
  return aligned(channels * 132 * 2 * sizeof(float) * (backward ? 2 : 1));
}

std::size_t batch_norm_reserve(int mode, int ops, const Shape& x) {
  (void)mode;
  if (ops == CUDNN_BATCHNORM_OPS_BN) return 0;
  std::size_t elements = 1;
  for (const std::int64_t d : x.dims)
    elements *= static_cast<std::size_t>(std::max<std::int64_t>(d, 0));
  return aligned((elements + 7) / 8);
}

int Rnn::gates() const {
  switch (cell) {
    case CUDNN_LSTM: return 4;
    case CUDNN_GRU: return 3;
    default: return 1;
  }
}

int Rnn::linear_layers() const {
  return 2 * gates() + (cell == CUDNN_LSTM && proj_size > 0 ? 1 : 0);
}

namespace {

int output_width(const Rnn& r) {
  return r.cell == CUDNN_LSTM && r.proj_size > 0 ? r.proj_size : r.hidden_size;
}
int input_width(const Rnn& r, int layer) {
  return layer == 0 ? r.input_size : output_width(r) * r.directions;
}

bool has_input_bias(const Rnn& r) {
  return r.bias == CUDNN_RNN_DOUBLE_BIAS || r.bias == CUDNN_RNN_SINGLE_INP_BIAS;
}
bool has_recurrent_bias(const Rnn& r) {
  return r.bias == CUDNN_RNN_DOUBLE_BIAS || r.bias == CUDNN_RNN_SINGLE_REC_BIAS;
}

// A pseudo-layer's matrix `id`: its rows and columns (false where there is none).
bool matrix_shape(const Rnn& r, int layer, int id, std::int64_t* rows, std::int64_t* columns) {
  const int g = r.gates();
  if (id < g) {
    if (layer == 0 && r.skip_input) return false;
    *rows = r.hidden_size, *columns = input_width(r, layer);
    return true;
  }
  if (id < 2 * g) {
    *rows = r.hidden_size, *columns = output_width(r);
    return true;
  }
  if (id == 2 * g && r.cell == CUDNN_LSTM && r.proj_size > 0) {
    *rows = r.proj_size, *columns = r.hidden_size;
    return true;
  }
  return false;
}
bool bias_length(const Rnn& r, int id, std::int64_t* length) {
  const int g = r.gates();
  if ((id < g && has_input_bias(r)) || (id >= g && id < 2 * g && has_recurrent_bias(r))) {
    *length = r.hidden_size;
    return true;
  }
  return false;
}

// Elements of one pseudo-layer: its matrices in id order, then its biases.
std::int64_t layer_elements(const Rnn& r, int layer, int up_to_matrix, int up_to_bias) {
  std::int64_t n = 0;
  for (int id = 0; id < up_to_matrix; ++id) {
    std::int64_t rows = 0, columns = 0;
    if (matrix_shape(r, layer, id, &rows, &columns)) n += rows * columns;
  }
  for (int id = 0; id < up_to_bias; ++id) {
    std::int64_t length = 0;
    if (bias_length(r, id, &length)) n += length;
  }
  return n;
}

std::int64_t pseudo_layer_offset(const Rnn& r, int pseudo_layer) {
  std::int64_t n = 0;
  for (int p = 0; p < pseudo_layer; ++p) {
    n += layer_elements(r, p / r.directions, r.linear_layers(), r.linear_layers());
  }
  return n;
}

}  // namespace

// The weight space, pseudo-layer after pseudo-layer (each layer's forward
// direction, then its backward one), each its matrices in linLayerID order
// and then its biases: the layout PyTorch's RNN code checks cuDNN's
// pointers against, parameter after parameter.
bool rnn_matrix(const Rnn& rnn, int pseudo_layer, int linear_id, WeightPart* out) {
  const int layer = pseudo_layer / rnn.directions;
  std::int64_t rows = 0, columns = 0;
  if (!matrix_shape(rnn, layer, linear_id, &rows, &columns)) return false;
  *out =
      WeightPart{pseudo_layer_offset(rnn, pseudo_layer) + layer_elements(rnn, layer, linear_id, 0),
                 rows, columns};
  return true;
}

bool rnn_bias(const Rnn& rnn, int pseudo_layer, int linear_id, WeightPart* out) {
  const int layer = pseudo_layer / rnn.directions;
  std::int64_t length = 0;
  if (!bias_length(rnn, linear_id, &length)) return false;
  *out = WeightPart{pseudo_layer_offset(rnn, pseudo_layer) +
                        layer_elements(rnn, layer, rnn.linear_layers(), linear_id),
                    length, 1};
  return true;
}

std::size_t rnn_weight_space_bytes(const Rnn& rnn) {
  return static_cast<std::size_t>(pseudo_layer_offset(rnn, rnn.layers * rnn.directions)) *
         element_bytes(rnn.data_type);
}

// The workspace holds one layer's input GEMM for every step (its gates, both
// directions); training keeps, for every step and pseudo-layer, the gates'
// pre-activations and the hidden state (and an LSTM's cell state) in the
// reserve, for the backward pass; inference keeps nothing.
std::size_t rnn_workspace_bytes(const Rnn& rnn, int sequence, int batch, bool training) {
  (void)training;
  const std::size_t e = element_bytes(rnn.data_type);
  return aligned(static_cast<std::size_t>(sequence) * static_cast<std::size_t>(batch) *
                 static_cast<std::size_t>(rnn.gates() * rnn.hidden_size * rnn.directions) * e);
}

std::size_t rnn_reserve_bytes(const Rnn& rnn, int sequence, int batch, bool training) {
  if (!training) return 0;
  const std::size_t e = element_bytes(rnn.data_type);
  const int per_step = rnn.gates() * rnn.hidden_size + output_width(rnn) +
                       (rnn.cell == CUDNN_LSTM ? rnn.hidden_size : 0);
  return aligned(static_cast<std::size_t>(sequence) * static_cast<std::size_t>(batch) *
                 static_cast<std::size_t>(rnn.layers * rnn.directions) *
                 static_cast<std::size_t>(per_step) * e);
}

}  // namespace reservoir::simcuda::cudnn
