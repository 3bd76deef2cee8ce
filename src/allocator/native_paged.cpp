// The native_paged policy: PyTorch's segments and every one of its decisions
// (pools, best fit, splitting, merging, the retry ladder, empty_cache), with
// each segment's memory mapped in pages as its blocks are handed out.
//
// A segment is an address reservation of the size the native policy would
// allocate, with no memory behind it when made. Serving a block maps the
// pages under it that have none (one physical handle per run of such pages:
// create, map, set access); cached pages stay mapped, so a loop that reuses
// its memory makes no device calls. Since the blocks are the native policy's,
// at the native policy's offsets in segments of the native policy's sizes,
// and only pages of those segments are ever mapped, reserved memory is at
// most what the native policy reserves for the same program at the same
// point: the bound holds by construction, with no model of the native policy
// beside it. Where memory runs short, handles whose pages hold no block in
// use go back to the device (after their stream synchronizes) before the
// retry ladder frees whole segments; empty_cache() gives back those pages
// too, beyond the free segments the native policy releases.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"
#include "segment_source.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;
using detail::Segment;
using detail::VmState;

namespace detail {
namespace {

class NativePagedSegments final : public SegmentSource {
 public:
  using SegmentSource::SegmentSource;
  Policy policy() const noexcept override { return Policy::native_paged; }
  SourceTraits traits(const AllocatorConfig& config) const noexcept override {
    SourceTraits t;
    t.checks_fraction = true;  // against the pages mapped, not the segment's size
    t.rescues = config.native_paged_rescue;
    return t;
  }
  bool obtain(AllocParams& p) override RESERVOIR_REQUIRES(core_.source_lock()) {
    return core_.new_paged_segment(p);
  }
};

}  // namespace

std::unique_ptr<SegmentSource> make_native_paged_segments(CachingAllocator::Impl& core) {
  return std::make_unique<NativePagedSegments>(core);
}

}  // namespace detail

namespace {

// Memory is plentiful while what a choice would map (a whole new segment),
// or hold beyond a block's own pages (a larger handle it sits in), is at most
// this share of what the device has free: then the choice that makes fewer
// calls is taken; otherwise the one that maps less. (1/256 of what is free:
// measured over the recordings and generated programs, the minimum capacity
// of mapping block by block at no more calls than mapping whole segments;
// docs/benchmarks.md.)
constexpr std::size_t kPlentifulShare = 256;

// Runs of at least this many pages are mapped with their partly covered end
// pages apart (back_block).
constexpr std::size_t kEdgeSplitRun = 6;

// Whether a handle has a page in use (busy: sorted, disjoint runs).
bool any_in_use(const VmState::Handle& h, const std::vector<std::pair<std::size_t, std::size_t>>& busy) {
  // The first run that ends after the handle's first page.
  auto it = std::upper_bound(busy.begin(), busy.end(), h.first_page,
                             [](std::size_t page, const auto& run) { return page < run.second; });
  return it != busy.end() && it->first < h.first_page + h.pages;
}

// The address space reserved for a segment of `size` bytes: whole pages.
std::size_t reservation(std::size_t size, std::size_t page) {
  return (size + page - 1) / page * page;
}

}  // namespace

bool CachingAllocator::Impl::new_paged_segment(AllocParams& p) {
  const std::size_t size = p.alloc_size;
  const std::size_t page = std::max<std::size_t>(device_.granularity(), 1);
  (void)total_capacity();  // asked once, for back_block's fast path
  const std::size_t reserved_space = reservation(size, page);
  bool in_arena = false;
  const DevicePtr va = paged_segment_space(reserved_space, in_arena);
  if (va == 0) return false;
  Segment* seg = add_segment(va, size, p.stream, p.pool);
  seg->paged = std::make_unique<VmState>();
  seg->paged->page = page;
  seg->paged->pages = reserved_space / page;
  seg->paged->plentiful_above = reserved_space * kPlentifulShare;
  seg->paged->in_arena = in_arena;
  BlockPool& pool = *p.pool;
  add_stats(stats_.segment, stat_index(pool), 1);
  if (size >= config_.max_split_size) add_stat(stats_.oversize_segments, 1);
  p.block = seg->head;
  p.block_in_pool = false;
  bool backed = false;
  try {
    backed = back_block(p);
  } catch (...) {
    backed = false;
    release_paged_segment(seg->head, /*in_pool=*/false);
    throw;
  }
  if (!backed) release_paged_segment(seg->head, /*in_pool=*/false);
  return backed;
}

