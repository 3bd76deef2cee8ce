// Blocks, pools and segments: the allocator's data structures.
//
// Glossary
//   segment  one device allocation; its blocks tile it exactly.
//   block    a piece of a segment, allocated to a caller or free.
//   pool     the free blocks of one size class (small <= 1 MiB, large) of the
//            default pool or of a private pool, ordered by (stream, size, address).
//
// Invariants (checked by CachingAllocator::validate):
//   for every segment S:  sum(b.size for b in S) == S.size,
//                         b.next.ptr == b.ptr + b.size, head.ptr == S.base
//   a block is in pool.blocks  <=>  !allocated && event_count == 0 && stream_uses empty
//   no two neighbours are both in a pool (free neighbours always merge)
//   virtual-memory segments (expandable, paging): the segment is one address
//   reservation; its blocks are mapped (allocated or cached) or unmapped
//   (address space only, in pool.unmapped); mapped/unmapped boundaries fall
//   on page boundaries; no two unmapped blocks are neighbours; a page has a
//   physical handle exactly when a mapped block covers part of it
//   stats.X.current == recount of X over all segments (allocated, active,
//   reserved, requested, inactive split), total_reserved == sum(S.size)
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <set>
#include <vector>

#include "recycling.hpp"
#include "reservoir/device.hpp"
#include "reservoir/snapshot.hpp"

namespace reservoir {
class PoolSegmentAllocator;
}

namespace reservoir::detail {

struct BlockPool;
struct Segment;
struct PrivatePool;

struct Block;

// How cached blocks of one stream and size are ordered (PyTorch's
// BlockComparatorSize after stream and size): by address (2.11 and before),
// by the order the blocks were made in (2.12: the oldest first), or by the
// order their segments were made in, then address (2.13 and later).
enum class TieOrder : std::uint8_t { address, block_age, segment_age };

// Best fit order: stream, then size, then address; with `by_age` (2.12 and
// later), stream, size, then Block::order (the oldest first), then address.
// A search key: the first place a block of `size` on `stream` could sit
// (before every block of that stream and size).
struct SizeKey {
  StreamId stream;
  std::size_t size;
};

struct BlockBySize {
  using is_transparent = void;  // lower_bound(SizeKey) builds no Block
  bool by_age = false;
  bool operator()(const Block* a, const Block* b) const noexcept;
  bool operator()(const Block* a, const SizeKey& k) const noexcept;
  bool operator()(const SizeKey& k, const Block* b) const noexcept;
};

using BlockSet = std::set<Block*, BlockBySize, RecyclingAllocator<Block*>>;

struct Block {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  StreamId stream = 0;
  BlockPool* pool = nullptr;
  Segment* segment = nullptr;
  Block* prev = nullptr;
  Block* next = nullptr;
  bool allocated = false;
  bool mapped = true;                 // false: address space of a VM segment only
  bool lent = false;                  // pages lent to a stitched block (paging)
  bool in_vm = false;                 // its segment is a virtual-memory one (segment->vm set)
  bool cached = false;                // in pool->blocks (then is_free(): the validator checks)
  int event_count = 0;                // outstanding stream events
  std::uint32_t context = 0;          // history context of its allocation
  std::vector<StreamId> stream_uses;  // streams recorded with record_stream
  std::int64_t gc_count_base = 0;     // pool's free-block search count when cached
  // Its age: its segment's creation order (1 = the first), or under
  // PyTorch 2.12's rule its own, as PyTorch makes Block objects (a
  // segment's first block, the front of a split; a merge keeps the freed
  // block's). 0: a search key.
  std::uint64_t order = 0;
  BlockSet::iterator pool_pos{};  // where it sits in pool->blocks, while free

