// reservoir as PyTorch's own allocator: a c10::cuda::CUDACachingAllocator::
// CUDAAllocator (the interface PyTorch's native caching allocator
// implements), built per PyTorch release against its headers into the
// release's libreservoir_torch_hooks.so, so that torch.cuda.memory_stats(),
// memory_summary(), empty_cache(), set_per_process_memory_fraction(),
// reset_peak_memory_stats(), Tensor.record_stream, MemPool and CUDA-graph
// pools and the out-of-memory observers keep working with reservoir
// underneath, under every policy. (The pluggable allocator, torch_hooks.cpp,
// reaches only what CUDAPluggableAllocator forwards.)
//
// What reservoir cannot do raises PyTorch's error naming the method and
// why (IPC under the virtual-memory policies, a MemPool of another
// allocator), never a silent no-op.
//
// reservoir_torch_use_as_allocator(path, release) installs it before the
// first CUDA allocation; reservoir.use_as_allocator() calls it.
#if __has_include(<c10/core/AllocatorConfig.h>)
#include <c10/core/AllocatorConfig.h>
#endif
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <nlohmann/json.hpp>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torch_entry.hpp"
#include "torch_releases.hpp"

namespace {

using c10::cuda::CUDACachingAllocator::CUDAAllocator;
using reservoir_torch_hooks::entry;
namespace cca = c10::cuda::CUDACachingAllocator;
#if RESERVOIR_TORCH_C10_MEMPOOL_ID
using MempoolId = c10::MempoolId_t;
#else
using MempoolId = c10::cuda::MempoolId_t;
#endif
#if RESERVOIR_TORCH_DEVICE_TRACE_TYPES
namespace trace_types = c10::CachingDeviceAllocator;
#else
namespace trace_types = c10::cuda::CUDACachingAllocator;
#endif
// A stream as the snapshot's types hold it (void* from 2.11, cudaStream_t before).
using TraceStream = decltype(trace_types::TraceEntry::stream_);
template <class T>
TraceStream trace_stream(T stream) {
  if constexpr (std::is_integral_v<T>) {
    return reinterpret_cast<TraceStream>(static_cast<std::uintptr_t>(stream));
  } else if constexpr (std::is_null_pointer_v<T>) {
    return nullptr;
  } else {
    return reinterpret_cast<TraceStream>(stream);
  }
}
// A trace entry (with its user metadata from 2.10).
template <class Stream>
trace_types::TraceEntry trace_entry(trace_types::TraceEntry::Action action, int device, std::size_t addr,
                                    std::size_t size, Stream stream, std::shared_ptr<c10::GatheredContext> context,
                                    std::string compile_context, std::string user_metadata) {
#if RESERVOIR_TORCH_USER_METADATA
  return {action, static_cast<c10::DeviceIndex>(device), addr, size, trace_stream(stream), {0, 0}, 0,
          std::move(context), std::move(compile_context), std::move(user_metadata)};
#elif RESERVOIR_TORCH_COMPILE_CONTEXT
  (void)user_metadata;
  return {action, static_cast<c10::DeviceIndex>(device), addr, size, trace_stream(stream), {0, 0}, 0,
          std::move(context), std::move(compile_context)};
#else
  (void)user_metadata, (void)compile_context;
  return {action, static_cast<c10::DeviceIndex>(device), addr, size, trace_stream(stream), 0, std::move(context)};
#endif
}

// What a method reservoir does not implement says, as PyTorch's own
// allocators do: the method, and why.
[[noreturn]] void unsupported(const char* method, const char* why) {
  TORCH_CHECK(false, "reservoir (PyTorch's allocator): ", method, " is not supported: ", why);
}

// torch.cuda.memory_stats()'s keys, from reservoir, into PyTorch's struct.
void fill(c10::CachingDeviceAllocator::StatArray& out, const nlohmann::json& stats, const std::string& name) {
  static const char* const kTypes[] = {"all", "small_pool", "large_pool"};
  for (std::size_t t = 0; t < 3; ++t) {
    const std::string prefix = name + "." + kTypes[t] + ".";
    c10::CachingDeviceAllocator::Stat& s = out[t];
    s.current = stats.value(prefix + "current", std::int64_t{0});
    s.peak = stats.value(prefix + "peak", std::int64_t{0});
    s.allocated = stats.value(prefix + "allocated", std::int64_t{0});
    s.freed = stats.value(prefix + "freed", std::int64_t{0});
  }
}

void raw_delete_fn(void* ptr);
void uncached_delete_fn(void* ptr);

// The pool a segment of reservoir's snapshot JSON belongs to ({0, 0}: the default pools).
MempoolId pool_of(const nlohmann::json& segment) {
  return {segment["pool"][0].get<unsigned long long>(), segment["pool"][1].get<unsigned long long>()};
}
constexpr MempoolId kDefaultPools{0, 0};

// A JSON answer of reservoir's (freed here); PyTorch's error with reservoir's
// reason when there is none.
nlohmann::json parsed(char* text, const char* method) {
  TORCH_CHECK(text != nullptr, "reservoir (PyTorch's allocator): ", method, ": ", entry().error());
  nlohmann::json j = nlohmann::json::parse(text);
  std::free(text);
  return j;
}

class ReservoirAllocator final : public CUDAAllocator {
 public:
  // ---- allocation ----
  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    if (uncached()) {
      void* p = uncached_allocate(size);
      return {p, p, &uncached_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
    }
    void* p = size == 0 ? nullptr : malloc_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }
  // With caching off (torch.cuda.memory.caching_allocator_enable(False), or
  // PYTORCH_NO_CUDA_MEMORY_CACHING=1), as PyTorch's allocator: each request
  // is a cudaMalloc of its own, given back by cudaFree when freed, outside
  // the cache and its statistics.
  bool uncached() const {
    static const bool forced = [] {
      const char* v = std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING");
      return v != nullptr && std::strcmp(v, "1") == 0;
    }();
    return forced || !enabled_.load(std::memory_order_relaxed);
  }
  void* uncached_allocate(size_t size) {
    if (size == 0) return nullptr;
    void* p = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&p, size));
    std::lock_guard lock(mutex_);
    uncached_.insert(p);
    uncached_live_.store(uncached_.size(), std::memory_order_relaxed);
    return p;
  }
  // A pointer of uncached_allocate's: freed with cudaFree (true); false
  // otherwise (without a lock while none lives: every free asks).
  bool uncached_free(void* ptr) {
    if (uncached_live_.load(std::memory_order_relaxed) == 0) return false;
    {
      std::lock_guard lock(mutex_);
      if (uncached_.erase(ptr) == 0) return false;
      uncached_live_.store(uncached_.size(), std::memory_order_relaxed);
    }
    C10_CUDA_CHECK(cudaFree(ptr));
    return true;
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }
  void* raw_alloc(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(size, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    if (uncached()) return uncached_allocate(size);
    return size == 0 ? nullptr : malloc_on(size, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override {
    if (ptr == nullptr || uncached_free(ptr)) return;
    Live live;
    std::optional<Recorded> recorded;
    if (recording_.load(std::memory_order_relaxed)) {
      int device = 0;
      {
        std::lock_guard lock(mutex_);
        auto it = live_.find(ptr);
        if (it != live_.end()) device = it->second.device;
      }
      recorded = record_context(false, device);
    }
    {
      std::lock_guard lock(mutex_);
      if (recorded && history_on_) contexts_[reinterpret_cast<std::size_t>(ptr)].frees.push_back(std::move(*recorded));
      auto it = live_.find(ptr);
      TORCH_CHECK(it != live_.end(), "reservoir (PyTorch's allocator): raw_delete of ", ptr,
                  ", which it did not allocate or has freed");
      live = it->second;
      live_.erase(it);
    }
    entry().free(ptr, static_cast<ssize_t>(live.size), live.device, live.stream);
  }

  // ---- set-up and state ----
  void init(int device_count) override {
    // The settings' memory fraction (per_process_memory_fraction), checked
    // here as PyTorch checks it: a bad value is PyTorch's ValueError at
    // initialization, not a failure of the first allocation.
    double fraction = 1.0;
    TORCH_CHECK_VALUE(entry().configured_fraction(&fraction) == 0, entry().error());
    entry().init(device_count);
    std::unique_lock lock(mutex_);
    fractions_.assign(static_cast<std::size_t>(device_count), fraction);
    initialized_ = true;
    // reservoir's events cost a call each: taken only once asked for.
    const bool wanted = history_on_ || !trackers_.empty();
    lock.unlock();
    if (wanted) connect_events(device_count);
  }
  bool initialized() override {
    std::lock_guard lock(mutex_);
    return initialized_;
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    std::lock_guard lock(mutex_);
    return static_cast<std::size_t>(device) < fractions_.size() ? fractions_[device] : 1.0;
  }
  // torch.cuda.memory._set_allocator_settings(text), after PyTorch took it
  // (its own parser validated it): reservoir's allocators follow.
  void settings_changed(const std::string& text) {
    char* ignored = nullptr;
    TORCH_CHECK_VALUE(entry().apply_settings(text.c_str(), &ignored) == 0,
                      "reservoir (PyTorch's allocator): _set_allocator_settings(\"", text, "\"): ", entry().error());
    if (ignored != nullptr) {
      const std::string what = ignored;
      std::free(ignored);
      TORCH_WARN("reservoir (PyTorch's allocator): _set_allocator_settings(\"", text, "\"): ", what,
                 " is not applied at run time (reservoir keeps one kind of segment per allocator); the rest "
                 "is. Give it in PYTORCH_ALLOC_CONF or RESERVOIR_ALLOC_CONF before the first allocation.");
    }
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    reservoir_torch_hooks::set_memory_fraction(fraction, device);
    std::lock_guard lock(mutex_);
    if (static_cast<std::size_t>(device) >= fractions_.size()) fractions_.resize(device + 1, 1.0);
    fractions_[device] = fraction;
  }
  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }
  std::string name() override { return "reservoir"; }

  // ---- caches and statistics ----
#if !RESERVOIR_TORCH_POOL_EMPTY_CACHE
  void emptyCache() override { emptyCache(MempoolId{0, 0}); }
  void emptyCache(MempoolId mempool_id) {
#else
  void emptyCache(MempoolId mempool_id) override {
#endif
    if (mempool_id.first != 0 || mempool_id.second != 0) {
      // A pool's own: its memory goes back once its last user released it
      // (MemPool's destructor asks right after); a pool in use keeps it, as
      // under PyTorch's allocator.
      const c10::DeviceIndex device = c10::cuda::current_device();
      const std::optional<Recorded> recorded = record_context(false, device);
      InCall call(recorded ? &*recorded : nullptr);
      TORCH_CHECK(entry().empty_pool_cache(device, mempool_id.first, mempool_id.second) == 0,
                  "reservoir (PyTorch's allocator): emptyCache: ", entry().error());
      return;
    }
    // Its segment releases carry this call (its frames when history
    // records every call, as PyTorch's).
    const std::optional<Recorded> recorded = record_context(false, c10::cuda::current_device());
    InCall call(recorded ? &*recorded : nullptr);
    entry().reset();
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const nlohmann::json stats = parsed(entry().stats_json(device), "getDeviceStats");
    c10::CachingDeviceAllocator::DeviceStats out;
    fill(out.allocation, stats, "allocation");
    fill(out.segment, stats, "segment");
    fill(out.active, stats, "active");
    fill(out.inactive_split, stats, "inactive_split");
    fill(out.allocated_bytes, stats, "allocated_bytes");
    fill(out.reserved_bytes, stats, "reserved_bytes");
    fill(out.active_bytes, stats, "active_bytes");
    fill(out.inactive_split_bytes, stats, "inactive_split_bytes");
    fill(out.requested_bytes, stats, "requested_bytes");
    out.num_alloc_retries = stats.value("num_alloc_retries", std::int64_t{0});
    out.num_ooms = stats.value("num_ooms", std::int64_t{0});
    out.num_sync_all_streams = stats.value("num_sync_all_streams", std::int64_t{0});
    out.num_device_alloc = stats.value("num_device_alloc", std::int64_t{0});
    out.num_device_free = stats.value("num_device_free", std::int64_t{0});
    out.oversize_allocations.current = stats.value("oversize_allocations.current", std::int64_t{0});
    out.oversize_allocations.peak = stats.value("oversize_allocations.peak", std::int64_t{0});
    out.oversize_allocations.allocated = stats.value("oversize_allocations.allocated", std::int64_t{0});
    out.oversize_allocations.freed = stats.value("oversize_allocations.freed", std::int64_t{0});
    out.oversize_segments.current = stats.value("oversize_segments.current", std::int64_t{0});
    out.oversize_segments.peak = stats.value("oversize_segments.peak", std::int64_t{0});
    out.oversize_segments.allocated = stats.value("oversize_segments.allocated", std::int64_t{0});
    out.oversize_segments.freed = stats.value("oversize_segments.freed", std::int64_t{0});
    out.max_split_size = stats.value("max_split_size", std::int64_t{0});
#if RESERVOIR_TORCH_PRIVATE_POOL_STATS
    // Each private pool's reserved bytes: reserved_bytes_by_private_pools.<first>_<second>.<type>.<stat>.
    static const std::string kPrefix = "reserved_bytes_by_private_pools.";
    for (auto it = stats.begin(); it != stats.end(); ++it) {
      if (!it.key().starts_with(kPrefix)) continue;
      const std::string rest = it.key().substr(kPrefix.size());
      const std::size_t underscore = rest.find('_');
      const std::size_t dot = rest.find('.');
      if (underscore == std::string::npos || dot == std::string::npos || underscore > dot) continue;
      const MempoolId id{std::stoull(rest.substr(0, underscore)),
                                std::stoull(rest.substr(underscore + 1, dot - underscore - 1))};
      if (out.reserved_bytes_by_private_pools.count(id) == 0) {
        fill(out.reserved_bytes_by_private_pools[id], stats, kPrefix + rest.substr(0, dot));
      }
    }
#endif
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    TORCH_CHECK(entry().reset_accumulated_stats(device) == 0, "reservoir (PyTorch's allocator): ",
                entry().error());
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(entry().reset_peak_stats(device) == 0, "reservoir (PyTorch's allocator): ", entry().error());
  }
  // cuDNN's benchmark mode asks how large a workspace could be: the largest
  // free block cached for the default pools, no less than *largestBlock,
  // which (when 0) starts as the device's free memory, as PyTorch's does.
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    if (*largestBlock == 0) {
      c10::cuda::CUDAGuard guard(device);
      size_t device_free = 0;
      size_t device_total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(&device_free, &device_total));
      *largestBlock = device_free;
    }
    const nlohmann::json state = state_of(device);  // named: a temporary's member would dangle in the loop
    for (const nlohmann::json& seg : state["segments"]) {
      if (pool_of(seg) != kDefaultPools) continue;
      for (const nlohmann::json& b : seg["blocks"]) {
        if (b["state"].get<std::string>() == "inactive") {
          *largestBlock = std::max(*largestBlock, b["size"].get<std::size_t>());
        }
      }
    }
  }
  // The segment an allocation lies in: its base, and its size in *size.
  void* getBaseAllocation(void* ptr, size_t* size) override {
    const auto at = reinterpret_cast<std::size_t>(ptr);
    int device = 0;
    {
      std::lock_guard lock(mutex_);
      auto it = live_.find(ptr);
      TORCH_CHECK(it != live_.end(), "reservoir (PyTorch's allocator): getBaseAllocation of ", ptr,
                  ", which is not a live allocation's start");
      device = it->second.device;
    }
    const nlohmann::json state = state_of(device);  // named: a temporary's member would dangle in the loop
    for (const nlohmann::json& seg : state["segments"]) {
      const auto base = seg["address"].get<std::size_t>();
      const auto total = seg["total_size"].get<std::size_t>();
      if (at >= base && at < base + total) {
        if (size != nullptr) *size = total;
        return reinterpret_cast<void*>(base);
      }
    }
    TORCH_CHECK(false, "reservoir (PyTorch's allocator): getBaseAllocation: no segment holds ", ptr);
    return nullptr;  // not reached (TORCH_CHECK(false) throws; unoptimized builds do not see it)
  }
  // The memory mapped into each stream's expandable segment of the default
  // pools (small and large apart), as PyTorch's allocator reports it (the
  // default stream's left out, as there); reservoir's snapshot lists a
  // segment's mapped ranges one by one.
#if RESERVOIR_TORCH_EXPANDABLE_SEGMENT_SIZES
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override {
    const nlohmann::json state = state_of(device);  // named: a temporary's member would dangle in the loop
    std::vector<cca::StreamSegmentSize> out;
    for (const nlohmann::json& seg : state["segments"]) {
      if (!seg["is_expandable"].get<bool>()) continue;
      if (pool_of(seg) != kDefaultPools) continue;
      const auto stream = reinterpret_cast<cudaStream_t>(seg["stream"].get<std::uintptr_t>());
      if (stream == nullptr) continue;  // the default stream's are not reported, as PyTorch's
      const bool small = !seg["is_large"].get<bool>();
      const auto size = seg["total_size"].get<std::size_t>();
      auto it = std::find_if(out.begin(), out.end(), [&](const cca::StreamSegmentSize& s) {
        return s.stream == stream && s.is_small_pool == small;
      });
      if (it == out.end()) {
        out.emplace_back(stream, small, size);
      } else {
        it->total_size += size;
      }
    }
    return out;
  }
#endif

  // ---- streams, pools, graphs ----
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr) return;
    entry().record_stream(ptr.get(), stream.stream());
  }
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId id,
                           std::function<bool(cudaStream_t)> filter) override {
    auto owned = std::make_unique<std::function<bool(cudaStream_t)>>(std::move(filter));
    void* context = owned.get();
    {
      // A route is a user of the pool too (PyTorch releases it after
      // endAllocateToPool, as it does a MemPool's).
      std::lock_guard lock(mutex_);
      filters_[{device, id}] = std::move(owned);
      ++pool_users_[{device, id}];
    }
    TORCH_CHECK(entry().begin_allocate_to_pool(device, id.first, id.second, call_filter, context) == 0,
                "reservoir (PyTorch's allocator): beginAllocateToPool: ", entry().error());
    // reservoir counts a use of the pool per route begun after its first;
    // here pool_users_ counts them all, and reservoir hears of the last
    // release alone: its count stays at one.
    bool again = false;
    {
      std::lock_guard lock(mutex_);
      again = !routed_pools_.insert({device, id}).second;
    }
    if (again) {
      TORCH_CHECK(entry().release_pool(device, id.first, id.second) == 0,
                  "reservoir (PyTorch's allocator): beginAllocateToPool: ", entry().error());
    }
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId id) override {
    TORCH_CHECK(entry().end_allocate_to_pool(device, id.first, id.second) == 0,
                "reservoir (PyTorch's allocator): endAllocateToPool: ", entry().error());
    std::lock_guard lock(mutex_);
    filters_.erase({device, id});
  }
  // A pool's users (MemPool objects, graphs): created or counted up here,
  // counted down by releasePool, whose last user gives its memory back.
