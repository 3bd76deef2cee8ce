#include "sim.hpp"

#include <string_view>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <thread>

#include "control.h"
#include "reservoir/detail/free_list.hpp"

namespace reservoir::simcuda {
namespace {

std::string env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

thread_local std::string refused_call;  // this thread's last refused call
thread_local std::string refused_text_buf;

constexpr std::size_t kPage = 4096;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

}  // namespace

std::size_t parse_bytes(const char* text) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (end == text) return 0;
  const std::string unit(end);
  if (unit.empty()) return v;
  if (unit == "KiB") return v << 10;
  if (unit == "MiB") return v << 20;
  if (unit == "GiB") return v << 30;
  return 0;
}

Sim::Sim() {
  const int count = std::atoi(env("RESERVOIR_SIMCUDA_DEVICES", "1").c_str());
  std::size_t capacity = parse_bytes(env("RESERVOIR_SIMCUDA_MEMORY", "81079MiB").c_str());
  if (count <= 0 || capacity == 0) {
    std::fprintf(stderr,
                 "reservoir simulated CUDA: RESERVOIR_SIMCUDA_DEVICES must be a positive count and "
                 "RESERVOIR_SIMCUDA_MEMORY bytes, KiB, MiB or GiB; using 1 device of 81079MiB\n");
    capacity = std::size_t{81079} << 20;
  }
  devices_.resize(static_cast<std::size_t>(count > 0 ? count : 1), Device{capacity, 0, 0, {}, {}});
  legacy_busy_ms_.assign(devices_.size(), 0.0);
  per_thread_busy_ms_.assign(devices_.size(), 0.0);
  name_ = env("RESERVOIR_SIMCUDA_NAME", "NVIDIA H100 80GB HBM3");
  held_ = env("RESERVOIR_SIMCUDA_EVENTS", "complete") == "held";
  kernels_ = env("RESERVOIR_SIMCUDA_KERNELS", "refuse") == "skip";
  log_ = env("RESERVOIR_SIMCUDA_LOG", "0") == "1";
  // "call:N,call:N"
  const std::string fail = env("RESERVOIR_SIMCUDA_FAIL", "");
  std::size_t at = 0;
  while (at < fail.size()) {
    const std::size_t comma = fail.find(',', at);
    const std::string item = fail.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const std::size_t colon = item.find(':');
    if (colon != std::string::npos) {
      const auto n = std::strtoull(item.c_str() + colon + 1, nullptr, 10);
      if (n > 0) failures_[item.substr(0, colon)].push_back(n);
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
}

Sim& Sim::get() {
  static Sim* sim = new Sim();  // never destroyed: calls may come from other static destructors
  return *sim;
}

int& Sim::current_device() {
  thread_local int device = 0;
  return device;
}

bool& Sim::runtime_thread() {
  thread_local bool used = false;
  return used;
}

namespace {
// Calls that still answer once the device faulted: what asks about devices,
// versions and the current device or context, which CUDA answers without
// the lost context (PyTorch's device guards call them while an illegal
// address error unwinds, and a throw there would end the process).
bool answers_after_fault(std::string_view call) {
  for (std::string_view prefix : {"cuDevice", "cudaGetDevice", "cudaSetDevice", "cudaDeviceGet",
                                  "cuCtxGet", "cuInit", "cuDriverGetVersion", "cudaDriverGetVersion",
                                  "cudaRuntimeGetVersion", "cudaGetErrorString", "cudaGetErrorName",
                                  "cudaGetLastError", "cudaPeekAtLastError"}) {
    if (call.starts_with(prefix)) return true;
  }
  return false;
}
}  // namespace

int Sim::enter(const char* call, bool alloc) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint64_t n = ++counts_[call];
  if (log_) std::fprintf(stderr, "simcuda: %s #%llu\n", call, static_cast<unsigned long long>(n));
  if (sticky_ != kSuccess && !answers_after_fault(call)) return sticky_;
  auto it = failures_.find(call);
  if (it == failures_.end()) return kSuccess;
  for (const std::uint64_t use : it->second) {
    if (use == n) return alloc ? kOutOfMemory : kUnknown;
  }
  return kSuccess;
}

int Sim::refuse(const char* call) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = ++counts_[call] == 1;
  }
  if (first) {
    std::fprintf(stderr, "reservoir simulated CUDA: %s is not served by the simulated device\n", call);
  }
  refused_call = call;
  return kNotSupported;
}

