// libreservoir_preload.so: reservoir's caching allocator under any CUDA
// program, by LD_PRELOAD.
//
//   RESERVOIR_ALLOC_CONF=max_split_size_mb:128 LD_PRELOAD=libreservoir_preload.so ./program
//
// Intercepted: cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync (the
// runtime calls frameworks and programs linked against the shared CUDA
// runtime make). Each GPU gets one CachingAllocator on a CudaRuntimeDevice,
// which calls the runtime's own functions (looked up in libcudart itself, so
// never these). Pointers reservoir did not hand out go to the real cudaFree /
// cudaFreeAsync. Not intercepted, and why: the driver API (cuMemAlloc and
// friends: its callers manage their own contexts, which the runtime's
// primary-context memory would not match), cudaMallocManaged / cudaMallocHost
// / cudaMallocPitch (other kinds of memory), and programs linked against the
// static CUDA runtime (nvcc's default: their calls never reach the dynamic
// linker; build with -cudart shared).
//
// Semantics: cudaMalloc memory is served on the legacy default stream, so a
// block freed with cudaFree is reused in that stream's order (which the
// legacy stream keeps with every blocking stream); cudaFree itself does not
// synchronize the device as the real one does. Work on non-blocking streams
// that still uses a freed pointer must be synchronized by the program first,
// or freed with cudaFreeAsync on its stream. RESERVOIR_PRELOAD_SUMMARY=1
// prints each device's memory summary at exit; RESERVOIR_PRELOAD_STATS=FILE
// writes each device's statistics there at exit, as JSON
// ({"0": {torch.cuda.memory_stats() keys}, ...}).
//
// Tags: each GPU's allocator is a Saver's untagged allocator (the same
// decisions as a plain CachingAllocator), and the reservoir_preload_* entry
// points below open regions on the calling thread, pause and resume tags,
// and read backups, so that a program (reservoir.memory_saver under
// PyTorch's own allocator, as torch_memory_saver's preload mode) can release
// the memory it allocated inside a region while keeping its addresses.
// Tagged memory needs CUDA's virtual memory management (the driver API);
// without it regions fail with an error that says so.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/cuda_device.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/open_device.hpp"
#include "reservoir/saver.hpp"

namespace {

constexpr int kMaxDevices = 64;

struct Real {
  cudaError_t (*free)(void*) = nullptr;
  cudaError_t (*free_async)(void*, cudaStream_t) = nullptr;
  cudaError_t (*get_device)(int*) = nullptr;
};

// One GPU: the runtime (untagged memory), the driver's virtual memory
// (tags), pinned host memory (backups) and the saver over them.
struct PerDevice {
  std::unique_ptr<reservoir::CudaRuntimeDevice> runtime;
  std::unique_ptr<reservoir::Device> vmm;
  std::unique_ptr<reservoir::CudaPinnedMemory> pinned;
  std::unique_ptr<reservoir::Saver> saver;
};

struct State {
  std::mutex mutex;
  std::array<PerDevice, kMaxDevices> devices;
  // cudaFree of untagged memory also empties the untagged cache: for a
  // caching allocator above (PyTorch's), whose cudaFree means "give it back"
  // (empty_cache), not "keep it for my next cudaMalloc".
  std::atomic<bool> free_releases{false};
  Real real;
  bool real_loaded = false;

  // Keys are torch.cuda.memory_stats()'s: plain ASCII, nothing to escape.
  void write_stats(const char* path) const {
    std::FILE* f = std::fopen(path, "w");
    if (f == nullptr) {
      std::fprintf(stderr, "reservoir preload: cannot write RESERVOIR_PRELOAD_STATS=%s\n", path);
      return;
    }
    const char* sep = "";
    std::fprintf(f, "{");
    for (std::size_t d = 0; d < devices.size(); ++d) {
      if (!devices[d].saver) continue;
      std::fprintf(f, "%s\"%zu\": {", sep, d);
      const char* inner = "";
      for (const auto& [key, value] : devices[d].saver->stats_map()) {
        std::fprintf(f, "%s\"%s\": %lld", inner, key.c_str(), static_cast<long long>(value));
        inner = ", ";
      }
      std::fprintf(f, "}");
      sep = ", ";
    }
    std::fprintf(f, "}\n");
    std::fclose(f);
  }