#if RESERVOIR_TORCH_POOL_ALLOCATOR_SHARED
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId id,
                          std::shared_ptr<CUDAAllocator> allocator) override {
    create_or_incref_pool(device, id, allocator.get());
  }
#elif RESERVOIR_TORCH_CREATE_OR_INCREF_POOL
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId id, CUDAAllocator* allocator) override {
    create_or_incref_pool(device, id, allocator);
  }
#else
  void ensureExistsAndIncrefPool(c10::DeviceIndex device, MempoolId id) override {
    create_or_incref_pool(device, id, nullptr);
  }
#endif
  void create_or_incref_pool(c10::DeviceIndex device, MempoolId id, const CUDAAllocator* allocator) {
    if (allocator != nullptr && allocator != this) {
      unsupported("createOrIncrefPool with another allocator (MemPool(allocator=...))",
                  "a pool of reservoir's allocator is served by reservoir itself");
    }
    std::lock_guard lock(mutex_);
    ++pool_users_[{device, id}];
  }
  int getPoolUseCount(c10::DeviceIndex device, MempoolId id) override {
    std::lock_guard lock(mutex_);
    auto it = pool_users_.find({device, id});
    return it == pool_users_.end() ? 0 : it->second;
  }
  // MemPool(use_on_oom=True): the pool's free blocks are the last resort
  // before running out; MemPool(no_split=True): its blocks are handed out whole.
