// reservoir's paging policy: pages of the device's granularity in one pool
// per stream (small requests share pages with large ones); the pages mapped
// together for one request share one physical handle (one create, one map,
// one set_access), released only when all its pages are free; a request
// grows the free range that needs the fewest new pages, mapping ahead while
// memory is plentiful. Cached pages stay mapped, so a loop that reuses its
// memory makes no device calls. Under pressure, free handles move to where
// they are needed, and scattered free pages are stitched into a new range.
// With paging_release_threshold_mb, free handles beyond that much cached
// memory go back after each free.
#include <algorithm>

#include "allocator_impl.hpp"
#include "reservoir/errors.hpp"
#include "segment_source.hpp"

namespace reservoir::detail {

namespace {

class PagingSegments final : public VmSegments {
 public:
  using VmSegments::VmSegments;
  Policy policy() const noexcept override { return Policy::paging; }
  SourceTraits traits(const AllocatorConfig& config) const noexcept override {
    SourceTraits t;
    t.small_pool = false;
    t.virtual_memory = true;
    t.checks_fraction = true;
    t.after_free = config.paging_release_threshold != kNoReleaseThreshold;
    return t;
  }
  bool obtain(AllocParams& p) override RESERVOIR_REQUIRES(core_.source_lock());
  void after_free() noexcept override RESERVOIR_REQUIRES(core_.source_lock());
  std::size_t page_size(const BlockPool& /*pool*/, std::size_t granularity,
                        const AllocatorConfig& /*config*/) const noexcept override {
    return granularity;
  }
  bool shares_handles() const noexcept override { return true; }
  bool lowest_fit() const noexcept override { return false; }
  std::size_t map_bytes(const Block* to_map, std::size_t bytes, std::size_t request) override
      RESERVOIR_REQUIRES(core_.source_lock());

 private:
  static constexpr std::size_t kMapAheadDivisor = 16;
  static constexpr std::size_t kMapAheadMin = std::size_t{20} << 20;
  static constexpr std::size_t kMapAheadMax = std::size_t{160} << 20;
  static constexpr std::size_t kLargeRequest = std::size_t{128} << 20;
  // Cached bytes at the last look that found no whole handle to release.
  std::size_t release_floor_ = 0;
};

bool PagingSegments::obtain(AllocParams& p) {
  if (core_.try_alloc_vm_block(p)) return true;
  // Under pressure: map whole free handles from elsewhere (any stream's,
  // once it has synchronized) where the arena grows; then give back just
  // enough of them (largest first) and try once more; the retry ladder
  // follows if not.
  if (core_.try_alloc_vm_block(p, /*recycling=*/true)) return true;
  Block* candidate = core_.find_vm_candidate(p);
  if (candidate == nullptr) return false;
  // Ask for the whole unmapped blocks the request reaches into.
  std::size_t need = 0;
  for (const Block* b = candidate; b != nullptr && need < p.size; b = b->next) {
    if (!b->mapped) need += b->size;
    if (b->ptr + b->size >= candidate->ptr + p.size) break;
  }
  if (core_.release_free_handles(need, candidate) && core_.try_alloc_vm_block(p)) return true;
  // Still no contiguous run: stitch scattered free pages into a new range.
  return core_.stitch_block(p);
}

std::size_t PagingSegments::map_bytes(const Block* to_map, std::size_t bytes,
                                      std::size_t request) {
  // Paging maps ahead of the request while memory is plentiful, so that a
  // growing workload makes few mappings (each is three driver calls: create,
  // map, set access). The chunk follows what the stream's arena has shown it
  // needs: a sixteenth of what it maps already, from 20 MiB (the segment
  // PyTorch gives a mid-sized request) up to 160 MiB, so that what is left
  // unused when the workload peaks stays within what the native policy loses
  // to fragmentation; a request of 128 MiB or more brings room for half
  // another like it, as large tensors come in groups. Near the limit it maps
  // only what is asked. PyTorch's expandable segments never map ahead.
  const VmState& vm = *to_map->segment->vm;
  std::size_t wanted =
      std::clamp(vm.mapped_pages * vm.page / kMapAheadDivisor, kMapAheadMin, kMapAheadMax);
  if (request >= kLargeRequest) wanted = std::max(wanted, request + request / 2);
  if (bytes >= wanted) return bytes;
  const std::size_t headroom = core_.mapping_headroom();
  if (headroom <= bytes) return bytes;
  const std::size_t extra = std::min(wanted - bytes, (headroom - bytes) / 8);
  return std::min(to_map->size, bytes + extra);
}

void PagingSegments::after_free() noexcept {
  const std::size_t threshold = core_.current_config().paging_release_threshold;
  const std::size_t cached = core_.cached_bytes();
  if (cached <= threshold) {
    release_floor_ = 0;
    return;
  }
  // Cached memory in pieces of handles that still hold live blocks cannot
  // go: look again only once more has been freed since a fruitless look.
  if (cached <= release_floor_) return;
  bool released = false;
  try {
    released = core_.release_free_handles(cached - threshold, nullptr);
  } catch (const std::exception&) {
    // A handle that would not go stays cached (and counted); the next free,
    // empty_cache() or shortage tries again. The caller's free succeeded.
  }
  if (!released) release_floor_ = cached;
}

}  // namespace

std::unique_ptr<SegmentSource> make_paging_segments(CachingAllocator::Impl& core) {
  return std::make_unique<PagingSegments>(core);
}

}  // namespace reservoir::detail
