// Stream capture and CUDA graphs of the simulated runtime: see graphs.hpp.
#include "graphs.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "sim.hpp"

using reservoir::simcuda::Event;
using reservoir::simcuda::Sim;
using reservoir::simcuda::Stream;

// The runtime's error bookkeeping (runtime.cpp).
cudaError_t reservoir_simcudart_result(int code);

namespace reservoir::simcuda::capture {
namespace {

cudaError_t result(int code) { return reservoir_simcudart_result(code); }

enum class Kind { Kernel, Copy, Fill, Host, Record, Wait, Child, Empty };

struct Segment {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t count = 0;
};

// What a node does when its graph runs.
struct Step {
  Kind kind = Kind::Empty;
  std::vector<Segment> segments;  // Copy
  void* ptr = nullptr;            // Fill: dst, rows of `count` elements of `element` bytes
  size_t pitch = 0, count = 0, rows = 1;
  unsigned value = 0, element = 1;
  const void* function = nullptr;  // Kernel
  double ms = 0.0;
  cudaHostFn_t fn = nullptr;  // Host
  void* data = nullptr;
  Event* event = nullptr;                            // Record, Wait
  std::shared_ptr<const std::vector<Step>> child;    // Child: the launched graph's steps
};

struct Graph;
}  // namespace
}  // namespace reservoir::simcuda::capture

// The opaque handle types of the runtime are these structures.
struct CUgraphNode_st {
  reservoir::simcuda::capture::Step step;
  std::vector<CUgraphNode_st*> deps;
  reservoir::simcuda::capture::Graph* graph = nullptr;
};
struct CUuserObject_st {
  void* ptr = nullptr;
  cudaHostFn_t destroy = nullptr;
  unsigned refs = 0;
};