#if !RESERVOIR_TORCH_USE_ON_OOM
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id, bool use_on_oom) {
#elif !RESERVOIR_TORCH_USE_ON_OOM_FLAG
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id) override { setUseOnOOM(device, id, true); }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id, bool use_on_oom) {
#else
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id, bool use_on_oom) override {
#endif
    TORCH_CHECK(entry().set_pool_option(device, id.first, id.second, 0, use_on_oom ? 1 : 0) == 0,
                "reservoir (PyTorch's allocator): setUseOnOOM: ", entry().error());
  }
#if RESERVOIR_TORCH_NO_SPLIT_POOLS
  void setNoSplit(c10::DeviceIndex device, MempoolId id) override {
    TORCH_CHECK(entry().set_pool_option(device, id.first, id.second, 1, 1) == 0,
                "reservoir (PyTorch's allocator): setNoSplit: ", entry().error());
  }
#endif
  void releasePool(c10::DeviceIndex device, MempoolId id) override {
    {
      std::lock_guard lock(mutex_);
      auto it = pool_users_.find({device, id});
      if (it != pool_users_.end() && --it->second > 0) return;
      if (it != pool_users_.end()) pool_users_.erase(it);
      // A pool never allocated to holds nothing in reservoir.
      if (routed_pools_.erase({device, id}) == 0) return;
    }
    TORCH_CHECK(entry().release_pool(device, id.first, id.second) == 0,
                "reservoir (PyTorch's allocator): releasePool: ", entry().error());
  }

  // ---- history and observers ----
  // torch.cuda.memory._snapshot(): every device's segments and blocks, and
  // with history on, its trace, from reservoir's own record; the contexts
  // are PyTorch's (its context recorder, called here on each allocation, and
  // on each free when it records everything).
#if !RESERVOIR_TORCH_SNAPSHOT_INCLUDE_TRACES
#if RESERVOIR_TORCH_POOL_SNAPSHOT
  cca::SnapshotInfo snapshot(MempoolId mempool_id) override { return snapshot(mempool_id, true); }
#else
  // MemPool.snapshot() takes its snapshot inside the pool's use_mem_pool:
  // the active pool's segments alone, as PyTorch's allocator gives them then.
  cca::SnapshotInfo snapshot() override {
    c10::cuda::MemPool* active = c10::cuda::MemPoolContext::getActiveMemPool();
    return snapshot(active != nullptr ? active->id() : MempoolId{0, 0}, true);
  }
