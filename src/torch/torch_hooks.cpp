// libreservoir_torch_hooks.so, built once per PyTorch release against that
// release's headers: makes reservoir PyTorch's CUDA allocator
// through CUDAPluggableAllocator with every hook connected.
//
// Python's torch.cuda.memory.CUDAPluggableAllocator binds only malloc and
// free; its C++ class also takes init, reset (torch.cuda.empty_cache()),
// memory fraction (set_per_process_memory_fraction), record_stream
// (Tensor.record_stream) and the pool hooks (MemPool and CUDA graph
// capture). Without them PyTorch ignores those calls for a pluggable
// allocator: a tensor recorded on a second stream could be reused while that
// stream still reads it. reservoir.install_torch() loads this library when
// one was built for the running release (and says when none was).
//
// reservoir_torch_install_hooks(path, release) dlopens the library holding
// reservoir's entry points (libreservoir_torch.so or the Python module, which
// carries the same source), checks that PyTorch is of the minor release this
// file was built for (2.12.0 runs 2.12.1's library), and installs the allocator. Returns 0, or -1 with the reason in
// reservoir_torch_hooks_error().
#include <dlfcn.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#ifndef RESERVOIR_TORCH_RELEASE
#error "RESERVOIR_TORCH_RELEASE (the PyTorch release the headers are of) must be defined"
#endif

#include "torch_entry.hpp"

namespace reservoir_torch_hooks {

namespace {

Entry the_entry;
thread_local std::string the_last_error;  // each thread reads its own call's

template <typename F>
void find(void* lib, const char* name, F& out) {
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    throw std::runtime_error(std::string("the reservoir library has no ") + name +
                             " (a library of another reservoir version?)");
  }
  out = reinterpret_cast<F>(sym);
}

}  // namespace

Entry& entry() { return the_entry; }

void set_memory_fraction(double fraction, int device) {
  TORCH_CHECK(0 <= fraction && fraction <= 1, "invalid fraction:", fraction, ". Please set within [0, 1].");
  TORCH_CHECK(the_entry.set_memory_fraction(fraction, device) == 0, the_entry.error());
}
std::string& last_error() { return the_last_error; }

// "2.12" of "2.12.1": a release's patches keep its allocator interface.
std::string minor_release(const std::string& release) {
  const std::size_t first = release.find('.');
  return release.substr(0, first == std::string::npos ? first : release.find('.', first + 1));
}

void load(const char* path, const char* release) {
  if (minor_release(release) != minor_release(RESERVOIR_TORCH_RELEASE)) {
    throw std::runtime_error(std::string("this library was built for PyTorch ") + RESERVOIR_TORCH_RELEASE +
                             ", and PyTorch " + release + " is running: build reservoir against it");
  }
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) throw std::runtime_error(std::string("cannot load ") + path + ": " + dlerror());
  Entry& e = the_entry;
  find(lib, "reservoir_torch_malloc", e.malloc);
  find(lib, "reservoir_torch_free", e.free);
  find(lib, "reservoir_torch_init", e.init);
  find(lib, "reservoir_torch_reset", e.reset);
  find(lib, "reservoir_torch_set_memory_fraction", e.set_memory_fraction);
  find(lib, "reservoir_torch_record_stream", e.record_stream);
  find(lib, "reservoir_torch_begin_allocate_to_pool", e.begin_allocate_to_pool);
  find(lib, "reservoir_torch_end_allocate_to_pool", e.end_allocate_to_pool);
  find(lib, "reservoir_torch_release_pool", e.release_pool);
  find(lib, "reservoir_torch_last_error", e.error);
  find(lib, "reservoir_torch_last_error_is_oom", e.error_is_oom);
  find(lib, "reservoir_torch_stats_json", e.stats_json);
  find(lib, "reservoir_torch_reset_peak_stats", e.reset_peak_stats);
  find(lib, "reservoir_torch_reset_accumulated_stats", e.reset_accumulated_stats);
  find(lib, "reservoir_torch_snapshot_json", e.snapshot_json);
  find(lib, "reservoir_torch_record_history", e.record_history);
  find(lib, "reservoir_torch_attach_trace_tracker", e.attach_trace_tracker);
  find(lib, "reservoir_torch_set_pool_option", e.set_pool_option);
  find(lib, "reservoir_torch_set_pool_allocator", e.set_pool_allocator);
  find(lib, "reservoir_torch_empty_pool_cache", e.empty_pool_cache);
  find(lib, "reservoir_torch_checkpoint_pool", e.checkpoint_pool);
  find(lib, "reservoir_torch_restore_pool", e.restore_pool);
  find(lib, "reservoir_torch_configured_memory_fraction", e.configured_fraction);
  find(lib, "reservoir_torch_apply_settings", e.apply_settings);
  find(lib, "reservoir_torch_usage", e.usage);
  // The native policy takes this release's decisions (unless configured otherwise).
  int (*set_release)(const char*) = nullptr;
  find(lib, "reservoir_torch_set_pytorch_release", set_release);
  if (set_release(release) != 0) throw std::runtime_error(e.error());
  // Failed allocations raise PyTorch's error with reservoir's message from
  // here on: the library need not print it too.
  void (*errors_raised)() = nullptr;
  find(lib, "reservoir_torch_errors_raised", errors_raised);
  errors_raised();
}

}  // namespace reservoir_torch_hooks