  ~State() {
    if (const char* s = std::getenv("RESERVOIR_PRELOAD_SUMMARY"); s != nullptr && *s == '1') {
      for (const PerDevice& d : devices) {
        if (d.saver) std::fprintf(stderr, "%s", d.saver->memory_summary().c_str());
      }
    }
    if (const char* path = std::getenv("RESERVOIR_PRELOAD_STATS"); path != nullptr && *path != '\0') {
      write_stats(path);
    }
    // Savers go first: they return their segments through the devices.
    for (PerDevice& d : devices) d.saver.reset();
  }
};

State& state() {
  static State s;
  return s;
}

// A runtime entry point: the next definition after this library; else, when
// the runtime is not in the global scope (a library loaded it with
// RTLD_LOCAL, as Python extension modules are), the runtime's own: the one
// the process has loaded (CUDA 13's, 12's or 11's: one process, one
// runtime), else the first that loads.
void* runtime_symbol(const char* name) {
  if (void* f = dlsym(RTLD_NEXT, name)) return f;
  constexpr std::array kRuntimes{"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};
  for (const int mode : {RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
    for (const char* lib : kRuntimes) {
      void* handle = dlopen(lib, mode);
      if (handle == nullptr) continue;
      return dlsym(handle, name);  // the library stays open for the process
    }
  }
  return nullptr;
}

// The runtime's own entry points.
const Real& real() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.real_loaded) {
    s.real.free = reinterpret_cast<cudaError_t (*)(void*)>(runtime_symbol("cudaFree"));
    s.real.free_async =
        reinterpret_cast<cudaError_t (*)(void*, cudaStream_t)>(runtime_symbol("cudaFreeAsync"));
    s.real.get_device = reinterpret_cast<cudaError_t (*)(int*)>(runtime_symbol("cudaGetDevice"));
    s.real_loaded = true;
  }
  return s.real;
}

int current_device() {
  int d = 0;
  if (real().get_device == nullptr || real().get_device(&d) != cudaSuccess) return 0;
  return d;
}

// The saver of a GPU, created on first use; null when CUDA cannot be
// opened (the message goes to stderr).
reservoir::Saver* saver_of(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  State& s = state();
  std::lock_guard lock(s.mutex);
  PerDevice& d = s.devices[static_cast<std::size_t>(device)];
  if (!d.saver) {
    try {
      d.runtime = reservoir::CudaRuntimeDevice::open(device);
      reservoir::SaverOptions options;
      options.config = reservoir::AllocatorConfig::from_env();
      options.device_index = device;
      try {
        d.vmm = reservoir::open_device(reservoir::DeviceKind::cuda_vmm, {.index = device});
        options.tag_device = d.vmm.get();
      } catch (const reservoir::DeviceUnavailableError&) {
        // No virtual memory management: regions will say so when opened.
      }
      d.pinned = reservoir::CudaPinnedMemory::open();
      options.pinned_source = d.pinned.get();
      reservoir::read_saver_environment(options);
      d.saver = std::make_unique<reservoir::Saver>(*d.runtime, options);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "reservoir preload: %s\n", e.what());
      d = PerDevice{};
      return nullptr;
    }
  }
  return d.saver.get();
}

reservoir::Saver* current_saver() { return saver_of(current_device()); }

cudaError_t allocate(void** ptr, size_t size, cudaStream_t stream) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  reservoir::Saver* a = current_saver();
  if (a == nullptr) return cudaErrorInitializationError;
  try {
    *ptr = a->allocate(size, reinterpret_cast<reservoir::StreamId>(stream));
    return cudaSuccess;
  } catch (const reservoir::OutOfMemoryError&) {
    *ptr = nullptr;
    return cudaErrorMemoryAllocation;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reservoir preload: %s\n", e.what());
    *ptr = nullptr;
    return cudaErrorUnknown;
  }
}

// Frees a pointer reservoir holds; false when it is not reservoir's.
bool release(void* ptr, cudaStream_t stream, bool async) {
  reservoir::Saver* a = current_saver();
  if (a == nullptr) return false;
  try {
    if (async && stream != nullptr) {
      a->record_stream(ptr, reinterpret_cast<reservoir::StreamId>(stream));
    }
    // (Looked up only when asked for: a plain program's cudaFree stays a free.)
    const bool give_back =
        state().free_releases.load(std::memory_order_relaxed) && !a->tagged(ptr);
    a->deallocate(ptr);
    if (give_back) a->untagged_allocator().empty_cache();
    return true;
  } catch (const reservoir::InvalidPointerError&) {
    return false;
  }
}