#endif
  cca::SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) {
#else
  cca::SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) override {
#endif
    cca::SnapshotInfo out;
    int devices = 0;
    {
      std::lock_guard lock(mutex_);
      devices = static_cast<int>(fractions_.size());
    }
    out.device_traces.resize(static_cast<std::size_t>(devices));
    std::unordered_map<std::size_t, std::size_t> alloc_seen;
    std::unordered_map<std::size_t, std::size_t> free_seen;
    for (int device = 0; device < devices; ++device) {
      const nlohmann::json snap = state_of(device);
      std::lock_guard lock(mutex_);
      const std::size_t first_segment = out.segments.size();
      for (const nlohmann::json& seg : snap["segments"]) {
        const MempoolId pool = pool_of(seg);
        if ((mempool_id.first != 0 || mempool_id.second != 0) && pool != mempool_id) continue;
        trace_types::SegmentInfo info;
        info.device = static_cast<c10::DeviceIndex>(device);
        info.address = seg["address"].get<std::size_t>();
        info.total_size = seg["total_size"].get<std::size_t>();
        info.requested_size = seg["requested_size"].get<std::size_t>();
        info.allocated_size = seg["allocated_size"].get<std::size_t>();
        info.active_size = seg["active_size"].get<std::size_t>();
        info.stream = trace_stream(seg["stream"].get<std::uintptr_t>());
        info.is_large = seg["is_large"].get<bool>();
        info.is_expandable = seg["is_expandable"].get<bool>();
        info.owner_private_pool_id = pool;
        for (const nlohmann::json& b : seg["blocks"]) {
          trace_types::BlockInfo block;
          block.size = b["size"].get<std::size_t>();
          block.requested_size = b["requested_size"].get<std::size_t>();
          const std::string state = b["state"].get<std::string>();
          block.allocated = state == "active_allocated";
          block.active = state != "inactive";
          if (block.allocated) {
            auto it = contexts_.find(b["address"].get<std::size_t>());
            if (it != contexts_.end() && !it->second.allocs.empty()) {
              block.context_when_allocated = it->second.allocs.back().context;
            }
          }
          info.blocks.push_back(std::move(block));
        }
        out.segments.push_back(std::move(info));
      }
      std::size_t total_active = 0;
      for (std::size_t i = first_segment; i < out.segments.size(); ++i) total_active += out.segments[i].active_size;
      if (!include_traces) {
        note_snapshot(device, total_active);
        continue;
      }
      auto& trace = out.device_traces[static_cast<std::size_t>(device)];
      using TE = trace_types::TraceEntry;
      const nlohmann::json& history = snap["history"];
      std::unordered_map<std::size_t, Recorded> last_free;
      std::unordered_map<std::size_t, std::shared_ptr<c10::GatheredContext>> last_alloc;
      std::unordered_map<std::size_t, std::size_t> release_seen;
      std::size_t own_entries_added = 0;
      for (std::size_t i = 0; i < history.size(); ++i) {
        const nlohmann::json& e = history[i];
        const std::string action = e["action"].get<std::string>();
        const auto kind = trace_action(action);
        // reservoir notes its own snapshots in the history; PyTorch's _snapshot() does not.
        if (!kind || *kind == TE::SNAPSHOT || skipped(action)) continue;
        const std::size_t addr = e["addr"].get<std::size_t>();
        Recorded recorded;
        recorded.compile_context = "N/A";
        // The k-th alloc (or free) at an address is the k-th call kept for
        // it; a segment made for an allocation has the allocation's, a
        // completed free the request's. (A segment given back has none:
        // which call gave it back, the history does not say.)
        if (*kind == TE::ALLOC || *kind == TE::FREE_REQUESTED) {
          const bool alloc = *kind == TE::ALLOC;
          auto& seen = alloc ? alloc_seen : free_seen;
          auto it = contexts_.find(addr);
          const std::size_t k = seen[addr]++;
          if (it != contexts_.end()) {
            const auto& list = alloc ? it->second.allocs : it->second.frees;
            if (k < list.size()) recorded = list[k];
          }
          if (alloc) {
            last_alloc[addr] = recorded.context;
          } else {
            // Without the free's frames (history keeping allocations'
            // only), the allocation's, as PyTorch's.
            if (recorded.context == nullptr) recorded.context = last_alloc[addr];
            last_free[addr] = recorded;
          }
        } else if (*kind == TE::FREE_COMPLETED) {
          auto it = last_free.find(addr);
          if (it != last_free.end()) recorded = it->second;
        } else if (*kind == TE::SEGMENT_ALLOC || *kind == TE::SEGMENT_MAP) {
          for (std::size_t j = i + 1; j < history.size(); ++j) {
            const std::string next = history[j]["action"].get<std::string>();
            if (next == "alloc") {
              const std::size_t at = history[j]["addr"].get<std::size_t>();
              auto it = contexts_.find(at);
              const std::size_t k = alloc_seen[at];
              if (it != contexts_.end() && k < it->second.allocs.size()) recorded = it->second.allocs[k];
              break;
            }
            if (next != "segment_alloc" && next != "segment_map") break;
          }
        } else if (*kind == TE::SEGMENT_FREE || *kind == TE::SEGMENT_UNMAP) {
          // The call it happened in (no frames when history keeps
          // allocations' only, as PyTorch's).
          auto it = releases_.find(addr);
          const std::size_t k = release_seen[addr]++;
          if (it != releases_.end() && k < it->second.size()) recorded = it->second[k];
        }
        // context="state" keeps frames on the blocks in use only, as
        // PyTorch's: its trace entries have none.
        if (when_ == cca::RecordContext::STATE) recorded.context = nullptr;
        const auto time_us = e["time_us"].get<std::int64_t>();
        add_own_entries_until(trace, device, time_us, &own_entries_added);
        TE te = trace_entry(*kind, device, addr, e["size"].get<std::size_t>(), e["stream"].get<std::uintptr_t>(),
                            std::move(recorded.context), std::move(recorded.compile_context),
                            std::move(recorded.user_metadata));
        te.time_.t_ = static_cast<time_t>(time_us);
        trace.push_back(std::move(te));
      }
      add_own_entries_until(trace, device, std::numeric_limits<std::int64_t>::max(), &own_entries_added);
      note_snapshot(device, total_active);  // in the traces of later snapshots, as PyTorch's
      if (device == 0) fill_config(out.config_metadata, snap["config"]);
    }
    {
      std::lock_guard lock(mutex_);
      out.external_annotations.assign(annotations_.begin(), annotations_.end());
    }
    if (devices == 0) {
      char* text = entry().snapshot_json(0);
      if (text != nullptr) {
        fill_config(out.config_metadata, nlohmann::json::parse(text)["config"]);
        std::free(text);
      }
    }
    return out;
  }
#if !RESERVOIR_TORCH_HISTORY_CLEAR
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when) override {
    recordHistory(enabled, std::move(context_recorder), alloc_trace_max_entries, when, false, {});
  }
#endif
#if !RESERVOIR_TORCH_HISTORY_SKIP_ACTIONS
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clearHistory)
#if RESERVOIR_TORCH_HISTORY_CLEAR
      override
