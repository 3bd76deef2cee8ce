// libreservoir_torch.so: reservoir as PyTorch's CUDA allocator, through
// torch.cuda.memory.CUDAPluggableAllocator(path, "reservoir_torch_malloc",
// "reservoir_torch_free") (python/reservoir_torch.py installs it).
//
// One Saver per GPU (reservoir/saver.hpp), created on first use, on the
// backend RESERVOIR_TORCH_DEVICE names (cuda-runtime by default; cuda-vmm for
// the expandable and paging policies; sim or host to exercise the library
// without a GPU), configured by RESERVOIR_ALLOC_CONF (else
// PYTORCH_CUDA_ALLOC_CONF). Allocations outside every region are served by
// its untagged allocator exactly as a plain CachingAllocator would; tagged
// ones (regions opened through the Python module) live on CUDA's virtual
// memory API (a cuda-vmm view of the same GPU when the main backend is
// cuda-runtime) so they can be paused. Beside malloc and free it exports the
// optional hooks PyTorch's CUDAPluggableAllocator accepts (init, reset,
// memory fraction, record_stream, begin/end allocate to pool, release pool),
// with its signatures, and C functions for stats, summary and snapshots.
//
// The same source is compiled into the Python module (reservoir._core), which
// hands its own file to CUDAPluggableAllocator, so the module's region,
// pause and resume act on the saver PyTorch allocates from.
#include <fmt/format.h>
#include <sys/types.h>

#include <atomic>
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/combined_device.hpp"
#include "reservoir/cuda_device.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "reservoir/saver.hpp"
#include "torch_saver.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/open_device.hpp"
#include "reservoir/trace.hpp"

struct CUstream_st;  // cudaStream_t, without CUDA's headers

