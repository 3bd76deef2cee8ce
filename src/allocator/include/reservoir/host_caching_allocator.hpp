// HostCachingAllocator: a caching allocator for pinned (page-locked) host
// memory, the buffers device<->host copies run at full link speed from, as
// PyTorch's CachingHostAllocator keeps one. Requests round up to a power of
// two (at least 512 bytes); a freed block is cached whole for requests of its
// size class, and when it was used on streams (record_stream) it is reused
// only once the events recorded on those streams at free time complete, so
// an asynchronous copy still reading or writing it is never overtaken.
//
// Memory comes from a PinnedMemorySource: cudaHostAlloc on a GPU
// (CudaPinnedMemory), page-aligned host memory elsewhere (HostPinnedMemory,
// optionally mlock'ed). Events come from the Device the copies run on.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "reservoir/device.hpp"
#include "reservoir/pinned_memory.hpp"

namespace reservoir {

struct HostCacheStats {
  std::int64_t allocated_bytes = 0;  // in blocks handed out (size classes)
  std::int64_t allocated_bytes_peak = 0;
  std::int64_t reserved_bytes = 0;  // obtained from the source
  std::int64_t reserved_bytes_peak = 0;
  std::int64_t allocations = 0;   // allocate calls served
  std::int64_t cache_hits = 0;    // of which from the cache
  std::int64_t source_allocs = 0; // pinned allocations made
  std::int64_t source_frees = 0;
  std::int64_t pending_blocks = 0;  // freed, waiting for stream events
};

class HostCachingAllocator {
 public:
  // Neither is owned; both must outlive the allocator.
  HostCachingAllocator(PinnedMemorySource& source, Device& device);
  // Waits for pending events and returns every block to the source.
  ~HostCachingAllocator();
  HostCachingAllocator(const HostCachingAllocator&) = delete;
  HostCachingAllocator& operator=(const HostCachingAllocator&) = delete;

  // nullptr for 0 bytes. Throws OutOfMemoryError when the source refuses
  // even after the cache was emptied; DeviceError on an event failure.
  void* allocate(std::size_t bytes);
  // Throws InvalidPointerError for a pointer not handed out (or freed twice).
  void deallocate(void* ptr);
  // The block is used by work on `stream`: reuse waits for it after free.
  void record_stream(void* ptr, StreamId stream);
  // Returns every cached block whose events completed to the source.
  void empty_cache();
  HostCacheStats stats() const;

  static std::size_t size_class(std::size_t bytes) noexcept;

 private:
  struct Block {
    void* ptr = nullptr;
    std::size_t size = 0;
    bool allocated = false;
    int pending_events = 0;
    std::vector<StreamId> streams;
  };
  void process_events_locked();
  void release_free_locked();
  void free_block_locked(Block* block);

  PinnedMemorySource& source_;
  Device& device_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, std::unique_ptr<Block>> blocks_;
  std::map<std::size_t, std::vector<Block*>> free_;  // by size class, reused last-in first-out
  std::deque<std::pair<EventId, Block*>> pending_;
  std::vector<EventId> idle_events_;
  HostCacheStats stats_;
};

}  // namespace reservoir