#endif
  {
    recordHistory(enabled, std::move(context_recorder), alloc_trace_max_entries, when, clearHistory, {});
  }
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clearHistory, const std::vector<std::string>& skip_actions) {
#else
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
#endif
    int devices = 0;
    {
      std::lock_guard lock(mutex_);
      recorder_ = enabled ? context_recorder : nullptr;
      history_on_ = enabled;
      recording_.store(enabled, std::memory_order_relaxed);
      when_ = when;
      skip_actions_ = skip_actions;
      max_entries_ = alloc_trace_max_entries;
      if (clearHistory || !enabled) {
        contexts_.clear();
        releases_.clear();
        annotations_.clear();
        own_entries_.clear();
      }
      devices = static_cast<int>(fractions_.size());
    }
    for (int device = 0; device < std::max(devices, 1); ++device) {
      TORCH_CHECK(entry().record_history(device, enabled ? 1 : 0, alloc_trace_max_entries, 0) == 0,
                  "reservoir (PyTorch's allocator): recordHistory: ", entry().error());
    }
    if (enabled) connect_events(std::max(devices, 1));
  }
  bool isHistoryEnabled() override {
    std::lock_guard lock(mutex_);
    return history_on_;
  }
  // record_function's annotations (torch.profiler, FSDP's stages), kept
  // with history as PyTorch keeps them: the latest alloc_trace_max_entries.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    std::lock_guard lock(mutex_);
    if (!history_on_) return;
    trace_types::AnnotationEntry entry(device, 0);
    entry.time_.t_ = static_cast<time_t>(now_us());
    for (const auto& [name, value] : md) entry.recordUserMetadata(name, value);
    annotations_.push_back(std::move(entry));
    while (max_entries_ > 0 && annotations_.size() > max_entries_) annotations_.pop_front();
  }
  // torch.compile's contexts: the innermost one in force is written on each
  // trace entry of the device (PyTorch keeps a stack per device).
#if RESERVOIR_TORCH_COMPILE_CONTEXT
  void pushCompileContext(std::string& md) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    std::lock_guard lock(mutex_);
    if (history_on_) compile_contexts_[device].push_back(md);
  }
  void popCompileContext() override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    std::lock_guard lock(mutex_);
    auto it = compile_contexts_.find(device);
    if (it != compile_contexts_.end() && !it->second.empty()) it->second.pop_back();
  }
#endif
#if RESERVOIR_TORCH_USER_METADATA
  // torch.cuda.memory._set_memory_metadata: written on the device's entries from now on.
  void setUserMetadata(const std::string& metadata) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    std::lock_guard lock(mutex_);
    user_metadata_[device] = metadata;
  }
  std::string getUserMetadata() override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    std::lock_guard lock(mutex_);
    auto it = user_metadata_.find(device);
    return it == user_metadata_.end() ? std::string() : it->second;
  }
#endif
#if RESERVOIR_TORCH_ANNOTATE_MEMORY
  bool supportsUserMetadata() override { return true; }
  // torch.cuda.memory._annotate_memory: an "annotate" entry for a live
  // allocation, in time order among the device's entries.
  void annotateMemory(const void* ptr, const std::string& metadata) override {
    std::lock_guard lock(mutex_);
    if (!history_on_) return;
    auto it = live_.find(const_cast<void*>(ptr));
    TORCH_CHECK(it != live_.end(), "reservoir (PyTorch's allocator): annotateMemory of ", ptr,
                ", which is not a live allocation's start");
    trace_types::TraceEntry te(trace_types::TraceEntry::ANNOTATE,
                                               static_cast<c10::DeviceIndex>(it->second.device),
                                               reinterpret_cast<std::size_t>(ptr), it->second.size,
                                               it->second.stream, {0, 0}, 0, nullptr,
                                               compile_context_of(it->second.device), metadata);
    te.time_.t_ = static_cast<time_t>(now_us());
    keep_own_entry(std::move(te));
  }
#endif
#if RESERVOIR_TORCH_CONTEXT_FOR_POINTER
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    std::lock_guard lock(mutex_);
    if (live_.find(const_cast<void*>(ptr)) == live_.end()) return nullptr;
    auto it = contexts_.find(reinterpret_cast<std::size_t>(ptr));
    return it == contexts_.end() || it->second.allocs.empty() ? nullptr : it->second.allocs.back().context;
  }
#endif
  // CUDA graph trees check that a pool holds exactly the allocations they
  // expect to be live.
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId id,
                                const std::unordered_set<void*>& expected_live_allocations) override {
    const nlohmann::json state = state_of(device);  // named: a temporary's member would dangle in the loop
    std::size_t live_in_pool = 0;
    bool found = false;
    for (const nlohmann::json& seg : state["segments"]) {
      if (pool_of(seg) != id) continue;
      found = true;
      for (const nlohmann::json& b : seg["blocks"]) {
        if (b["state"].get<std::string>() != "active_allocated") continue;
        if (expected_live_allocations.count(reinterpret_cast<void*>(b["address"].get<std::size_t>())) == 0) {
          return false;
        }
        ++live_in_pool;
      }
    }
    {
      std::lock_guard lock(mutex_);
      found = found || pool_users_.count({device, id}) > 0;
    }
    TORCH_CHECK(found, "reservoir (PyTorch's allocator): checkPoolLiveAllocations: no pool (", id.first, ", ",
                id.second, ") on device ", static_cast<int>(device));
    return live_in_pool == expected_live_allocations.size();
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }
#if RESERVOIR_TORCH_OOM_REJECTION_OBSERVER
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    // reservoir rejects no allocation ahead of the device (PyTorch's
    // throw_on_cudamalloc_oom policy): there is nothing to observe.
    std::lock_guard lock(mutex_);
    rejection_observers_.push_back(std::move(observer));
  }
