// The whole-structure validator: tests call it after every operation.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {

using detail::Block;
using detail::BlockPool;

namespace {

[[noreturn]] void breach(const std::string& what) {
  throw InvariantError("allocator invariant broken: " + what);
}

void expect_stat(const char* name, std::size_t type, std::int64_t have, std::int64_t recount) {
  static constexpr const char* kTypes[] = {"all", "small_pool", "large_pool"};
  if (have != recount) {
    breach(fmt::format("stat {}.{}.current is {} but a recount gives {}", name, kTypes[type], have,
                       recount));
  }
}

}  // namespace

std::size_t CachingAllocator::Impl::validate_page_table(const detail::Segment& seg,
                                                       const detail::VmState& pages,
                                                       std::string_view kind) const {
  // Handles: each live one covers its pages exactly.
  std::size_t with_handle = 0;
  for (std::size_t i = 0; i < pages.page_handle.size(); ++i) {
    const std::uint32_t slot = pages.at(i);
    if (slot == detail::VmState::kNone) continue;
    ++with_handle;
    if (slot >= pages.handles.size() || !pages.handles[slot].live ||
        i < pages.handles[slot].first_page ||
        i >= pages.handles[slot].first_page + pages.handles[slot].pages) {
      breach(fmt::format("{} {:#x}: page {} names a handle that does not cover it", kind, seg.base,
                         i));
    }
  }
  return with_handle;
}

void CachingAllocator::Impl::validate_paged_segment(const detail::Segment& seg) const {
  const detail::VmState& pg = *seg.paged;
  if (pg.page == 0 || seg.size > pg.pages * pg.page || pg.pages * pg.page >= seg.size + pg.page ||
      pg.page_handle.size() > pg.pages) {
    breach(fmt::format("paged segment {:#x}: {} pages of {} bytes do not hold its {} bytes",
                       seg.base, pg.pages, pg.page, seg.size));
  }
  const std::size_t with_handle = validate_page_table(seg, pg, "paged segment");
  if (with_handle != pg.mapped_pages) {
    breach(fmt::format("paged segment {:#x}: {} pages have a handle, {} counted", seg.base,
                       with_handle, pg.mapped_pages));
  }
  // Every block in use has memory behind all its caller asked for.
  for (const Block* b = seg.head; b != nullptr; b = b->next) {
    if (!b->allocated) continue;
    const std::size_t offset = b->ptr - seg.base;
    const std::size_t used = b->touched_bytes();
    for (std::size_t i = offset / pg.page; i < (offset + used + pg.page - 1) / pg.page; ++i) {
      if (pg.at(i) == detail::VmState::kNone) {
        breach(fmt::format("paged segment {:#x}: the allocated block at {:#x} has no memory at "
                           "page {}", seg.base, b->ptr, i));
      }
    }
  }
}

void CachingAllocator::Impl::validate_address_arena() const {
  // Free ranges and the segments carved from the arena, in address order:
  // inside it, apart from each other (free ranges merged), and together all
  // of it.
  std::vector<std::pair<DevicePtr, std::size_t>> spans;  // segments' (base, bytes)
  std::size_t in_segments = 0;
  for (const auto& [base, seg] : segments_) {
    if (!seg->paged || !seg->paged->in_arena) continue;
    const std::size_t span = seg->paged->pages * seg->paged->page;
    if (!address_arena_.contains(base) ||
        span > address_arena_.bytes() - (base - address_arena_.base())) {
      breach(fmt::format("paged segment {:#x} of {} bytes says it lies in the address arena "
                         "but does not", base, span));
    }
    spans.emplace_back(base, span);
    in_segments += span;
  }
  std::size_t free = 0;
  DevicePtr end = address_arena_.base();
  bool last_free = false;
  auto seg_it = spans.begin();
  auto next_segments_up_to = [&](DevicePtr at) {
    for (; seg_it != spans.end() && seg_it->first < at; ++seg_it) {
      if (seg_it->first < end) {
        breach(fmt::format("address arena: segment {:#x} overlaps what lies before it",
                           seg_it->first));
      }
      end = seg_it->first + seg_it->second;
      last_free = false;
    }
  };
  for (const auto& [at, bytes] : address_arena_.free_ranges()) {
    next_segments_up_to(at);
    if (at < end || (last_free && at == end) || bytes == 0 || !address_arena_.contains(at) ||
        bytes > address_arena_.bytes() - (at - address_arena_.base())) {
      breach(fmt::format("address arena: free range {:#x} of {} bytes is out of place", at, bytes));
    }
    free += bytes;
    end = at + bytes;
    last_free = true;
  }
  next_segments_up_to(std::numeric_limits<DevicePtr>::max());
  if (address_arena_.taken() != in_segments || free + in_segments != address_arena_.bytes()) {
    breach(fmt::format("address arena of {} bytes: {} free and {} in segments, {} counted taken",
                       address_arena_.bytes(), free, in_segments, address_arena_.taken()));
  }
}

