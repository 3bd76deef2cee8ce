// The simulated cuDNN's backend (graph) API, which PyTorch's convolutions
// (through cudnn-frontend's v0.x API) and its cuDNN attention (through the
// frontend's graph API) use: descriptors of every type keep the attributes
// they are given, exactly as given, and hand them back; finalizing checks
// what cuDNN needs of a descriptor of that type; what cuDNN works out (the
// engines heuristics offer, their notes, an execution plan's workspace) comes
// from the model (cudnn_model.hpp). cudnnBackendExecute checks the plan and
// its variant pack and is then a kernel (cudnn_internal.hpp).
#include <cudnn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cudnn_internal.hpp"
#include "cudnn_model.hpp"
#include "handles.hpp"

namespace model = reservoir::simcuda::cudnn;

namespace {

struct Attribute {
  cudnnBackendAttributeType_t type{};
  std::int64_t count = 0;
  std::vector<unsigned char> bytes;
};

struct Descriptor {
  cudnnBackendDescriptorType_t type{};
  bool finalized = false;
  std::map<int, Attribute> attributes;
  // What finalizing worked out, by type: an operation graph's summary (also
  // kept by its heuristics, engines, configurations and plans), the engine
  // of an engine, configuration or plan, heuristics' results, a plan's
  // workspace.
  model::GraphSummary graph;
  model::Engine engine;
  std::vector<model::Engine> results;
  std::size_t workspace = 0;
};

// Live descriptors (handles.hpp: a destroyed or foreign one is not found).
reservoir::simcuda::Handles<Descriptor>& registry() {
  static reservoir::simcuda::Handles<Descriptor> r;
  return r;
}

constexpr int kReshapeModeType = 31;

// Bytes of one element of an attribute type; 0 for a type cuDNN 9 lacks.
std::size_t element_size(cudnnBackendAttributeType_t t) {
  switch (t) {
    case CUDNN_TYPE_HANDLE:
    case CUDNN_TYPE_VOID_PTR:
    case CUDNN_TYPE_BACKEND_DESCRIPTOR: return sizeof(void*);
    case CUDNN_TYPE_BOOLEAN: return sizeof(bool);
    case CUDNN_TYPE_INT64: return sizeof(std::int64_t);
    case CUDNN_TYPE_FLOAT: return sizeof(float);
    case CUDNN_TYPE_DOUBLE: return sizeof(double);
    case CUDNN_TYPE_INT32: return sizeof(std::int32_t);
    case CUDNN_TYPE_CHAR: return sizeof(char);
    case CUDNN_TYPE_FRACTION: return sizeof(cudnnFraction_t);
    case CUDNN_TYPE_DATA_TYPE:
    case CUDNN_TYPE_CONVOLUTION_MODE:
    case CUDNN_TYPE_HEUR_MODE:
    case CUDNN_TYPE_KNOB_TYPE:
    case CUDNN_TYPE_NAN_PROPOGATION:
    case CUDNN_TYPE_NUMERICAL_NOTE:
    case CUDNN_TYPE_LAYOUT_TYPE:
    case CUDNN_TYPE_ATTRIB_NAME:
    case CUDNN_TYPE_POINTWISE_MODE:
    case CUDNN_TYPE_GENSTATS_MODE:
    case CUDNN_TYPE_BN_FINALIZE_STATS_MODE:
    case CUDNN_TYPE_REDUCTION_OPERATOR_TYPE:
    case CUDNN_TYPE_BEHAVIOR_NOTE:
    case CUDNN_TYPE_TENSOR_REORDERING_MODE:
    case CUDNN_TYPE_RESAMPLE_MODE:
    case CUDNN_TYPE_PADDING_MODE:
    case CUDNN_TYPE_SIGNAL_MODE:
    case CUDNN_TYPE_NORM_MODE:
    case CUDNN_TYPE_NORM_FWD_PHASE:
    case CUDNN_TYPE_RNG_DISTRIBUTION:
    case CUDNN_TYPE_MOE_GROUPED_MATMUL_MODE: return sizeof(int);  // C enums
  }
  // Types newer than the headers this is built with (cuDNN 9.19's), which
  // newer cudnn-frontends set: CUDNN_TYPE_RESHAPE_MODE (31, an enum).
  if (static_cast<int>(t) == kReshapeModeType) return sizeof(int);
  return 0;
}

cudnnStatus_t fail(cudnnStatus_t status, const std::string& what) {
  model::set_last_error(what);
  return status;
}

// RESERVOIR_SIMCUDA_LOG=1: each backend call, its descriptor's type, the
// attribute and what it answered, a line on stderr.
cudnnStatus_t logged(const char* call, const void* desc, int type, int attribute,
                     cudnnStatus_t status, std::int64_t count = -1) {
  static const bool on = [] {
    const char* v = std::getenv("RESERVOIR_SIMCUDA_LOG");
    return v != nullptr && v[0] == '1';
  }();
  if (on) {
    std::fprintf(stderr,
                 "reservoir simulated cuDNN: %s(%p type %d attribute %d) -> %d count %lld\n", call,
                 desc, type, attribute, static_cast<int>(status), static_cast<long long>(count));
  }
  return status;
}

std::string named(const Descriptor& d, int attribute) {
  return "descriptor type " + std::to_string(d.type) + ", attribute " + std::to_string(attribute);
}

const Attribute* attribute(const Descriptor& d, int name) {
  auto it = d.attributes.find(name);
  return it == d.attributes.end() ? nullptr : &it->second;
}

template <typename T>
std::vector<T> values(const Descriptor& d, int name) {
  const Attribute* a = attribute(d, name);
  if (a == nullptr || a->count == 0 ||
      a->bytes.size() != static_cast<std::size_t>(a->count) * sizeof(T))
    return {};
  std::vector<T> out(static_cast<std::size_t>(a->count));
  std::memcpy(out.data(), a->bytes.data(), a->bytes.size());
  return out;
}

// The live descriptor an attribute names (its first), or null.
Descriptor* referenced(const Descriptor& d, int name) {
  const auto v = values<void*>(d, name);
  return v.empty() ? nullptr : registry().find(v.front());
}

model::Shape tensor_shape(const Descriptor* t) {
  model::Shape s;
  if (t == nullptr) return s;
  const auto type = values<int>(*t, CUDNN_ATTR_TENSOR_DATA_TYPE);
  s.data_type = type.empty() ? 0 : type.front();
  s.dims = values<std::int64_t>(*t, CUDNN_ATTR_TENSOR_DIMENSIONS);
  s.strides = values<std::int64_t>(*t, CUDNN_ATTR_TENSOR_STRIDES);
  return s;
}

// What the model needs to know of an operation graph's operations.
model::GraphSummary summarize(const Descriptor& graph) {
  model::GraphSummary g;
  bool first = true;
  for (void* p : values<void*>(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS)) {
    const Descriptor* op = registry().find(p);
    if (op == nullptr) continue;
    auto conv = [&](int& counter, int x, int w, int y) {
      ++counter;
      if (!first) return;
      first = false;
      g.x = tensor_shape(referenced(*op, x));
      g.w = tensor_shape(referenced(*op, w));
      g.y = tensor_shape(referenced(*op, y));
      g.data_type = g.x.data_type;
    };
    switch (op->type) {
      case CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR:
        conv(g.convolutions_forward, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
             CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
             CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y);
        break;
      case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR:
        conv(g.convolutions_backward_data, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
             CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
             CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY);
        break;
      case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR:
        conv(g.convolutions_backward_filter, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
             CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
             CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY);
        break;
      case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
        ++g.matmuls;
        if (first) {
          first = false;
          g.data_type = tensor_shape(referenced(*op, CUDNN_ATTR_OPERATION_MATMUL_ADESC)).data_type;
        }
        break;
      default: ++g.other_operations;
    }
  }
  return g;
}

// The engine of `index` for a graph: one heuristics offer it (or the fallback).
bool engine_of(const model::GraphSummary& g, std::int64_t index, model::Engine* out) {
  for (const bool fallback : {false, true}) {
    for (const model::Engine& e : model::engines(g, fallback)) {
      if (e.global_index == index) {
        *out = e;
        return true;
      }
    }
  }
  return false;
}

bool has(const Descriptor& d, int name) {
  return attribute(d, name) != nullptr;
}

// Checks a descriptor as finalizing it does, and works out what cuDNN would.
cudnnStatus_t finalize(Descriptor& d) {
  auto need = [&](std::initializer_list<int> names) -> cudnnStatus_t {
    for (const int n : names) {
      if (!has(d, n)) {
        return fail(CUDNN_STATUS_BAD_PARAM,
                    "cudnnBackendFinalize: " + named(d, n) + " is required and was not set");
      }
    }
    return CUDNN_STATUS_SUCCESS;
  };
  auto finalized = [&](int name, cudnnBackendDescriptorType_t type,
                       Descriptor** out) -> cudnnStatus_t {
    Descriptor* r = referenced(d, name);
    if (r == nullptr || r->type != type) {
      return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendFinalize: " + named(d, name) +
                                              " is no descriptor of type " + std::to_string(type));
    }
    if (!r->finalized) {
      return fail(
          CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED,
          "cudnnBackendFinalize: " + named(d, name) + " names a descriptor that was not finalized");
    }
    *out = r;
    return CUDNN_STATUS_SUCCESS;
  };
  cudnnStatus_t s = CUDNN_STATUS_SUCCESS;
  Descriptor* r = nullptr;
  switch (d.type) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR: {
      if ((s = need({CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_ATTR_TENSOR_DIMENSIONS,
                     CUDNN_ATTR_TENSOR_STRIDES, CUDNN_ATTR_TENSOR_UNIQUE_ID})) !=
          CUDNN_STATUS_SUCCESS) {
        return s;
      }
      const model::Shape shape = tensor_shape(&d);
      if (shape.dims.empty() || shape.dims.size() != shape.strides.size()) {
        return fail(CUDNN_STATUS_BAD_PARAM,
                    "cudnnBackendFinalize: a tensor's dimensions and strides differ in count");
      }
      for (std::size_t i = 0; i < shape.dims.size(); ++i) {
        if (shape.dims[i] <= 0 || shape.strides[i] <= 0) {
          return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendFinalize: a tensor's dimension " +
                                                  std::to_string(i) +
                                                  " or its stride is not positive");
        }
      }
      break;
    }
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
      // The handle is optional: cudnn-frontend's graph API sets none.
      if ((s = need({CUDNN_ATTR_OPERATIONGRAPH_OPS})) != CUDNN_STATUS_SUCCESS) return s;
      for (void* p : values<void*>(d, CUDNN_ATTR_OPERATIONGRAPH_OPS)) {
        const Descriptor* op = registry().find(p);
        if (op == nullptr || !op->finalized) {
          return fail(
              CUDNN_STATUS_BAD_PARAM,
              "cudnnBackendFinalize: an operation graph's operation is no finalized descriptor");
        }
      }
      d.graph = summarize(d);
      break;
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR: {
      if ((s = need({CUDNN_ATTR_ENGINEHEUR_MODE})) != CUDNN_STATUS_SUCCESS) return s;
      if ((s = finalized(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                         CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &r)) != CUDNN_STATUS_SUCCESS) {
        return s;
      }
      const auto mode = values<int>(d, CUDNN_ATTR_ENGINEHEUR_MODE);
      d.graph = r->graph;
      d.results =
          model::engines(d.graph, !mode.empty() && mode.front() == CUDNN_HEUR_MODE_FALLBACK);
      break;
    }
    case CUDNN_BACKEND_ENGINE_DESCRIPTOR: {
      if ((s = need({CUDNN_ATTR_ENGINE_GLOBAL_INDEX})) != CUDNN_STATUS_SUCCESS) return s;
      if ((s = finalized(CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR,
                         &r)) != CUDNN_STATUS_SUCCESS) {
        return s;
      }
      d.graph = r->graph;
      const auto index = values<std::int64_t>(d, CUDNN_ATTR_ENGINE_GLOBAL_INDEX);
      if (index.empty() || !engine_of(d.graph, index.front(), &d.engine)) {
        return fail(CUDNN_STATUS_NOT_SUPPORTED,
                    "cudnnBackendFinalize: no engine of that global index for this graph");
      }
      break;
    }
    case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR:
      if ((s = finalized(CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_BACKEND_ENGINE_DESCRIPTOR, &r)) !=
          CUDNN_STATUS_SUCCESS) {
        return s;
      }
      d.graph = r->graph, d.engine = r->engine;
      d.workspace = model::plan_workspace(d.graph, d.engine.global_index);
      break;
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:  // the handle is optional: cudnn-frontend 1.x
                                                   // sets none
      if ((s = finalized(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                         CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &r)) != CUDNN_STATUS_SUCCESS) {
        return s;
      }
      d.graph = r->graph, d.engine = r->engine, d.workspace = r->workspace;
      break;
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: {
      const Attribute* pointers = attribute(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS);
      const Attribute* uids = attribute(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS);
      if ((pointers != nullptr ? pointers->count : 0) != (uids != nullptr ? uids->count : 0)) {
        return fail(
            CUDNN_STATUS_BAD_PARAM,
            "cudnnBackendFinalize: a variant pack's data pointers and unique ids differ in count");
      }
      break;
    }
    default: break;  // operations, their descriptors, knobs: kept as given
  }
  d.finalized = true;
  return CUDNN_STATUS_SUCCESS;
}