const char* Sim::refused_text() const {
  refused_text_buf = refused_call.empty()
                         ? std::string("operation not supported")
                         : "operation not supported: " + refused_call +
                               " is not served by reservoir's simulated CUDA device";
  return refused_text_buf.c_str();
}

std::size_t Sim::used(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  return valid(device) ? devices_[static_cast<std::size_t>(device)].used : 0;
}

bool Sim::open_range(Device& d) {
  if (d.base != 0) return true;
  // Addresses are not memory: a GPU's address space is far larger than its
  // memory, so a request finds addresses wherever the pages in use lie, and
  // only the memory (d.used against d.capacity) can run out.
  const std::size_t span = kAddressSpanFactor * d.capacity;
  void* p = ::mmap(nullptr, span + kGranularity, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return false;
  d.base = round_up(reinterpret_cast<std::uintptr_t>(p), kGranularity);
  d.holes[0] = span;  // offset -> length
  return true;
}

namespace {

// Free lists (offset -> length), taken first fit and merged on return.
bool take_first_fit(std::map<std::size_t, std::size_t>& holes, std::size_t bytes, std::size_t* offset) {
  return reservoir::detail::take_first_fit(holes, bytes, std::size_t{1}, offset);
}
using reservoir::detail::give_back;

}  // namespace

std::uintptr_t Sim::take_range(Device& d, std::size_t bytes) {
  std::size_t offset = 0;
  if (!take_first_fit(d.holes, bytes, &offset)) return 0;  // no hole fits: fragmented
  d.used += bytes;
  return d.base + offset;
}

void Sim::give_range(Device& d, std::uintptr_t at, std::size_t bytes) {
  d.used -= bytes;
  give_back(d.holes, at - d.base, bytes);
}

// cudaMalloc as a GPU's allocator places memory (as measured on an H100,
// tests/data/gpu): in the device's own address range (reserved once, four
// times its capacity), first fit from its start, so that addresses ascend as
// a program allocates; memory in use freed between live allocations leaves
// addresses free there, never memory unusable. From 2 MiB up, whole 2 MiB pages, 2 MiB aligned;
// below, 512-byte slots packed into shared 2 MiB pages (a 1-byte cudaMalloc
// follows another by 512 bytes, and the device's free memory drops by the
// page the first one opens).
int Sim::malloc_device(int device, std::size_t size, void** out) {
  if (out == nullptr) return kInvalidValue;
  if (!valid(device)) return kInvalidDevice;
  if (size == 0) {
    *out = nullptr;
    return kSuccess;
  }
  std::uintptr_t at = 0;
  std::uintptr_t opened = 0;  // pages taken from the range for this call: made accessible below
  std::size_t opened_bytes = 0;
  std::size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = devices_[static_cast<std::size_t>(device)];
    if (!open_range(d)) return kOutOfMemory;
    if (size < kGranularity) {
      bytes = round_up(size, kSmallAlignment);
      for (auto& [page, sp] : d.small_pages) {
        std::size_t offset = 0;
        if (take_first_fit(sp.free, bytes, &offset)) {
          at = page + offset;
          ++sp.live;
          break;
        }
      }
      if (at == 0) {
        if (d.used + kGranularity > d.capacity) return kOutOfMemory;
        opened = at = take_range(d, kGranularity);
        if (at == 0) return kOutOfMemory;
        opened_bytes = kGranularity;
        Device::SmallPage& sp = d.small_pages[at];
        sp.free[bytes] = kGranularity - bytes;  // bytes < kGranularity: the rest of the page
        sp.live = 1;
      }
    } else {
      bytes = round_up(size, kGranularity);
      if (d.used + bytes > d.capacity) return kOutOfMemory;
      opened = at = take_range(d, bytes);
      if (at == 0) return kOutOfMemory;
      opened_bytes = bytes;
    }
    allocations_[at] = {bytes, device};
  }
  if (opened != 0 && size >= kGranularity) {
    // Its own memfd, shared, so that an IPC handle can name it.
    const int fd = ::memfd_create("reservoir-simcuda-malloc", MFD_CLOEXEC);
    const bool ok = fd >= 0 && ::ftruncate(fd, static_cast<off_t>(opened_bytes)) == 0 &&
                    ::mmap(reinterpret_cast<void*>(opened), opened_bytes, PROT_READ | PROT_WRITE,
                           MAP_SHARED | MAP_FIXED, fd, 0) != MAP_FAILED;
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok) {
      if (fd >= 0) ::close(fd);
      allocations_.erase(at);
      give_range(devices_[static_cast<std::size_t>(device)], at, opened_bytes);
      return kOutOfMemory;
    }
    shared_fds_[at] = fd;
  } else if (opened != 0) {
    ::mprotect(reinterpret_cast<void*>(opened), opened_bytes, PROT_READ | PROT_WRITE);
  }
  *out = reinterpret_cast<void*>(at);
  return kSuccess;
}

