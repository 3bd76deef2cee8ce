// Host copies of a tag's live allocations, and the engine that moves them.
//
// A backup is a linear host byte space (a HostStore) and the device ranges
// it holds (BackupPiece: device address, length, offset in the store). The
// CopyEngine cuts the pieces at chunk boundaries and spreads the copies
// round robin over several streams, so no copy is larger than a chunk and
// copies on different streams overlap; it synchronizes every stream it used
// before returning, so buffers can be handed back at once.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "reservoir/device.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "tag_device.hpp"

namespace reservoir::detail {

struct BackupPiece {
  DevicePtr addr = 0;
  std::size_t bytes = 0;
  std::size_t offset = 0;  // in the store
};

class HostStore {
 public:
  virtual ~HostStore() = default;
  virtual std::size_t size() const noexcept = 0;
  // The host bytes at offset and how many of them are contiguous from there.
  virtual std::byte* at(std::size_t offset, std::size_t* contiguous) noexcept = 0;
  // True when the memory is not pinned: copies go through pinned staging.
  virtual bool staged() const noexcept = 0;
  // Called once the backup is complete (an mmap store lets its pages go).
  virtual void backed_up() noexcept {}
};

// Buffers of chunk bytes each from the pinned host cache; returned to the
// cache when the store is destroyed. Throws OutOfMemoryError when the cache
// cannot give them (nothing held then).
std::unique_ptr<HostStore> make_pinned_store(HostCachingAllocator& cache, std::size_t bytes,
                                             std::size_t chunk);
// A shared file mapping: an unlinked file in `directory`, or a memfd when
// it is empty. Throws UsageError naming the directory when it cannot be
// created, OutOfMemoryError when the space cannot be reserved.
std::unique_ptr<HostStore> make_mmap_store(const std::string& directory, std::size_t bytes);

class CopyEngine {
 public:
  // streams: at least one. Staging buffers (chunk bytes each, one per
  // stream) come from `cache` when a store needs them.
  CopyEngine(Device& device, HostCachingAllocator& cache, std::size_t chunk,
             std::vector<StreamId> streams);
  // Device to host and back. On failure the work already queued is waited
  // for and the first failed call is returned.
  StepFailure to_host(const std::vector<BackupPiece>& pieces, HostStore& store);
  StepFailure to_device(const std::vector<BackupPiece>& pieces, HostStore& store);

 private:
  template <bool kToHost>
  StepFailure run(const std::vector<BackupPiece>& pieces, HostStore& store);

  Device& device_;
  HostCachingAllocator& cache_;
  std::size_t chunk_;
  std::vector<StreamId> streams_;
};

}  // namespace reservoir::detail