// The element count a get answers: how many the attribute has when asked
// without a place for them (cudnn-frontend sizes its arrays so), else how
// many were written (it resizes its results to that).
std::int64_t answered(std::int64_t n, std::int64_t requested, const void* out) {
  return out == nullptr ? n : std::min(n, requested);
}

// Writes `n` elements of `type` from `data` for a get of `requested`.
cudnnStatus_t answer(cudnnBackendAttributeType_t asked, cudnnBackendAttributeType_t type,
                     const void* data, std::int64_t n, std::int64_t requested, std::int64_t* count,
                     void* out) {
  if (asked != type)
    return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE,
                "cudnnBackendGetAttribute: wrong attribute type");
  if (count != nullptr) *count = answered(n, requested, out);
  if (out != nullptr && requested > 0 && n > 0) {
    std::memcpy(out, data, static_cast<std::size_t>(std::min(n, requested)) * element_size(type));
  }
  return CUDNN_STATUS_SUCCESS;
}

// Fills the caller's descriptors of `type` with what `from` gives (each as
// cuDNN returns one: finalized).
cudnnStatus_t fill(cudnnBackendAttributeType_t asked, cudnnBackendDescriptorType_t type,
                   std::int64_t n, std::int64_t requested, std::int64_t* count, void* out,
                   const std::function<void(std::int64_t, Descriptor&)>& from) {
  if (asked != CUDNN_TYPE_BACKEND_DESCRIPTOR) {
    return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE,
                "cudnnBackendGetAttribute: wrong attribute type");
  }
  if (count != nullptr) *count = answered(n, requested, out);
  if (out == nullptr) return CUDNN_STATUS_SUCCESS;
  auto* targets = static_cast<void**>(out);
  for (std::int64_t i = 0; i < std::min(n, requested); ++i) {
    Descriptor* t = registry().find(targets[i]);
    if (t == nullptr || t->type != type) {
      return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendGetAttribute: element " + std::to_string(i) +
                                              " is no descriptor of type " + std::to_string(type));
    }
    from(i, *t);
    t->finalized = true;
  }
  return CUDNN_STATUS_SUCCESS;
}