namespace {

using reservoir::AllocatorConfig;
using reservoir::CachingAllocator;

constexpr int kMaxDevices = 64;

struct PerDevice {
  std::unique_ptr<reservoir::Device> runtime;     // cuda-runtime's ordinary segments, under device
  std::unique_ptr<reservoir::Device> tag_device;  // cuda-vmm beside cuda-runtime
  // The allocators' device: cuda-runtime and cuda-vmm combined where both
  // open (so the kind of segments can change at run time), else the one.
  std::unique_ptr<reservoir::Device> device;
  std::unique_ptr<reservoir::PinnedMemorySource> pinned;
  std::unique_ptr<reservoir::Saver> saver;
  std::string settings;  // the configuration as given (PyTorch's allocator settings show it so)
};

std::mutex mutex;
// Never destroyed, as PyTorch's own caching allocator is not: at exit the
// memory goes with the process, and a private pool's segments are not handed
// back to its allocator (MemPool(allocator=...): vLLM's CuMemAllocator frees
// through a Python callback, after the interpreter has been finalized, which
// crashed the process at exit) nor anything to a driver already unloading.
std::array<PerDevice, kMaxDevices>& devices = *new std::array<PerDevice, kMaxDevices>();

// Regions on every device (torch_memory_saver's regions tag allocations on
// whichever device they are made): per thread, the regions open, innermost
// last, each with the token of every saver it was entered on. A saver
// created while a region is open enters the creating thread's regions.
struct EveryDeviceRegion {
  std::uint64_t id = 0;
  std::optional<std::string> tag;  // none: untagged
  reservoir::RegionOptions options;
  std::vector<std::pair<int, std::uint64_t>> tokens;  // (device, the saver's token)
};
thread_local std::vector<EveryDeviceRegion> every_device_regions;
std::uint64_t next_every_device_region = 1;  // under mutex

// Enters `region` on `saver` (the device's), noting the token.
void enter_on(EveryDeviceRegion& region, int device, reservoir::Saver& saver) {
  const std::uint64_t token =
      region.tag ? saver.push_region(*region.tag, region.options) : saver.push_untagged();
  region.tokens.emplace_back(device, token);
}

// Closes `region` on every saver it was entered on, innermost first. Under mutex.
void leave(const EveryDeviceRegion& region);
// The running PyTorch's release ("2.15"), when a library built for it said
// so: the native policy then takes that release's decisions unless the
// configuration names another (pytorch_version).
std::string running_release;
// The settings as changed at run time (reservoir_torch_apply_settings), for
// every allocator from then on; empty: the environment's.
std::string runtime_settings;

// The configuration every allocator takes now: the run-time settings, else
// the environment's. Under mutex.
AllocatorConfig current_config() {
  return runtime_settings.empty() ? AllocatorConfig::from_env() : AllocatorConfig::parse(runtime_settings);
}

thread_local std::string last_error;
thread_local bool last_error_out_of_memory = false;

reservoir::DeviceKind backend_kind(const AllocatorConfig& config) {
  if (const char* kind = std::getenv("RESERVOIR_TORCH_DEVICE"); kind != nullptr && *kind != '\0') {
    try {
      return reservoir::parse_device_kind(kind);
    } catch (const reservoir::UsageError& e) {
      throw reservoir::UsageError(fmt::format("RESERVOIR_TORCH_DEVICE: {}", e.what()));
    }
  }
  const bool vm = config.expandable_segments || config.policy != reservoir::Policy::native;
  return vm ? reservoir::DeviceKind::cuda_vmm : reservoir::DeviceKind::cuda_runtime;
}

// torch_explain_oom's settings, for the savers made after it.
std::optional<std::pair<reservoir::ExplainOptions, std::size_t>> explaining;

// Each device's fraction from torch.cuda.set_per_process_memory_fraction (0:
// none, or removed by 1.0 from 2.10), for the answer at an error.
std::array<std::atomic<double>, kMaxDevices> run_time_fractions{};

// The process's limit on `allocator`'s device when one is set (PyTorch's
// allowed_memory_maximum: the fraction of the device's total), else none.
std::optional<std::uint64_t> memory_limit(int device, const reservoir::CachingAllocator& allocator,
                                          std::uint64_t device_total) {
  double fraction = 0.0;
  if (device >= 0 && device < kMaxDevices) fraction = run_time_fractions[static_cast<std::size_t>(device)].load();
  if (fraction <= 0.0) fraction = allocator.config().per_process_memory_fraction;
  if (fraction <= 0.0 || fraction >= 1.0 || device_total == 0) return std::nullopt;
  return static_cast<std::uint64_t>(fraction * static_cast<double>(device_total));
}

void explain_on(reservoir::Saver& saver, int device) {
  reservoir::HistoryOptions history;
  history.max_entries = explaining->second;
  history.stacks = false;
  saver.record_history(history);
  // The settings as the allocator reads them at the error (run-time
  // settings included), the running release's rules named (pytorch_version):
  // the analysis replays that release's decisions, and the snapshot written
  // says which they were, for `reservoir verify`.
  saver.set_oom_explainer([&saver, device, options = explaining->first](const reservoir::OutOfMemoryError& e) {
    reservoir::ExplainOptions with_limit = options;
    with_limit.device = device;
    with_limit.memory_limit = memory_limit(device, saver.untagged_allocator(), e.device_total());
    const reservoir::OomExplainer explain = reservoir::oom_explainer(
        [&saver] { return saver.snapshot(); }, with_limit, saver.untagged_allocator().config().to_string());
    std::string text = explain(e);
    // Before the error, where a dying job's log shows it.
    if (!text.empty()) std::fprintf(stderr, "%s\n", text.c_str());
    return text;
  });
}

// The saver of a device, created on first use. Throws on failure.
reservoir::Saver& saver_for(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw reservoir::UsageError(fmt::format("reservoir_torch: device {} out of range", device));
  }
  std::lock_guard lock(mutex);
  PerDevice& d = devices[static_cast<std::size_t>(device)];
  if (!d.saver) {
    reservoir::SaverOptions options;
    options.config = current_config();
    d.settings = options.config.to_string();
    if (options.config.pytorch_version.empty()) options.config.set_pytorch_version(running_release);
    options.device_index = device;
    using reservoir::DeviceKind;
    const DeviceKind kind = backend_kind(options.config);
    d.device = reservoir::open_device(kind, {.index = device});
    if (kind == DeviceKind::cuda_runtime) {
      // Tagged regions need virtual memory management beside cudaMalloc, and
      // so does expandable_segments turned on at run time.
      try {
        d.tag_device = reservoir::open_device(DeviceKind::cuda_vmm, {.index = device});
        options.tag_device = d.tag_device.get();
        d.runtime = std::move(d.device);
        d.device = std::make_unique<reservoir::CombinedDevice>(*d.runtime, *d.tag_device);
      } catch (const reservoir::DeviceUnavailableError&) {
        // No virtual memory management here: regions will say so when opened.
      }
    }
    if (kind == DeviceKind::cuda_runtime || kind == DeviceKind::cuda_vmm) {
      d.pinned = reservoir::CudaPinnedMemory::open();
      options.pinned_source = d.pinned.get();
    }
    reservoir::read_saver_environment(options);
    d.saver = std::make_unique<reservoir::Saver>(*d.device, options);
    for (EveryDeviceRegion& region : every_device_regions) enter_on(region, device, *d.saver);
    if (explaining) explain_on(*d.saver, device);
  }
  return *d.saver;
}

CachingAllocator& allocator_for(int device) { return saver_for(device).untagged_allocator(); }

std::string settings_of(int device) {
  std::lock_guard lock(mutex);
  return devices[static_cast<std::size_t>(device)].settings;
}

}  // namespace

namespace reservoir {
Saver& torch_saver(int device) { return saver_for(device); }

void torch_explain_oom(const ExplainOptions& options, std::size_t max_entries) {
  std::lock_guard lock(mutex);
  explaining.emplace(options, max_entries);
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].saver) explain_on(*devices[i].saver, static_cast<int>(i));
  }
}

std::vector<int> torch_saver_devices() {
  std::lock_guard lock(mutex);
  std::vector<int> out;
  for (int i = 0; i < kMaxDevices; ++i) {
    if (devices[static_cast<std::size_t>(i)].saver) out.push_back(i);
  }
  return out;
}