namespace reservoir::simcuda::capture {
namespace {

using Node = CUgraphNode_st;
using UserObject = CUuserObject_st;

struct Graph {
  std::vector<std::unique_ptr<Node>> nodes;
  std::map<UserObject*, unsigned> objects;  // user objects and the references it holds
  bool capturing = false;
};

struct Exec {
  int device = 0;
  std::shared_ptr<const std::vector<Step>> steps;
  std::vector<std::pair<Kind, std::vector<std::size_t>>> shape;  // each node's kind and dependencies
  std::map<UserObject*, unsigned> objects;
};

struct Capture {
  unsigned long long id = 0;
  Graph* graph = nullptr;
  bool owns_graph = true;  // false when captured into the caller's graph
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
  std::uintptr_t origin = 0;
  int device = 0;
  bool invalidated = false;
};

struct StreamState {
  Capture* capture = nullptr;
  std::vector<Node*> deps;
  bool blocking = false;  // synchronizes with the legacy stream (set when it enters the capture)
};

struct CapturedEvent {
  Capture* capture = nullptr;
  std::vector<Node*> deps;
};

std::mutex mu;
unsigned long long next_id = 1;
std::map<unsigned long long, std::unique_ptr<Capture>> captures;  // live captures by id
std::map<std::uintptr_t, StreamState> streams;                    // capturing streams
std::map<const Event*, CapturedEvent> events;                     // events last recorded in a capture
std::map<Graph*, std::unique_ptr<Graph>> graphs;
std::map<Exec*, std::unique_ptr<Exec>> execs;
std::set<UserObject*> objects;

thread_local cudaStreamCaptureMode thread_mode = cudaStreamCaptureModeGlobal;
thread_local char per_thread_key;  // this thread's cudaStreamPerThread

bool is_legacy(cudaStream_t s) { return s == nullptr || reinterpret_cast<std::uintptr_t>(s) == 1; }
bool is_per_thread(cudaStream_t s) { return reinterpret_cast<std::uintptr_t>(s) == 2; }
std::uintptr_t key_of(cudaStream_t s) {
  return is_per_thread(s) ? reinterpret_cast<std::uintptr_t>(&per_thread_key) : reinterpret_cast<std::uintptr_t>(s);
}
int device_of(cudaStream_t s) {
  return is_legacy(s) || is_per_thread(s) ? Sim::current_device() : reinterpret_cast<Stream*>(s)->device;
}
bool blocking(cudaStream_t s) {
  return is_per_thread(s) || (reinterpret_cast<Stream*>(s)->flags & cudaStreamNonBlocking) == 0;
}

StreamState* state_of(cudaStream_t s) {
  auto it = streams.find(key_of(s));
  return it == streams.end() ? nullptr : &it->second;
}

// Releases `count` references of a user object; its destructor, when the
// last goes, is returned for the caller to run outside the lock.
std::pair<cudaHostFn_t, void*> drop(UserObject* o, unsigned count) {
  o->refs = count >= o->refs ? 0 : o->refs - count;
  if (o->refs != 0) return {nullptr, nullptr};
  std::pair<cudaHostFn_t, void*> destructor{o->destroy, o->ptr};
  objects.erase(o);
  delete o;  // NOLINT(cppcoreguidelines-owning-memory): handles are raw pointers by the API's design
  return destructor;
}
using Destructors = std::vector<std::pair<cudaHostFn_t, void*>>;
void run_destructors(const Destructors& ds) {
  for (const auto& [fn, data] : ds) {
    if (fn != nullptr) fn(data);
  }
}
Destructors release_all(std::map<UserObject*, unsigned>& held) {
  Destructors out;
  for (auto& [o, n] : held) out.push_back(drop(o, n));
  held.clear();
  return out;
}

// Ends a capture: its streams and events leave it, and the graph it made
// is destroyed unless `keep`.
Destructors end(Capture* c, bool keep) {
  for (auto it = streams.begin(); it != streams.end();) {
    it = it->second.capture == c ? streams.erase(it) : std::next(it);
  }
  for (auto it = events.begin(); it != events.end();) {
    it = it->second.capture == c ? events.erase(it) : std::next(it);
  }
  Destructors ds;
  if (c->owns_graph && !keep) {
    auto g = graphs.find(c->graph);
    if (g != graphs.end()) {
      ds = release_all(g->second->objects);
      graphs.erase(g);
    }
  } else if (c->graph != nullptr) {
    c->graph->capturing = false;
  }
  captures.erase(c->id);
  return ds;
}

Node* add_node(Graph* g, Step step, const std::vector<Node*>& deps) {
  auto node = std::make_unique<Node>();
  node->step = std::move(step);
  node->deps = deps;
  node->graph = g;
  g->nodes.push_back(std::move(node));
  return g->nodes.back().get();
}

// The work of a capturing stream: a node after its last ones.
int capture_step(cudaStream_t s, Step step) {
  std::lock_guard<std::mutex> lock(mu);
  StreamState* st = state_of(s);
  if (st == nullptr) return kNotCapturing;
  if (st->capture->invalidated) return cudaErrorStreamCaptureInvalidated;
  Node* n = add_node(st->capture->graph, std::move(step), st->deps);
  st->deps.assign(1, n);
  return cudaSuccess;
}

// Whether the calling thread may make a potentially unsafe call now; the
// captures that forbid it are invalidated when it may not.
int judge_unsafe_locked() {
  if (thread_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  const std::thread::id me = std::this_thread::get_id();
  bool refused = false;
  for (auto& [id, c] : captures) {
    if (c->mode == cudaStreamCaptureModeRelaxed) continue;
    const bool mine = c->thread == me;
    const bool global_elsewhere = thread_mode == cudaStreamCaptureModeGlobal && c->mode == cudaStreamCaptureModeGlobal;
    if (mine || global_elsewhere) {
      c->invalidated = true;
      refused = true;
    }
  }
  return refused ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

// Every node `from` depends on, itself included.
void ancestors(const std::vector<Node*>& from, std::set<const Node*>& out) {
  std::vector<const Node*> todo(from.begin(), from.end());
  while (!todo.empty()) {
    const Node* n = todo.back();
    todo.pop_back();
    if (!out.insert(n).second) continue;
    todo.insert(todo.end(), n->deps.begin(), n->deps.end());
  }
}

std::vector<std::pair<Kind, std::vector<std::size_t>>> shape_of(const Graph& g) {
  std::map<const Node*, std::size_t> index;
  for (std::size_t i = 0; i < g.nodes.size(); ++i) index[g.nodes[i].get()] = i;
  std::vector<std::pair<Kind, std::vector<std::size_t>>> shape;
  for (const auto& n : g.nodes) {
    std::vector<std::size_t> deps;
    for (const Node* d : n->deps) deps.push_back(index.at(d));
    std::sort(deps.begin(), deps.end());
    shape.emplace_back(n->step.kind, std::move(deps));
  }
  return shape;
}

std::shared_ptr<const std::vector<Step>> steps_of(const Graph& g) {
  auto steps = std::make_shared<std::vector<Step>>();
  for (const auto& n : g.nodes) steps->push_back(n->step);
  return steps;
}

// Runs a graph's steps on `s`, in order (each depends only on earlier ones).
int run_steps(const std::vector<Step>& steps, cudaStream_t s, int device) {
  Sim& sim = Sim::get();
  for (const Step& step : steps) {
    switch (step.kind) {
      case Kind::Kernel:
        if (!sim.allow_kernels()) return sim.refuse(sim.function_name(step.function).c_str());
        sim.run(s, device, step.ms);
        break;
      case Kind::Copy:
        for (const Segment& seg : step.segments) {
          if (const int fault = sim.copy(seg.dst, seg.src, seg.count)) return fault;
        }
        sim.run(s, device, 0.0);
        break;
      case Kind::Fill: {
        auto* row = static_cast<unsigned char*>(step.ptr);
        for (size_t r = 0; r < step.rows; ++r, row += step.pitch) {
          if (step.element == 1) {
            if (const int fault = sim.fill(row, static_cast<int>(step.value), step.count)) return fault;
            continue;
          }
          if (const int fault = sim.touch(row, step.count * step.element)) return fault;
          for (size_t i = 0; i < step.count; ++i) std::memcpy(row + i * step.element, &step.value, step.element);
        }
        sim.run(s, device, 0.0);
        break;
      }
      case Kind::Host:
        step.fn(step.data);
        break;
      case Kind::Record:
        sim.record(step.event, s);
        break;
      case Kind::Child:
        if (const int code = run_steps(*step.child, s, device)) return code;
        break;
      case Kind::Wait:
      case Kind::Empty:
        break;
    }
  }
  return cudaSuccess;
}

bool valid_mode(cudaStreamCaptureMode mode) {
  return mode == cudaStreamCaptureModeGlobal || mode == cudaStreamCaptureModeThreadLocal ||
         mode == cudaStreamCaptureModeRelaxed;
}

int begin(cudaStream_t s, Graph* into, const cudaGraphNode_t* deps, size_t count, cudaStreamCaptureMode mode) {
  if (!valid_mode(mode)) return cudaErrorInvalidValue;
  if (is_legacy(s)) return cudaErrorStreamCaptureUnsupported;  // the legacy stream cannot capture
  std::lock_guard<std::mutex> lock(mu);
  if (state_of(s) != nullptr) return cudaErrorIllegalState;
  auto c = std::make_unique<Capture>();
  c->id = next_id++;
  c->mode = mode;
  c->thread = std::this_thread::get_id();
  c->origin = key_of(s);
  c->device = device_of(s);
  StreamState st;
  if (into != nullptr) {
    if (graphs.count(into) == 0 || into->capturing) return cudaErrorInvalidValue;
    c->graph = into;
    c->owns_graph = false;
    for (size_t i = 0; i < count; ++i) {
      if (deps == nullptr || deps[i] == nullptr || deps[i]->graph != into) return cudaErrorInvalidValue;
      st.deps.push_back(deps[i]);
    }
  } else {
    auto g = std::make_unique<Graph>();
    c->graph = g.get();
    graphs.emplace(g.get(), std::move(g));
  }
  c->graph->capturing = true;
  st.capture = c.get();
  st.blocking = blocking(s);
  streams[key_of(s)] = st;
  captures.emplace(c->id, std::move(c));
  return cudaSuccess;
}

}  // namespace

int capture_kernel(cudaStream_t s, const void* function, double ms) {
  Step step;
  step.kind = Kind::Kernel;
  step.function = function;
  step.ms = ms;
  return capture_step(s, std::move(step));
}

int capture_copy(cudaStream_t s, void* dst, const void* src, size_t count) {
  Step step;
  step.kind = Kind::Copy;
  step.segments.push_back({dst, src, count});
  return capture_step(s, std::move(step));
}

int capture_copy_2d(cudaStream_t s, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                    size_t height) {
  Step step;
  step.kind = Kind::Copy;
  for (size_t row = 0; row < height; ++row) {
    step.segments.push_back(
        {static_cast<char*>(dst) + row * dpitch, static_cast<const char*>(src) + row * spitch, width});
  }
  return capture_step(s, std::move(step));
}

int capture_fill(cudaStream_t s, void* ptr, int value, size_t count) {
  Step step;
  step.kind = Kind::Fill;
  step.ptr = ptr;
  step.value = static_cast<unsigned char>(value);
  step.count = count;
  return capture_step(s, std::move(step));
}

int capture_host(cudaStream_t s, cudaHostFn_t fn, void* data) {
  Step step;
  step.kind = Kind::Host;
  step.fn = fn;
  step.data = data;
  return capture_step(s, std::move(step));
}

int capture_record(cudaEvent_t e, cudaStream_t s) {
  const auto* event = reinterpret_cast<const Event*>(e);
  std::lock_guard<std::mutex> lock(mu);
  StreamState* st = state_of(s);
  if (st == nullptr) {
    events.erase(event);
    return kNotCapturing;
  }
  if (st->capture->invalidated) return cudaErrorStreamCaptureInvalidated;
  events[event] = CapturedEvent{st->capture, st->deps};
  return cudaSuccess;
}

int capture_wait(cudaStream_t s, cudaEvent_t e) {
  const auto* event = reinterpret_cast<const Event*>(e);
  std::lock_guard<std::mutex> lock(mu);
  StreamState* st = state_of(s);
  auto ev = events.find(event);
  if (ev == events.end()) {
    // An event of work outside any capture: a capturing stream's graph
    // cannot depend on it, and that work is done here when issued.
    return st == nullptr ? kNotCapturing : (st->capture->invalidated ? cudaErrorStreamCaptureInvalidated : cudaSuccess);
  }
  Capture* c = ev->second.capture;
  if (c->invalidated) return cudaErrorStreamCaptureInvalidated;
  if (st == nullptr) {
    if (is_legacy(s)) {
      c->invalidated = true;
      return cudaErrorStreamCaptureImplicit;
    }
    streams[key_of(s)] = StreamState{c, ev->second.deps, blocking(s)};  // joins the capture
    return cudaSuccess;
  }
  if (st->capture != c) {
    st->capture->invalidated = true;
    c->invalidated = true;
    return cudaErrorStreamCaptureMerge;
  }
  if (st->capture->invalidated) return cudaErrorStreamCaptureInvalidated;
  for (Node* n : ev->second.deps) {
    if (std::find(st->deps.begin(), st->deps.end(), n) == st->deps.end()) st->deps.push_back(n);
  }
  return cudaSuccess;
}

int capture_refuses(cudaStream_t s, const char* call) {
  {
    std::lock_guard<std::mutex> lock(mu);
    StreamState* st = state_of(s);
    if (st == nullptr) return kNotCapturing;
    st->capture->invalidated = true;
  }
  return Sim::get().refuse(call);
}

int unsafe_call() {
  std::lock_guard<std::mutex> lock(mu);
  return judge_unsafe_locked();
}

int stream_sync(cudaStream_t s, int device) {
  if (const int implicit = legacy_use(s, device)) return implicit;
  std::lock_guard<std::mutex> lock(mu);
  if (StreamState* st = state_of(s)) {
    st->capture->invalidated = true;
    return cudaErrorStreamCaptureUnsupported;
  }
  return judge_unsafe_locked();
}

int device_sync(int device) {
  std::lock_guard<std::mutex> lock(mu);
  bool refused = false;
  for (auto& [id, c] : captures) {
    if (c->device == device) {
      c->invalidated = true;
      refused = true;
    }
  }
  return refused ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

int event_sync(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(mu);
  auto ev = events.find(reinterpret_cast<const Event*>(e));
  if (ev != events.end()) {
    ev->second.capture->invalidated = true;
    return cudaErrorCapturedEvent;
  }
  return judge_unsafe_locked();
}

int legacy_use(cudaStream_t s, int device) {
  if (!is_legacy(s)) return cudaSuccess;
  std::lock_guard<std::mutex> lock(mu);
  bool refused = false;
  for (auto& [key, st] : streams) {
    if (st.capture->device != device || !st.blocking) continue;
    st.capture->invalidated = true;
    refused = true;
  }
  return refused ? cudaErrorStreamCaptureImplicit : cudaSuccess;
}

void forget_stream(cudaStream_t s) {
  Destructors ds;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = streams.find(key_of(s));
    if (it == streams.end()) return;
    Capture* c = it->second.capture;
    c->invalidated = true;
    streams.erase(it);
    if (c->origin == key_of(s)) ds = end(c, false);
  }
  run_destructors(ds);
}

void forget_event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(mu);
  events.erase(reinterpret_cast<const Event*>(e));
}

}  // namespace reservoir::simcuda::capture

using namespace reservoir::simcuda::capture;  // NOLINT(google-build-using-namespace): the entry points below

#define ENTER(name, alloc)                                         \
  Sim::runtime_thread() = true;                                    \
  if (const int injected = Sim::get().enter(name, alloc)) return result(injected)

extern "C" {

// ---- stream capture -------------------------------------------------------

SIMCUDA_API cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  ENTER("cudaStreamBeginCapture", false);
  return result(begin(s, nullptr, nullptr, 0, mode));
}

#if CUDART_VERSION >= 12000  // CUDA 12.3's
SIMCUDA_API cudaError_t cudaStreamBeginCaptureToGraph(cudaStream_t s, cudaGraph_t graph,
                                                      const cudaGraphNode_t* deps, const cudaGraphEdgeData* edges,
                                                      size_t count, cudaStreamCaptureMode mode) {
  ENTER("cudaStreamBeginCaptureToGraph", false);
  (void)edges;
  if (graph == nullptr) return result(cudaErrorInvalidValue);
  return result(begin(s, reinterpret_cast<Graph*>(graph), deps, count, mode));
}
#endif

SIMCUDA_API cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  ENTER("cudaStreamEndCapture", false);
  if (graph == nullptr) return result(cudaErrorInvalidValue);
  Destructors ds;
  int code = cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(mu);
    StreamState* st = state_of(s);
    if (st == nullptr) return result(cudaErrorIllegalState);
    Capture* c = st->capture;
    if (c->origin != key_of(s)) return result(cudaErrorStreamCaptureUnmatched);
    if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id()) {
      return result(cudaErrorStreamCaptureWrongThread);
    }
    *graph = nullptr;
    if (c->invalidated) {
      code = cudaErrorStreamCaptureInvalidated;
    } else {
      std::set<const Node*> joined;
      ancestors(st->deps, joined);
      for (const auto& [key, other] : streams) {
        if (other.capture != c || key == c->origin) continue;
        for (const Node* n : other.deps) {
          if (joined.count(n) == 0) code = cudaErrorStreamCaptureUnjoined;
        }
      }
    }
    if (code == cudaSuccess) *graph = reinterpret_cast<cudaGraph_t>(c->graph);
    ds = end(c, code == cudaSuccess);
  }
  run_destructors(ds);
  return result(code);
}