DevicePtr CachingAllocator::Impl::paged_segment_space(std::size_t bytes, bool& in_arena) {
  if (!address_arena_.active() && !address_arena_refused_) {
    const std::size_t page = std::max<std::size_t>(device_.granularity(), 1);
    const std::size_t capacity = std::min(total_capacity(), kAddressArenaMost / kAddressArenaShare);
    const std::size_t span = reservation(capacity * kAddressArenaShare, page);
    DevicePtr base = 0;
    const Status st = span == 0 ? Status::out_of_memory : device_.reserve(span, 0, &base);
    if (st == Status::ok) {
      address_arena_.reset(base, span);
    } else if (st == Status::out_of_memory || st == Status::invalid_argument) {
      // No address space that large (or a size the device will not take):
      // segments reserve their own from now on.
      address_arena_refused_ = true;
    } else {
      throw DeviceError(CallKind::reserve, st,
                        fmt::format("reserving {} bytes of address space for segments", span));
    }
  }
  if (address_arena_.active()) {
    if (const DevicePtr at = address_arena_.take(bytes); at != 0) {
      in_arena = true;
      return at;
    }
  }
  in_arena = false;
  DevicePtr va = 0;
  const Status status = device_.reserve(bytes, 0, &va);
  if (status == Status::out_of_memory) return 0;
  if (status != Status::ok) {
    throw DeviceError(CallKind::reserve, status,
                      fmt::format("reserving {} bytes of address space for a segment", bytes));
  }
  return va;
}

void CachingAllocator::Impl::release_idle_address_arena() {
  if (!address_arena_.active() || address_arena_.taken() != 0) return;
  unreserve_or_retry(address_arena_.base(), address_arena_.bytes());
  address_arena_.clear();
}

bool CachingAllocator::Impl::plentiful(std::size_t bytes) {
  const std::size_t need = bytes > std::numeric_limits<std::size_t>::max() / kPlentifulShare
                               ? std::numeric_limits<std::size_t>::max()
                               : bytes * kPlentifulShare;
  if (headroom_reads_left_ > 0) {
    // The last reading, less what this allocator mapped since (plus what it
    // gave back): asked again only when that says no, or it is old.
    const std::size_t before = headroom_reading_ + reserved_at_reading_;
    const std::size_t estimate = before - std::min(before, total_reserved_);
    --headroom_reads_left_;
    if (estimate >= need) return true;
  }
  headroom_reading_ = mapping_headroom();
  reserved_at_reading_ = total_reserved_;
  headroom_reads_left_ = kHeadroomReadingUses - 1;
  return headroom_reading_ >= need;
}

bool CachingAllocator::Impl::map_paged_run(Segment& seg, std::size_t first, std::size_t pages) {
  VmState& pg = *seg.paged;
  const std::size_t bytes = pages * pg.page;
  const DevicePtr va = seg.base + first * pg.page;
  if (set_fraction_ && total_reserved_ + bytes > allowed_memory_maximum_) return false;
  PhysicalHandle h = 0;
  Status st = device_.create_physical(bytes, &h);
  if (st == Status::out_of_memory) {
    headroom_reads_left_ = 0;  // the device has less than the last reading said
    return false;
  }
  if (st != Status::ok) {
    throw DeviceError(CallKind::create_physical, st,
                      fmt::format("creating {} bytes of physical memory for {:#x}", bytes, va));
  }
  st = device_.map(va, bytes, h, 0);
  if (st != Status::ok) {
    if (device_.release_physical(h) != Status::ok) keep_unreleased(h, bytes, stat_index(*seg.pool));
    throw DeviceError(CallKind::map, st, fmt::format("mapping {} bytes at {:#x}", bytes, va));
  }
  st = device_.set_access(va, bytes);
  if (st != Status::ok) {
    if (device_.unmap(va, bytes) != Status::ok) stuck_mappings_.emplace_back(va, bytes);
    if (device_.release_physical(h) != Status::ok) keep_unreleased(h, bytes, stat_index(*seg.pool));
    throw DeviceError(CallKind::set_access, st,
                      fmt::format("setting access to {} bytes at {:#x}", bytes, va));
  }
  pg.add(h, first, pages);
  total_reserved_ += bytes;
  add_stats(stats_.reserved_bytes, stat_index(*seg.pool), bytes);
  ++stats_.num_device_alloc;
  trace(TraceAction::segment_map, va, bytes, seg.stream);
  return true;
}

