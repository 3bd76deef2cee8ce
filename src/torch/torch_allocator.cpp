// reservoir as PyTorch's own allocator (torch_allocator.hpp): allocation and
// deleters, set-up, caches, checkpoints of graphs' pools, peer access, and
// the methods that join the parts.
#include "torch_allocator.hpp"

#include "torch_profiler.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <cstring>
#include <optional>

namespace reservoir_torch_hooks {

// ---- allocation ----

c10::DataPtr ReservoirAllocator::allocate(size_t size) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  if (uncached()) {
    void* p = uncached_allocate(size);
    return {p, p, &uncached_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }
  void* p = size == 0 ? nullptr
                      : malloc_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
}

bool ReservoirAllocator::uncached() const {
  static const bool forced = [] {
    const char* v = std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return forced || !enabled_.load(std::memory_order_relaxed);
}

void* ReservoirAllocator::uncached_allocate(size_t size) {
  if (size == 0) return nullptr;
  void* p = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&p, size));
  std::lock_guard lock(mutex_);
  uncached_.insert(p);
  uncached_live_.store(uncached_.size(), std::memory_order_relaxed);
  return p;
}

// Without a lock while none lives: every free asks.
bool ReservoirAllocator::uncached_free(void* ptr) {
  if (uncached_live_.load(std::memory_order_relaxed) == 0) return false;
  {
    std::lock_guard lock(mutex_);
    if (uncached_.erase(ptr) == 0) return false;
    uncached_live_.store(uncached_.size(), std::memory_order_relaxed);
  }
  C10_CUDA_CHECK(cudaFree(ptr));
  return true;
}

c10::DeleterFnPtr ReservoirAllocator::raw_deleter() const {
  return &raw_delete_fn;
}

void ReservoirAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

void* ReservoirAllocator::raw_alloc(size_t size) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  return raw_alloc_with_stream(size, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* ReservoirAllocator::raw_alloc_with_stream(size_t size, cudaStream_t stream) {
  if (uncached()) return uncached_allocate(size);
  return size == 0 ? nullptr : malloc_on(size, c10::cuda::current_device(), stream);
}

void ReservoirAllocator::raw_delete(void* ptr) {
  if (ptr == nullptr || uncached_free(ptr)) return;
  std::optional<History::Recorded> recorded;
  if (history_.recording()) {
    int device = 0;
    {
      std::lock_guard lock(mutex_);
      auto it = live_.find(ptr);
      if (it != live_.end()) device = it->second.device;
    }
    recorded = history_.record(false, device);
  }
  if (recorded) history_.note_free(ptr, std::move(*recorded));
  Live live;
  std::size_t reported = 0;
  {
    std::lock_guard lock(mutex_);
    auto it = live_.find(ptr);
    TORCH_CHECK(it != live_.end(), "reservoir (PyTorch's allocator): raw_delete of ", ptr,
                ", which it did not allocate or has freed");
    live = it->second;
    live_.erase(it);
  }
  reported = block_size_to_report(ptr, live.device);
  entry().free(ptr, static_cast<ssize_t>(live.size), live.device, live.stream);
  report_free(ptr, reported, live.device);
}

void* ReservoirAllocator::malloc_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
  // PyTorch's own check, ahead of its device allocator (no statistics,
  // no observers): 1 EiB is more than any device holds.
  constexpr size_t kOneExaByte = size_t{1} << 60;
  TORCH_CHECK_WITH(OutOfMemoryError, size < kOneExaByte,
                   "CUDA out of memory. Tried to allocate more than 1EB memory.");
  std::optional<History::Recorded> recorded = history_.record(true, device);
  void* p = nullptr;
  {
    History::InCall call(recorded);
    p = entry().malloc(static_cast<ssize_t>(size), device, stream);
  }
  if (p == nullptr) {
    if (entry().error_is_oom() != 0) {
      const std::string message = entry().error();
      report_out_of_memory(size, device);
      std::vector<cca::OutOfMemoryObserver> observers;
      {
        std::lock_guard lock(mutex_);
        observers = oom_observers_;
      }
      if (!observers.empty()) {
        size_t device_free = 0;
        size_t device_total = 0;
        c10::cuda::CUDAGuard guard(device);
        if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) (void)cudaGetLastError();
        for (const auto& observer : observers) observer(device, size, device_total, device_free);
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, message);
    }
    TORCH_CHECK(false, "reservoir (PyTorch's allocator): ", entry().error());
  }
  {
    std::lock_guard lock(mutex_);
    live_[p] = Live{size, device, stream};
  }
  if (recorded) history_.note_alloc(p, std::move(*recorded));
  report_allocation(p, device);
  return p;
}