namespace {

constexpr char kIpcMagic[8] = {'r', 's', 'v', 's', 'i', 'm', 'I', 'P'};

// A range of the device's back to its reserved, inaccessible state (the
// pages it held leave the process).
void close_range(std::uintptr_t at, std::size_t bytes) {
  ::mmap(reinterpret_cast<void*>(at), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
         -1, 0);
}

}  // namespace

int Sim::ipc_get_handle(const void* ptr, unsigned char* handle) {
  if (handle == nullptr) return kInvalidValue;
  const auto at = reinterpret_cast<std::uintptr_t>(ptr);
  std::unique_lock<std::mutex> lock(mu_);
  auto it = allocations_.find(at);
  if (it == allocations_.end()) return kInvalidValue;  // not the base of a cudaMalloc
  auto fd = shared_fds_.find(at);
  if (fd == shared_fds_.end()) {
    lock.unlock();  // refuse() takes the lock
    return refuse("cudaIpcGetMemHandle of an allocation under 2 MiB");
  }
  std::memset(handle, 0, kIpcHandleSize);
  std::memcpy(handle, kIpcMagic, sizeof kIpcMagic);
  const std::int32_t pid = ::getpid();
  const std::int32_t descriptor = fd->second;
  const std::uint64_t bytes = it->second.first;
  const std::int32_t device = it->second.second;
  std::memcpy(handle + 8, &pid, 4);
  std::memcpy(handle + 12, &descriptor, 4);
  std::memcpy(handle + 16, &bytes, 8);
  std::memcpy(handle + 24, &device, 4);
  std::memcpy(handle + 28, &at, 8);
  return kSuccess;
}

int Sim::ipc_open(const unsigned char* handle, void** out) {
  if (handle == nullptr || out == nullptr) return kInvalidValue;
  if (std::memcmp(handle, kIpcMagic, sizeof kIpcMagic) != 0) return kInvalidHandle;
  std::int32_t pid = 0;
  std::int32_t descriptor = 0;
  std::uint64_t bytes = 0;
  std::memcpy(&pid, handle + 8, 4);
  std::memcpy(&descriptor, handle + 12, 4);
  std::memcpy(&bytes, handle + 16, 8);
  if (pid == ::getpid()) return kInvalidContext;  // a handle opens in other processes only
  const std::string key(reinterpret_cast<const char*>(handle), 36);
  const int device = current_device();
  if (!valid(device)) return kInvalidDevice;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = imported_by_key_.find(key); it != imported_by_key_.end()) {
      ++imported_.at(it->second).refs;  // opened before: the same pointer, counted
      *out = reinterpret_cast<void*>(it->second);
      return kSuccess;
    }
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(descriptor);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return kInvalidHandle;  // the process or its allocation is gone
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<std::uint64_t>(st.st_size) != bytes) {
    ::close(fd);
    return kInvalidHandle;
  }
  std::uintptr_t at = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = devices_[static_cast<std::size_t>(device)];
    if (!open_range(d) || (at = take_range(d, bytes)) == 0) {
      ::close(fd);
      return kOutOfMemory;  // no room in this process's device range
    }
    d.used -= bytes;  // the exporting device's memory, not this one's
  }
  const bool mapped = ::mmap(reinterpret_cast<void*>(at), bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                             fd, 0) != MAP_FAILED;
  ::close(fd);  // the mapping keeps the memory
  std::lock_guard<std::mutex> lock(mu_);
  if (!mapped) {
    Device& d = devices_[static_cast<std::size_t>(device)];
    d.used += bytes;
    give_range(d, at, bytes);
    return kOutOfMemory;
  }
  imported_[at] = Imported{bytes, device, 1, key};
  imported_by_key_[key] = at;
  *out = reinterpret_cast<void*>(at);
  return kSuccess;
}