std::size_t CachingAllocator::Impl::served_bytes(const AllocParams& p, const Block* b) const {
  // What alloc_found_block will hand out (the front of the block, or all of
  // it), of which the caller may touch what it asked for.
  const std::size_t handed = should_split(b, p.size) ? p.size : b->size;
  return p.requested != 0 ? std::min(p.requested, handed) : handed;
}

bool CachingAllocator::Impl::back_block(AllocParams& p) {
  const Block* b = p.block;
  Segment& seg = *b->segment;
  VmState& pg = *seg.paged;
  const std::size_t bytes = served_bytes(p, b);
  const std::size_t first = (b->ptr - seg.base) / pg.page;
  const std::size_t end = (b->ptr - seg.base + bytes + pg.page - 1) / pg.page;
  if (pg.mapped_pages == 0) {
    if (plentiful(seg.size) && map_paged_run(seg, 0, pg.pages)) {
      // A new segment, memory to spare: all of it at once (one handle, three
      // calls, where mapping it block by block takes three a block).
      return true;
    }
  } else {
    // Pages the block would hold beyond its own: those of larger handles it
    // sits in (mapped for a larger block before, or with the whole segment).
    std::size_t missing = 0;  // pages
    std::size_t beyond = 0;   // bytes
    for (std::size_t i = first; i < end;) {
      const std::uint32_t slot = pg.at(i);
      if (slot == VmState::kNone) {
        ++missing;
        ++i;
        continue;
      }
      const VmState::Handle& h = pg.handles[slot];
      const std::size_t h_end = h.first_page + h.pages;
      beyond += (h.pages - (std::min(h_end, end) - std::max(h.first_page, first))) * pg.page;
      i = h_end;
    }
    if (missing == 0 && beyond == 0) [[likely]]
      return true;
    // Unless memory is plentiful, such handles (free but for this block) go
    // back and the block gets pages of its own, so that what is mapped stays
    // close to what is in use: served as it is, the block would hold all of
    // them while it lives, and no shortage could get the rest back.
    if (!plentiful(beyond)) shed_handles(seg, first, end);
  }
  for (std::size_t i = first; i < end;) {
    if (pg.at(i) != VmState::kNone) {
      ++i;
      continue;
    }
    // Pages past the highest mapped one are all unmapped: no need to look.
    std::size_t run = 1;
    while (i + run < end && i + run < pg.page_handle.size() && pg.at(i + run) == VmState::kNone) {
      ++run;
    }
    if (i + run >= pg.page_handle.size()) run = end - i;
    // A long run's end pages that the block covers only in part get handles
    // of their own: a neighbour that comes to live on one then keeps that
    // page alone mapped once this block is freed, not the whole run.
    std::size_t head = 0;
    std::size_t tail = 0;
    if (run >= kEdgeSplitRun) {
      head = i == first && (b->ptr - seg.base) % pg.page != 0 ? 1 : 0;
      tail = i + run == end && (b->ptr - seg.base + bytes) % pg.page != 0 ? 1 : 0;
    }
    const std::size_t pieces[3][2] = {{i, head}, {i + head, run - head - tail}, {i + run - tail, tail}};
    for (const auto& [at, pages] : pieces) {
      if (pages == 0) continue;
      // Short of memory: free pages elsewhere (not this block's) go back first.
      if (!map_paged_run(seg, at, pages) &&
          (release_free_pages(pages * pg.page, b->ptr, b->ptr + bytes) == 0 ||
           !map_paged_run(seg, at, pages))) {
        return false;  // the pages mapped so far stay, cached under the block
      }
    }
    i += run;
  }
  return true;
}