// ---- set-up and state ----

void ReservoirAllocator::init(int device_count) {
  // The settings' memory fraction (per_process_memory_fraction), checked
  // here as PyTorch checks it: a bad value is PyTorch's ValueError at
  // initialization, not a failure of the first allocation.
  double fraction = 1.0;
  TORCH_CHECK_VALUE(entry().configured_fraction(&fraction) == 0, entry().error());
  entry().init(device_count);
  {
    std::lock_guard lock(mutex_);
    fractions_.assign(static_cast<std::size_t>(device_count), fraction);
    initialized_ = true;
  }
  // reservoir's events cost a call each: taken only once asked for.
  if (history_.wants_events()) connect_events(device_count);
}

bool ReservoirAllocator::initialized() {
  std::lock_guard lock(mutex_);
  return initialized_;
}

int ReservoirAllocator::devices() {
  std::lock_guard lock(mutex_);
  return static_cast<int>(fractions_.size());
}

double ReservoirAllocator::getMemoryFraction(c10::DeviceIndex device) {
  std::lock_guard lock(mutex_);
  return static_cast<std::size_t>(device) < fractions_.size() ? fractions_[device] : 1.0;
}

void ReservoirAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  set_memory_fraction(fraction, device);
  std::lock_guard lock(mutex_);
  if (static_cast<std::size_t>(device) >= fractions_.size()) fractions_.resize(device + 1, 1.0);
  fractions_[device] = fraction;
}

void ReservoirAllocator::settings_changed(const std::string& text) {
  char* ignored = nullptr;
  TORCH_CHECK_VALUE(entry().apply_settings(text.c_str(), &ignored) == 0,
                    "reservoir (PyTorch's allocator): _set_allocator_settings(\"", text,
                    "\"): ", entry().error());
  if (ignored != nullptr) {
    const std::string what = ignored;
    std::free(ignored);
    TORCH_WARN(
        "reservoir (PyTorch's allocator): _set_allocator_settings(\"", text, "\"): ", what,
        " is not applied at run time (reservoir keeps one kind of segment per allocator); the rest "
        "is. Give it in PYTORCH_ALLOC_CONF or RESERVOIR_ALLOC_CONF before the first allocation.");
  }
}

// ---- caches and statistics ----

void ReservoirAllocator::empty_cache(MempoolId mempool_id) {
  if (mempool_id != kDefaultPools) {
    // A pool's own: its memory goes back once its last user released it
    // (MemPool's destructor asks right after); a pool in use keeps it, as
    // under PyTorch's allocator.
    const c10::DeviceIndex device = c10::cuda::current_device();
    const std::optional<History::Recorded> recorded = history_.record(false, device);
    History::InCall call(recorded);
    TORCH_CHECK(entry().empty_pool_cache(device, mempool_id.first, mempool_id.second) == 0,
                "reservoir (PyTorch's allocator): emptyCache: ", entry().error());
    return;
  }
  // Its segment releases carry this call (its frames when history
  // records every call, as PyTorch's).
  const std::optional<History::Recorded> recorded =
      history_.record(false, c10::cuda::current_device());
  History::InCall call(recorded);
  entry().reset();
}

void ReservoirAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  TORCH_CHECK(entry().reset_accumulated_stats(device) == 0,
              "reservoir (PyTorch's allocator): ", entry().error());
}

void ReservoirAllocator::resetPeakStats(c10::DeviceIndex device) {
  TORCH_CHECK(entry().reset_peak_stats(device) == 0,
              "reservoir (PyTorch's allocator): ", entry().error());
}

// cuDNN's benchmark mode asks how large a workspace could be: the largest
// free block cached for the default pools, no less than *largestBlock,
// which (when 0) starts as the device's free memory, as PyTorch's does.
void ReservoirAllocator::cacheInfo(c10::DeviceIndex device, size_t* largestBlock) {
  if (*largestBlock == 0) {
    c10::cuda::CUDAGuard guard(device);
    size_t device_free = 0;
    size_t device_total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&device_free, &device_total));
    *largestBlock = device_free;
  }
  *largestBlock = largest_free_block(state_of(device), *largestBlock);
}

// The segment an allocation lies in: its base, and its size in *size.
void* ReservoirAllocator::getBaseAllocation(void* ptr, size_t* size) {
  int device = 0;
  {
    std::lock_guard lock(mutex_);
    auto it = live_.find(ptr);
    TORCH_CHECK(it != live_.end(), "reservoir (PyTorch's allocator): getBaseAllocation of ", ptr,
                ", which is not a live allocation's start");
    device = it->second.device;
  }
  void* base = segment_holding(state_of(device), reinterpret_cast<std::size_t>(ptr), size);
  TORCH_CHECK(base != nullptr,
              "reservoir (PyTorch's allocator): getBaseAllocation: no segment holds ", ptr);
  return base;
}

