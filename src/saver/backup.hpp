// Host copies of a tag's live allocations, and the engine that moves them.
//
// A backup is a linear host byte space (a HostStore) and the device ranges
// it holds (BackupPiece: device address, length, offset in the store). The
// CopyEngine cuts the pieces at chunk boundaries and spreads the copies
// round robin over several streams, so no copy is larger than a chunk and
// copies on different streams overlap; finish() synchronizes every stream it
// used, so buffers can be handed back at once.
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

// `bytes` of zeros, read from one zeroed buffer of `chunk` bytes (staged).
std::unique_ptr<HostStore> make_zero_store(std::size_t bytes, std::size_t chunk);

// One direction of copies between device memory and a store. Pieces are
// issued as they become ready (resume issues a piece as soon as its memory
// is mapped); finish() waits for them all.
class CopyEngine {
 public:
  // streams: at least one. Staging buffers (chunk bytes each, one per
  // stream) come from `cache` when the store needs them; OutOfMemoryError
  // when it cannot give them.
  CopyEngine(Device& device, HostCachingAllocator& cache, std::size_t chunk,
             const std::vector<StreamId>& streams, HostStore& store, bool to_host);
  // Waits for whatever is still in flight and gives the staging buffers back.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues the copies of one piece. After a failure, the work queued before
  // is waited for and nothing more is queued.
  StepFailure issue(const BackupPiece& piece);
  // Waits for every copy (staged copies to the host land in the store).
  StepFailure finish();
  std::size_t issued_bytes() const noexcept { return issued_; }

 private:
  struct Slot {
    std::byte* staging = nullptr;
    std::byte* host = nullptr;
    std::size_t bytes = 0;
    bool busy = false;
  };
  Status drain(std::size_t k);

  Device& device_;
  HostCachingAllocator& cache_;
  std::size_t chunk_;
  std::vector<StreamId> streams_;
  HostStore& store_;
  bool to_host_;
  bool staged_;
  std::vector<Slot> slots_;
  std::size_t next_ = 0;
  std::size_t issued_ = 0;
  StepFailure failure_;
};

}  // namespace reservoir::detail