bool CachingAllocator::Impl::rescue_paged(AllocParams& p) {
  // Every free block of the request's pool and, for the default pools, of
  // the other default pool, on every stream, that could serve it under the
  // native policy's limits on oversize blocks; the one with the fewest pages
  // still to map wins (the request's stream, then its own pool, on ties).
  const std::size_t max_split = config_.max_split_size;
  Block* best = nullptr;
  std::size_t best_missing = std::numeric_limits<std::size_t>::max();
  auto consider = [&](Block* b) RESERVOIR_REQUIRES(mutex_) {
    if (!b->segment->paged || b->size < p.size) return;
    if (p.size < max_split && b->size >= max_split) return;
    if (p.size >= max_split && b->size >= p.size + config_.max_non_split_rounding_size) return;
    if (in_stitched(b)) return;
    const VmState& pg = *b->segment->paged;
    const std::size_t offset = b->ptr - b->segment->base;
    const std::size_t first = offset / pg.page;
    const std::size_t end = (offset + served_bytes(p, b) + pg.page - 1) / pg.page;
    std::size_t missing = 0;
    for (std::size_t i = first; i < end && missing < best_missing; ++i) {
      missing += pg.at(i) == VmState::kNone ? 1 : 0;
    }
    const bool better = missing < best_missing ||
                        (missing == best_missing && best->stream != p.stream && b->stream == p.stream);
    if (better) {
      best_missing = missing;
      best = b;
    }
  };
  BlockPool* const other = p.pool == &small_ ? &large_ : p.pool == &large_ ? &small_ : nullptr;
  for (BlockPool* pool : {p.pool, other}) {
    if (pool == nullptr) continue;
    for (Block* b : pool->blocks) consider(b);
  }
  if (best == nullptr) return false;
  AllocParams q{p.size, p.alloc_size, best->stream, best->pool};
  q.requested = p.requested;
  q.block = best;
  q.block_in_pool = true;
  // Another stream's free block may still be read by work queued there.
  if (best->stream != p.stream) synchronize_segment_stream(*best->segment, "lending a free block of", best->ptr);
  if (!back_block(q)) return false;
  p = q;
  return true;
}

void CachingAllocator::Impl::shed_handles(Segment& seg, std::size_t first, std::size_t end) {
  VmState& pg = *seg.paged;
  PageRuns busy;  // the block served is still free: not among them
  pages_in_use(seg, 0, 0, busy);
  std::vector<std::uint32_t> shed;
  for (std::size_t i = first; i < end;) {
    const std::uint32_t slot = pg.at(i);
    if (slot == VmState::kNone) {
      ++i;
      continue;
    }
    const VmState::Handle& h = pg.handles[slot];
    i = h.first_page + h.pages;
    if (h.first_page >= first && h.first_page + h.pages <= end) continue;  // the block's own
    if (!any_in_use(h, busy)) shed.push_back(slot);  // only a handle under free blocks alone
  }
  if (shed.empty()) return;
  synchronize_segment_stream(seg, "unmapping free pages of", seg.base);
  for (std::uint32_t slot : shed) release_paged_handle(seg, slot);
}

std::size_t CachingAllocator::Impl::total_capacity() {
  if (total_capacity_ == 0) {
    MemoryInfo info;
    if (device_.memory_info(&info) == Status::ok) total_capacity_ = info.total;
  }
  return total_capacity_;
}

void CachingAllocator::Impl::pages_in_use(const Segment& seg, DevicePtr keep_from,
                                          DevicePtr keep_to, PageRuns& busy) {
  const VmState& pg = *seg.paged;
  busy.clear();
  auto mark = [&](DevicePtr from, DevicePtr to) {
    if (to <= seg.base || from >= seg.base + pg.pages * pg.page) return;
    from = std::max(from, seg.base);
    const std::size_t first = (from - seg.base) / pg.page;
    const std::size_t last = std::min<std::size_t>((to - seg.base + pg.page - 1) / pg.page, pg.pages);
    if (first < last) busy.emplace_back(first, last);
  };
  for (const Block* b = seg.head; b != nullptr; b = b->next) {  // in address order
    if (!b->is_free()) mark(b->ptr, b->ptr + b->touched_bytes());
  }
  mark(keep_from, keep_to);
  std::sort(busy.begin(), busy.end());
  // Runs that overlap or touch (blocks sharing a page) become one.
  std::size_t out = 0;
  for (std::size_t i = 0; i < busy.size(); ++i) {
    if (out > 0 && busy[i].first <= busy[out - 1].second) {
      busy[out - 1].second = std::max(busy[out - 1].second, busy[i].second);
    } else {
      busy[out++] = busy[i];
    }
  }
  busy.resize(out);
}