void CachingAllocator::Impl::validate_vm_segment(const detail::Segment& seg) const {
  const detail::VmState& vm = *seg.vm;
  const std::size_t page = vm.page;
  if (page == 0 || seg.size != vm.pages * page || vm.page_handle.size() > vm.pages) {
    breach(fmt::format("VM segment {:#x}: {} pages of {} bytes do not make its {} bytes", seg.base,
                       vm.pages, page, seg.size));
  }
  (void)validate_page_table(seg, vm, "VM segment");
  for (std::size_t i = 0; i < vm.page_handle.size() && !vm.paging; ++i) {
    const std::uint32_t slot = vm.at(i);
    if (slot != detail::VmState::kNone && vm.handles[slot].pages != 1) {
      breach(fmt::format("expandable segment {:#x}: page {} has a multi-page handle", seg.base, i));
    }
  }
  for (const Block* b = seg.head; b != nullptr; b = b->next) {
    const std::size_t first = (b->ptr - seg.base) / page;
    const std::size_t end = (b->ptr - seg.base + b->size + page - 1) / page;
    if (!b->mapped) {
      if ((b->ptr - seg.base) % page != 0 || b->size % page != 0) {
        breach(
            fmt::format("unmapped block at {:#x} ({} bytes) is not page-aligned", b->ptr, b->size));
      }
      if (b->allocated || b->event_count != 0 || !b->stream_uses.empty()) {
        breach(fmt::format("unmapped block at {:#x} is in use", b->ptr));
      }
      if (b->next != nullptr && !b->next->mapped) {
        breach(fmt::format("unmapped blocks at {:#x} and {:#x} are neighbours but not merged",
                           b->ptr, b->next->ptr));
      }
      if (b->pool->unmapped.count(const_cast<Block*>(b)) != 1) {
        breach(fmt::format("unmapped block at {:#x} is missing from its pool", b->ptr));
      }
    }
    if (b->mapped && end > vm.page_handle.size()) {
      breach(fmt::format("block at {:#x} reaches past the last mapped page", b->ptr));
    }
    for (std::size_t i = first; i < std::min(end, vm.page_handle.size()); ++i) {
      if (b->mapped && vm.at(i) == detail::VmState::kNone) {
        breach(fmt::format("block at {:#x} covers page {} which has no memory", b->ptr, i));
      }
      if (!b->mapped && vm.at(i) != detail::VmState::kNone) {
        breach(fmt::format("unmapped block at {:#x} covers page {} which has memory", b->ptr, i));
      }
    }
  }
}