int Sim::ipc_close(void* ptr) {
  const auto at = reinterpret_cast<std::uintptr_t>(ptr);
  std::size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = imported_.find(at);
    if (it == imported_.end()) return kInvalidValue;
    if (--it->second.refs > 0) return kSuccess;
    bytes = it->second.size;
    Device& d = devices_[static_cast<std::size_t>(it->second.device)];
    imported_by_key_.erase(it->second.key);
    imported_.erase(it);
    close_range(at, bytes);
    d.used += bytes;
    give_range(d, at, bytes);
  }
  return kSuccess;
}

int Sim::managed_alloc(std::size_t size, void** out) {
  if (out == nullptr || size == 0) return kInvalidValue;
  const std::size_t bytes = round_up(size, kPage);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return kOutOfMemory;
  std::lock_guard<std::mutex> lock(mu_);
  managed_[reinterpret_cast<std::uintptr_t>(p)] = bytes;
  *out = p;
  return kSuccess;
}

int Sim::free_device(void* ptr) {
  if (ptr == nullptr) return kSuccess;
  const auto at = reinterpret_cast<std::uintptr_t>(ptr);
  std::uintptr_t release_at = 0;  // pages handed back: their memory leaves the process
  std::size_t release_bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocations_.find(at);
    if (it == allocations_.end()) {
      const auto managed = managed_.find(at);
      if (managed == managed_.end()) return kInvalidValue;
      const std::size_t bytes = managed->second;
      managed_.erase(managed);
      ::munmap(ptr, bytes);
      return kSuccess;
    }
    const std::size_t bytes = it->second.first;
    Device& d = devices_[static_cast<std::size_t>(it->second.second)];
    allocations_.erase(it);
    if (bytes < kGranularity) {
      const std::uintptr_t page = at - (at - d.base) % kGranularity;
      Device::SmallPage& sp = d.small_pages.at(page);
      give_back(sp.free, at - page, bytes);
      if (--sp.live == 0) {
        d.small_pages.erase(page);
        give_range(d, page, kGranularity);
        release_at = page, release_bytes = kGranularity;
      }
    } else {
      give_range(d, at, bytes);
      release_at = at, release_bytes = bytes;
      if (auto fd = shared_fds_.find(at); fd != shared_fds_.end()) {
        // The shared pages leave with the memfd (another process's
        // mapping keeps them until it closes its handle).
        close_range(at, bytes);
        ::close(fd->second);
        shared_fds_.erase(fd);
        release_at = 0;
      }
    }
  }
  if (release_at != 0) {
    // The pages go back to the system; the range stays the device's.
    ::madvise(reinterpret_cast<void*>(release_at), release_bytes, MADV_DONTNEED);
    ::mprotect(reinterpret_cast<void*>(release_at), release_bytes, PROT_NONE);
  }
  return kSuccess;
}

bool Sim::device_range(const void* ptr, std::uintptr_t* base, std::size_t* size, int* device) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = allocations_.upper_bound(p); it != allocations_.begin()) {
    --it;
    if (p < it->first + it->second.first) {
      *base = it->first, *size = it->second.first, *device = it->second.second;
      return true;
    }
  }
  if (auto it = imported_.upper_bound(p); it != imported_.begin()) {
    --it;
    if (p < it->first + it->second.size) {
      *base = it->first, *size = it->second.size, *device = it->second.device;
      return true;
    }
  }
  if (auto it = mappings_.upper_bound(p); it != mappings_.begin()) {
    --it;
    if (p < it->first + it->second.size) {
      *base = it->first, *size = it->second.size;
      *device = physical_.count(it->second.handle) ? physical_[it->second.handle].device : 0;
      return true;
    }
  }
  return false;
}