thread_local std::string last_error;
thread_local const char* last_error_kind = "";

// Runs `f`: 0, or -1 with last_error saying why and last_error_kind naming
// reservoir's error class.
template <typename F>
int reported(F&& f) {
  try {
    f();
    return 0;
  } catch (const reservoir::UsageError& e) {
    last_error_kind = "UsageError";
    last_error = e.what();
  } catch (const reservoir::OutOfMemoryError& e) {
    last_error_kind = "OutOfMemoryError";
    last_error = e.what();
  } catch (const reservoir::DeviceError& e) {
    last_error_kind = "DeviceError";
    last_error = e.what();
  } catch (const std::exception& e) {
    last_error_kind = "Error";
    last_error = e.what();
  }
  return -1;
}

// Runs `f` on the current GPU's saver, as reported() does.
template <typename F>
int on_saver(F&& f) {
  return reported([&] {
    reservoir::Saver* saver = current_saver();
    if (saver == nullptr) throw reservoir::DeviceUnavailableError("reservoir preload: CUDA could not be opened");
    f(*saver);
  });
}

// Runs `f` on every GPU's saver that holds `tag` (every saver when it is
// null); when none holds it, on the current GPU's, whose error then says so.
template <typename F>
int on_every_saver(const char* tag, F&& f) {
  std::vector<reservoir::Saver*> holding;
  {
    State& s = state();
    std::lock_guard lock(s.mutex);
    for (PerDevice& d : s.devices) {
      if (!d.saver) continue;
      if (tag == nullptr) {
        holding.push_back(d.saver.get());
        continue;
      }
      for (const reservoir::TagInfo& t : d.saver->tags()) {
        if (t.tag == tag) {
          holding.push_back(d.saver.get());
          break;
        }
      }
    }
  }
  if (holding.empty()) return on_saver(std::forward<F>(f));
  return reported([&] {
    for (reservoir::Saver* saver : holding) f(*saver);
  });
}

}  // namespace

