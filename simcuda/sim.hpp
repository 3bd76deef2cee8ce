// A simulated CUDA device in host memory: the state behind the simulated
// driver (libcuda.so.1), runtime (libcudart.so.13) and NVML
// (libnvidia-ml.so.1), under which the real PyTorch runs unchanged.
//
// Device memory is real host memory: cudaMalloc places memory in the
// device's own address range, first fit and 2 MiB aligned as a GPU does, the
// virtual-memory calls reserve address space (PROT_NONE), make physical
// memory as memfd files and map them there, so what is written through a
// device pointer reads back, and memory handed back leaves the process.
// Copies in every direction are memcpy; work on a stream is done when it
// is issued. Events complete when recorded, or are held until released,
// under test control. Kernel launches are refused unless allowed.
//
// Configuration, read once from the environment:
//   RESERVOIR_SIMCUDA_DEVICES   device count (default 1)
//   RESERVOIR_SIMCUDA_MEMORY    each device's capacity: bytes, or with KiB,
//                               MiB, GiB (default 81079MiB: what CUDA reports
//                               as an H100 80GB's total; NVML adds the 480 MiB
//                               the driver keeps, 81559 MiB as nvidia-smi shows)
//   RESERVOIR_SIMCUDA_NAME      device name (default "NVIDIA H100 80GB HBM3")
//   RESERVOIR_SIMCUDA_EVENTS    "complete" (default) or "held"
//   RESERVOIR_SIMCUDA_KERNELS   "refuse" (default) or "skip" (a launch does
//                               nothing and succeeds)
//   RESERVOIR_SIMCUDA_FAIL      "call:N[,call:N...]": the Nth use of each
//                               named call fails (allocation calls with out
//                               of memory, others with an unknown error)
//   RESERVOIR_SIMCUDA_LOG       "1": every call, one line each, to stderr
// Tests also steer it through the reservoirSimCuda* functions (control.h).
//
// Thread safety: every entry takes the one lock of Sim for the state it
// touches; copies run outside it.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#define SIMCUDA_API __attribute__((visibility("default")))

// The runtime is built three times: as CUDA 13's libcudart.so.13 and,
// against CUDA 12's and 11's headers, as libcudart.so.12 and
// libcudart.so.11.0 (for the PyTorch releases built with those). Where 13
// renamed a call, 12 exports it with a suffix: SIMCUDA_12_NAME(name, suffix)
// is the name this build defines. What 11 calls differently has its own
// definitions under CUDART_VERSION < 12000.
#if defined(CUDART_VERSION) && CUDART_VERSION < 13000
#define SIMCUDA_12_NAME(name, suffix) name##suffix
#else
#define SIMCUDA_12_NAME(name, suffix) name
#endif

namespace reservoir::simcuda {

// Codes shared by the runtime and the driver (their numbers agree).
enum Code : int {
  kSuccess = 0,
  kInvalidValue = 1,
  kOutOfMemory = 2,
  kNotInitialized = 3,
  kInvalidDevice = 101,
  kInvalidContext = 201,
  kInvalidHandle = 400,
  kNotFound = 500,
  kNotReady = 600,
  kIllegalAddress = 700,
  kHostMemoryAlreadyRegistered = 712,
  kHostMemoryNotRegistered = 713,
  kNotSupported = 801,
  kUnknown = 999,
};

struct Event {
  int device = 0;
  bool interprocess = false;  // cudaEventInterprocess: its handle can be shared
  bool recorded = false;
  bool complete = true;       // false while held (RESERVOIR_SIMCUDA_EVENTS=held)
  double time_ms = 0.0;       // when the work before it ends (the simulated clock)
};

struct Stream {
  int device = 0;
  int priority = 0;
  unsigned flags = 0;
  double busy_until_ms = 0.0;  // when the work queued on it ends
};

// Work takes time on a stream: a kernel that spins (torch.cuda._sleep's
// spin_kernel) keeps its stream busy for its cycles at this clock, and
// events recorded behind it complete when that time has passed, or when
// they, their stream or the device are synchronized (which waits for it).
// Every other kernel and copy takes no time, but runs in its stream's
// order. The legacy default stream waits for the work of every blocking
// stream of its device, and they for its, as CUDA's does.
constexpr double kSimulatedCyclesPerMs = 1.98e6;  // an H100 SXM at 1980 MHz

// Physical memory made by cuMemCreate: a memfd of `size` bytes.
struct Physical {
  int fd = -1;
  std::size_t size = 0;
  int device = 0;
  int refs = 1;  // the handle, and each retain
};

struct Mapping {
  std::size_t size = 0;
  std::uint64_t handle = 0;
  std::size_t offset = 0;
  bool accessible = false;  // set_access given for it
};

struct Device {
  std::size_t capacity = 0;
  std::size_t used = 0;                        // cudaMalloc'd and cuMemCreate'd bytes
  std::uintptr_t base = 0;                     // its cudaMalloc address range (kAddressSpanFactor x capacity)
  std::map<std::size_t, std::size_t> holes;    // free parts of that range: offset -> length
  // cudaMalloc below 2 MiB shares 2 MiB pages, 512-byte aligned, as a GPU's
  // does: page base -> its free slots (offset -> length) and live count.
  struct SmallPage {
    std::map<std::size_t, std::size_t> free;
    std::size_t live = 0;
  };
  std::map<std::uintptr_t, SmallPage> small_pages;
};

class SIMCUDA_API Sim {
 public:
  static Sim& get();