#endif
  // Called with every event as it happens, under reservoir's lock (as
  // PyTorch calls them under its own): NCCL's memory registration uses them.
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    int devices = 0;
    {
      std::lock_guard lock(mutex_);
      devices = static_cast<int>(fractions_.size());
    }
    {
      std::lock_guard lock(mutex_);
      trackers_.push_back(std::move(tracker));
    }
    connect_events(devices);
  }

  // ---- devices and IPC ----
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // clear it
      return;
    }
    C10_CUDA_CHECK(err);
  }
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }
  // torch.multiprocessing's CUDA tensors: PyTorch's own handle format
  // ([version]['c'][cudaIpcMemHandle_t of the segment], the block's offset
  // in it), so that a process under PyTorch's native allocator opens what
  // reservoir shares and the other way round. Version 2 up to PyTorch 2.12,
  // 3 from 2.13 (the same 'c' payload). Segments of cudaMalloc only: under
  // expandable segments and paging, memory is mapped through CUDA's
  // virtual memory API, which a cudaIpcMemHandle cannot name.
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    size_t total = 0;
    void* base = getBaseAllocation(ptr, &total);
    cudaIpcMemHandle_t handle;
    const cudaError_t rc = cudaIpcGetMemHandle(&handle, base);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      TORCH_CHECK(false, "reservoir (PyTorch's allocator): shareIpcHandle of ", ptr,
                  ": CUDA cannot export its segment at ", base, " (", cudaGetErrorString(rc),
                  "); tensors shared between processes need reservoir's native policy, whose segments are "
                  "cudaMalloc's (expandable segments and paging map memory through CUDA's virtual memory API)");
    }
    std::string out;
    out.push_back(kHandleVersion);
    out.push_back('c');
    out.append(reinterpret_cast<const char*>(&handle), sizeof handle);
    return cca::ShareableHandle{static_cast<char*>(ptr) - static_cast<char*>(base), out};
  }
  // Opens what another process shared, once per handle while it is in use
  // (as PyTorch's allocator caches it); closed when the last user lets go.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard lock(ipc_mutex_);
    if (auto it = opened_.find(handle); it != opened_.end()) {
      if (std::shared_ptr<void> alive = it->second.lock()) return alive;
    }
    const char* payload = handle.data();
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {  // a bare handle predates the version byte
      TORCH_CHECK(handle.size() >= 2, "reservoir (PyTorch's allocator): getIpcDevPtr: a handle of ",
                  handle.size(), " bytes");
      TORCH_CHECK(handle[0] <= kHandleVersion,
                  "received sharable handle from a future version of torch that this version does not know how "
                  "to handle");
      TORCH_CHECK(handle[1] == 'c', "reservoir (PyTorch's allocator): getIpcDevPtr: ",
                  handle[1] == 'e' ? "a handle of PyTorch's expandable segments is not supported (the sharing "
                                     "process can use expandable_segments:False for the tensors it shares)"
                                   : "not a handle of PyTorch's (unknown type)");
      TORCH_CHECK(handle.size() == 2 + sizeof(cudaIpcMemHandle_t),
                  "reservoir (PyTorch's allocator): getIpcDevPtr: a cudaMalloc handle of ", handle.size(),
                  " bytes, not ", 2 + sizeof(cudaIpcMemHandle_t));
      payload += 2;
    }
    cudaIpcMemHandle_t ipc;
    std::memcpy(&ipc, payload, sizeof ipc);
    const c10::DeviceIndex device = c10::cuda::current_device();
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, ipc, cudaIpcMemLazyEnablePeerAccess));
    std::shared_ptr<void> opened(ptr, [this, device, handle](void* p) {
      {
        c10::cuda::CUDAGuard guard(device);
        if (cudaIpcCloseMemHandle(p) != cudaSuccess) (void)cudaGetLastError();  // a deleter does not throw
      }
      std::lock_guard lock(ipc_mutex_);
      auto it = opened_.find(handle);
      if (it != opened_.end() && it->second.expired()) opened_.erase(it);  // not a newer opening's
    });
    opened_[handle] = opened;
    return opened;
  }
  // CUDA graph trees: a private pool's layout, to lay it out again before
  // recording a new graph after replaying others (setCheckpointPoolState).
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId id) override {
    char* text = entry().checkpoint_pool(device, id.first, id.second);
    TORCH_CHECK(text != nullptr, "reservoir (PyTorch's allocator): getCheckpointState: ", entry().error());
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
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> as) override {
    const auto pps = std::dynamic_pointer_cast<PoolState>(as);
    TORCH_CHECK(pps != nullptr, "reservoir (PyTorch's allocator): setCheckpointPoolState: the state is not one "
                "reservoir's getCheckpointState made");
    TORCH_CHECK(pps->device == device, "reservoir (PyTorch's allocator): setCheckpointPoolState: a checkpoint of "
                "device ", static_cast<int>(pps->device), " given for device ", static_cast<int>(device));
    // The calls PyTorch's history writes them with: the restore's allocations
    // with this call's context, its frees with it only when every call is kept.
    const std::optional<Recorded> alloc_context = record_context(true, device);
    const std::optional<Recorded> free_context = record_context(false, device);
    const nlohmann::json done = parsed(entry().restore_pool(device, pps->id.first, pps->id.second,
                                                            pps->text.c_str()),
                                       "setCheckpointPoolState");
    cca::CheckpointDelta delta;
    std::lock_guard lock(mutex_);
    const bool keep = alloc_context && history_on_;
    for (const nlohmann::json& p : done["freed"]) {
      void* ptr = reinterpret_cast<void*>(p.get<std::uintptr_t>());
      live_.erase(ptr);
      if (keep) contexts_[p.get<std::size_t>()].frees.push_back(*free_context);
      delta.ptrs_freed.push_back(ptr);
    }
    for (const nlohmann::json& seg : pps->layout["segments"]) {
      for (const nlohmann::json& b : seg["blocks"]) {
        const auto at = b[0].get<std::size_t>();
        void* ptr = reinterpret_cast<void*>(at);
        if (keep) contexts_[at].allocs.push_back(*alloc_context);
        if (!b[3].get<bool>()) {
          if (keep) contexts_[at].frees.push_back(*free_context);
          continue;
        }
        live_[ptr] = Live{b[1].get<std::size_t>(), device, reinterpret_cast<cudaStream_t>(b[2].get<std::uintptr_t>())};
        delta.dataptrs_allocd.emplace_back(ptr, ptr, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device));
      }
    }
    return delta;
  }

 private:
  // What getCheckpointState hands PyTorch: reservoir's layout of the pool.
  struct PoolState final : cca::AllocatorState {
    c10::DeviceIndex device = 0;
    MempoolId id{0, 0};
    std::string text;        // reservoir_torch_checkpoint_pool's JSON, as restore_pool takes it
    nlohmann::json layout;   // ... read once (graph trees restore a checkpoint many times)
  };
  struct Live {
    size_t size = 0;
    int device = 0;
    cudaStream_t stream = nullptr;
  };

  // What history keeps of a call: PyTorch's recorder's context, and the
  // compile context and user metadata in force on its device.
  struct Recorded {
    std::shared_ptr<c10::GatheredContext> context;
    std::string compile_context;
    std::string user_metadata;
  };
  // Per address, in the order of the allocations (and frees) there.
  struct Contexts {
    std::vector<Recorded> allocs;
    std::vector<Recorded> frees;
  };

  static std::optional<trace_types::TraceEntry::Action> trace_action(const std::string& a) {
    using A = trace_types::TraceEntry;
    static const std::map<std::string, A::Action> kActions = {
        {"alloc", A::ALLOC},           {"free_requested", A::FREE_REQUESTED},
        {"free_completed", A::FREE_COMPLETED}, {"segment_alloc", A::SEGMENT_ALLOC},
        {"segment_free", A::SEGMENT_FREE},     {"segment_map", A::SEGMENT_MAP},
        {"segment_unmap", A::SEGMENT_UNMAP},   {"snapshot", A::SNAPSHOT},
        {"oom", A::OOM}};
    auto it = kActions.find(a);
    if (it == kActions.end()) return std::nullopt;
    return it->second;
  }

  // The annotate entries of a device not yet added, up to a time, into its
  // trace (in time order with reservoir's entries); *next counts those
  // added. Holds mutex_.
  // Keeps an entry this library wrote, the latest max_entries as PyTorch's
  // ring of entries keeps them. Holds mutex_.
  void keep_own_entry(trace_types::TraceEntry te) {
    own_entries_.push_back(std::move(te));
    while (max_entries_ > 0 && own_entries_.size() > max_entries_) own_entries_.pop_front();
  }

  void add_own_entries_until(std::vector<trace_types::TraceEntry>& trace, int device,
                             std::int64_t time_us, std::size_t* next) const {
    std::size_t seen = 0;
    for (const auto& te : own_entries_) {
      if (te.device_ != device) continue;
      if (seen++ < *next) continue;
      if (static_cast<std::int64_t>(te.time_.t_) >= time_us) break;  // a tie: after the event
      trace.push_back(te);
      ++*next;
    }
  }

  // A snapshot taken is an entry of the device's trace while history is on
  // (its size the active bytes it reported), as PyTorch writes it. Holds mutex_.
  void note_snapshot(int device, std::size_t total_active) {
    if (!history_on_ || skipped("snapshot")) return;
    trace_types::TraceEntry te = trace_entry(trace_types::TraceEntry::SNAPSHOT, device, 0, total_active, nullptr,
                                             nullptr, compile_context_of(device), metadata_of(device));
    te.time_.t_ = static_cast<time_t>(now_us());
    keep_own_entry(std::move(te));
  }

  bool skipped(const std::string& action) const {
    return std::find(skip_actions_.begin(), skip_actions_.end(), action) != skip_actions_.end();
  }

  static void fill_config(cca::AllocatorConfigInfo& c, const nlohmann::json& j) {
    c.garbage_collection_threshold = j.value("garbage_collection_threshold", 0.0);
    c.max_split_size = j.value("max_split_size", std::size_t{0});
    c.pinned_num_register_threads = j.value("pinned_num_register_threads", std::size_t{1});
    c.expandable_segments = j.value("expandable_segments", false);
    c.release_lock_on_malloc = j.value("release_lock_on_malloc", false);
    c.pinned_use_host_register = j.value("pinned_use_host_register", false);
#if RESERVOIR_TORCH_CONFIG_RECORD_STREAM_REUSE
    c.graph_capture_record_stream_reuse = j.value("graph_capture_record_stream_reuse", false);
#endif
    c.last_allocator_settings = j.value("settings", std::string());
    c.roundup_power2_divisions = j.value("roundup_power2_divisions", std::vector<std::size_t>{});
#if RESERVOIR_TORCH_CONFIG_ROUND_AND_CACHED
    c.max_round_threshold = j.value("max_round_threshold", std::size_t{0});
    c.max_cached_size = j.value("max_cached_size", std::size_t{0});
#endif
  }

  // What history keeps of an allocation or a free on `device`, when it is on.
  std::optional<Recorded> record_context(bool alloc, int device) {
    if (!recording_.load(std::memory_order_relaxed)) return std::nullopt;  // allocate/free without a lock
    cca::CreateContextFn recorder = nullptr;
    cca::RecordContext when{};
    Recorded out;
    {
      std::lock_guard lock(mutex_);
      if (!history_on_) return std::nullopt;
      recorder = recorder_;
      when = when_;
      out.compile_context = compile_context_of(device);
      out.user_metadata = metadata_of(device);
    }
    const bool wanted = recorder != nullptr && when != cca::RecordContext::NEVER &&
                        (alloc || when == cca::RecordContext::ALL);
    if (wanted) out.context = recorder();
    return out;
  }

  // The user metadata set on a device. Holds mutex_.
  std::string metadata_of(int device) const {
    auto it = user_metadata_.find(device);
    return it == user_metadata_.end() ? std::string() : it->second;
  }

  // The call of this thread's that is in reservoir now, when history keeps
  // it: what its segment releases are written with.
  static thread_local const Recorded* current_call;
  struct InCall {
    explicit InCall(const Recorded* r) : previous(current_call) { current_call = r; }
    ~InCall() { current_call = previous; }
    InCall(const InCall&) = delete;
    InCall& operator=(const InCall&) = delete;
    const Recorded* previous;
  };

  // The innermost compile context pushed on a device, "N/A" without one (as PyTorch writes it).
  std::string compile_context_of(int device) const {
    auto it = compile_contexts_.find(device);
    return it == compile_contexts_.end() || it->second.empty() ? std::string("N/A") : it->second.back();
  }

  // Microseconds since the epoch: the clock of reservoir's history.
  static std::int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  // Every event of reservoir's as it happens (under reservoir's lock): to
  // PyTorch's trace trackers, and for history, the call a segment release
  // happened in (empty_cache, or the allocation whose retry released it).
  static void on_event(void* self, int device, const char* action, size_t action_size, unsigned long long addr,
                       unsigned long long size, void* stream, long long time_us) {
    auto* me = static_cast<ReservoirAllocator*>(self);
    const auto kind = trace_action(std::string(action, action_size));
    if (!kind) return;
    using TE = trace_types::TraceEntry;
    std::vector<cca::AllocatorTraceTracker> trackers;
    {
      std::lock_guard lock(me->mutex_);
      if (!me->trackers_.empty()) trackers = me->trackers_;  // no copy per event for history alone
      if (me->history_on_ && (*kind == TE::SEGMENT_FREE || *kind == TE::SEGMENT_UNMAP)) {
        me->releases_[addr].push_back(current_call != nullptr
                                          ? *current_call
                                          : Recorded{nullptr, me->compile_context_of(device), me->metadata_of(device)});
      }
    }
    if (trackers.empty()) return;
    TE te = trace_entry(*kind, device, addr, size, stream, nullptr, {}, {});
    te.time_.t_ = static_cast<time_t>(time_us != 0 ? time_us : now_us());
    for (const auto& tracker : trackers) tracker(te);
  }

  // Connects every device the allocator knows to reservoir's events, once
  // each. reservoir calls on_event under its own lock, and on_event takes
  // ours: no lock of ours is held while reservoir is called.
  void connect_events(int devices) {
    std::vector<int> todo;
    {
      std::lock_guard lock(mutex_);
      for (int d = connected_devices_; d < devices; ++d) todo.push_back(d);
      connected_devices_ = std::max(connected_devices_, devices);
    }
    for (int d : todo) {
      TORCH_CHECK(entry().attach_trace_tracker(d, on_event, this) == 0,
                  "reservoir (PyTorch's allocator): attaching to device ", d, "'s events: ", entry().error());
    }
  }

  // reservoir's segments and history of a device, as JSON.
  static nlohmann::json state_of(int device) { return parsed(entry().snapshot_json(device), "snapshot"); }

  static int call_filter(void* context, cudaStream_t stream) {
    return (*static_cast<std::function<bool(cudaStream_t)>*>(context))(stream) ? 1 : 0;
  }

  void* malloc_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    // PyTorch's own check, ahead of its device allocator (no statistics,
    // no observers): 1 EiB is more than any device holds.
    constexpr size_t kOneExaByte = size_t{1} << 60;
    TORCH_CHECK_WITH(OutOfMemoryError, size < kOneExaByte,
                     "CUDA out of memory. Tried to allocate more than 1EB memory.");
    std::optional<Recorded> recorded = record_context(true, device);
    void* p = nullptr;
    {
      InCall call(recorded ? &*recorded : nullptr);
      p = entry().malloc(static_cast<ssize_t>(size), device, stream);
    }
    if (p == nullptr) {
      if (entry().error_is_oom() != 0) {
        const std::string message = entry().error();
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
    std::lock_guard lock(mutex_);
    live_[p] = Live{size, device, stream};
    if (recorded && history_on_) contexts_[reinterpret_cast<std::size_t>(p)].allocs.push_back(std::move(*recorded));
    return p;
  }

  std::mutex mutex_;
  bool initialized_ = false;
  std::atomic<bool> enabled_{true};
  std::unordered_set<void*> uncached_;  // uncached_allocate's, live
  std::atomic<std::size_t> uncached_live_{0};  // uncached_.size(), read without the lock
  std::vector<double> fractions_;
  std::unordered_map<void*, Live> live_;
  std::map<std::pair<int, MempoolId>, std::unique_ptr<std::function<bool(cudaStream_t)>>> filters_;
  std::map<std::pair<int, MempoolId>, int> pool_users_;
  std::set<std::pair<int, MempoolId>> routed_pools_;  // pools reservoir holds (begun at least once)
  cca::CreateContextFn recorder_ = nullptr;
  std::atomic<bool> recording_{false};  // recorder_ != nullptr, read without the lock
  cca::RecordContext when_{};
  std::vector<std::string> skip_actions_;
  std::unordered_map<std::size_t, Contexts> contexts_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  bool history_on_ = false;
  std::size_t max_entries_ = 0;
  std::map<int, std::vector<std::string>> compile_contexts_;
  std::map<int, std::string> user_metadata_;
  std::deque<trace_types::AnnotationEntry> annotations_;
  // Entries this library writes itself, merged into the trace by time:
  // torch.cuda.memory._annotate_memory's, and each _snapshot()'s own.
  std::deque<trace_types::TraceEntry> own_entries_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  // IPC handles opened here, while in use (their own lock: a deleter runs
  // wherever the last user lets go).
  std::mutex ipc_mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;
  static constexpr char kHandleVersion = RESERVOIR_TORCH_IPC_HANDLE_VERSION;
  int connected_devices_ = 0;  // devices whose events on_event receives
  // Per segment address, the calls its releases happened in, in order.
  std::unordered_map<std::size_t, std::vector<Recorded>> releases_;
#if RESERVOIR_TORCH_OOM_REJECTION_OBSERVER
  std::vector<cca::OomRejectionObserver> rejection_observers_;
#endif
};