std::uint64_t torch_push_region_everywhere(std::optional<std::string> tag, RegionOptions options) {
  std::lock_guard lock(mutex);
  EveryDeviceRegion region{.id = next_every_device_region++, .tag = std::move(tag), .options = options,
                           .tokens = {}};
  try {
    for (int i = 0; i < kMaxDevices; ++i) {
      PerDevice& d = devices[static_cast<std::size_t>(i)];
      if (d.saver) enter_on(region, i, *d.saver);
    }
  } catch (...) {
    leave(region);  // nothing stays open of a region that could not be entered everywhere
    throw;
  }
  every_device_regions.push_back(std::move(region));
  return every_device_regions.back().id;
}

void torch_pop_region_everywhere(std::uint64_t id) {
  std::lock_guard lock(mutex);
  if (every_device_regions.empty() || every_device_regions.back().id != id) {
    throw UsageError(fmt::format(
        "region: closing region {} of every device, but {} is the innermost open on this thread "
        "(regions close innermost first)",
        id, every_device_regions.empty() ? std::string("none") : std::to_string(every_device_regions.back().id)));
  }
  const EveryDeviceRegion region = std::move(every_device_regions.back());
  every_device_regions.pop_back();
  leave(region);
}
}  // namespace reservoir

namespace {
void leave(const EveryDeviceRegion& region) {
  for (auto it = region.tokens.rbegin(); it != region.tokens.rend(); ++it) {
    devices[static_cast<std::size_t>(it->first)].saver->pop_region(it->second);
  }
}
}  // namespace

namespace {

template <typename F>
bool guarded(F&& f) {
  try {
    f();
    return true;
  } catch (const reservoir::OutOfMemoryError& e) {
    last_error = e.what();
    last_error_out_of_memory = true;
    return false;
  } catch (const std::exception& e) {
    last_error = e.what();
    last_error_out_of_memory = false;
    return false;
  }
}

// The items of a settings string, split at the commas outside brackets
// (roundup_power2_divisions:[256:1,>:4] is one item).
std::vector<std::string> settings_items(const std::string& text) {
  std::vector<std::string> items;
  int depth = 0;
  std::string item;
  for (const char c : text + ",") {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth <= 0) {
      const auto first = item.find_first_not_of(" \t");
      if (first != std::string::npos) items.push_back(item.substr(first));
      item.clear();
      continue;
    }
    item += c;
  }
  return items;
}

std::string item_key(const std::string& item) {
  std::string key = item.substr(0, item.find(':'));
  while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
  return key;
}

std::vector<std::string> settings_keys(const std::string& text) {
  std::vector<std::string> keys;
  for (const std::string& item : settings_items(text)) keys.push_back(item_key(item));
  return keys;
}

// `text` less the items of `keys`.
std::string settings_without(const std::string& text, const std::vector<std::string>& keys) {
  std::string out;
  for (const std::string& item : settings_items(text)) {
    if (std::find(keys.begin(), keys.end(), item_key(item)) != keys.end()) continue;
    out += (out.empty() ? "" : ",") + item;
  }
  return out;
}

char* copy_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.data(), s.size() + 1);
  return out;
}

}  // namespace

extern "C" {

// Set once a hooks library (torch_hooks.cpp) carries every failed
// allocation's message into PyTorch's exception: nothing to print then.
std::atomic<bool> errors_raised{false};

__attribute__((visibility("default"))) void reservoir_torch_errors_raised() { errors_raised = true; }

}  // extern "C"

namespace {
// Through Python's binding alone, PyTorch's CUDAPluggableAllocator does not
// check malloc's result nor see why: a line on stderr says it, once for a
// run of the same message from one thread (a loop that retries does not
// print a line each time).
void say_error() {
  thread_local std::string last_said;
  if (errors_raised || last_said == last_error) return;
  last_said = last_error;
  std::fprintf(stderr, "reservoir: %s (repeats on this thread are not printed)\n", last_error.c_str());
}

// ---- pools over another allocator (MemPool(allocator=...)) ----
using PoolAllocFn = void* (*)(void* context, size_t size, CUstream_st* stream, const char** error);
using PoolFreeFn = int (*)(void* context, void* ptr, size_t size, CUstream_st* stream,
                           const char** error);
using PoolDropFn = void (*)(void* context);

// Calls into a pool's allocator in progress, in the process and on this
// thread: reservoir's lock is held through them, so a pool's allocator that
// calls reservoir's own allocator back would wait on itself; it gets an
// error instead. (The process-wide count keeps the thread-local read off
// every allocation.)
std::atomic<int> pool_allocator_calls{0};
thread_local int pool_allocator_depth = 0;
thread_local std::string reentry_refused;  // what refuse_reentry said inside the call

void refuse_reentry(const char* what) {
  if (pool_allocator_calls.load(std::memory_order_relaxed) > 0 && pool_allocator_depth > 0)
      [[unlikely]] {
    reentry_refused = fmt::format(
        "{} called by the allocator of a MemPool(allocator=...) that reservoir is serving: a "
        "pool's allocator must not allocate from or free to reservoir's own allocator (a pool "
        "of reservoir's allocator needs no allocator of its own)",
        what);
    throw reservoir::UsageError(reentry_refused);
  }
}

class PoolCall {
 public:
  PoolCall() {
    pool_allocator_calls.fetch_add(1, std::memory_order_relaxed);
    ++pool_allocator_depth;
  }
  ~PoolCall() {
    --pool_allocator_depth;
    pool_allocator_calls.fetch_sub(1, std::memory_order_relaxed);
  }
  PoolCall(const PoolCall&) = delete;
  PoolCall& operator=(const PoolCall&) = delete;
};

// A pool's allocator as the per-release library hands it over: C callbacks
// over PyTorch's CUDAAllocator (raw_alloc and raw_delete), and its context,
// dropped when the last segment and pool holding it are gone.
class CallbackPoolAllocator final : public reservoir::PoolSegmentAllocator {
 public:
  CallbackPoolAllocator(int device, PoolAllocFn alloc, PoolFreeFn free, PoolDropFn drop, void* context)
      : device_(device), alloc_(alloc), free_(free), drop_(drop), context_(context) {}
  ~CallbackPoolAllocator() override {
    if (drop_ != nullptr) drop_(context_);
  }
  CallbackPoolAllocator(const CallbackPoolAllocator&) = delete;
  CallbackPoolAllocator& operator=(const CallbackPoolAllocator&) = delete;