  // Entry to every served call: counts it, logs it, and answers the
  // failure injected for this use (kSuccess otherwise). `alloc` calls fail
  // with out of memory, the others with an unknown error.
  int enter(const char* call, bool alloc = false);
  // A call the simulation does not serve: says so once on stderr, and
  // remembers it for the error string. Returns kNotSupported.
  int refuse(const char* call);
  const char* refused_text() const;  // this thread's last refusal, described

  // Devices.
  int device_count() const { return static_cast<int>(devices_.size()); }
  bool valid(int device) const { return device >= 0 && device < device_count(); }
  const std::string& name() const { return name_; }
  std::size_t capacity(int device) const { return devices_.at(static_cast<std::size_t>(device)).capacity; }
  std::size_t used(int device);
  static int& current_device();  // this thread's
  // Whether this thread called the runtime, which makes the current
  // device's primary context current on it (cuCtxGetCurrent then answers it).
  static bool& runtime_thread();

  // cudaMalloc-style memory: real pages; nullptr-free errors by code.
  int malloc_device(int device, std::size_t size, void** out);
  int free_device(void* ptr);
  // Whether `ptr` lies in memory of a device; its range when it does.
  bool device_range(const void* ptr, std::uintptr_t* base, std::size_t* size, int* device);

  // Interprocess memory (cudaIpc*): a cudaMalloc of 2 MiB or more lives in
  // a memfd of its own, which a handle names (process, descriptor, size),
  // and another process maps through /proc/<pid>/fd into its own device
  // range. An allocation under 2 MiB (in a shared page) is refused, as is a
  // handle opened by the process that made it.
  static constexpr std::size_t kIpcHandleSize = 64;
  int ipc_get_handle(const void* ptr, unsigned char* handle);  // handle: kIpcHandleSize bytes
  int ipc_open(const unsigned char* handle, void** out);
  int ipc_close(void* ptr);

  // Virtual memory.
  static constexpr std::size_t kGranularity = std::size_t{2} << 20;
  // cudaMalloc's address range per byte of memory: room to place a request
  // however the memory in use is spread, as a GPU's address space gives.
  static constexpr std::size_t kAddressSpanFactor = 4;
  static constexpr std::size_t kSmallAlignment = 512;
  // NVML's total minus CUDA's: what the driver keeps of an H100 80GB.
  static constexpr std::size_t kDriverReserved = std::size_t{480} << 20;
  int reserve(std::size_t size, std::size_t alignment, std::uintptr_t* out);
  int unreserve(std::uintptr_t va, std::size_t size);
  int create_physical(int device, std::size_t size, std::uint64_t* handle);
  int release_physical(std::uint64_t handle);
  int map(std::uintptr_t va, std::size_t size, std::size_t offset, std::uint64_t handle);
  int unmap(std::uintptr_t va, std::size_t size);
  int set_access(std::uintptr_t va, std::size_t size, bool read_write);
  // The device reading or writing [p, p + n) (a copy, a memset): inside a
  // reserved range every byte must be mapped with access given, or, as on a
  // GPU, the access faults with kIllegalAddress, and the fault is sticky:
  // every later call of the process answers it (CUDA's context is lost).
  // Memory outside reserved ranges (cudaMalloc's, the host's) is not checked.
  int touch(const void* p, std::size_t n);
  // A copy and a fill as the device makes them (the runtime's and the
  // driver's): kIllegalAddress without touching anything when either side
  // is out of reach (touch), else done and kSuccess.
  int copy(void* dst, const void* src, std::size_t n);
  int fill(void* p, int value, std::size_t n);
  int export_fd(std::uint64_t handle, int* fd);
  int import_fd(int fd, int device, std::uint64_t* handle);
  int retain(const void* ptr, std::uint64_t* handle);
  int physical_size(std::uint64_t handle, std::size_t* size, int* device);