thread_local const ReservoirAllocator::Recorded* ReservoirAllocator::current_call = nullptr;

// Never destroyed, as PyTorch's own allocator is not: at exit the
// interpreter has been finalized before the static destructors run, and
// the allocator's history holds Python stacks (PyTorch's CapturedTraceback)
// whose release takes the GIL and drops references to Python objects
// already freed. PyTorch's own reference (changeCurrentAllocator's) is a
// static of its library, so a reference of ours must outlive every static.
std::shared_ptr<ReservoirAllocator>& the_allocator() {
  static auto* instance = new std::shared_ptr<ReservoirAllocator>();
  return *instance;
}

void raw_delete_fn(void* ptr) { the_allocator()->raw_delete(ptr); }
void uncached_delete_fn(void* ptr) {
  if (ptr != nullptr) (void)the_allocator()->uncached_free(ptr);
}

// Settings PyTorch takes at run time (torch.cuda.memory._set_allocator_settings,
// torch._C._accelerator_setAllocatorSettings) reach reservoir through c10's
// device parser hook, wrapped: PyTorch's own parser (CUDA's keys) runs
// first, then reservoir's allocators follow. The hook is an object of
// libc10's (a process-wide unique symbol), looked up there: an inline
// reference from this library, built with hidden inlines, would be a copy
// of its own.
void follow_runtime_settings() {
#if RESERVOIR_TORCH_SETTINGS_HOOK
  using Hook = std::function<void(const std::string&)>;
  Hook* hook = nullptr;
  if (void* c10 = dlopen("libc10.so", RTLD_NOW | RTLD_NOLOAD)) {
    // An exported function returning it (2.15), the function's static
    // itself where the function is inline in the headers (2.11 to 2.14), or
    // an inline static member (2.9, 2.10).
    if (void* f = dlsym(c10, "_ZN3c1016CachingAllocator26AcceleratorAllocatorConfig19getConfigParserHookB5cxx11Ev")) {
      hook = &reinterpret_cast<Hook& (*)()>(f)();
    } else if (void* h = dlsym(
                   c10, "_ZZN3c1016CachingAllocator26AcceleratorAllocatorConfig19getConfigParserHookB5cxx11EvE4hook")) {
      hook = static_cast<Hook*>(h);
    } else {
      hook = static_cast<Hook*>(
          dlsym(c10, "_ZN3c1016CachingAllocator26AcceleratorAllocatorConfig26device_config_parser_hook_B5cxx11E"));
    }
    dlclose(c10);
  }
  TORCH_CHECK(hook != nullptr,
              "reservoir (PyTorch's allocator): libc10 has no allocator settings hook to follow "
              "_set_allocator_settings with (a PyTorch this library was not built for?)");
  const Hook previous = *hook;
  *hook = [previous](const std::string& text) {
    if (previous) previous(text);
    if (the_allocator()) the_allocator()->settings_changed(text);
  };
#endif
}

}  // namespace