  reservoir::DevicePtr allocate(std::size_t size, reservoir::StreamId stream) override {
    const char* error = nullptr;
    void* p = nullptr;
    reentry_refused.clear();
    {
      PoolCall call;
      p = alloc_(context_, size, reinterpret_cast<CUstream_st*>(stream), &error);
    }
    // (PyTorch's pluggable allocator hands back null without a reason.)
    if (p == nullptr && !reentry_refused.empty()) throw reservoir::UsageError(reentry_refused);
    if (p == nullptr && error != nullptr) {
      throw std::runtime_error(fmt::format(
          "the allocator of a MemPool(allocator=...) on device {} failed allocating {} bytes: {}",
          device_, size, error));
    }
    return reinterpret_cast<reservoir::DevicePtr>(p);
  }
  void free(reservoir::DevicePtr ptr, std::size_t size, reservoir::StreamId stream) override {
    const char* error = nullptr;
    int rc = 0;
    {
      PoolCall call;
      rc = free_(context_, reinterpret_cast<void*>(ptr), size, reinterpret_cast<CUstream_st*>(stream),
                 &error);
    }
    if (rc != 0) {
      throw std::runtime_error(fmt::format(
          "the allocator of a MemPool(allocator=...) on device {} failed freeing its segment at "
          "{:#x} ({} bytes): {}",
          device_, ptr, size, error != nullptr ? error : "no reason given"));
    }
  }

 private:
  int device_;
  PoolAllocFn alloc_;
  PoolFreeFn free_;
  PoolDropFn drop_;
  void* context_;
};
}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* reservoir_torch_malloc(ssize_t size, int device,
                                                                     CUstream_st* stream) {
  void* p = nullptr;
  if (!guarded([&] {
        refuse_reentry("reservoir_torch_malloc");
        p = saver_for(device).allocate(static_cast<std::size_t>(size),
                                       reinterpret_cast<reservoir::StreamId>(stream));
      })) {
    say_error();
  }
  return p;
}

__attribute__((visibility("default"))) void reservoir_torch_free(void* ptr, ssize_t, int device,
                                                                 CUstream_st*) {
  if (!guarded([&] {
        refuse_reentry("reservoir_torch_free");
        saver_for(device).deallocate(ptr);
      })) {
    say_error();
  }
}

__attribute__((visibility("default"))) void reservoir_torch_init(int device_count) {
  (void)device_count;  // allocators are created per device on first use
}

__attribute__((visibility("default"))) void reservoir_torch_reset() {
  std::lock_guard lock(mutex);
  for (PerDevice& d : devices) {
    if (d.saver) d.saver->empty_cache();
  }
}

// 0, or -1 with last_error (a fraction outside [0, 1], NaN included).
__attribute__((visibility("default"))) int reservoir_torch_set_memory_fraction(double fraction,
                                                                               int device) {
  return guarded([&] {
           CachingAllocator& allocator = allocator_for(device);
           // From 2.10 PyTorch's setMemoryFraction(1.0) removes the limit
           // (seen under 2.11 and 2.15: its message then names no allowed
           // memory); before, it sets a limit of the whole device.
           const std::string release = allocator.config().pytorch_version;
           if (fraction == 1.0 && !release.empty() && reservoir::compare_versions(release, "2.10") >= 0) {
             allocator.clear_memory_fraction();
             run_time_fractions[static_cast<std::size_t>(device)] = 0.0;
           } else {
             allocator.set_memory_fraction(fraction);
             run_time_fractions[static_cast<std::size_t>(device)] = fraction;
           }
         })
             ? 0
             : -1;
}