  // Streams and events.
  Stream* create_stream(int device, int priority, unsigned flags);
  int destroy_stream(Stream* s);
  Event* create_event(int device);
  int destroy_event(Event* e);
  int record(Event* e, void* stream = nullptr);
  int query(const Event* e);
  int synchronize(Event* e);
  void complete_all();
  // `ms` of work queued on `stream` of `device` (0: ordered, no time).
  void run(void* stream, int device, double ms);
  int stream_query(void* stream, int device);
  int stream_synchronize(void* stream, int device);
  int stream_wait_event(void* stream, int device, const Event* e);
  void device_synchronize(int device);
  // The device function a host stub was registered for (__cudaRegisterFunction).
  void register_function(const void* host, const char* name, int thread_limit = -1);
  std::string function_name(const void* host);
  // The kernel registered for `host` (its name stays valid for the
  // process), or null for a pointer that is no registered kernel.
  struct Kernel {
    std::string name;
    int thread_limit = -1;  // __launch_bounds__ as registered, -1 for none
  };
  const Kernel* kernel(const void* host);
  void hold_events(bool held);
  bool allow_kernels() const { return kernels_; }
  void set_allow_kernels(bool allow) { kernels_ = allow; }

  // Managed memory (cudaMallocManaged): host pages both sides reach, not
  // counted as the device's (a GPU counts only what migrated to it); freed
  // by cudaFree.
  int managed_alloc(std::size_t size, void** out);
  bool is_managed(const void* ptr);

  // Pinned host memory.
  int host_alloc(std::size_t size, void** out);
  int host_free(void* ptr);
  // cudaHostRegister / cudaHostUnregister: page-locked host memory the
  // program allocated itself, which is_host() then answers for (PyTorch's
  // is_pinned() asks cudaPointerGetAttributes).
  int host_register(void* ptr, std::size_t size);
  int host_unregister(void* ptr);
  bool is_host(const void* ptr);

  // Test control.
  void fail_at(const std::string& call, std::uint64_t nth_from_now);
  std::uint64_t calls(const std::string& call);

 private:
  Sim();
  double now_ms() const;

  std::mutex mu_;
  std::vector<Device> devices_;
  std::string name_;
  bool held_ = false;
  int sticky_ = kSuccess;  // kIllegalAddress once the device faulted
  bool kernels_ = false;
  bool log_ = false;
  std::unordered_map<std::string, std::uint64_t> counts_;
  std::unordered_map<std::string, std::vector<std::uint64_t>> failures_;  // call -> uses that fail
  std::map<std::uintptr_t, std::pair<std::size_t, int>> allocations_;    // cudaMalloc: base -> size, device
  std::unordered_map<std::uintptr_t, int> shared_fds_;                   // cudaMalloc >= 2 MiB: base -> memfd
  struct Imported {
    std::size_t size = 0;
    int device = 0;
    int refs = 1;
    std::string key;  // the handle's process, descriptor and size
  };
  std::map<std::uintptr_t, Imported> imported_;                          // cudaIpcOpenMemHandle: va -> it
  std::unordered_map<std::string, std::uintptr_t> imported_by_key_;
  // Holes of the device range: takes `bytes` (first fit), returns 0 when none fits.
  std::uintptr_t take_range(Device& d, std::size_t bytes);
  void give_range(Device& d, std::uintptr_t at, std::size_t bytes);
  bool open_range(Device& d);
  std::map<std::uintptr_t, std::size_t> reservations_;                   // base -> size
  std::map<std::uintptr_t, Mapping> mappings_;                           // va -> mapping
  std::unordered_map<std::uint64_t, Physical> physical_;
  std::uint64_t next_handle_ = 1;
  std::map<std::uintptr_t, std::size_t> host_;  // pinned host allocations
  std::map<std::uintptr_t, std::size_t> registered_;  // host ranges registered
  std::map<std::uintptr_t, std::size_t> managed_;     // cudaMallocManaged: base -> bytes
  std::vector<std::unique_ptr<Event>> events_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::vector<double> legacy_busy_ms_;      // per device: the legacy default stream
  std::vector<double> per_thread_busy_ms_;  // per device: cudaStreamPerThread
  std::unordered_map<const void*, Kernel> functions_;  // nodes: their names stay put
  // Under mu_: where the work of `stream` ends (its own queue; `joined`: with
  // what a blocking stream waits for on the legacy one and the other way round).
  double busy_until(void* stream, int device, bool joined);
  double* queue_of(void* stream, int device);
  static void wait_until(double ms);
};

// Parses "80GiB", "512MiB", "1024" (bytes). 0 when malformed.
std::size_t parse_bytes(const char* text);

}  // namespace reservoir::simcuda

// A device attribute (the driver's and the runtime's numbers agree): an
// H100 SXM's values; any other attribute is refused, naming it.
SIMCUDA_API int reservoir_simcuda_attribute(int attribute, int device, int* value);
