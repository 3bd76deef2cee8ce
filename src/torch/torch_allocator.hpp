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
// The class is PyTorch's interface, each release's form of it
// (torch_releases.hpp), delegating to reservoir's entry points
// (torch_entry.hpp) and to one part per concern:
//   torch_allocator.cpp  allocation and deleters, set-up, caches, checkpoints
//   torch_stats.cpp      statistics and segments in PyTorch's types
//   torch_pools.cpp      private pools: routes, users, options
//   torch_history.cpp    history, snapshots' traces, trace trackers
//   torch_profiler.cpp   the profiler's memory events
//   torch_ipc.cpp        CUDA IPC handles in PyTorch's format
//   torch_install.cpp    installing it into PyTorch; settings at run time
//
// What reservoir cannot do raises PyTorch's error naming the method and
// why (IPC under the virtual-memory policies, a MemPool of another
// allocator), never a silent no-op. Thread-safe: each part has its lock;
// none is held while reservoir is called.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torch_history.hpp"
#include "torch_ipc.hpp"
#include "torch_pools.hpp"
#include "torch_stats.hpp"
#include "torch_types.hpp"

namespace reservoir_torch_hooks {

class ReservoirAllocator final : public CUDAAllocator {
 public:
  // ---- allocation (torch_allocator.cpp) ----
  c10::DataPtr allocate(size_t size) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  void* raw_alloc(size_t size) override;
  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  // A pointer of the uncached path's (caching off): freed with cudaFree
  // (true); false otherwise.
  bool uncached_free(void* ptr);

  // ---- set-up and state (torch_allocator.cpp) ----
  void init(int device_count) override;
  bool initialized() override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }
  std::string name() override { return "reservoir"; }
  // torch.cuda.memory._set_allocator_settings(text), after PyTorch took it
  // (its own parser validated it): reservoir's allocators follow.
  void settings_changed(const std::string& text);

  // ---- caches and statistics (torch_allocator.cpp, torch_stats.cpp) ----
#if !RESERVOIR_TORCH_POOL_EMPTY_CACHE
  void emptyCache() override {
    empty_cache(kDefaultPools);
  }
#else
  void emptyCache(MempoolId mempool_id) override {
    empty_cache(mempool_id);
  }
#endif
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return device_stats(parsed(entry().stats_json(device), "getDeviceStats"));
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
#if RESERVOIR_TORCH_EXPANDABLE_SEGMENT_SIZES
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override {
    return expandable_segment_sizes(state_of(device));
  }
#endif

  // ---- streams, pools, graphs (torch_pools.cpp) ----
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() != nullptr) entry().record_stream(ptr.get(), stream.stream());
  }
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId id,
                           std::function<bool(cudaStream_t)> filter) override {
#if !RESERVOIR_TORCH_CREATE_OR_INCREF_POOL
    // 2.6 and 2.7: a MemPool's own allocator is the active pool's
    // (use_mem_pool makes it active before routing to it).
    if (c10::cuda::MemPool* active = c10::cuda::MemPoolContext::getActiveMemPool();
        active != nullptr && active->id() == id && active->allocator() != nullptr &&
        active->allocator() != this && !pools_.has_allocator(device, id)) {
      pools_.set_allocator(device, id, active->allocator(), nullptr);
    }
#endif
    pools_.begin_route(device, id, std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId id) override {
    pools_.end_route(device, id);
  }
#if RESERVOIR_TORCH_POOL_ALLOCATOR_SHARED
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId id,
                          std::shared_ptr<CUDAAllocator> allocator) override {
    create_or_incref_pool(device, id, allocator.get(), allocator);
  }
#elif RESERVOIR_TORCH_CREATE_OR_INCREF_POOL
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId id,
                          CUDAAllocator* allocator) override {
    create_or_incref_pool(device, id, allocator, nullptr);
  }
#else
  void ensureExistsAndIncrefPool(c10::DeviceIndex device, MempoolId id) override {
    create_or_incref_pool(device, id, nullptr, nullptr);
  }
#endif
  int getPoolUseCount(c10::DeviceIndex device, MempoolId id) override {
    return pools_.users(device, id);
  }
#if !RESERVOIR_TORCH_USE_ON_OOM
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id, bool use_on_oom) {
    Pools::set_use_on_oom(device, id, use_on_oom);
  }
#elif !RESERVOIR_TORCH_USE_ON_OOM_FLAG
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id) override {
    Pools::set_use_on_oom(device, id, true);
  }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id, bool use_on_oom) {
    Pools::set_use_on_oom(device, id, use_on_oom);
  }
#else
  void setUseOnOOM(c10::DeviceIndex device, MempoolId id, bool use_on_oom) override {
    Pools::set_use_on_oom(device, id, use_on_oom);
  }
#endif
#if RESERVOIR_TORCH_NO_SPLIT_POOLS
  void setNoSplit(c10::DeviceIndex device, MempoolId id) override {
    Pools::set_no_split(device, id);
  }
#endif
  void releasePool(c10::DeviceIndex device, MempoolId id) override {
    pools_.release(device, id);
  }
  // CUDA graph trees check that a pool holds exactly the allocations they
  // expect to be live.
  bool checkPoolLiveAllocations(
      c10::DeviceIndex device, MempoolId id,
      const std::unordered_set<void*>& expected_live_allocations) override;
  // CUDA graph trees: a private pool's layout, to lay it out again before
  // recording a new graph after replaying others (setCheckpointPoolState).
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId id) override;
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> as) override;

  // ---- history and observers (torch_history.cpp) ----
  // torch.cuda.memory._snapshot(): every device's segments and blocks, and
  // with history on, its trace, from reservoir's own record; the contexts
  // are PyTorch's (its context recorder, called here on each allocation, and
  // on each free when it records everything).