__attribute__((visibility("default"))) void reservoir_torch_record_stream(void* ptr,
                                                                          CUstream_st* stream) {
  (void)guarded([&] {
    std::lock_guard lock(mutex);
    for (PerDevice& d : devices) {
      if (!d.saver) continue;
      try {
        d.saver->record_stream(ptr, reinterpret_cast<reservoir::StreamId>(stream));
        return;
      } catch (const reservoir::InvalidPointerError&) {
        // not this device's
      }
    }
    throw reservoir::InvalidPointerError(
        fmt::format("record_stream: {} is not a live allocation of any device", ptr));
  });
}

// The pool hooks (MemPool, CUDA graph capture), in C: a pool id is the two
// halves of PyTorch's MempoolId_t; `filter` (with `context`) says which
// streams' allocations go to the pool while it is routed, and is called
// until end_allocate_to_pool returns. Errors: -1, and last_error says why.
using reservoir_torch_stream_filter = int (*)(void* context, CUstream_st* stream);

__attribute__((visibility("default"))) int reservoir_torch_begin_allocate_to_pool(
    int device, unsigned long long pool_first, unsigned long long pool_second,
    reservoir_torch_stream_filter filter, void* context) {
  return guarded([&] {
    if (filter == nullptr) {
      throw reservoir::UsageError("begin_allocate_to_pool: no stream filter given");
    }
    saver_for(device).begin_allocate_to_pool(
        reservoir::PoolId{pool_first, pool_second}, [filter, context](reservoir::StreamId s) {
          return filter(context, reinterpret_cast<CUstream_st*>(s)) != 0;
        });
  }) ? 0 : -1;
}

__attribute__((visibility("default"))) int reservoir_torch_end_allocate_to_pool(
    int device, unsigned long long pool_first, unsigned long long pool_second) {
  return guarded([&] {
    saver_for(device).end_allocate_to_pool(reservoir::PoolId{pool_first, pool_second});
  }) ? 0 : -1;
}

__attribute__((visibility("default"))) int reservoir_torch_release_pool(
    int device, unsigned long long pool_first, unsigned long long pool_second) {
  return guarded([&] {
    saver_for(device).release_pool(reservoir::PoolId{pool_first, pool_second});
  }) ? 0 : -1;
}

// MemPool's options: option 0 use_on_oom (value 0 or 1), 1 no_split. 0, or
// -1 with last_error.
__attribute__((visibility("default"))) int reservoir_torch_set_pool_option(
    int device, unsigned long long pool_first, unsigned long long pool_second, int option, int value) {
  return guarded([&] {
    CachingAllocator& allocator = allocator_for(device);
    const reservoir::PoolId id{pool_first, pool_second};
    if (option == 0) {
      allocator.set_pool_use_on_oom(id, value != 0);
    } else if (option == 1) {
      allocator.set_pool_no_split(id);
    } else {
      throw reservoir::UsageError(fmt::format("set_pool_option: option {} is not 0 (use_on_oom) or 1 (no_split)",
                                              option));
    }
  }) ? 0 : -1;
}

// MemPool(allocator=...): the pool's segments come from `alloc` and go back
// to `free` (in every allocator of the device's saver); `drop` is called
// with `context` when nothing holds it any more (after the pool and its last
// segment are gone; at once when the call fails). A null `alloc` forgets a
// pool's allocator (a pool never routed to). 0, or -1 with last_error.
__attribute__((visibility("default"))) int reservoir_torch_set_pool_allocator(
    int device, unsigned long long pool_first, unsigned long long pool_second, PoolAllocFn alloc,
    PoolFreeFn free, PoolDropFn drop, void* context) {
  std::shared_ptr<reservoir::PoolSegmentAllocator> allocator;
  if (alloc != nullptr) {
    if (free == nullptr) {
      if (drop != nullptr) drop(context);
      last_error = "set_pool_allocator: an allocator without a free function";
      return -1;
    }
    allocator = std::make_shared<CallbackPoolAllocator>(device, alloc, free, drop, context);
  }
  return guarded([&] {
    saver_for(device).set_pool_allocator({pool_first, pool_second}, std::move(allocator));
  }) ? 0 : -1;
}

// PyTorch's emptyCache(pool): a released pool's cached segments go back now.
__attribute__((visibility("default"))) int reservoir_torch_empty_pool_cache(int device,
                                                                          unsigned long long pool_first,
                                                                          unsigned long long pool_second) {
  return guarded([&] { allocator_for(device).empty_pool_cache({pool_first, pool_second}); }) ? 0 : -1;
}

// PyTorch's getCheckpointState: the layout of a private pool, as JSON
// {"segments": [{"is_small": b, "blocks": [[ptr, size, stream, allocated, mapped], ...]}, ...]};
// free with free(). Null on error.
__attribute__((visibility("default"))) char* reservoir_torch_checkpoint_pool(int device,
                                                                           unsigned long long pool_first,
                                                                           unsigned long long pool_second) {
  char* out = nullptr;
  (void)guarded([&] {
    const reservoir::PoolCheckpoint cp = allocator_for(device).checkpoint_pool({pool_first, pool_second});
    nlohmann::json segments = nlohmann::json::array();
    for (const auto& seg : cp.segments) {
      nlohmann::json blocks = nlohmann::json::array();
      for (const auto& b : seg.blocks) blocks.push_back({b.ptr, b.size, b.stream, b.allocated, b.mapped});
      segments.push_back({{"is_small", seg.is_small}, {"blocks", std::move(blocks)}});
    }
    out = copy_string(nlohmann::json{{"segments", std::move(segments)}}.dump());
  });
  return out;
}

