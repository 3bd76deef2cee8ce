// What the simulated cuDNN answers where a real cuDNN's answer depends on
// its kernels: the memory its calls ask for (workspaces, reserve spaces,
// dropout states) and the engines its heuristics offer. One place, so that
// the figures the GPU bundle's `cudnn` step records on an H100 correct them
// (docs/simcuda.md says where each figure comes from and that none has been
// measured on a GPU yet).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace reservoir::simcuda::cudnn {

// cuDNN's version as PyTorch 2.15's wheel ships it (9.26.0); the newest
// release tested, and no older release refuses a newer minor version.
// RESERVOIR_SIMCUDA_CUDNN_VERSION (e.g. 91900) answers another.
std::size_t version();

// Bytes of one element of a cudnnDataType_t; 0 for one not modelled.
std::size_t element_bytes(int data_type);

// A tensor as the model sees it: element type, sizes and strides.
struct Shape {
  int data_type = 0;
  std::vector<std::int64_t> dims;
  std::vector<std::int64_t> strides;
  std::size_t bytes() const;   // the elements it spans, dense
  bool channels_last() const;  // the channel stride (dim 1) is 1: NHWC in memory
};

// ---- the backend (graph) API's engines -----------------------------------
//
// Every operation graph is offered the engines below, in this order, by
// heuristics of any mode (CUDNN_HEUR_MODE_FALLBACK: the last one alone).
// Their numerical notes are what PyTorch filters on (TF32 and tensor cores
// off, deterministic algorithms).
struct Engine {
  std::int64_t global_index = 0;
  bool tensor_core = false;       // CUDNN_NUMERICAL_NOTE_TENSOR_CORE
  bool down_converts = false;     // CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS (TF32 for float)
  bool nondeterministic = false;  // CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC
};

// What a graph's operations are, as far as the model needs to know.
struct GraphSummary {
  int convolutions_forward = 0;
  int convolutions_backward_data = 0;
  int convolutions_backward_filter = 0;
  int matmuls = 0;
  int other_operations = 0;
  int data_type = 0;  // the first convolution's or matmul's input type
  Shape x, w, y;      // the first convolution's tensors (empty otherwise)
};

// The engines heuristics return for a graph (`fallback`: the fallback list).
std::vector<Engine> engines(const GraphSummary& graph, bool fallback);
// How many engines cuDNN knows for the graph (CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT).
std::int64_t engine_count(const GraphSummary& graph);
// The workspace an execution plan of `engine` needs for the graph.
std::size_t plan_workspace(const GraphSummary& graph, std::int64_t engine);

// ---- the legacy API's memory -------------------------------------------

// cudnnDropoutGetStatesSize: one random-number generator state for each
// thread the device keeps resident.
std::size_t dropout_states_bytes();
// Batch normalization (cudnnGetBatchNormalization*): workspace and reserve.
std::size_t batch_norm_workspace(int mode, const Shape& x, bool backward);
std::size_t batch_norm_reserve(int mode, int ops, const Shape& x);

// RNNs (cudnnSetRNNDescriptor_v8's parameters).
struct Rnn {
  int cell = 0;  // cudnnRNNMode_t
  int bias = 2;  // cudnnRNNBiasMode_t
  int directions = 1;
  bool skip_input = false;
  int data_type = 0;
  int input_size = 0, hidden_size = 0, proj_size = 0, layers = 1;
  int gates() const;  // weight matrices of one input: 1, 3 or 4
  int linear_layers()
      const;  // linLayerID count: input and recurrent matrices (+1 for a projection)
};
// Where a pseudo-layer's matrix or bias lies in the weight space: element
// offset and its two sizes (rows, columns; a bias has one column). False
// for an id the cell has none of (a bias under CUDNN_RNN_NO_BIAS...).
struct WeightPart {
  std::int64_t offset = 0, rows = 0, columns = 0;
};
bool rnn_matrix(const Rnn& rnn, int pseudo_layer, int linear_id, WeightPart* out);
bool rnn_bias(const Rnn& rnn, int pseudo_layer, int linear_id, WeightPart* out);
std::size_t rnn_weight_space_bytes(const Rnn& rnn);
// cudnnGetRNNTempSpaceSizes, for `sequence` steps of `batch`.
std::size_t rnn_workspace_bytes(const Rnn& rnn, int sequence, int batch, bool training);
std::size_t rnn_reserve_bytes(const Rnn& rnn, int sequence, int batch, bool training);

}  // namespace reservoir::simcuda::cudnn