  bool is_split() const noexcept { return prev != nullptr || next != nullptr; }
  // Of a block in use, the bytes its caller may touch: what it asked for
  // (an unsplit block can be up to 1 MiB larger, an oversize one more, and
  // roundup_power2_divisions rounds requests up by as much as a quarter).
  std::size_t touched_bytes() const noexcept {
    return requested_size != 0 && requested_size < size ? requested_size : size;
  }
  // Cached: mapped, not allocated, no pending stream use (belongs in pool->blocks).
  bool is_free() const noexcept {
    return mapped && !lent && !allocated && event_count == 0 && stream_uses.empty();
  }
  // Usable address space for a VM allocation: cached or unmapped.
  bool is_available() const noexcept {
    return !lent && !allocated && event_count == 0 && stream_uses.empty();
  }
};

// Unmapped blocks of VM segments: stream, then address.
struct BlockByAddress {
  bool operator()(const Block* a, const Block* b) const noexcept {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->ptr < b->ptr;
  }
};

inline bool BlockBySize::operator()(const Block* a, const Block* b) const noexcept {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  if (by_age && a->order != b->order) return a->order < b->order;
  return a->ptr < b->ptr;
}
inline bool BlockBySize::operator()(const Block* a, const SizeKey& k) const noexcept {
  if (a->stream != k.stream) return a->stream < k.stream;
  return a->size < k.size;
}
inline bool BlockBySize::operator()(const SizeKey& k, const Block* b) const noexcept {
  if (k.stream != b->stream) return k.stream < b->stream;
  return k.size <= b->size;
}

struct BlockPool {
  BlockPool(bool small, PrivatePool* owner, NodeRecycler* nodes)
      : blocks(BlockBySize{}, RecyclingAllocator<Block*>(nodes)), is_small(small), owner(owner) {}
  BlockSet blocks;
  std::set<Block*, BlockByAddress> unmapped;  // address space of VM segments
  const bool is_small;
  PrivatePool* const owner;  // null for the default pools
  std::int64_t get_free_blocks_call_count = 0;

  void insert(Block* block) {
    block->gc_count_base = get_free_blocks_call_count;
    block->pool_pos = blocks.insert(block).first;
    block->cached = true;
  }
  void erase(Block* block) {
    blocks.erase(block->pool_pos);
    block->cached = false;
  }
  // Orders the cached blocks by age (by_age: 2.12 and later) or address.
  void set_order(bool by_age) {
    if (blocks.key_comp().by_age == by_age) return;
    BlockSet ordered(BlockBySize{by_age}, blocks.get_allocator());
    for (Block* b : blocks) b->pool_pos = ordered.insert(b).first;
    blocks.swap(ordered);
  }
  // A block in the set whose size just fell (shrunk) or rose (grown), its
  // address perhaps with it: its key moved in that direction only, so it
  // keeps its node while the neighbour on that side still brackets it, and
  // is re-inserted otherwise. It counts as newly cached (as PyTorch
  // re-inserts it).
  [[gnu::always_inline]] void reposition_shrunk(Block* block) {
    block->gc_count_base = get_free_blocks_call_count;
    const auto it = block->pool_pos;
    if (it == blocks.begin() || blocks.key_comp()(*std::prev(it), block)) return;
    blocks.erase(it);
    block->pool_pos = blocks.insert(block).first;
  }
  [[gnu::always_inline]] void reposition_grown(Block* block) {
    block->gc_count_base = get_free_blocks_call_count;
    const auto it = block->pool_pos;
    const auto after = std::next(it);
    if (after == blocks.end() || blocks.key_comp()(block, *after)) return;
    blocks.erase(it);
    block->pool_pos = blocks.insert(block).first;
  }
  // Age of a cached block in free-block searches, as PyTorch computes it.
  std::size_t gc_count(const Block* block) const noexcept {
    return static_cast<std::size_t>(
        static_cast<int>(get_free_blocks_call_count - block->gc_count_base));
  }
};

// The physical side of a virtual-memory segment: which handle backs each page.
// Expandable segments (PyTorch's) use one handle per page; the paging policy
// creates one handle per run of pages mapped together.
struct VmState {
  static constexpr std::uint32_t kNone = 0xffffffffU;
  struct Handle {
    PhysicalHandle handle = 0;
    std::size_t first_page = 0;
    std::size_t pages = 0;
    bool live = false;
    // paging: the arena growth (the allocator's count) that moved this
    // handle here from a free block elsewhere; 0: created here.
    std::uint64_t moved_at = 0;
  };
  bool paging = false;  // policy:paging; false: expandable_segments
  // A stitched segment (paging under pressure) holds one block made of free
  // pages of other segments, mapped here a second time, plus fresh memory
  // for the rest. The lenders' pages sit in `lent` blocks until it dissolves.
  struct Piece {
    DevicePtr va = 0;
    std::size_t bytes = 0;
    PhysicalHandle handle = 0;
    std::size_t offset = 0;
    bool fresh = false;  // created for this segment (released with it)
  };
  bool stitched = false;
  std::vector<Piece> pieces;
  std::vector<Block*> lent;
  std::size_t page = 0;
  std::size_t pages = 0;                   // pages in the reservation
  std::vector<std::uint32_t> page_handle;  // per page up to the highest mapped: handle or kNone
  std::vector<Handle> handles;
  std::vector<std::uint32_t> free_slots;  // reusable entries of handles
  std::size_t mapped_pages = 0;           // pages with a handle behind them
  // native_paged: every page mapped by one handle (the segment mapped whole),
  // and the reserved memory from which the segment's size is no longer
  // plentiful (its size x 256 below the capacity).
  bool whole = false;
  std::size_t plentiful_above = 0;
  // native_paged: the segment's address space was carved from the
  // allocator's address arena (false: a reservation of its own).
  bool in_arena = false;