// PyTorch's setCheckpointPoolState: restores what reservoir_torch_checkpoint_pool
// gave; {"freed": [ptr, ...], "allocated": [ptr, ...]}, free with free(). Null on error
// (a layout that is not one, or does not fit the pool: nothing changed).
__attribute__((visibility("default"))) char* reservoir_torch_restore_pool(int device,
                                                                        unsigned long long pool_first,
                                                                        unsigned long long pool_second,
                                                                        const char* layout) {
  char* out = nullptr;
  (void)guarded([&] {
    reservoir::PoolCheckpoint cp;
    cp.pool = {pool_first, pool_second};
    try {
      const nlohmann::json j = nlohmann::json::parse(layout == nullptr ? "" : layout);
      for (const nlohmann::json& seg : j.at("segments")) {
        reservoir::PoolCheckpoint::SegmentState state;
        state.is_small = seg.at("is_small").get<bool>();
        for (const nlohmann::json& b : seg.at("blocks")) {
          state.blocks.push_back({b.at(0).get<reservoir::DevicePtr>(), b.at(1).get<std::size_t>(),
                                  b.at(2).get<reservoir::StreamId>(), b.at(3).get<bool>(),
                                  b.size() < 5 || b.at(4).get<bool>()});
        }
        cp.segments.push_back(std::move(state));
      }
    } catch (const nlohmann::json::exception& e) {
      throw reservoir::UsageError(fmt::format("restore_pool: not a checkpoint of a pool's layout ({})", e.what()));
    }
    const reservoir::PoolRestore r = allocator_for(device).restore_pool(cp);
    out = copy_string(nlohmann::json{{"freed", r.freed}, {"allocated", r.allocated}}.dump());
  });
  return out;
}

// The per_process_memory_fraction of the settings (1.0 without one) in
// *fraction: 0, or -1 with last_error (settings it cannot read, in PyTorch's
// words where PyTorch has some).
__attribute__((visibility("default"))) int reservoir_torch_configured_memory_fraction(double* fraction) {
  return guarded([&] {
    std::lock_guard lock(mutex);
    if (fraction != nullptr) *fraction = current_config().per_process_memory_fraction;
  }) ? 0 : -1;
}

// Settings changed at run time (torch.cuda.memory._set_allocator_settings:
// `text` as PyTorch took it), applied to every device's allocators and to
// those created later, as PyTorch applies them: max_split_size_mb,
// roundup_power2_divisions and garbage_collection_threshold fall back to
// their defaults when `text` leaves them out, every other key keeps its
// value unless `text` gives it. Segments made already stay as they are. A
// change of the segment kind (expandable_segments, policy) is made where
// the devices have virtual memory; where not, *ignored (free with free())
// names what was left, and the rest still applies. 0, or -1 with
// last_error (nothing changed).
__attribute__((visibility("default"))) int reservoir_torch_apply_settings(const char* text, char** ignored) {
  if (ignored != nullptr) *ignored = nullptr;
  return guarded([&] {
    const std::string given = text == nullptr ? "" : text;
    (void)AllocatorConfig::parse(given);  // validates
    std::lock_guard lock(mutex);
    const AllocatorConfig before = current_config();
    std::vector<std::string> keys = settings_keys(given);
    for (const char* reset : {"max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold"}) {
      keys.emplace_back(reset);
    }
    std::string merged = settings_without(before.to_string(), keys);
    if (!given.empty()) merged += (merged.empty() ? "" : ",") + given;
    AllocatorConfig after = AllocatorConfig::parse(merged);
    // A change of segment kind applies as PyTorch's does (segments made
    // already stay and serve as before) where every device has the virtual
    // memory the new kind needs; else it is left, and *ignored says so.
    std::string left;
    if (after.expandable_segments != before.expandable_segments || after.policy != before.policy) {
      const reservoir::Policy kind = after.expandable_segments ? reservoir::Policy::expandable : after.policy;
      bool needs_vm = false;
      for (const reservoir::PolicyInfo& p : reservoir::policies()) {
        if (p.policy == kind) needs_vm = p.needs_virtual_memory;
      }
      bool can = true;
      for (PerDevice& d : devices) {
        if (d.saver && needs_vm && !d.device->supports_virtual_memory()) can = false;
      }
      if (!can) {
        left = fmt::format("expandable_segments:{}", after.expandable_segments ? "True" : "False");
        after.expandable_segments = before.expandable_segments;
        after.policy = before.policy;
        merged = after.to_string();
      }
    }
    for (PerDevice& d : devices) {
      if (!d.saver) continue;
      AllocatorConfig c = after;
      if (c.pytorch_version.empty()) c.set_pytorch_version(running_release);
      d.saver->untagged_allocator().set_config(c);
      d.settings = merged;
    }
    runtime_settings = merged;
    if (!left.empty() && ignored != nullptr) *ignored = copy_string(left);
  }) ? 0 : -1;
}