int Sim::reserve(std::size_t size, std::size_t alignment, std::uintptr_t* out) {
  if (size == 0 || size % kGranularity != 0 || out == nullptr) return kInvalidValue;
  if ((alignment & (alignment - 1)) != 0) return kInvalidValue;  // 0 or a power of two, as CUDA's
  const std::size_t align = alignment > kGranularity ? alignment : kGranularity;
  // Over-reserve to align, then give back the ends.
  void* p = ::mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return kOutOfMemory;
  const auto raw = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t base = round_up(raw, align);
  if (base > raw) ::munmap(p, base - raw);
  if (raw + size + align > base + size) {
    ::munmap(reinterpret_cast<void*>(base + size), raw + size + align - (base + size));
  }
  std::lock_guard<std::mutex> lock(mu_);
  reservations_[base] = size;
  *out = base;
  return kSuccess;
}

int Sim::unreserve(std::uintptr_t va, std::size_t size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = reservations_.find(va);
    if (it == reservations_.end() || it->second != size) return kInvalidValue;
    // Nothing may still be mapped inside.
    auto m = mappings_.lower_bound(va);
    if (m != mappings_.end() && m->first < va + size) return kInvalidValue;
    reservations_.erase(it);
  }
  ::munmap(reinterpret_cast<void*>(va), size);
  return kSuccess;
}

int Sim::create_physical(int device, std::size_t size, std::uint64_t* handle) {
  if (!valid(device)) return kInvalidDevice;
  if (size == 0 || size % kGranularity != 0 || handle == nullptr) return kInvalidValue;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Device& d = devices_[static_cast<std::size_t>(device)];
    if (d.used + size > d.capacity) return kOutOfMemory;
    d.used += size;
  }
  const int fd = ::memfd_create("reservoir-simcuda", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (fd >= 0) ::close(fd);
    std::lock_guard<std::mutex> lock(mu_);
    devices_[static_cast<std::size_t>(device)].used -= size;
    return kOutOfMemory;
  }
  std::lock_guard<std::mutex> lock(mu_);
  *handle = next_handle_++;
  physical_[*handle] = Physical{fd, size, device, 1};
  return kSuccess;
}

int Sim::release_physical(std::uint64_t handle) {
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = physical_.find(handle);
    if (it == physical_.end()) return kInvalidValue;
    if (--it->second.refs > 0) return kSuccess;
    // Memory still mapped stays alive until unmapped (the mapping holds the
    // pages); it counts as released, as PyTorch unmaps before releasing.
    devices_[static_cast<std::size_t>(it->second.device)].used -= it->second.size;
    fd = it->second.fd;
    physical_.erase(it);
  }
  ::close(fd);
  return kSuccess;
}

int Sim::map(std::uintptr_t va, std::size_t size, std::size_t offset, std::uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto ph = physical_.find(handle);
  if (ph == physical_.end()) return kInvalidHandle;
  if (size == 0 || size % kGranularity != 0 || va % kGranularity != 0) return kInvalidValue;
  // A part of a handle, or past its end: the driver answers "not supported".
  if (offset != 0 || size > ph->second.size) return kNotSupported;
  // Inside one reservation, over nothing mapped.
  auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin()) return kInvalidValue;
  --r;
  if (va + size > r->first + r->second) return kInvalidValue;
  if (auto m = mappings_.upper_bound(va); m != mappings_.begin()) {
    --m;
    if (m->first + m->second.size > va) return kInvalidValue;
  }
  if (auto m = mappings_.lower_bound(va); m != mappings_.end() && m->first < va + size) {
    return kInvalidValue;
  }
  void* p = ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
                   ph->second.fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED) return kOutOfMemory;
  mappings_[va] = Mapping{size, handle, offset};
  return kSuccess;
}

int Sim::unmap(std::uintptr_t va, std::size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  // Inside one reservation; a range with nothing mapped in it is unmapped
  // already (the driver answers success).
  auto r = reservations_.upper_bound(va);
  if (size == 0 || r == reservations_.begin()) return kInvalidValue;
  --r;
  if (va + size > r->first + r->second) return kInvalidValue;
  if (auto m = mappings_.lower_bound(va); m == mappings_.end() || m->first >= va + size) {
    auto before = mappings_.lower_bound(va);
    if (before == mappings_.begin() ||
        std::prev(before)->first + std::prev(before)->second.size <= va) {
      return kSuccess;
    }
  }
  // Otherwise whole mappings only, as CUDA requires.
  std::uintptr_t at = va;
  while (at < va + size) {
    auto m = mappings_.find(at);
    if (m == mappings_.end()) return kInvalidValue;
    at += m->second.size;
  }
  if (at != va + size) return kInvalidValue;
  void* p = ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return kUnknown;
  for (at = va; at < va + size;) {
    auto m = mappings_.find(at);
    at += m->second.size;
    mappings_.erase(m);
  }
  return kSuccess;
}