void as_engine(const Descriptor& src, Descriptor& t) {
  t.graph = src.graph, t.engine = src.engine;
  t.attributes.clear();
  const std::int64_t index = src.engine.global_index;
  Attribute a{CUDNN_TYPE_INT64, 1, std::vector<unsigned char>(sizeof index)};
  std::memcpy(a.bytes.data(), &index, sizeof index);
  t.attributes[CUDNN_ATTR_ENGINE_GLOBAL_INDEX] = a;
}
void as_config(const model::GraphSummary& g, const model::Engine& e, Descriptor& t) {
  t.graph = g, t.engine = e, t.workspace = model::plan_workspace(g, e.global_index);
  t.attributes.clear();
}

cudnnStatus_t get(const Descriptor& d, int name, cudnnBackendAttributeType_t type,
                  std::int64_t requested, std::int64_t* count, void* out) {
  const auto i64 = [&](std::int64_t v) {
    return answer(type, CUDNN_TYPE_INT64, &v, 1, requested, count, out);
  };
  switch (name) {
    case CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT: return i64(model::engine_count(d.graph));
    case CUDNN_ATTR_ENGINEHEUR_RESULTS:
      return fill(type, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
                  static_cast<std::int64_t>(d.results.size()), requested, count, out,
                  [&](std::int64_t i, Descriptor& t) {
                    as_config(d.graph, d.results[static_cast<std::size_t>(i)], t);
                  });
    case CUDNN_ATTR_ENGINECFG_ENGINE:
      if (d.type != CUDNN_BACKEND_ENGINECFG_DESCRIPTOR) break;
      return fill(type, CUDNN_BACKEND_ENGINE_DESCRIPTOR, 1, requested, count, out,
                  [&](std::int64_t, Descriptor& t) { as_engine(d, t); });
    case CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG:
      return fill(type, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, 1, requested, count, out,
                  [&](std::int64_t, Descriptor& t) { as_config(d.graph, d.engine, t); });
    case CUDNN_ATTR_ENGINE_GLOBAL_INDEX: return i64(d.engine.global_index);
    case CUDNN_ATTR_ENGINE_NUMERICAL_NOTE: {
      std::vector<int> notes;
      if (d.engine.tensor_core) notes.push_back(CUDNN_NUMERICAL_NOTE_TENSOR_CORE);
      if (d.engine.down_converts) notes.push_back(CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS);
      if (d.engine.nondeterministic) notes.push_back(CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC);
      return answer(type, CUDNN_TYPE_NUMERICAL_NOTE, notes.data(),
                    static_cast<std::int64_t>(notes.size()), requested, count, out);
    }
    case CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE:
      return answer(type, CUDNN_TYPE_BEHAVIOR_NOTE, nullptr, 0, requested, count, out);
    case CUDNN_ATTR_ENGINE_KNOB_INFO:  // the model's engines have no knobs
      return fill(type, CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR, 0, requested, count, out,
                  [](std::int64_t, Descriptor&) {});
    case CUDNN_ATTR_ENGINECFG_KNOB_CHOICES:
      if (!has(d, name)) {
        return fill(type, CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, 0, requested, count, out,
                    [](std::int64_t, Descriptor&) {});
      }
      break;
    case CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE:
    case CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE:
      return i64(static_cast<std::int64_t>(d.workspace));
    case CUDNN_ATTR_ENGINECFG_SHARED_MEMORY_USED: {  // an INT32, as cudnn-frontend asks it
      const std::int32_t none = 0;
      return answer(type, CUDNN_TYPE_INT32, &none, 1, requested, count, out);
    }
    case CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION: {
      const std::string json = "{\"engine\":" + std::to_string(d.engine.global_index) +
                               ",\"workspace\":" + std::to_string(d.workspace) +
                               ",\"simulated\":true}";
      return answer(type, CUDNN_TYPE_CHAR, json.c_str(), static_cast<std::int64_t>(json.size() + 1),
                    requested, count, out);
    }
    default: break;
  }
  const Attribute* a = attribute(d, name);
  if (a == nullptr) {
    return fail(CUDNN_STATUS_BAD_PARAM,
                "cudnnBackendGetAttribute: " + named(d, name) + " was never set");
  }
  if (a->type == CUDNN_TYPE_BACKEND_DESCRIPTOR) {  // copies of the descriptors it names
    const auto sources = values<void*>(d, name);
    if (type != CUDNN_TYPE_BACKEND_DESCRIPTOR) {
      return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE,
                  "cudnnBackendGetAttribute: wrong attribute type");
    }
    if (count != nullptr) *count = answered(a->count, requested, out);
    auto* targets = static_cast<void**>(out);
    for (std::int64_t i = 0; out != nullptr && i < std::min(a->count, requested); ++i) {
      const Descriptor* s = registry().find(sources[static_cast<std::size_t>(i)]);
      Descriptor* t = registry().find(targets[i]);
      if (s == nullptr || t == nullptr || s->type != t->type) {
        return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendGetAttribute: " + named(d, name) +
                                                ": a target is no descriptor of the type it names");
      }
      *t = *s;
    }
    return CUDNN_STATUS_SUCCESS;
  }
  return answer(type, a->type, a->bytes.data(), a->count, requested, count, out);
}

}  // namespace