// The running PyTorch's release ("2.15.0" or "2.15"), from the library built
// for it, before the first allocation: the native policy takes that
// release's decisions where releases differ, unless the configuration names
// pytorch_version. 0, or -1 with last_error (not a 2.x release).
// Checks the settings every allocator would take now (RESERVOIR_ALLOC_CONF
// or PyTorch's variables, and RESERVOIR_TORCH_DEVICE) without opening a
// device: installing reservoir refuses a bad one there, not at the first
// allocation. 0, or -1 with last_error naming what is wrong.
__attribute__((visibility("default"))) int reservoir_torch_check_settings() {
  return guarded([&] {
    std::lock_guard lock(mutex);
    (void)backend_kind(current_config());
  }) ? 0 : -1;
}

__attribute__((visibility("default"))) int reservoir_torch_set_pytorch_release(const char* release) {
  return guarded([&] {
    const std::string text = release == nullptr ? "" : release;
    const std::size_t second_dot = text.find('.', text.find('.') + 1);
    const std::string minor = text.substr(0, second_dot);
    (void)AllocatorConfig::parse("pytorch_version:" + minor);  // throws, naming the value, for a bad one
    std::lock_guard lock(mutex);  // devices already in use keep the decisions they took
    running_release = minor;
  }) ? 0 : -1;
}

__attribute__((visibility("default"))) const char* reservoir_torch_last_error() {
  return last_error.c_str();
}

// 1 when the calling thread's last error was running out of memory.
__attribute__((visibility("default"))) int reservoir_torch_last_error_is_oom() {
  return last_error_out_of_memory ? 1 : 0;
}

// JSON of torch.cuda.memory_stats() keys; free with free(). Null on error.
__attribute__((visibility("default"))) char* reservoir_torch_stats_json(int device) {
  char* out = nullptr;
  (void)guarded([&] { out = copy_string(nlohmann::json(saver_for(device).stats_map()).dump()); });
  return out;
}

// What PyTorch's allocator reports to its profiler for an allocation or a
// free at ptr: the size of the live block at ptr (0 when none, as after its
// free; without ptr, `request` rounded as the allocator rounds it: a request
// that failed), and the device's allocated and reserved bytes now. 0, or -1
// with last_error.
__attribute__((visibility("default"))) int reservoir_torch_usage(int device, void* ptr,
                                                                  unsigned long long request,
                                                                  unsigned long long* block_size,
                                                                  unsigned long long* allocated,
                                                                  unsigned long long* reserved) {
  return guarded([&] {
           reservoir::Saver& saver = saver_for(device);
           *block_size = ptr != nullptr ? saver.block_size(ptr)
                         : request == 0 ? 0
                                        : reservoir::CachingAllocator::round_size(
                                              request, saver.untagged_allocator().config());
           const reservoir::DeviceStats stats = saver.stats();
           *allocated = static_cast<unsigned long long>(stats.allocated_bytes[0].current);
           *reserved = static_cast<unsigned long long>(stats.reserved_bytes[0].current);
         })
             ? 0
             : -1;
}

// torch.cuda.reset_peak_memory_stats() and reset_accumulated_memory_stats():
// 0, or -1 with last_error.
__attribute__((visibility("default"))) int reservoir_torch_reset_peak_stats(int device) {
  return guarded([&] { saver_for(device).reset_peak_stats(); }) ? 0 : -1;
}

__attribute__((visibility("default"))) int reservoir_torch_reset_accumulated_stats(int device) {
  return guarded([&] { saver_for(device).reset_accumulated_stats(); }) ? 0 : -1;
}

__attribute__((visibility("default"))) char* reservoir_torch_memory_summary(int device,
                                                                            int abbreviated) {
  char* out = nullptr;
  (void)guarded([&] { out = copy_string(saver_for(device).memory_summary(abbreviated != 0)); });
  return out;
}

__attribute__((visibility("default"))) int reservoir_torch_record_history(int device, int enabled,
                                                                          size_t max_entries,
                                                                          int stacks) {
  return guarded([&] {
    saver_for(device).record_history({.enabled = enabled != 0,
                                          .max_entries = max_entries,
                                          .stacks = stacks != 0,
                                          .max_frames = 32});
  }) ? 0 : -1;
}