int Sim::set_access(std::uintptr_t va, std::size_t size, bool read_write) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Mapping*> covered;
  std::uintptr_t at = va;
  while (at < va + size) {
    auto m = mappings_.upper_bound(at);
    if (m == mappings_.begin()) return kInvalidValue;
    --m;
    if (at >= m->first + m->second.size) return kInvalidValue;
    covered.push_back(&m->second);
    at = m->first + m->second.size;
  }
  if (::mprotect(reinterpret_cast<void*>(va), size, read_write ? PROT_READ | PROT_WRITE : PROT_READ) != 0) {
    return kInvalidValue;
  }
  for (Mapping* m : covered) m->accessible = true;
  return kSuccess;
}

int Sim::copy(void* dst, const void* src, std::size_t n) {
  if (const int fault = touch(src, n)) return fault;
  if (const int fault = touch(dst, n)) return fault;
  if (n != 0 && dst != src) std::memmove(dst, src, n);
  return kSuccess;
}

int Sim::fill(void* p, int value, std::size_t n) {
  if (const int fault = touch(p, n)) return fault;
  if (n != 0) std::memset(p, value, n);
  return kSuccess;
}

int Sim::touch(const void* p, std::size_t n) {
  if (n == 0) return kSuccess;
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto r = reservations_.upper_bound(begin);
  if (r == reservations_.begin()) return kSuccess;
  --r;
  if (begin >= r->first + r->second) return kSuccess;  // not reserved memory
  const std::uintptr_t end = begin + n;
  for (std::uintptr_t at = begin; at < end;) {
    auto m = mappings_.upper_bound(at);
    if (m == mappings_.begin()) break;
    --m;
    if (at >= m->first + m->second.size || !m->second.accessible) break;
    at = m->first + m->second.size;
    if (at >= end) return kSuccess;
  }
  sticky_ = kIllegalAddress;
  return kIllegalAddress;
}

int Sim::export_fd(std::uint64_t handle, int* fd) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = physical_.find(handle);
  if (it == physical_.end() || fd == nullptr) return kInvalidValue;
  *fd = ::dup(it->second.fd);
  return *fd < 0 ? kUnknown : kSuccess;
}

int Sim::import_fd(int fd, int device, std::uint64_t* handle) {
  if (!valid(device)) return kInvalidDevice;
  const off_t size = ::lseek(fd, 0, SEEK_END);
  if (size <= 0 || handle == nullptr) return kInvalidValue;
  const int own = ::dup(fd);
  if (own < 0) return kInvalidValue;
  std::lock_guard<std::mutex> lock(mu_);
  *handle = next_handle_++;
  // Imported memory was counted by its exporter.
  physical_[*handle] = Physical{own, static_cast<std::size_t>(size), device, 1};
  devices_[static_cast<std::size_t>(device)].used += static_cast<std::size_t>(size);
  return kSuccess;
}

int Sim::retain(const void* ptr, std::uint64_t* handle) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto m = mappings_.upper_bound(p);
  if (m == mappings_.begin()) return kInvalidValue;
  --m;
  if (p >= m->first + m->second.size) return kInvalidValue;
  auto ph = physical_.find(m->second.handle);
  if (ph == physical_.end()) return kInvalidValue;
  ++ph->second.refs;
  *handle = m->second.handle;
  return kSuccess;
}

int Sim::physical_size(std::uint64_t handle, std::size_t* size, int* device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = physical_.find(handle);
  if (it == physical_.end()) return kInvalidValue;
  *size = it->second.size;
  *device = it->second.device;
  return kSuccess;
}

Stream* Sim::create_stream(int device, int priority, unsigned flags) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.push_back(std::make_unique<Stream>(Stream{device, priority, flags}));
  return streams_.back().get();
}

int Sim::destroy_stream(Stream* s) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = streams_.begin(); it != streams_.end(); ++it) {
    if (it->get() == s) {
      streams_.erase(it);
      return kSuccess;
    }
  }
  return kInvalidHandle;
}