extern "C" {

// ---- tags (reservoir.memory_saver's preload mode) -------------------------
// Every call but pause and resume acts on the calling thread's current GPU;
// -1 on an error, and reservoir_preload_last_error() says why.

__attribute__((visibility("default"))) const char* reservoir_preload_last_error() {
  return last_error.c_str();
}

// The class of that error in reservoir's Python module: "UsageError",
// "OutOfMemoryError", "DeviceError" or "Error".
__attribute__((visibility("default"))) const char* reservoir_preload_last_error_kind() {
  return last_error_kind;
}

// Opens a region on this thread: `tag` (null: outside every tag), with a
// backup in `storage` ("pinned", "mmap", "disk"; null or "" for none).
__attribute__((visibility("default"))) int reservoir_preload_region_push(const char* tag,
                                                                        const char* storage,
                                                                        unsigned long long* token) {
  return on_saver([&](reservoir::Saver& saver) {
    if (token == nullptr) throw reservoir::UsageError("region_push: token is null");
    if (tag == nullptr) {
      *token = saver.push_untagged();
      return;
    }
    reservoir::RegionOptions options;
    if (storage != nullptr && *storage != '\0') {
      options.cpu_backup = true;
      options.storage = reservoir::parse_backup_storage(storage, "region_push: storage");
    }
    *token = saver.push_region(tag, options);
  });
}

__attribute__((visibility("default"))) int reservoir_preload_region_pop(unsigned long long token) {
  return on_saver([&](reservoir::Saver& saver) { saver.pop_region(token); });
}

// Pauses or resumes `tag` on every GPU that holds it, or every tag of
// every GPU when it is null (a tag no GPU holds: the current GPU's error).
__attribute__((visibility("default"))) int reservoir_preload_pause(const char* tag) {
  return on_every_saver(tag, [&](reservoir::Saver& saver) { tag != nullptr ? saver.pause(tag) : saver.pause(); });
}

__attribute__((visibility("default"))) int reservoir_preload_resume(const char* tag) {
  return on_every_saver(tag, [&](reservoir::Saver& saver) { tag != nullptr ? saver.resume(tag) : saver.resume(); });
}

// torch_memory_saver's preload library's C entry points that programs call
// themselves: pause or resume `tag` (every tag when null), as above. They
// return nothing, as there; an error is printed with what was wrong.
__attribute__((visibility("default"))) void tms_pause(const char* tag) {
  if (reservoir_preload_pause(tag) != 0) {
    std::fprintf(stderr, "reservoir preload: tms_pause(%s): %s\n", tag != nullptr ? tag : "NULL",
                 last_error.c_str());
  }
}

__attribute__((visibility("default"))) void tms_resume(const char* tag) {
  if (reservoir_preload_resume(tag) != 0) {
    std::fprintf(stderr, "reservoir preload: tms_resume(%s): %s\n", tag != nullptr ? tag : "NULL",
                 last_error.c_str());
  }
}

// The tags of every GPU as a JSON list of TagInfo objects (a tag held on
// two GPUs is listed twice, with "device" apart); free it with free(). Null
// on error.
__attribute__((visibility("default"))) char* reservoir_preload_tags_json() {
  char* out = nullptr;
  (void)reported([&] {
    nlohmann::json list = nlohmann::json::array();
    State& s = state();
    std::lock_guard lock(s.mutex);
    for (std::size_t device = 0; device < s.devices.size(); ++device) {
      if (!s.devices[device].saver) continue;
      for (const reservoir::TagInfo& t : s.devices[device].saver->tags()) {
        nlohmann::json j;
        t.for_each_field([&](const char* name, const auto& value) { j[name] = value; });
        j["device"] = device;
        list.push_back(std::move(j));
      }
    }
    const std::string text = list.dump();
    out = static_cast<char*>(std::malloc(text.size() + 1));
    if (out == nullptr) throw reservoir::OutOfMemoryError("tags_json: no host memory", text.size() + 1, 0, 0);
    std::memcpy(out, text.c_str(), text.size() + 1);
  });
  return out;
}

__attribute__((visibility("default"))) int reservoir_preload_set_disk_backup_dir(const char* path) {
  return on_saver([&](reservoir::Saver& saver) { saver.set_disk_backup_dir(path != nullptr ? path : ""); });
}

__attribute__((visibility("default"))) int reservoir_preload_set_retain_backup(int on) {
  return on_saver([&](reservoir::Saver& saver) { saver.set_retain_backup(on != 0); });
}

// 1 or 0; -1 on an error.
__attribute__((visibility("default"))) int reservoir_preload_retain_backup() {
  int value = -1;
  (void)on_saver([&](reservoir::Saver& saver) { value = saver.retain_backup() ? 1 : 0; });
  return value;
}

// On: a cudaFree of untagged memory gives its segment back to the device
// (for PyTorch's caching allocator above the interposer). Off by default.
__attribute__((visibility("default"))) void reservoir_preload_set_free_releases(int on) {
  state().free_releases.store(on != 0, std::memory_order_relaxed);
}

__attribute__((visibility("default"))) int reservoir_preload_set_memory_margin(unsigned long long bytes) {
  return on_saver([&](reservoir::Saver& saver) { saver.set_memory_margin(bytes); });
}

// 1 with the backed-up bytes of [ptr, ptr + bytes) in out, 0 when there is
// no backup of ptr, -1 on an error.
__attribute__((visibility("default"))) int reservoir_preload_read_backup(const void* ptr, size_t bytes,
                                                                        void* out) {
  int found = 0;
  const int rc = on_saver([&](reservoir::Saver& saver) { found = saver.read_backup(ptr, bytes, out) ? 1 : 0; });
  return rc != 0 ? rc : found;
}

// The interposer's statistics and summary (torch.cuda.memory_stats() keys).
__attribute__((visibility("default"))) char* reservoir_preload_stats_json() {
  char* out = nullptr;
  (void)on_saver([&](reservoir::Saver& saver) {
    const std::string text = nlohmann::json(saver.stats_map()).dump();
    out = static_cast<char*>(std::malloc(text.size() + 1));
    if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  });
  return out;
}

// ---- the CUDA runtime's allocation calls ------------------------------------

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** ptr, size_t size) {
  return allocate(ptr, size, nullptr);
}

__attribute__((visibility("default"))) cudaError_t cudaMallocAsync(void** ptr, size_t size,
                                                                   cudaStream_t stream) {
  return allocate(ptr, size, stream);
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* ptr) {
  if (ptr != nullptr && release(ptr, nullptr, false)) return cudaSuccess;
  return real().free != nullptr ? real().free(ptr) : cudaErrorInitializationError;
}

__attribute__((visibility("default"))) cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (ptr != nullptr && release(ptr, stream, true)) return cudaSuccess;
  return real().free_async != nullptr ? real().free_async(ptr, stream)
                                      : cudaErrorInitializationError;
}

}  // extern "C"