#if !RESERVOIR_TORCH_SNAPSHOT_INCLUDE_TRACES
#if RESERVOIR_TORCH_POOL_SNAPSHOT
  cca::SnapshotInfo snapshot(MempoolId mempool_id) override {
    return take_snapshot(mempool_id, true);
  }
#else
  // MemPool.snapshot() takes its snapshot inside the pool's use_mem_pool:
  // the active pool's segments alone, as PyTorch's allocator gives them then.
  cca::SnapshotInfo snapshot() override {
    c10::cuda::MemPool* active = c10::cuda::MemPoolContext::getActiveMemPool();
    return take_snapshot(active != nullptr ? active->id() : kDefaultPools, true);
  }
#endif
#else
  cca::SnapshotInfo snapshot(MempoolId mempool_id, bool include_traces) override {
    return take_snapshot(mempool_id, include_traces);
  }
#endif
#if !RESERVOIR_TORCH_HISTORY_CLEAR
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, cca::RecordContext when) override {
    record_history(enabled, std::move(context_recorder), alloc_trace_max_entries, when, false, {});
  }
#elif !RESERVOIR_TORCH_HISTORY_SKIP_ACTIONS
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, cca::RecordContext when,
                     bool clearHistory) override {
    record_history(enabled, std::move(context_recorder), alloc_trace_max_entries, when,
                   clearHistory, {});
  }
#else
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, cca::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    record_history(enabled, std::move(context_recorder), alloc_trace_max_entries, when,
                   clearHistory, skip_actions);
  }
#endif
  bool isHistoryEnabled() override {
    return history_.on();
  }
  // record_function's annotations (torch.profiler, FSDP's stages), kept
  // with history as PyTorch keeps them: the latest alloc_trace_max_entries.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    history_.annotate(c10::cuda::current_device(), md);
  }
  // torch.compile's contexts: the innermost one in force is written on each
  // trace entry of the device (PyTorch keeps a stack per device).
#if RESERVOIR_TORCH_COMPILE_CONTEXT
  void pushCompileContext(std::string& md) override {
    history_.push_compile_context(c10::cuda::current_device(), md);
  }
  void popCompileContext() override {
    history_.pop_compile_context(c10::cuda::current_device());
  }
#endif
#if RESERVOIR_TORCH_USER_METADATA
  // torch.cuda.memory._set_memory_metadata: written on the device's entries from now on.
  void setUserMetadata(const std::string& metadata) override {
    history_.set_user_metadata(c10::cuda::current_device(), metadata);
  }
  std::string getUserMetadata() override {
    return history_.user_metadata(c10::cuda::current_device());
  }
#endif
#if RESERVOIR_TORCH_ANNOTATE_MEMORY
  bool supportsUserMetadata() override {
    return true;
  }
  // torch.cuda.memory._annotate_memory: an "annotate" entry for a live
  // allocation, in time order among the device's entries.
  void annotateMemory(const void* ptr, const std::string& metadata) override;
#endif
#if RESERVOIR_TORCH_CONTEXT_FOR_POINTER
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override;
#endif
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override;
#if RESERVOIR_TORCH_OOM_REJECTION_OBSERVER
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override;
#endif
  // Called with every event as it happens, under reservoir's lock (as
  // PyTorch calls them under its own): NCCL's memory registration uses them.
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override;

  // ---- devices and IPC (torch_allocator.cpp, torch_ipc.cpp) ----
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  cca::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    return ipc_.open(handle);
  }

 private:
  struct Live {
    size_t size = 0;
    int device = 0;
    cudaStream_t stream = nullptr;
  };

  // With caching off (torch.cuda.memory.caching_allocator_enable(False), or
  // PYTORCH_NO_CUDA_MEMORY_CACHING=1), as PyTorch's allocator: each request
  // is a cudaMalloc of its own, given back by cudaFree when freed, outside
  // the cache and its statistics.
  bool uncached() const;
  void* uncached_allocate(size_t size);
  void* malloc_on(size_t size, c10::DeviceIndex device, cudaStream_t stream);
  void empty_cache(MempoolId mempool_id);
  void create_or_incref_pool(c10::DeviceIndex device, MempoolId id, CUDAAllocator* allocator,
                             std::shared_ptr<CUDAAllocator> owner);
  cca::SnapshotInfo take_snapshot(MempoolId mempool_id, bool include_traces);
  void record_history(bool enabled, cca::CreateContextFn context_recorder,
                      size_t alloc_trace_max_entries, cca::RecordContext when, bool clear,
                      const std::vector<std::string>& skip_actions);
  // Connects every device the allocator knows to reservoir's events, once
  // each. reservoir calls History::on_event under its own lock, which takes
  // the history's: no lock of ours is held while reservoir is called.
  void connect_events(int devices);
  int devices();  // the devices init() was told of

  std::mutex mutex_;  // guards what follows, up to the parts
  bool initialized_ = false;
  std::vector<double> fractions_;
  std::unordered_map<void*, Live> live_;
  std::unordered_set<void*> uncached_;  // uncached_allocate's, live
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
#if RESERVOIR_TORCH_OOM_REJECTION_OBSERVER
  std::vector<cca::OomRejectionObserver> rejection_observers_;
#endif
  int connected_devices_ = 0;  // devices whose events History::on_event receives
  std::atomic<bool> enabled_{true};
  std::atomic<std::size_t> uncached_live_{0};  // uncached_.size(), read without the lock

  History history_;
  Pools pools_;
  IpcHandles ipc_;
};

// The one instance PyTorch was given (torch_install.cpp); the deleters'.
std::shared_ptr<ReservoirAllocator>& the_allocator();
void raw_delete_fn(void* ptr);
void uncached_delete_fn(void* ptr);

}  // namespace reservoir_torch_hooks
