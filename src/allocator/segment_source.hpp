// Segment policies as types.
//
// The core (CachingAllocator::Impl) owns pools, blocks, split and merge,
// statistics, history and the lock. What differs between policies is where
// memory comes from when no cached block serves a request, and what goes back
// after a free: that is a SegmentSource, one class per policy, each in its
// own file (native_segments.cpp, expandable_segments.cpp,
// paging_segments.cpp), listed once in segment_sources.cpp. The core makes
// the source its configuration names at construction, and again when
// set_config names another (PyTorch lets expandable_segments change at run
// time; segments made under the old policy stay and are served as before).
//
// A source is called with the core's lock held. What it may use of the core
// is the section of CachingAllocator::Impl marked "segment sources"; the
// traits are read into the core's members when the source is made, so the
// hot path tests a flag rather than calling through the interface.
//
// Adding a policy: a value in reservoir::Policy, a file with a class derived
// from SegmentSource (or VmSegments, for pages of virtual-memory segments) and
// its factory, and a line in segment_sources.cpp. docs/architecture.md walks
// through an example.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>

#include "block.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/config.hpp"

namespace reservoir::detail {

// One request on its way through the core.
struct AllocParams {
  std::size_t size;        // rounded request
  std::size_t alloc_size;  // device allocation size if a new segment is needed (set on a miss)
  StreamId stream;
  BlockPool* pool;
  Block* block = nullptr;
  bool block_in_pool = false;  // a cached block, still in its pool's set
  std::size_t requested = 0;   // the caller's size (set on a miss)
};

// What the core needs to know of a policy, read once per configuration.
class VmSegments;

struct SourceTraits {
  // Requests of kSmallSize or less have a pool of their own (PyTorch's
  // 2 MiB segments); without it they share the large pool.
  bool small_pool = true;
  // The default pool's memory is pages of virtual-memory segments: a block
  // splits whenever the rest is a block (pages merge back on free), cached
  // blocks count with the unmapped space after them, and empty_cache unmaps
  // pages rather than freeing segments.
  bool virtual_memory = false;
  // Private pools' memory comes from the source too (PyTorch's expandable
  // segments from 2.5: a reservation per stream and private pool); without
  // it they keep classic segments, as under reservoir's own policies.
  bool private_pools = false;
  // obtain() checks the memory fraction itself (against what it maps), so
  // the core does not check the size of a whole segment first.
  bool checks_fraction = false;
  // Where the native policy's choice finds no memory, the core tries the
  // free block whose pages are mapped the most (native_paged's rescue).
  bool rescues = false;
  // after_free() is called after each free that returns a block to the cache.
  bool after_free = false;
  // observe() hears every allocation and free request (and out-of-memory
  // error), stream_used() every record_stream, cache_emptied() every
  // empty_cache: the source follows the program (paging's native bound).
  bool observes = false;
};

class SegmentSource {
 public:
  explicit SegmentSource(CachingAllocator::Impl& core) noexcept : core_(core) {}
  virtual ~SegmentSource() = default;
  SegmentSource(const SegmentSource&) = delete;
  SegmentSource& operator=(const SegmentSource&) = delete;

  virtual Policy policy() const noexcept = 0;
  virtual SourceTraits traits(const AllocatorConfig& config) const noexcept = 0;
  // Memory for p (a request of the default pool, or of a private pool with
  // traits().private_pools, that no cached block serves, p.alloc_size set): a free block in p.block (in its pool when
  // p.block_in_pool says so). False when the device has none to give:
  // the core's retry ladder follows. Throws DeviceError on other failures,
  // having undone what it did.
  virtual bool obtain(AllocParams& p) = 0;
  // After a free (only with traits().after_free). A device failure is the
  // source's to absorb: the caller's free has succeeded.
  virtual void after_free() {}
  // The configuration, each time it is set (at construction too).
  virtual void configure(const AllocatorConfig& config) { (void)config; }
  // With traits().observes: an alloc, free_requested or oom event, and
  // whether its block is in a default pool (not a private one).
  virtual void observe(const TraceEvent& event, bool default_pool) {
    (void)event;
    (void)default_pool;
  }
  virtual void stream_used(DevicePtr ptr, StreamId stream) {
    (void)ptr;
    (void)stream;
  }
  virtual void cache_emptied() {}
  // This source as a VmSegments, or nullptr.
  virtual VmSegments* as_vm() noexcept { return nullptr; }

 protected:
  CachingAllocator::Impl& core_;
};

// A policy whose memory is pages of virtual-memory segments (one address
// reservation per stream and pool). The core maps and unmaps the pages; the
// source decides their size, which free range a request grows into, and how
// much to map at once.
class VmSegments : public SegmentSource {
 public:
  using SegmentSource::SegmentSource;
  VmSegments* as_vm() noexcept final { return this; }
  // The page of a new segment for `pool` (rounded up to the device's granularity by the core).
  virtual std::size_t page_size(const BlockPool& pool, std::size_t granularity,
                                const AllocatorConfig& config) const noexcept = 0;
  // Segments of this policy share one physical handle among the pages mapped
  // together, released when all are free (paging); otherwise one per page.
  virtual bool shares_handles() const noexcept = 0;
  // Of the free ranges a request fits in: the lowest address (true), or the
  // one needing the fewest new pages.
  virtual bool lowest_fit() const noexcept = 0;
  // Bytes to map at `to_map` (an unmapped block) for `bytes` of growth
  // serving a request of `request` bytes: at least `bytes`, at most to_map's size.
  virtual std::size_t map_bytes(const Block* to_map, std::size_t bytes, std::size_t request) {
    (void)to_map;
    (void)request;
    return bytes;
  }
};

// The registered policies, one entry each: what reservoir::policies()
// lists, and the factory of the policy's source.
struct SegmentSourceEntry {
  PolicyInfo info;
  std::unique_ptr<SegmentSource> (*make)(CachingAllocator::Impl& core);
};
std::span<const SegmentSourceEntry> segment_sources() noexcept;
// The entry of `policy` (every Policy value has one).
const SegmentSourceEntry& segment_source(Policy policy) noexcept;
// The registered policy called `name`, or nullptr.
const SegmentSourceEntry* find_segment_source(std::string_view name) noexcept;
// The policy a configuration names: `policy:`, or expandable_segments:True.
Policy configured_policy(const AllocatorConfig& config) noexcept;

}  // namespace reservoir::detail
