// Installing reservoir as PyTorch's own allocator (torch_allocator.hpp) and
// following the settings PyTorch takes at run time; the C functions the
// Python package calls, and those its tests ask PyTorch's current allocator
// (whichever it is) through.
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <nlohmann/json.hpp>

#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>

#include "torch_allocator.hpp"

namespace reservoir_torch_hooks {

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

void raw_delete_fn(void* ptr) {
  the_allocator()->raw_delete(ptr);
}
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
    if (void* f = dlsym(c10,
                        "_ZN3c1016CachingAllocator26AcceleratorAllocatorConfig19getConfigParserHook"
                        "B5cxx11Ev")) {
      hook = &reinterpret_cast<Hook& (*)()>(f)();
    } else if (void* h = dlsym(c10,
                               "_ZZN3c1016CachingAllocator26AcceleratorAllocatorConfig19getConfigPa"
                               "rserHookB5cxx11EvE4hook")) {
      hook = static_cast<Hook*>(h);
    } else {
      hook = static_cast<Hook*>(dlsym(c10,
                                      "_ZN3c1016CachingAllocator26AcceleratorAllocatorConfig26devic"
                                      "e_config_parser_hook_B5cxx11E"));
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

}  // namespace reservoir_torch_hooks

using reservoir_torch_hooks::ReservoirAllocator;
using reservoir_torch_hooks::the_allocator;
namespace trace_types = reservoir_torch_hooks::trace_types;

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
    std::call_once(followed, reservoir_torch_hooks::follow_runtime_settings);
    // The device-generic API (torch.accelerator.memory_stats(),
    // empty_cache(), ...) asks c10's allocator of the CUDA device type,
    // which changeCurrentAllocator leaves at PyTorch's: it is reservoir's
    // too (at the highest priority, which no later registration overrides).
    c10::SetAllocator(c10::DeviceType::CUDA, the_allocator().get(),
                      std::numeric_limits<uint8_t>::max());
  });
}

// For tests: what PyTorch's current CUDA allocator (whichever it is) answers
// to cacheInfo (starting from `initial`) and getBaseAllocation, which no
// Python binding reaches. -1 / null with the reason in reservoir_torch_hooks_error().
__attribute__((visibility("default"))) long long reservoir_torch_current_cache_info(
    int device, unsigned long long initial) {
  size_t largest = initial;
  const int rc = reservoir_torch_hooks::guarded([&] {
    c10::cuda::CUDACachingAllocator::get()->cacheInfo(static_cast<c10::DeviceIndex>(device),
                                                      &largest);
  });
  return rc == 0 ? static_cast<long long>(largest) : -1;
}

__attribute__((visibility("default"))) void* reservoir_torch_current_base_allocation(
    void* ptr, unsigned long long* size) {
  void* base = nullptr;
  size_t total = 0;
  if (reservoir_torch_hooks::guarded([&] {
        base = c10::cuda::CUDACachingAllocator::get()->getBaseAllocation(ptr, &total);
      }) != 0) {
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
          static const char* const kNames[] = {
              "alloc",       "free_requested", "free_completed", "segment_alloc", "segment_free",
              "segment_map", "segment_unmap",  "snapshot",       "oom",           "annotate"};
          const auto index = static_cast<std::size_t>(te.action_);
          std::lock_guard lock(traced_mutex);
          traced.push_back({index < std::size(kNames) ? kNames[index] : "?", te.addr_, te.size_});
        });
  });
}

// For tests: getExpandableSegmentSizes of PyTorch's current CUDA allocator,
// as JSON [[stream, is_small_pool, total_size], ...] (free with free()), or
// null with the reason in reservoir_torch_hooks_error().
__attribute__((visibility("default"))) char* reservoir_torch_current_expandable_segment_sizes(
    int device) {
  std::string text;
  if (reservoir_torch_hooks::guarded([&] {
        nlohmann::json out = nlohmann::json::array();
#if RESERVOIR_TORCH_EXPANDABLE_SEGMENT_SIZES
        for (const auto& s : c10::cuda::CUDACachingAllocator::get()->getExpandableSegmentSizes(
                 static_cast<c10::DeviceIndex>(device))) {
          out.push_back(
              {reinterpret_cast<std::uintptr_t>(s.stream), s.is_small_pool, s.total_size});
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