SIMCUDA_API cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  ENTER("cudaStreamIsCapturing", false);
  if (status == nullptr) return result(cudaErrorInvalidValue);
  if (const int implicit = legacy_use(s, device_of(s))) return result(implicit);
  std::lock_guard<std::mutex> lock(mu);
  const StreamState* st = state_of(s);
  *status = st == nullptr ? cudaStreamCaptureStatusNone
                          : (st->capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                                      : cudaStreamCaptureStatusActive);
  return cudaSuccess;
}

}  // extern "C"

namespace {

// What a capture query reports, in every version's terms (CUDA 12's edges
// are left to the caller: every edge here is a default one).
cudaError_t capture_info(cudaStream_t s, cudaStreamCaptureStatus* status, unsigned long long* id, cudaGraph_t* graph,
                         const cudaGraphNode_t** deps, size_t* count) {
  ENTER("cudaStreamGetCaptureInfo", false);
  if (status == nullptr) return result(cudaErrorInvalidValue);
  if (const int implicit = legacy_use(s, device_of(s))) return result(implicit);
  std::lock_guard<std::mutex> lock(mu);
  StreamState* st = state_of(s);
  if (st == nullptr) {
    *status = cudaStreamCaptureStatusNone;
    if (id != nullptr) *id = 0;
    if (graph != nullptr) *graph = nullptr;
    if (deps != nullptr) *deps = nullptr;
    if (count != nullptr) *count = 0;
    return cudaSuccess;
  }
  *status = st->capture->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  if (id != nullptr) *id = st->capture->id;
  if (graph != nullptr) *graph = reinterpret_cast<cudaGraph_t>(st->capture->graph);
  if (deps != nullptr) *deps = st->deps.empty() ? nullptr : st->deps.data();
  if (count != nullptr) *count = st->deps.size();
  return cudaSuccess;
}

// Sets (or adds to) the nodes a capturing stream's next work depends on.
cudaError_t update_capture_dependencies(cudaStream_t s, cudaGraphNode_t* deps, size_t count, unsigned int flags) {
  ENTER("cudaStreamUpdateCaptureDependencies", false);
  if (flags != cudaStreamAddCaptureDependencies && flags != cudaStreamSetCaptureDependencies) {
    return result(cudaErrorInvalidValue);
  }
  std::lock_guard<std::mutex> lock(mu);
  StreamState* st = state_of(s);
  if (st == nullptr) return result(cudaErrorIllegalState);
  if (st->capture->invalidated) return result(cudaErrorStreamCaptureInvalidated);
  std::vector<Node*> next = flags == cudaStreamAddCaptureDependencies ? st->deps : std::vector<Node*>{};
  for (size_t i = 0; i < count; ++i) {
    if (deps == nullptr || deps[i] == nullptr || deps[i]->graph != st->capture->graph) {
      return result(cudaErrorInvalidValue);
    }
    if (std::find(next.begin(), next.end(), deps[i]) == next.end()) next.push_back(deps[i]);
  }
  st->deps = std::move(next);
  return cudaSuccess;
}

// A node's dependencies (the first *count of them into deps, when given).
cudaError_t node_dependencies(cudaGraphNode_t node, cudaGraphNode_t* deps, size_t* count) {
  ENTER("cudaGraphNodeGetDependencies", false);
  if (node == nullptr || count == nullptr) return result(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(mu);
  if (deps != nullptr) {
    for (size_t i = 0; i < *count; ++i) deps[i] = i < node->deps.size() ? node->deps[i] : nullptr;
    *count = std::min(*count, node->deps.size());
  } else {
    *count = node->deps.size();
  }
  return cudaSuccess;
}

// The executable graph takes the graph's node parameters when both have
// the same nodes (kinds and dependencies), as CUDA's whole-graph update.
// *judged says whether the graphs were compared (and *verdict_out set).
cudaError_t exec_update(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResult* verdict_out,
                        bool* judged) {
  ENTER("cudaGraphExecUpdate", false);
  std::lock_guard<std::mutex> lock(mu);
  auto e = execs.find(reinterpret_cast<Exec*>(exec));
  auto g = graphs.find(reinterpret_cast<Graph*>(graph));
  if (e == execs.end() || g == graphs.end()) return result(cudaErrorInvalidValue);
  const auto shape = shape_of(*g->second);
  cudaGraphExecUpdateResult verdict = cudaGraphExecUpdateSuccess;
  if (shape.size() != e->second->shape.size()) {
    verdict = cudaGraphExecUpdateErrorTopologyChanged;
  } else {
    for (size_t i = 0; i < shape.size() && verdict == cudaGraphExecUpdateSuccess; ++i) {
      if (shape[i].second != e->second->shape[i].second) verdict = cudaGraphExecUpdateErrorTopologyChanged;
      else if (shape[i].first != e->second->shape[i].first) verdict = cudaGraphExecUpdateErrorNodeTypeChanged;
    }
  }
  *verdict_out = verdict;
  *judged = true;
  if (verdict != cudaGraphExecUpdateSuccess) return result(cudaErrorGraphExecUpdateFailure);
  e->second->steps = steps_of(*g->second);
  return cudaSuccess;
}

// A node added by hand to `graph` after `deps` (cudaGraphAddEmptyNode,
// cudaGraphAddNode): into *node.
cudaError_t add_by_hand(cudaGraphNode_t* node, cudaGraph_t graph, const cudaGraphNode_t* deps, size_t count,
                        Step step) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = graphs.find(reinterpret_cast<Graph*>(graph));
  if (it == graphs.end()) return result(cudaErrorInvalidValue);
  std::vector<Node*> after;
  for (size_t i = 0; i < count; ++i) {
    if (deps == nullptr || deps[i] == nullptr || deps[i]->graph != it->first) return result(cudaErrorInvalidValue);
    after.push_back(deps[i]);
  }
  *node = add_node(it->first, std::move(step), after);
  return cudaSuccess;
}

}  // namespace

