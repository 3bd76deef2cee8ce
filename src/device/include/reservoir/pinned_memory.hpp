// Sources of pinned (page-locked) host memory, the buffers device<->host
// copies run at full link speed from: cudaHostAlloc on a GPU
// (CudaPinnedMemory, cuda_device.hpp), page-aligned host memory elsewhere
// (HostPinnedMemory). HostCachingAllocator caches what they give.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>

#include "reservoir/device.hpp"

namespace reservoir {

class PinnedMemorySource {
 public:
  virtual ~PinnedMemorySource() = default;
  // bytes > 0; on ok, *ptr is page-aligned. out_of_memory when it cannot.
  virtual Status allocate(std::size_t bytes, void** ptr) noexcept = 0;
  virtual Status free(void* ptr) noexcept = 0;
};

// Page-aligned host memory; with lock_pages, mlock'ed (RLIMIT_MEMLOCK
// applies: a refusal is out_of_memory).
class HostPinnedMemory final : public PinnedMemorySource {
 public:
  explicit HostPinnedMemory(bool lock_pages = false) : lock_(lock_pages) {}
  Status allocate(std::size_t bytes, void** ptr) noexcept override;
  Status free(void* ptr) noexcept override;

 private:
  bool lock_;
  std::mutex mutex_;
  std::unordered_map<void*, std::size_t> sizes_;
};

}  // namespace reservoir
