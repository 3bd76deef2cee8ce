// HostPinnedMemory: page-aligned host memory, optionally mlock'ed.
#include "reservoir/pinned_memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>

namespace reservoir {

Status HostPinnedMemory::allocate(std::size_t bytes, void** ptr) noexcept {
  if (bytes == 0 || ptr == nullptr) return Status::invalid_argument;
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  void* p = nullptr;
  if (posix_memalign(&p, page, bytes) != 0) return Status::out_of_memory;
  if (lock_ && mlock(p, bytes) != 0) {
    std::free(p);
    return Status::out_of_memory;
  }
  std::lock_guard lock(mutex_);
  sizes_.emplace(p, bytes);
  *ptr = p;
  return Status::ok;
}

Status HostPinnedMemory::free(void* ptr) noexcept {
  std::size_t bytes = 0;
  {
    std::lock_guard lock(mutex_);
    auto it = sizes_.find(ptr);
    if (it == sizes_.end()) return Status::invalid_argument;
    bytes = it->second;
    sizes_.erase(it);
  }
  if (lock_) munlock(ptr, bytes);
  std::free(ptr);
  return Status::ok;
}

}  // namespace reservoir