extern "C" {

#if CUDART_VERSION >= 12000
// CUDA 13's cudaStreamGetCaptureInfo is CUDA 12's _v3 (12's name, a macro,
// means _v2: runtime12.cpp).
#if CUDART_VERSION < 13000
#define SIMCUDA_CAPTURE_INFO cudaStreamGetCaptureInfo_v3
#else
#define SIMCUDA_CAPTURE_INFO cudaStreamGetCaptureInfo
#endif
SIMCUDA_API cudaError_t SIMCUDA_CAPTURE_INFO(
    cudaStream_t s, cudaStreamCaptureStatus* status, unsigned long long* id, cudaGraph_t* graph,
    const cudaGraphNode_t** deps, const cudaGraphEdgeData** edges, size_t* count) {
  const cudaError_t code = capture_info(s, status, id, graph, deps, count);
  if (code == cudaSuccess && edges != nullptr) *edges = nullptr;  // every edge is a default one
  return code;
}
#else
// CUDA 11's: the capture's status and id (unsuffixed), and its graph and
// dependencies too (_v2, which 12 made the unsuffixed one).
SIMCUDA_API cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, cudaStreamCaptureStatus* status,
                                                 unsigned long long* id) {
  return capture_info(s, status, id, nullptr, nullptr, nullptr);
}
SIMCUDA_API cudaError_t cudaStreamGetCaptureInfo_v2(cudaStream_t s, cudaStreamCaptureStatus* status,
                                                    unsigned long long* id, cudaGraph_t* graph,
                                                    const cudaGraphNode_t** deps, size_t* count) {
  return capture_info(s, status, id, graph, deps, count);
}
#endif