void CachingAllocator::Impl::synchronize_segment_stream(const Segment& seg,
                                                        std::string_view doing, DevicePtr at) {
  const Status sync = device_.synchronize_stream(seg.stream);
  if (sync != Status::ok) [[unlikely]] {
    throw DeviceError(CallKind::synchronize_stream, sync,
                      fmt::format("synchronizing stream {} before {} {:#x}", seg.stream, doing, at));
  }
}

std::size_t CachingAllocator::Impl::release_free_pages(std::size_t bytes, DevicePtr keep_from,
                                                       DevicePtr keep_to) {
  std::size_t released = 0;
  PageRuns busy;
  std::vector<std::uint32_t> victims;
  for (auto& [base, seg] : segments_) {
    if (!seg->paged || seg->paged->mapped_pages == 0) continue;
    VmState& pg = *seg->paged;
    pages_in_use(*seg, keep_from, keep_to, busy);
    victims.clear();
    for (std::uint32_t slot = 0; slot < pg.handles.size(); ++slot) {
      if (pg.handles[slot].live && !any_in_use(pg.handles[slot], busy)) victims.push_back(slot);
    }
    if (victims.empty()) continue;
    // Work still queued on the segment's stream may use its free pages.
    synchronize_segment_stream(*seg, "unmapping free pages of", base);
    for (std::uint32_t slot : victims) {
      const std::size_t size = pg.handles[slot].pages * pg.page;
      release_paged_handle(*seg, slot);
      released += size;
      if (released >= bytes) return released;
    }
  }
  return released;
}

void CachingAllocator::Impl::release_paged_handle(Segment& seg, std::uint32_t slot) {
  VmState& pg = *seg.paged;
  const VmState::Handle h = pg.handles[slot];
  const DevicePtr va = seg.base + h.first_page * pg.page;
  const std::size_t bytes = h.pages * pg.page;
  const Status st = device_.unmap(va, bytes);
  if (st != Status::ok) {
    throw DeviceError(CallKind::unmap, st, fmt::format("unmapping {} bytes at {:#x}", bytes, va));
  }
  // Unmapped, the pages are gone from the segment whatever the release says:
  // a handle that will not go now is released again later.
  if (device_.release_physical(h.handle) != Status::ok) {
    keep_unreleased(h.handle, bytes, stat_index(*seg.pool));
  }
  pg.remove(slot);
  total_reserved_ -= bytes;
  sub_stats(stats_.reserved_bytes, stat_index(*seg.pool), bytes);
  ++stats_.num_device_free;
  trace(TraceAction::segment_unmap, va, bytes, seg.stream);
}

void CachingAllocator::Impl::release_paged_segment(Block* block, bool in_pool) {
  Segment& seg = *block->segment;
  VmState& pg = *seg.paged;
  if (pg.mapped_pages != 0) {
    // As cudaFree, which waits for the device: the segment's own stream here.
    synchronize_segment_stream(seg, "releasing the segment at", seg.base);
    for (std::uint32_t slot = 0; slot < pg.handles.size(); ++slot) {
      if (pg.handles[slot].live) release_paged_handle(seg, slot);
    }
  }
  const std::size_t space = pg.pages * pg.page;
  if (pg.in_arena) {
    const bool given = address_arena_.give(seg.base, space);
    RESERVOIR_DEBUG_ASSERT(given);
    (void)given;
  } else {
    unreserve_or_retry(seg.base, space);
  }
  BlockPool& pool = *block->pool;
  sub_stats(stats_.segment, stat_index(pool), 1);
  if (seg.size >= config_.max_split_size) sub_stat(stats_.oversize_segments, 1);
  if (in_pool) pool.erase(block);
  const DevicePtr base = seg.base;
  arena_.recycle(block);
  segments_.erase(base);
}

void CachingAllocator::Impl::drop_paged_segment_locked(Segment& seg) noexcept {
  VmState& pg = *seg.paged;
  for (VmState::Handle& h : pg.handles) {
    if (!h.live) continue;
    (void)device_.unmap(seg.base + h.first_page * pg.page, h.pages * pg.page);
    (void)device_.release_physical(h.handle);
    h.live = false;
  }
  if (!pg.in_arena) (void)device_.unreserve(seg.base, pg.pages * pg.page);
}

}  // namespace reservoir