void CachingAllocator::Impl::validate() const {
  validations_.fetch_add(1, std::memory_order_relaxed);
  detail::LockGuard lock(mutex_);
  std::array<std::int64_t, kStatTypes> allocation{}, segment{}, active{}, inactive_split{},
      allocated_bytes{}, reserved_bytes{}, active_bytes{}, inactive_split_bytes{},
      requested_bytes{};
  std::int64_t oversize_allocations = 0;
  std::int64_t oversize_segments = 0;
  std::size_t free_blocks = 0;
  std::size_t allocated_blocks = 0;
  std::size_t reserved = 0;
  std::size_t unmapped_blocks = 0;
  std::size_t lent_listed = 0;
  std::size_t lent_found = 0;
  std::unordered_set<const BlockPool*> known_pools = {&large_, &small_};
  for (const auto& [id, pool] : private_pools_) {
    known_pools.insert(&pool->large);
    known_pools.insert(&pool->small);
  }
  std::unordered_map<const Block*, int> events_per_block;
  for (const auto& [stream, queue] : pending_events_) {
    for (const PendingEvent& e : queue) ++events_per_block[e.block];
  }
  // Capture markers belong to blocks waiting for their streams, each with some.
  for (const auto& [block, markers] : capture_markers_) {
    if (std::find(deferred_event_blocks_.begin(), deferred_event_blocks_.end(), block) ==
        deferred_event_blocks_.end()) {
      breach(fmt::format("block at {:#x} has capture markers but does not wait for its streams",
                         block->ptr));
    }
    if (markers.empty()) breach(fmt::format("block at {:#x} has an empty list of capture markers", block->ptr));
  }

  for (const auto& [base, seg] : segments_) {
    if (seg->base != base)
      breach(fmt::format("segment keyed {:#x} has base {:#x}", base, seg->base));
    if (known_pools.count(seg->pool) == 0)
      breach(fmt::format("segment {:#x} has an unknown pool", base));
    const Block* head = seg->head;
    if (head == nullptr || head->prev != nullptr || head->ptr != base) {
      breach(fmt::format("segment {:#x}: head block is missing or not at the base", base));
    }
    const std::size_t t = stat_index(*seg->pool);
    const detail::VmState* vm = seg->vm.get();
    if (const detail::VmState* pg = seg->paged.get()) {
      segment[0] += 1;
      segment[t] += 1;
      const auto mapped = static_cast<std::int64_t>(pg->mapped_pages * pg->page);
      reserved_bytes[0] += mapped;
      reserved_bytes[t] += mapped;
      reserved += pg->mapped_pages * pg->page;
      if (seg->size >= config_.max_split_size) ++oversize_segments;
      validate_paged_segment(*seg);
    } else if (vm == nullptr) {
      segment[0] += 1;
      segment[t] += 1;
      reserved_bytes[0] += static_cast<std::int64_t>(seg->size);
      reserved_bytes[t] += static_cast<std::int64_t>(seg->size);
      reserved += seg->size;
      if (seg->size >= config_.max_split_size) ++oversize_segments;
    } else if (vm->stitched) {
      std::size_t bytes = 0;
      for (const auto& pc : vm->pieces) {
        if (pc.va != seg->base + bytes) {
          breach(fmt::format("stitched segment {:#x}: pieces do not tile it", seg->base));
        }
        bytes += pc.bytes;
        if (pc.fresh) {
          reserved_bytes[0] += static_cast<std::int64_t>(pc.bytes);
          reserved_bytes[t] += static_cast<std::int64_t>(pc.bytes);
          reserved += pc.bytes;
        }
      }
      if (bytes != seg->size || head->next != nullptr || head->size != seg->size || !head->mapped) {
        breach(fmt::format("stitched segment {:#x} is not one mapped block over its pieces",
                           seg->base));
      }
      for (const Block* l : vm->lent) {
        if (!l->lent || !l->mapped) {
          breach(fmt::format("stitched segment {:#x} lists a block at {:#x} that is not lent",
                             seg->base, l->ptr));
        }
        ++lent_listed;
      }
    } else {
      validate_vm_segment(*seg);
      for (std::uint32_t h : vm->page_handle) {
        if (h == detail::VmState::kNone) continue;
        reserved_bytes[0] += static_cast<std::int64_t>(vm->page);
        reserved_bytes[t] += static_cast<std::int64_t>(vm->page);
        reserved += vm->page;
      }
    }
    const bool split = head->next != nullptr && vm == nullptr;
    std::size_t covered = 0;
    DevicePtr cursor = base;
    for (const Block* b = head; b != nullptr; b = b->next) {
      if (b->ptr != cursor) {
        breach(fmt::format("segment {:#x}: block at {:#x} should start at {:#x}", base, b->ptr,
                           cursor));
      }
      if (b->size == 0) breach(fmt::format("block at {:#x} has size 0", b->ptr));
      if (b->next != nullptr && b->next->prev != b) {
        breach(fmt::format("block at {:#x}: next->prev does not point back", b->ptr));
      }
      if (b->segment != seg.get() || b->pool != seg->pool || b->stream != seg->stream ||
          b->in_vm != (seg->vm != nullptr)) {
        breach(fmt::format("block at {:#x} disagrees with its segment {:#x}", b->ptr, base));
      }
      auto ev = events_per_block.find(b);
      const int queued = ev == events_per_block.end() ? 0 : ev->second;
      if (queued != b->event_count) {
        breach(fmt::format("block at {:#x}: event_count {} but {} events queued", b->ptr,
                           b->event_count, queued));
      }
      const bool in_pool = b->pool->blocks.count(const_cast<Block*>(b)) == 1 &&
                           *b->pool->blocks.find(const_cast<Block*>(b)) == b && *b->pool_pos == b;
      if (b->is_free() != in_pool) {
        breach(fmt::format("block at {:#x} ({}) is {}in its pool", b->ptr,
                           b->is_free() ? "free" : "in use", in_pool ? "" : "not "));
      }
      if (b->cached != in_pool) {
        breach(fmt::format("block at {:#x} is {}marked cached but is {}in its pool", b->ptr,
                           b->cached ? "" : "not ", in_pool ? "" : "not "));
      }
      if (b->lent) {
        ++lent_found;
        covered += b->size;
        cursor += b->size;
        continue;
      }
      if (!b->mapped) {
        ++unmapped_blocks;
        covered += b->size;
        cursor += b->size;
        continue;
      }
      if (b->is_free()) {
        ++free_blocks;
        if (b->next != nullptr && b->next->is_free()) {
          breach(fmt::format("free blocks at {:#x} and {:#x} are neighbours but not merged", b->ptr,
                             b->next->ptr));
        }
        if (split) {
          inactive_split[0] += 1;
          inactive_split[t] += 1;
          inactive_split_bytes[0] += static_cast<std::int64_t>(b->size);
          inactive_split_bytes[t] += static_cast<std::int64_t>(b->size);
        }
      } else {
        active[0] += 1;
        active[t] += 1;
        active_bytes[0] += static_cast<std::int64_t>(b->size);
        active_bytes[t] += static_cast<std::int64_t>(b->size);
        requested_bytes[0] += static_cast<std::int64_t>(b->requested_size);
        requested_bytes[t] += static_cast<std::int64_t>(b->requested_size);
      }
      if (b->allocated) {
        ++allocated_blocks;
        Block* const* mapped = allocated_.find(b->ptr);
        if (mapped == nullptr || *mapped != b) {
          breach(fmt::format("allocated block at {:#x} is missing from the pointer map", b->ptr));
        }
        allocation[0] += 1;
        allocation[t] += 1;
        allocated_bytes[0] += static_cast<std::int64_t>(b->size);
        allocated_bytes[t] += static_cast<std::int64_t>(b->size);
        if (b->size >= config_.max_split_size) ++oversize_allocations;
      }
      covered += b->size;
      cursor += b->size;
    }
    if (covered != seg->size) {
      breach(fmt::format("segment {:#x}: blocks cover {} of {} bytes", base, covered, seg->size));
    }
  }

  // Handles the device would not take back are still reserved memory.
  for (const Unreleased& u : unreleased_) {
    reserved_bytes[0] += static_cast<std::int64_t>(u.bytes);
    reserved_bytes[u.index] += static_cast<std::int64_t>(u.bytes);
    reserved += u.bytes;
  }
  std::size_t pooled = 0;
  std::size_t unmapped_pooled = 0;
  for (const BlockPool* pool : known_pools) {
    pooled += pool->blocks.size();
    unmapped_pooled += pool->unmapped.size();
  }
  validate_address_arena();
  if (lent_listed != lent_found) {
    breach(
        fmt::format("{} lent blocks found but stitched segments list {}", lent_found, lent_listed));
  }
  if (unmapped_pooled != unmapped_blocks) {
    breach(fmt::format("pools list {} unmapped blocks but segments have {}", unmapped_pooled,
                       unmapped_blocks));
  }
  if (pooled != free_blocks) {
    breach(
        fmt::format("pools hold {} blocks but segments have {} free blocks", pooled, free_blocks));
  }
  if (allocated_.size() != allocated_blocks) {
    breach(fmt::format("pointer map holds {} entries for {} allocated blocks", allocated_.size(),
                       allocated_blocks));
  }
  if (reserved != total_reserved_) {
    breach(fmt::format("reserved total is {} but segments sum to {}", total_reserved_, reserved));
  }
  // The "all" entries are kept as peaks alone (folded_stats adds them up).
  const DeviceStats folded = folded_stats();
  for (StatArray DeviceStats::*a : kPerPoolStats) {
    const Stat& all = (stats_.*a)[0];
    if (all.current != 0 || all.allocated != 0 || all.freed != 0) {
      breach("an \"all\" statistic holds a value of its own; it is the sum of small and large");
    }
    if ((stats_.*a)[1].allocated != 0 || (stats_.*a)[2].allocated != 0) {
      breach("a per-pool statistic holds a total of increases; it is worked out when read");
    }
    if (all.peak < (folded.*a)[0].current) {
      breach(fmt::format("an \"all\" peak of {} is below its current value {}", all.peak,
                         (folded.*a)[0].current));
    }
  }
  for (std::size_t t = 0; t < kStatTypes; ++t) {
    expect_stat("allocation", t, folded.allocation[t].current, allocation[t]);
    expect_stat("segment", t, folded.segment[t].current, segment[t]);
    expect_stat("active", t, folded.active[t].current, active[t]);
    expect_stat("inactive_split", t, folded.inactive_split[t].current, inactive_split[t]);
    expect_stat("allocated_bytes", t, folded.allocated_bytes[t].current, allocated_bytes[t]);
    expect_stat("reserved_bytes", t, folded.reserved_bytes[t].current, reserved_bytes[t]);
    expect_stat("active_bytes", t, folded.active_bytes[t].current, active_bytes[t]);
    expect_stat("inactive_split_bytes", t, folded.inactive_split_bytes[t].current,
                inactive_split_bytes[t]);
    expect_stat("requested_bytes", t, folded.requested_bytes[t].current, requested_bytes[t]);
  }
  if (!max_split_changed_) {
    if (stats_.oversize_allocations.current != oversize_allocations) {
      breach(fmt::format("oversize_allocations.current is {} but a recount gives {}",
                         stats_.oversize_allocations.current, oversize_allocations));
    }
    if (stats_.oversize_segments.current != oversize_segments) {
      breach(fmt::format("oversize_segments.current is {} but a recount gives {}",
                         stats_.oversize_segments.current, oversize_segments));
    }
  }
}

}  // namespace reservoir