#if CUDART_VERSION >= 12000
SIMCUDA_API cudaError_t SIMCUDA_12_NAME(cudaStreamUpdateCaptureDependencies, _v2)(
    cudaStream_t s, cudaGraphNode_t* deps, const cudaGraphEdgeData* edges, size_t count, unsigned int flags) {
  (void)edges;  // every edge is a default one
  return update_capture_dependencies(s, deps, count, flags);
}
#endif
#if CUDART_VERSION < 13000  // 11's and 12's, without edges
SIMCUDA_API cudaError_t cudaStreamUpdateCaptureDependencies(cudaStream_t s, cudaGraphNode_t* deps, size_t count,
                                                            unsigned int flags) {
  return update_capture_dependencies(s, deps, count, flags);
}
#endif

SIMCUDA_API cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  ENTER("cudaThreadExchangeStreamCaptureMode", false);
  if (mode == nullptr || !valid_mode(*mode)) return result(cudaErrorInvalidValue);
  std::swap(thread_mode, *mode);
  return cudaSuccess;
}

// ---- graphs -----------------------------------------------------------------

SIMCUDA_API cudaError_t cudaGraphCreate(cudaGraph_t* graph, unsigned int flags) {
  ENTER("cudaGraphCreate", false);
  if (graph == nullptr || flags != 0) return result(cudaErrorInvalidValue);
  auto g = std::make_unique<Graph>();
  std::lock_guard<std::mutex> lock(mu);
  *graph = reinterpret_cast<cudaGraph_t>(g.get());
  graphs.emplace(g.get(), std::move(g));
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  ENTER("cudaGraphDestroy", false);
  Destructors ds;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = graphs.find(reinterpret_cast<Graph*>(graph));
    if (it == graphs.end()) return result(cudaErrorInvalidValue);
    if (it->second->capturing) return result(cudaErrorIllegalState);
    ds = release_all(it->second->objects);
    graphs.erase(it);
  }
  run_destructors(ds);
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, size_t* count) {
  ENTER("cudaGraphGetNodes", false);
  if (count == nullptr) return result(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(mu);
  auto it = graphs.find(reinterpret_cast<Graph*>(graph));
  if (it == graphs.end()) return result(cudaErrorInvalidValue);
  const auto& all = it->second->nodes;
  if (nodes != nullptr) {
    for (size_t i = 0; i < *count; ++i) nodes[i] = i < all.size() ? all[i].get() : nullptr;
    *count = std::min(*count, all.size());
  } else {
    *count = all.size();
  }
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaGraphNodeGetType(cudaGraphNode_t node, cudaGraphNodeType* type) {
  ENTER("cudaGraphNodeGetType", false);
  if (node == nullptr || type == nullptr) return result(cudaErrorInvalidValue);
  switch (node->step.kind) {
    case Kind::Kernel: *type = cudaGraphNodeTypeKernel; break;
    case Kind::Copy: *type = cudaGraphNodeTypeMemcpy; break;
    case Kind::Fill: *type = cudaGraphNodeTypeMemset; break;
    case Kind::Host: *type = cudaGraphNodeTypeHost; break;
    case Kind::Record: *type = cudaGraphNodeTypeEventRecord; break;
    case Kind::Wait: *type = cudaGraphNodeTypeWaitEvent; break;
    case Kind::Child: *type = cudaGraphNodeTypeGraph; break;
    case Kind::Empty: *type = cudaGraphNodeTypeEmpty; break;
  }
  return cudaSuccess;
}

#if CUDART_VERSION >= 12000
SIMCUDA_API cudaError_t SIMCUDA_12_NAME(cudaGraphNodeGetDependencies, _v2)(cudaGraphNode_t node,
                                                                          cudaGraphNode_t* deps,
                                                                          cudaGraphEdgeData* edges, size_t* count) {
  const size_t asked = count != nullptr ? *count : 0;
  const cudaError_t code = node_dependencies(node, deps, count);
  if (code == cudaSuccess && deps != nullptr && edges != nullptr) {
    for (size_t i = 0; i < asked; ++i) edges[i] = cudaGraphEdgeData{};  // every edge is a default one
  }
  return code;
}
#endif
#if CUDART_VERSION < 13000  // 11's and 12's, without edges
SIMCUDA_API cudaError_t cudaGraphNodeGetDependencies(cudaGraphNode_t node, cudaGraphNode_t* deps, size_t* count) {
  return node_dependencies(node, deps, count);
}
#endif

// An empty node added by hand after `deps` (every CUDA version's call), to
// a graph or to a capture's (PyTorch 2.9's allocator marks a block freed
// during a capture with one after each stream's last nodes).
SIMCUDA_API cudaError_t cudaGraphAddEmptyNode(cudaGraphNode_t* node, cudaGraph_t graph, const cudaGraphNode_t* deps,
                                              size_t count) {
  ENTER("cudaGraphAddEmptyNode", false);
  if (node == nullptr) return result(cudaErrorInvalidValue);
  Step step;
  step.kind = Kind::Empty;
  return add_by_hand(node, graph, deps, count, std::move(step));
}

#if CUDART_VERSION >= 12000  // CUDA 12.2's
// Nodes added by hand: empty, kernel, memset, host, event record and wait.
SIMCUDA_API cudaError_t SIMCUDA_12_NAME(cudaGraphAddNode, _v2)(cudaGraphNode_t* node, cudaGraph_t graph,
                                                              const cudaGraphNode_t* deps,
                                                              const cudaGraphEdgeData* edges, size_t count,
                                                              cudaGraphNodeParams* params) {
  ENTER("cudaGraphAddNode", false);
  (void)edges;
  if (node == nullptr || params == nullptr) return result(cudaErrorInvalidValue);
  Step step;
  switch (params->type) {
    case cudaGraphNodeTypeEmpty: step.kind = Kind::Empty; break;
    case cudaGraphNodeTypeKernel:
      step.kind = Kind::Kernel;
      step.function = params->kernel.func;
      break;
    case cudaGraphNodeTypeMemset: {
      const auto& m = params->memset;
      if (m.elementSize != 1 && m.elementSize != 2 && m.elementSize != 4) return result(cudaErrorInvalidValue);
      step.kind = Kind::Fill;
      step.ptr = m.dst;
      step.value = m.value;
      step.element = m.elementSize;
      step.count = m.width;
      step.rows = m.height;
      step.pitch = m.pitch;
      break;
    }
    case cudaGraphNodeTypeHost:
      if (params->host.fn == nullptr) return result(cudaErrorInvalidValue);
      step.kind = Kind::Host;
      step.fn = params->host.fn;
      step.data = params->host.userData;
      break;
    case cudaGraphNodeTypeEventRecord:
    case cudaGraphNodeTypeWaitEvent: {
      const bool record = params->type == cudaGraphNodeTypeEventRecord;
      step.kind = record ? Kind::Record : Kind::Wait;
      step.event = reinterpret_cast<Event*>(record ? params->eventRecord.event : params->eventWait.event);
      if (step.event == nullptr) return result(cudaErrorInvalidValue);
      break;
    }
    default:
      return result(Sim::get().refuse(params->type == cudaGraphNodeTypeConditional
                                          ? "cudaGraphAddNode (a conditional node)"
                                          : "cudaGraphAddNode (this kind of node)"));
  }
  return add_by_hand(node, graph, deps, count, std::move(step));
}

SIMCUDA_API cudaError_t cudaGraphConditionalHandleCreate(cudaGraphConditionalHandle* handle, cudaGraph_t graph,
                                                         unsigned int value, unsigned int flags) {
  (void)handle, (void)graph, (void)value, (void)flags;
  return result(Sim::get().refuse("cudaGraphConditionalHandleCreate"));
}
#endif

SIMCUDA_API cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph,
                                                      unsigned long long flags) {
  ENTER("cudaGraphInstantiateWithFlags", false);
#if CUDART_VERSION >= 12000
  constexpr unsigned long long kKnown = cudaGraphInstantiateFlagAutoFreeOnLaunch | cudaGraphInstantiateFlagUpload |
                                        cudaGraphInstantiateFlagDeviceLaunch |
                                        cudaGraphInstantiateFlagUseNodePriority;
#else  // 11.7's
  constexpr unsigned long long kKnown = cudaGraphInstantiateFlagAutoFreeOnLaunch |
                                        cudaGraphInstantiateFlagUseNodePriority;
#endif
  if (exec == nullptr || (flags & ~kKnown) != 0) return result(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(mu);
  auto it = graphs.find(reinterpret_cast<Graph*>(graph));
  if (it == graphs.end()) return result(cudaErrorInvalidValue);
  auto e = std::make_unique<Exec>();
  e->device = Sim::current_device();
  e->steps = steps_of(*it->second);
  e->shape = shape_of(*it->second);
  e->objects = it->second->objects;  // the executable graph holds the graph's user objects too
  for (auto& [o, n] : e->objects) o->refs += n;
  *exec = reinterpret_cast<cudaGraphExec_t>(e.get());
  execs.emplace(e.get(), std::move(e));
  return cudaSuccess;
}

#if CUDART_VERSION >= 12000
SIMCUDA_API cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  return cudaGraphInstantiateWithFlags(exec, graph, flags);
}
#else
// CUDA 11's: no flags; where it failed and CUDA's log (neither has anything
// to say here: instantiation fails only on invalid arguments).
SIMCUDA_API cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, cudaGraphNode_t* error_node,
                                             char* log, size_t log_size) {
  if (error_node != nullptr) *error_node = nullptr;
  if (log != nullptr && log_size > 0) log[0] = '\0';
  return cudaGraphInstantiateWithFlags(exec, graph, 0);
}
#endif