namespace {

using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using reservoir_torch_hooks::call_stream_filter;
using reservoir_torch_hooks::entry;

// The stream filters of pools being allocated to, kept until the route ends.
std::mutex filters_mutex;
std::map<std::pair<int, c10::cuda::MempoolId_t>, std::unique_ptr<std::function<bool(cudaStream_t)>>>
    filters;

void check(int rc, const char* what) {
  if (rc != 0) throw std::runtime_error(std::string("reservoir: ") + what + ": " + entry().error());
}

// PyTorch's pluggable allocator hands a null result on as a tensor without
// memory: raise PyTorch's own error instead (torch.cuda.OutOfMemoryError
// when reservoir ran out of memory, RuntimeError otherwise).
void* allocate(size_t size, int device, cudaStream_t stream) {
  void* p = entry().malloc(static_cast<ssize_t>(size), device, stream);
  if (p == nullptr && size > 0) {
    if (entry().error_is_oom() != 0) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, entry().error());
    }
    TORCH_CHECK(false, "reservoir: ", entry().error());
  }
  return p;
}

void install(const char* path, const char* release) {
  reservoir_torch_hooks::load(path, release);
  const reservoir_torch_hooks::Entry& e = entry();
  auto allocator = std::static_pointer_cast<Pluggable>(
      torch::cuda::CUDAPluggableAllocator::createCustomAllocator(allocate, e.free));
  allocator->set_init_fn(e.init);
  allocator->set_reset_fn(e.reset);
  allocator->set_memory_fraction_fn(&reservoir_torch_hooks::set_memory_fraction);
  allocator->set_record_stream_fn(e.record_stream);
  allocator->set_begin_allocate_to_pool(
      [](int device, c10::cuda::MempoolId_t id, std::function<bool(cudaStream_t)> filter) {
        auto owned = std::make_unique<std::function<bool(cudaStream_t)>>(std::move(filter));
        void* context = owned.get();
        {
          std::lock_guard lock(filters_mutex);
          filters[{device, id}] = std::move(owned);
        }
        check(entry().begin_allocate_to_pool(device, id.first, id.second, call_stream_filter, context),
              "beginAllocateToPool");
      });
  allocator->set_end_allocate_to_pool_fn([](int device, c10::cuda::MempoolId_t id) {
    check(entry().end_allocate_to_pool(device, id.first, id.second), "endAllocateToPool");
    std::lock_guard lock(filters_mutex);
    filters.erase({device, id});
  });
  allocator->set_release_pool([](int device, c10::cuda::MempoolId_t id) {
    check(entry().release_pool(device, id.first, id.second), "releasePool");
  });
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int reservoir_torch_install_hooks(const char* path,
                                                                         const char* release) {
  return reservoir_torch_hooks::guarded([&] { install(path, release); });
}

__attribute__((visibility("default"))) const char* reservoir_torch_hooks_error() {
  return reservoir_torch_hooks::last_error().c_str();
}

__attribute__((visibility("default"))) const char* reservoir_torch_hooks_release() {
  return RESERVOIR_TORCH_RELEASE;
}

}  // extern "C"