extern "C" {

SIMCUDA_API cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t type,
                                                       cudnnBackendDescriptor_t* out) {
  if (out == nullptr) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  Descriptor* made = registry().make();
  if (made == nullptr)
    return fail(CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED, "cudnnBackendCreateDescriptor");
  made->type = type;
  *out = reinterpret_cast<cudnnBackendDescriptor_t>(made);
  return logged("cudnnBackendCreateDescriptor", *out, type, -1, CUDNN_STATUS_SUCCESS);
}

SIMCUDA_API cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t desc) {
  if (desc == nullptr) return CUDNN_STATUS_SUCCESS;
  return registry().destroy(desc)
             ? CUDNN_STATUS_SUCCESS
             : fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendDestroyDescriptor: no such descriptor");
}

SIMCUDA_API cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t desc,
                                                   cudnnBackendAttributeName_t name,
                                                   cudnnBackendAttributeType_t type, int64_t count,
                                                   const void* elements) {
  Descriptor* d = registry().find(desc);
  if (d == nullptr)
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendSetAttribute: no such descriptor");
  if (d->finalized) {
    return fail(CUDNN_STATUS_BAD_PARAM,
                "cudnnBackendSetAttribute: " + named(*d, name) + ": already finalized");
  }
  const std::size_t size = element_size(type);
  if (size == 0) {
    return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE,
                "cudnnBackendSetAttribute: " + named(*d, name) + ": unknown attribute type " +
                    std::to_string(type));
  }
  if (count < 0 || (count > 0 && elements == nullptr)) {
    return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER,
                "cudnnBackendSetAttribute: " + named(*d, name) + ": no elements for a count of " +
                    std::to_string(count));
  }
  if (type == CUDNN_TYPE_BACKEND_DESCRIPTOR) {
    const auto* p = static_cast<void* const*>(elements);
    for (int64_t i = 0; i < count; ++i) {
      if (registry().find(p[i]) == nullptr) {
        return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendSetAttribute: " + named(*d, name) +
                                                ": element " + std::to_string(i) +
                                                " is no live descriptor");
      }
    }
  }
  Attribute a{type, count, std::vector<unsigned char>(static_cast<std::size_t>(count) * size)};
  if (count > 0) std::memcpy(a.bytes.data(), elements, a.bytes.size());
  d->attributes[name] = std::move(a);
  return logged("cudnnBackendSetAttribute", desc, d->type, name, CUDNN_STATUS_SUCCESS, count);
}