SIMCUDA_API cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  ENTER("cudaGraphExecDestroy", false);
  Destructors ds;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = execs.find(reinterpret_cast<Exec*>(exec));
    if (it == execs.end()) return result(cudaErrorInvalidValue);
    ds = release_all(it->second->objects);
    execs.erase(it);
  }
  run_destructors(ds);
  return cudaSuccess;
}

// Runs the executable graph's nodes on the stream; captured into a
// capturing stream's graph as a child graph instead.
SIMCUDA_API cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  ENTER("cudaGraphLaunch", false);
  std::shared_ptr<const std::vector<Step>> steps;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = execs.find(reinterpret_cast<Exec*>(exec));
    if (it == execs.end()) return result(cudaErrorInvalidValue);
    steps = it->second->steps;
  }
  if (const int implicit = legacy_use(s, device_of(s))) return result(implicit);
  Step child;
  child.kind = Kind::Child;
  child.child = steps;
  const int captured = capture_step(s, std::move(child));
  if (captured != kNotCapturing) return result(captured);
  return result(run_steps(*steps, s, device_of(s)));
}

SIMCUDA_API cudaError_t cudaGraphUpload(cudaGraphExec_t exec, cudaStream_t s) {
  ENTER("cudaGraphUpload", false);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (execs.count(reinterpret_cast<Exec*>(exec)) == 0) return result(cudaErrorInvalidValue);
    if (state_of(s) != nullptr) return result(cudaErrorStreamCaptureUnsupported);
  }
  Sim::get().run(s, device_of(s), 0.0);  // ordered in the stream; nothing to move here
  return cudaSuccess;
}