Event* Sim::create_event(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(std::make_unique<Event>());
  events_.back()->device = device;
  return events_.back().get();
}

int Sim::destroy_event(Event* e) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = events_.begin(); it != events_.end(); ++it) {
    if (it->get() == e) {
      events_.erase(it);
      return kSuccess;
    }
  }
  return kInvalidHandle;
}

double Sim::now_ms() const {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

namespace {
// The legacy default stream's handles (0 and cudaStreamLegacy), and cudaStreamPerThread's.
bool is_legacy(const void* stream) {
  return stream == nullptr || reinterpret_cast<std::uintptr_t>(stream) == 1;
}
bool is_per_thread(const void* stream) { return reinterpret_cast<std::uintptr_t>(stream) == 2; }
constexpr unsigned kNonBlocking = 1;  // cudaStreamNonBlocking
}  // namespace

double* Sim::queue_of(void* stream, int device) {
  const auto d = static_cast<std::size_t>(valid(device) ? device : 0);
  if (is_legacy(stream)) return &legacy_busy_ms_[d];
  if (is_per_thread(stream)) return &per_thread_busy_ms_[d];
  return &static_cast<Stream*>(stream)->busy_until_ms;
}

double Sim::busy_until(void* stream, int device, bool joined) {
  double until = *queue_of(stream, device);
  if (!joined) return until;
  const auto d = static_cast<std::size_t>(valid(device) ? device : 0);
  if (is_legacy(stream)) {
    // The legacy stream waits for every blocking stream of its device.
    until = std::max(until, per_thread_busy_ms_[d]);
    for (const auto& s : streams_) {
      if (s->device == device && (s->flags & kNonBlocking) == 0) until = std::max(until, s->busy_until_ms);
    }
  } else if (is_per_thread(stream) || (static_cast<Stream*>(stream)->flags & kNonBlocking) == 0) {
    until = std::max(until, legacy_busy_ms_[d]);  // a blocking stream waits for the legacy one
  }
  return until;
}

void Sim::wait_until(double ms) {
  using namespace std::chrono;
  const double now = duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
  if (ms > now) std::this_thread::sleep_for(duration<double, std::milli>(ms - now));
}

void Sim::run(void* stream, int device, double ms) {
  std::lock_guard<std::mutex> lock(mu_);
  const double start = std::max(now_ms(), busy_until(stream, device, true));
  *queue_of(stream, device) = start + ms;
}

int Sim::record(Event* e, void* stream) {
  if (e == nullptr) return kInvalidHandle;
  std::lock_guard<std::mutex> lock(mu_);
  e->recorded = true;
  e->complete = !held_;
  e->time_ms = std::max(now_ms(), busy_until(stream, e->device, true));
  return kSuccess;
}

int Sim::query(const Event* e) {
  if (e == nullptr) return kInvalidHandle;
  std::lock_guard<std::mutex> lock(mu_);
  return e->complete && e->time_ms <= now_ms() ? kSuccess : kNotReady;
}

int Sim::synchronize(Event* e) {
  if (e == nullptr) return kInvalidHandle;
  double until = 0.0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e->complete = true;  // the work it waits for is done: the device ran it
    until = e->time_ms;
  }
  wait_until(until);
  return kSuccess;
}

int Sim::stream_query(void* stream, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_until(stream, device, false) <= now_ms() ? kSuccess : kNotReady;
}

int Sim::stream_synchronize(void* stream, int device) {
  double until = 0.0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    until = busy_until(stream, device, true);
  }
  wait_until(until);
  return kSuccess;
}

int Sim::stream_wait_event(void* stream, int device, const Event* e) {
  if (e == nullptr) return kInvalidHandle;
  std::lock_guard<std::mutex> lock(mu_);
  double* queue = queue_of(stream, device);
  if (e->recorded) *queue = std::max(*queue, e->time_ms);
  return kSuccess;
}

void Sim::device_synchronize(int device) {
  double until = 0.0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    until = busy_until(nullptr, device, true);  // the legacy stream's, joined: every blocking stream's
    for (const auto& s : streams_) {
      if (s->device == device) until = std::max(until, s->busy_until_ms);
    }
    for (auto& e : events_) e->complete = true;
  }
  wait_until(until);
}