SIMCUDA_API cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const desc,
                                                   cudnnBackendAttributeName_t name,
                                                   cudnnBackendAttributeType_t type,
                                                   int64_t requested, int64_t* count,
                                                   void* elements) {
  const Descriptor* d = registry().find(desc);
  if (d == nullptr)
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendGetAttribute: no such descriptor");
  if (requested < 0)
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendGetAttribute: a negative element count");
  if (!d->finalized) {
    return fail(
        CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED,
        "cudnnBackendGetAttribute: " + named(*d, name) + ": the descriptor was not finalized");
  }
  const cudnnStatus_t s = get(*d, name, type, requested, count, elements);
  return logged("cudnnBackendGetAttribute", desc, d->type, name, s, count != nullptr ? *count : -1);
}

SIMCUDA_API cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t desc) {
  Descriptor* d = registry().find(desc);
  if (d == nullptr) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendFinalize: no such descriptor");
  if (d->finalized) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendFinalize: already finalized");
  return logged("cudnnBackendFinalize", desc, d->type, -1, finalize(*d));
}

// A plan of this handle's, run with a variant pack: the workspace it needs
// must be given; then it is a kernel.
SIMCUDA_API cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t plan,
                                              cudnnBackendDescriptor_t pack) {
  if (!model::valid_handle(handle))
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: no such handle");
  const Descriptor* p = registry().find(plan);
  const Descriptor* v = registry().find(pack);
  if (p == nullptr || p->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR || !p->finalized) {
    return fail(CUDNN_STATUS_BAD_PARAM,
                "cudnnBackendExecute: the plan is no finalized execution plan");
  }
  if (v == nullptr || v->type != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR || !v->finalized) {
    return fail(CUDNN_STATUS_BAD_PARAM,
                "cudnnBackendExecute: the variant pack is no finalized variant pack");
  }
  const auto workspace = values<void*>(*v, CUDNN_ATTR_VARIANT_PACK_WORKSPACE);
  if (p->workspace > 0 && (workspace.empty() || workspace.front() == nullptr)) {
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: the plan needs " +
                                            std::to_string(p->workspace) +
                                            " bytes of workspace and the variant pack gives none");
  }
  return model::kernel("cudnnBackendExecute");
}

}  // extern "C"