#if CUDART_VERSION >= 12000
SIMCUDA_API cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                            cudaGraphExecUpdateResultInfo* info) {
  cudaGraphExecUpdateResult verdict = cudaGraphExecUpdateSuccess;
  bool judged = false;
  const cudaError_t code = exec_update(exec, graph, &verdict, &judged);
  if (info != nullptr && judged) *info = cudaGraphExecUpdateResultInfo{verdict, nullptr, nullptr};
  return code;
}
#else
// CUDA 11's: the verdict and the node it concerns (none here) by pointer.
SIMCUDA_API cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphNode_t* error_node,
                                            cudaGraphExecUpdateResult* verdict) {
  if (error_node != nullptr) *error_node = nullptr;
  cudaGraphExecUpdateResult mine = cudaGraphExecUpdateSuccess;
  bool judged = false;
  const cudaError_t code = exec_update(exec, graph, &mine, &judged);
  if (verdict != nullptr && judged) *verdict = mine;
  return code;
}
#endif

// ---- user objects -----------------------------------------------------------

SIMCUDA_API cudaError_t cudaUserObjectCreate(cudaUserObject_t* object, void* ptr, cudaHostFn_t destroy,
                                             unsigned int refs, unsigned int flags) {
  ENTER("cudaUserObjectCreate", false);
  if (object == nullptr || destroy == nullptr || refs == 0 || flags != cudaUserObjectNoDestructorSync) {
    return result(cudaErrorInvalidValue);
  }
  auto* o = new UserObject{ptr, destroy, refs};  // NOLINT(cppcoreguidelines-owning-memory): a raw handle
  std::lock_guard<std::mutex> lock(mu);
  objects.insert(o);
  *object = o;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaUserObjectRetain(cudaUserObject_t object, unsigned int count) {
  ENTER("cudaUserObjectRetain", false);
  std::lock_guard<std::mutex> lock(mu);
  if (objects.count(object) == 0 || count == 0) return result(cudaErrorInvalidValue);
  object->refs += count;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaUserObjectRelease(cudaUserObject_t object, unsigned int count) {
  ENTER("cudaUserObjectRelease", false);
  std::pair<cudaHostFn_t, void*> destructor;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (objects.count(object) == 0 || count == 0) return result(cudaErrorInvalidValue);
    destructor = drop(object, count);
  }
  run_destructors({destructor});
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaGraphRetainUserObject(cudaGraph_t graph, cudaUserObject_t object, unsigned int count,
                                                  unsigned int flags) {
  ENTER("cudaGraphRetainUserObject", false);
  std::lock_guard<std::mutex> lock(mu);
  auto g = graphs.find(reinterpret_cast<Graph*>(graph));
  if (g == graphs.end() || objects.count(object) == 0 || count == 0 ||
      (flags != 0 && flags != cudaGraphUserObjectMove)) {
    return result(cudaErrorInvalidValue);
  }
  if (flags != cudaGraphUserObjectMove) object->refs += count;  // a move hands over the caller's
  g->second->objects[object] += count;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaGraphReleaseUserObject(cudaGraph_t graph, cudaUserObject_t object, unsigned int count) {
  ENTER("cudaGraphReleaseUserObject", false);
  std::pair<cudaHostFn_t, void*> destructor;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto g = graphs.find(reinterpret_cast<Graph*>(graph));
    if (g == graphs.end() || count == 0) return result(cudaErrorInvalidValue);
    auto held = g->second->objects.find(object);
    if (held == g->second->objects.end() || held->second < count) return result(cudaErrorInvalidValue);
    held->second -= count;
    if (held->second == 0) g->second->objects.erase(held);
    destructor = drop(object, count);
  }
  run_destructors({destructor});
  return cudaSuccess;
}

// ---- host functions -----------------------------------------------------------

// Runs `fn` now, in its stream's order (every earlier piece of work is done
// when issued); in a capture, a host node.
SIMCUDA_API cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* data) {
  ENTER("cudaLaunchHostFunc", false);
  if (fn == nullptr) return result(cudaErrorInvalidValue);
  if (const int implicit = legacy_use(s, device_of(s))) return result(implicit);
  const int captured = capture_host(s, fn, data);
  if (captured != kNotCapturing) return result(captured);
  Sim::get().stream_synchronize(s, device_of(s));
  fn(data);
  return cudaSuccess;
}

}  // extern "C"