// ---- pools and graphs ----

void ReservoirAllocator::create_or_incref_pool(c10::DeviceIndex device, MempoolId id,
                                               CUDAAllocator* allocator,
                                               std::shared_ptr<CUDAAllocator> owner) {
  // MemPool(allocator=...): set when the pool is made (its first user);
  // reservoir's own allocator as a pool's is reservoir serving the pool.
  if (allocator != nullptr && allocator != this && !pools_.known(device, id)) {
    pools_.set_allocator(device, id, allocator, std::move(owner));
  }
  pools_.add_user(device, id);
}

bool ReservoirAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, MempoolId id,
    const std::unordered_set<void*>& expected_live_allocations) {
  bool found = false;
  const bool exactly = pool_holds_exactly(state_of(device), id, expected_live_allocations, &found);
  if (!exactly && found) return false;
  found = found || pools_.known(device, id);
  TORCH_CHECK(found, "reservoir (PyTorch's allocator): checkPoolLiveAllocations: no pool (",
              id.first, ", ", id.second, ") on device ", static_cast<int>(device));
  return exactly;
}

namespace {
// What getCheckpointState hands PyTorch: reservoir's layout of the pool.
struct PoolState final : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  MempoolId id{0, 0};
  std::string text;       // reservoir_torch_checkpoint_pool's JSON, as restore_pool takes it
  nlohmann::json layout;  // ... read once (graph trees restore a checkpoint many times)
};
}  // namespace

std::shared_ptr<cca::AllocatorState> ReservoirAllocator::getCheckpointState(c10::DeviceIndex device,
                                                                            MempoolId id) {
  char* text = entry().checkpoint_pool(device, id.first, id.second);
  TORCH_CHECK(text != nullptr,
              "reservoir (PyTorch's allocator): getCheckpointState: ", entry().error());
  auto state = std::make_shared<PoolState>();
  state->device = device;
  state->id = id;
  state->text = text;
  std::free(text);
  state->layout = nlohmann::json::parse(state->text);
  return state;
}