  std::uint32_t add(PhysicalHandle h, std::size_t first, std::size_t pages) {
    std::uint32_t slot;
    if (free_slots.empty()) {
      slot = static_cast<std::uint32_t>(handles.size());
      handles.emplace_back();
    } else {
      slot = free_slots.back();
      free_slots.pop_back();
    }
    handles[slot] = Handle{h, first, pages, true, 0};
    mapped_pages += pages;
    whole = first == 0 && pages == this->pages && pages != 0;
    if (page_handle.size() < first + pages) page_handle.resize(first + pages, kNone);
    for (std::size_t i = first; i < first + pages; ++i) page_handle[i] = slot;
    return slot;
  }
  std::uint32_t at(std::size_t page_index) const noexcept {
    return page_index < page_handle.size() ? page_handle[page_index] : kNone;
  }
  void remove(std::uint32_t slot) {
    Handle& rec = handles[slot];
    mapped_pages -= rec.pages;
    for (std::size_t i = rec.first_page; i < rec.first_page + rec.pages; ++i) {
      page_handle[i] = kNone;
    }
    rec.live = false;
    whole = false;
    free_slots.push_back(slot);
    while (!page_handle.empty() && page_handle.back() == kNone) page_handle.pop_back();
  }
};

struct Segment {
  std::uint64_t order = 0;  // creation order in its allocator: 1 for the first
  DevicePtr base = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  BlockPool* pool = nullptr;
  Block* head = nullptr;        // the block at base
  std::unique_ptr<VmState> vm;  // set for virtual-memory segments
  // Set for native_paged segments (native_paged.cpp): a classic segment (the
  // native rules place, split and merge its blocks) on an address
  // reservation whose pages are mapped as its blocks are handed out.
  std::unique_ptr<VmState> paged;
  // A private pool's segment from its own allocator (MemPool(allocator=...)),
  // which goes back to it; null for the device's.
  std::shared_ptr<PoolSegmentAllocator> from;
};

struct PrivatePool {
  PrivatePool(PoolId pool_id, NodeRecycler* nodes)
      : id(pool_id), large(false, this, nodes), small(true, this, nodes) {}
  PoolId id;
  int use_count = 1;
  int device_alloc_count = 0;  // segments still held (PyTorch's cudaMalloc_count)
  bool no_split = false;       // MemPool(no_split=True): blocks handed out whole
  // MemPool(allocator=...): where its segments come from (else the device).
  std::shared_ptr<PoolSegmentAllocator> segments;
  BlockPool large;
  BlockPool small;
};

// Recycles Block objects so steady-state allocation does no heap allocation.
// A recycled block keeps its old fields (stream_uses emptied, its capacity
// kept): make() resets them all.
class BlockArena {
 public:
  // A fresh, unlinked, mapped and free block.
  Block* make(DevicePtr ptr, std::size_t size, StreamId stream, BlockPool* pool, Segment* segment,
              std::uint64_t order) {
    Block* b = free_;
    if (b == nullptr) {
      b = &storage_.emplace_back();
    } else {
      free_ = b->next;
    }
    b->ptr = ptr;
    b->size = size;
    b->requested_size = 0;
    b->stream = stream;
    b->pool = pool;
    b->segment = segment;
    b->prev = nullptr;
    b->next = nullptr;
    b->allocated = false;
    b->mapped = true;
    b->lent = false;
    b->event_count = 0;
    b->context = 0;
    b->gc_count_base = 0;
    b->order = order;
    b->in_vm = segment != nullptr && segment->vm != nullptr;
    b->cached = false;
    b->pool_pos = BlockSet::iterator{};
    return b;
  }
  // b must be unlinked from its pool, its segment and every map.
  void recycle(Block* b) noexcept {
    b->stream_uses.clear();
    b->next = free_;  // the free list runs through `next`
    free_ = b;
  }

 private:
  std::deque<Block> storage_;
  Block* free_ = nullptr;
};

}  // namespace reservoir::detail