void Sim::register_function(const void* host, const char* name, int thread_limit) {
  std::lock_guard<std::mutex> lock(mu_);
  Kernel& k = functions_[host];
  k.name = name != nullptr ? name : "";
  k.thread_limit = thread_limit;
}

std::string Sim::function_name(const void* host) {
  const Kernel* k = kernel(host);
  return k == nullptr ? std::string() : k->name;
}

const Sim::Kernel* Sim::kernel(const void* host) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = functions_.find(host);
  return it == functions_.end() ? nullptr : &it->second;
}

void Sim::complete_all() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& e : events_) e->complete = true;
}

void Sim::hold_events(bool held) {
  std::lock_guard<std::mutex> lock(mu_);
  held_ = held;
}

int Sim::host_alloc(std::size_t size, void** out) {
  if (out == nullptr) return kInvalidValue;
  const std::size_t bytes = round_up(size == 0 ? 1 : size, kPage);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return kOutOfMemory;
  std::lock_guard<std::mutex> lock(mu_);
  host_[reinterpret_cast<std::uintptr_t>(p)] = bytes;
  *out = p;
  return kSuccess;
}

int Sim::host_free(void* ptr) {
  if (ptr == nullptr) return kSuccess;
  std::size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = host_.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == host_.end()) return kInvalidValue;
    bytes = it->second;
    host_.erase(it);
  }
  ::munmap(ptr, bytes);
  return kSuccess;
}

namespace {
// The range of `ranges` holding p, or end().
std::map<std::uintptr_t, std::size_t>::const_iterator holding(const std::map<std::uintptr_t, std::size_t>& ranges,
                                                              std::uintptr_t p) {
  auto it = ranges.upper_bound(p);
  if (it == ranges.begin()) return ranges.end();
  --it;
  return p < it->first + it->second ? it : ranges.end();
}
}  // namespace

int Sim::host_register(void* ptr, std::size_t size) {
  if (ptr == nullptr || size == 0) return kInvalidValue;
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  // Any overlap with a registered range or a pinned allocation: already registered.
  for (const auto* ranges : {&registered_, &host_}) {
    const auto it = ranges->lower_bound(p);
    if (it != ranges->end() && it->first < p + size) return kHostMemoryAlreadyRegistered;
    if (holding(*ranges, p) != ranges->end()) return kHostMemoryAlreadyRegistered;
  }
  registered_[p] = size;
  return kSuccess;
}

int Sim::host_unregister(void* ptr) {
  if (ptr == nullptr) return kInvalidValue;
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = registered_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == registered_.end()) return kHostMemoryNotRegistered;
  registered_.erase(it);
  return kSuccess;
}

bool Sim::is_managed(const void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  return holding(managed_, reinterpret_cast<std::uintptr_t>(ptr)) != managed_.end();
}

bool Sim::is_host(const void* ptr) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  return holding(host_, p) != host_.end() || holding(registered_, p) != registered_.end();
}

void Sim::fail_at(const std::string& call, std::uint64_t nth_from_now) {
  std::lock_guard<std::mutex> lock(mu_);
  failures_[call].push_back(counts_[call] + nth_from_now);
}

std::uint64_t Sim::calls(const std::string& call) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = counts_.find(call);
  return it == counts_.end() ? 0 : it->second;
}

}  // namespace reservoir::simcuda

using reservoir::simcuda::Sim;

extern "C" {

SIMCUDA_API int reservoir_simcuda_refuse(const char* name) { return Sim::get().refuse(name); }

SIMCUDA_API void reservoirSimCudaFailAt(const char* call, unsigned long long nth) {
  Sim::get().fail_at(call, nth);
}
SIMCUDA_API unsigned long long reservoirSimCudaCalls(const char* call) { return Sim::get().calls(call); }
SIMCUDA_API void reservoirSimCudaHoldEvents(int held) { Sim::get().hold_events(held != 0); }
SIMCUDA_API void reservoirSimCudaCompleteEvents(void) { Sim::get().complete_all(); }
SIMCUDA_API void reservoirSimCudaAllowKernels(int allow) { Sim::get().set_allow_kernels(allow != 0); }
SIMCUDA_API size_t reservoirSimCudaUsed(int device) { return Sim::get().used(device); }
SIMCUDA_API int reservoirSimCudaIsSimulated(void) { return 1; }

}  // extern "C"