// Frees every allocation of the pool and makes the checkpoint's live ones
// again; PyTorch hands the new ones to the storages that own them.
cca::CheckpointDelta ReservoirAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> as) {
  const auto pps = std::dynamic_pointer_cast<PoolState>(as);
  TORCH_CHECK(pps != nullptr,
              "reservoir (PyTorch's allocator): setCheckpointPoolState: the state is not one "
              "reservoir's getCheckpointState made");
  TORCH_CHECK(pps->device == device,
              "reservoir (PyTorch's allocator): setCheckpointPoolState: a checkpoint of "
              "device ",
              static_cast<int>(pps->device), " given for device ", static_cast<int>(device));
  // The calls PyTorch's history writes them with: the restore's allocations
  // with this call's context, its frees with it only when every call is kept.
  const std::optional<History::Recorded> alloc_context = history_.record(true, device);
  const std::optional<History::Recorded> free_context = history_.record(false, device);
  const nlohmann::json done =
      parsed(entry().restore_pool(device, pps->id.first, pps->id.second, pps->text.c_str()),
             "setCheckpointPoolState");
  cca::CheckpointDelta delta;
  const bool keep = alloc_context.has_value();
  std::lock_guard lock(mutex_);
  for (const nlohmann::json& p : done["freed"]) {
    void* ptr = reinterpret_cast<void*>(p.get<std::uintptr_t>());
    live_.erase(ptr);
    if (keep) history_.note_free(ptr, *free_context);
    delta.ptrs_freed.push_back(ptr);
  }
  for (const nlohmann::json& seg : pps->layout["segments"]) {
    for (const nlohmann::json& b : seg["blocks"]) {
      const auto at = b[0].get<std::size_t>();
      void* ptr = reinterpret_cast<void*>(at);
      if (keep) history_.note_alloc(ptr, *alloc_context);
      if (!b[3].get<bool>()) {
        if (keep) history_.note_free(ptr, *free_context);
        continue;
      }
      live_[ptr] = Live{b[1].get<std::size_t>(), device,
                        reinterpret_cast<cudaStream_t>(b[2].get<std::uintptr_t>())};
      delta.dataptrs_allocd.emplace_back(ptr, ptr, &raw_delete_fn,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
  }
  return delta;
}

// ---- history and observers ----

cca::SnapshotInfo ReservoirAllocator::take_snapshot(MempoolId mempool_id, bool include_traces) {
  cca::SnapshotInfo out;
  const int count = devices();
  out.device_traces.resize(static_cast<std::size_t>(count));
  std::unordered_map<std::size_t, std::size_t> alloc_seen;
  std::unordered_map<std::size_t, std::size_t> free_seen;
  for (int device = 0; device < count; ++device) {
    const nlohmann::json snap = state_of(device);
    history_.add_device(out, device, snap, mempool_id, include_traces, alloc_seen, free_seen);
    if (include_traces && device == 0) fill_config(out.config_metadata, snap["config"]);
  }
  history_.add_annotations(out);
  if (count == 0) {
    char* text = entry().snapshot_json(0);
    if (text != nullptr) {
      fill_config(out.config_metadata, nlohmann::json::parse(text)["config"]);
      std::free(text);
    }
  }
  return out;
}

void ReservoirAllocator::record_history(bool enabled, cca::CreateContextFn context_recorder,
                                        size_t alloc_trace_max_entries, cca::RecordContext when,
                                        bool clear, const std::vector<std::string>& skip_actions) {
  history_.set(enabled, context_recorder, alloc_trace_max_entries, when, clear, skip_actions);
  const int count = devices();
  for (int device = 0; device < std::max(count, 1); ++device) {
    TORCH_CHECK(entry().record_history(device, enabled ? 1 : 0, alloc_trace_max_entries, 0) == 0,
                "reservoir (PyTorch's allocator): recordHistory: ", entry().error());
  }
  if (enabled) connect_events(std::max(count, 1));
}

#if RESERVOIR_TORCH_ANNOTATE_MEMORY
void ReservoirAllocator::annotateMemory(const void* ptr, const std::string& metadata) {
  if (!history_.on()) return;
  Live live;
  {
    std::lock_guard lock(mutex_);
    auto it = live_.find(const_cast<void*>(ptr));
    TORCH_CHECK(it != live_.end(), "reservoir (PyTorch's allocator): annotateMemory of ", ptr,
                ", which is not a live allocation's start");
    live = it->second;
  }
  history_.annotate_memory(ptr, live.device, live.size, live.stream, metadata);
}
#endif

#if RESERVOIR_TORCH_CONTEXT_FOR_POINTER
std::shared_ptr<c10::GatheredContext> ReservoirAllocator::getContextForPointer(const void* ptr) {
  {
    std::lock_guard lock(mutex_);
    if (live_.find(const_cast<void*>(ptr)) == live_.end()) return nullptr;
  }
  return history_.context_for(ptr);
}
#endif

void ReservoirAllocator::attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) {
  std::lock_guard lock(mutex_);
  oom_observers_.push_back(std::move(observer));
}

#if RESERVOIR_TORCH_OOM_REJECTION_OBSERVER
void ReservoirAllocator::attachOomRejectionObserver(cca::OomRejectionObserver observer) {
  // reservoir rejects no allocation ahead of the device (PyTorch's
  // throw_on_cudamalloc_oom policy): there is nothing to observe.
  std::lock_guard lock(mutex_);
  rejection_observers_.push_back(std::move(observer));
}
#endif

void ReservoirAllocator::attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) {
  history_.add_tracker(std::move(tracker));
  connect_events(devices());
}

void ReservoirAllocator::connect_events(int count) {
  int first = 0;
  {
    std::lock_guard lock(mutex_);
    first = connected_devices_;
    connected_devices_ = std::max(connected_devices_, count);
  }
  for (int d = first; d < count; ++d) {
    TORCH_CHECK(entry().attach_trace_tracker(d, History::on_event, &history_) == 0,
                "reservoir (PyTorch's allocator): attaching to device ", d,
                "'s events: ", entry().error());
  }
}

// ---- devices and IPC ----

void ReservoirAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard guard(dev);
  const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // clear it
    return;
  }
  C10_CUDA_CHECK(err);
}

cudaError_t ReservoirAllocator::memcpyAsync(void* dst, int dstDevice, const void* src,
                                            int srcDevice, size_t count, cudaStream_t stream,
                                            bool p2p_enabled) {
  if (p2p_enabled || dstDevice == srcDevice) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
}

// torch.multiprocessing's CUDA tensors: the handle of the segment the
// allocation lies in (torch_ipc.hpp).
cca::ShareableHandle ReservoirAllocator::shareIpcHandle(void* ptr) {
  return ipc_.share(ptr, getBaseAllocation(ptr, nullptr));
}

}  // namespace reservoir_torch_hooks