extern "C" {

// Makes reservoir PyTorch's CUDA allocator (before any CUDA allocation):
// `path` holds reservoir's entry points, `release` is the running PyTorch.
// 0, or -1 with the reason in reservoir_torch_hooks_error().
__attribute__((visibility("default"))) int reservoir_torch_use_as_allocator(const char* path,
                                                                           const char* release) {
  return reservoir_torch_hooks::guarded([&] {
    reservoir_torch_hooks::load(path, release);
    // PyTorch refuses the change once its allocator has served a request:
    // the allocator in place (reservoir's too) then stays as it is.
    auto fresh = std::make_shared<ReservoirAllocator>();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(fresh);
    the_allocator() = std::move(fresh);
    static std::once_flag followed;
    std::call_once(followed, follow_runtime_settings);
    // The device-generic API (torch.accelerator.memory_stats(),
    // empty_cache(), ...) asks c10's allocator of the CUDA device type,
    // which changeCurrentAllocator leaves at PyTorch's: it is reservoir's
    // too (at the highest priority, which no later registration overrides).
    c10::SetAllocator(c10::DeviceType::CUDA, the_allocator().get(), std::numeric_limits<uint8_t>::max());
  });
}

// For tests: what PyTorch's current CUDA allocator (whichever it is) answers
// to cacheInfo (starting from `initial`) and getBaseAllocation, which no
// Python binding reaches. -1 / null with the reason in reservoir_torch_hooks_error().
__attribute__((visibility("default"))) long long reservoir_torch_current_cache_info(int device,
                                                                                    unsigned long long initial) {
  size_t largest = initial;
  const int rc = reservoir_torch_hooks::guarded([&] {
    c10::cuda::CUDACachingAllocator::get()->cacheInfo(static_cast<c10::DeviceIndex>(device), &largest);
  });
  return rc == 0 ? static_cast<long long>(largest) : -1;
}

__attribute__((visibility("default"))) void* reservoir_torch_current_base_allocation(void* ptr,
                                                                                    unsigned long long* size) {
  void* base = nullptr;
  size_t total = 0;
  if (reservoir_torch_hooks::guarded(
          [&] { base = c10::cuda::CUDACachingAllocator::get()->getBaseAllocation(ptr, &total); }) != 0) {
    return nullptr;
  }
  *size = total;
  return base;
}

}  // extern "C"

namespace {
// A string for C callers, freed with free(); null when memory runs out.
char* malloc_copy(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

// What the test helper's trace tracker saw: [action, address, size] each.
std::mutex traced_mutex;
nlohmann::json traced = nlohmann::json::array();
}  // namespace

extern "C" {

// For tests: attaches a trace tracker to PyTorch's current CUDA allocator
// (whichever it is) that notes every event; _take gives them as JSON (free
// with free()) and starts over. 0 / the JSON, or -1 / null with the reason in
// reservoir_torch_hooks_error().
__attribute__((visibility("default"))) int reservoir_torch_current_trace_tracker_start() {
  return reservoir_torch_hooks::guarded([] {
    c10::cuda::CUDACachingAllocator::get()->attachAllocatorTraceTracker(
        [](const trace_types::TraceEntry& te) {
          static const char* const kNames[] = {"alloc",       "free_requested", "free_completed",
                                               "segment_alloc", "segment_free", "segment_map",
                                               "segment_unmap", "snapshot",     "oom",
                                               "annotate"};
          const auto index = static_cast<std::size_t>(te.action_);
          std::lock_guard lock(traced_mutex);
          traced.push_back({index < std::size(kNames) ? kNames[index] : "?", te.addr_, te.size_});
        });
  });
}

// For tests: getExpandableSegmentSizes of PyTorch's current CUDA allocator,
// as JSON [[stream, is_small_pool, total_size], ...] (free with free()), or
// null with the reason in reservoir_torch_hooks_error().
__attribute__((visibility("default"))) char* reservoir_torch_current_expandable_segment_sizes(int device) {
  std::string text;
  if (reservoir_torch_hooks::guarded([&] {
        nlohmann::json out = nlohmann::json::array();
#if RESERVOIR_TORCH_EXPANDABLE_SEGMENT_SIZES
        for (const auto& s : c10::cuda::CUDACachingAllocator::get()->getExpandableSegmentSizes(
                 static_cast<c10::DeviceIndex>(device))) {
          out.push_back({reinterpret_cast<std::uintptr_t>(s.stream), s.is_small_pool, s.total_size});
        }
#else
        (void)device;
        TORCH_CHECK(false, "getExpandableSegmentSizes came with PyTorch 2.10");
#endif
        text = out.dump();
      }) != 0) {
    return nullptr;
  }
  return malloc_copy(text);
}

__attribute__((visibility("default"))) char* reservoir_torch_current_trace_tracker_take() {
  std::string text;
  {
    std::lock_guard lock(traced_mutex);
    text = traced.dump();
    traced = nlohmann::json::array();
  }
  return malloc_copy(text);
}

}  // extern "C"