// The state and history of a device for PyTorch's SnapshotInfo (the
// per-release CUDAAllocator builds it): {"segments": [...], "history":
// [...], "config": {...}}; free with free(). Null on error.
__attribute__((visibility("default"))) char* reservoir_torch_snapshot_json(int device) {
  char* out = nullptr;
  (void)guarded([&] {
    reservoir::Saver& saver = saver_for(device);
    const reservoir::Snapshot snap = saver.snapshot();
    nlohmann::json segments = nlohmann::json::array();
    for (const reservoir::SegmentInfo& seg : snap.segments) {
      nlohmann::json blocks = nlohmann::json::array();
      for (const reservoir::BlockInfo& b : seg.blocks) {
        blocks.push_back({{"address", b.address}, {"size", b.size}, {"requested_size", b.requested_size},
                          {"state", std::string(reservoir::to_string(b.state))}});
      }
      segments.push_back({{"device", seg.device}, {"address", seg.address}, {"total_size", seg.total_size},
                          {"allocated_size", seg.allocated_size}, {"active_size", seg.active_size},
                          {"requested_size", seg.requested_size}, {"stream", seg.stream},
                          {"is_large", seg.is_large}, {"is_expandable", seg.is_expandable},
                          {"pool", {seg.pool_id.first, seg.pool_id.second}}, {"blocks", blocks}});
    }
    nlohmann::json history = nlohmann::json::array();
    for (const reservoir::TraceEvent& e : snap.history) {
      history.push_back({{"action", std::string(reservoir::to_string(e.action))}, {"addr", e.addr},
                         {"size", e.size}, {"stream", e.stream}, {"time_us", e.time_us}});
    }
    const reservoir::AllocatorConfig& config = saver.untagged_allocator().config();
    std::vector<std::size_t> divisions(config.roundup_power2_divisions.begin(),
                                       config.roundup_power2_divisions.end());
    nlohmann::json j{{"segments", segments},
                     {"history", history},
                     {"config",
                      {{"garbage_collection_threshold", config.garbage_collection_threshold},
                       {"max_split_size", config.max_split_size},
                       {"expandable_segments", config.expandable_segments},
                       {"release_lock_on_malloc", config.release_lock_on_cudamalloc},
                       {"pinned_use_host_register", config.pinned_use_host_register},
                       {"pinned_num_register_threads", config.pinned_num_register_threads},
                       {"graph_capture_record_stream_reuse", config.graph_capture_record_stream_reuse},
                       {"roundup_power2_divisions", divisions},
                       {"max_round_threshold", config.pinned_max_round_threshold},
                       {"max_cached_size", config.pinned_max_cached_size},
                       {"settings", settings_of(device)}}}};
    out = copy_string(j.dump());
  });
  return out;
}

// PyTorch's allocator trace trackers: `fn` (with `context`) is called for
// every event of the device's untagged allocator as it happens (alloc,
// free_requested, free_completed, segment_alloc/free/map/unmap, oom,
// snapshot), under the allocator's lock: it must not call back into it.
// The action's name is `action` (`action_size` bytes, not terminated).
// 0, or -1 with last_error.
using reservoir_torch_trace_fn = void (*)(void* context, int device, const char* action,
                                          size_t action_size, unsigned long long addr,
                                          unsigned long long size, void* stream, long long time_us);

__attribute__((visibility("default"))) int reservoir_torch_attach_trace_tracker(
    int device, reservoir_torch_trace_fn fn, void* context) {
  return guarded([&] {
    if (fn == nullptr) throw reservoir::UsageError("attach_trace_tracker: no function given");
    allocator_for(device).attach_trace_tracker([fn, context, device](const reservoir::TraceEvent& e) {
      const std::string_view action = reservoir::to_string(e.action);
      fn(context, device, action.data(), action.size(), e.addr, e.size,
         reinterpret_cast<void*>(e.stream), e.time_us);
    });
  }) ? 0 : -1;
}

// The snapshot as a PyTorch pickle, written to path (for memory_viz).
__attribute__((visibility("default"))) int reservoir_torch_dump_snapshot(int device,
                                                                         const char* path) {
  return guarded([&] {
    reservoir::Saver& saver = saver_for(device);
    const std::string bytes = reservoir::write_pytorch_snapshot(reservoir::to_trace(
        saver.snapshot(), path, saver.untagged_allocator().config().to_string()));
    std::FILE* f = std::fopen(path, "wb");
    if (f == nullptr) throw reservoir::UsageError(fmt::format("cannot write '{}'", path));
    const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    if (std::fclose(f) != 0 || !ok) throw reservoir::UsageError(fmt::format("writing '{}' failed", path));
  }) ? 0 : -1;
}

__attribute__((visibility("default"))) void reservoir_torch_empty_cache() { reservoir_torch_reset(); }

}  // extern "C"

// The pool hooks, with the C++ signatures CUDAPluggableAllocator's setters
// take (MempoolId_t is a pair of unsigned long long).
using MempoolId = std::pair<unsigned long long, unsigned long long>;

__attribute__((visibility("default"))) void reservoir_torch_begin_allocate_to_pool(
    int device, MempoolId pool, std::function<bool(CUstream_st*)> filter) {
  (void)guarded([&] {
    saver_for(device).begin_allocate_to_pool(
        {pool.first, pool.second}, [filter = std::move(filter)](reservoir::StreamId s) {
          return filter(reinterpret_cast<CUstream_st*>(s));
        });
  });
}

__attribute__((visibility("default"))) void reservoir_torch_end_allocate_to_pool(int device,
                                                                                 MempoolId pool) {
  (void)guarded([&] { saver_for(device).end_allocate_to_pool({pool.first, pool.second}); });
}

__attribute__((visibility("default"))) void reservoir_torch_release_pool(int device, MempoolId pool) {
  (void)guarded([&] { saver_for(device).release_pool({pool.first, pool.second}); });
}
