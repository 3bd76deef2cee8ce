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
//
// The native bound (paging_slack_mb; off by default): a model of the native
// policy follows the program (native_shadow.hpp), and whenever paging would
// grow, what the native policy reserves at that point plus the slack per
// stream is the most paging may hold in its default pools. Mapping ahead
// stops at the bound; growth that would pass it takes whole free handles
// from elsewhere first; and after growing, free handles above it go back to
// the device. Without capacity pressure the native policy only grows (frees
// are cached), so holding the bound where paging grows holds it everywhere.
#include <algorithm>
#include <memory>

#include "allocator_impl.hpp"
#include "native_shadow.hpp"
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
    t.observes = config.paging_slack != kNoPagingBound;
    return t;
  }
  bool obtain(AllocParams& p) override RESERVOIR_REQUIRES(core_.source_lock());
  // obtain's growth, without the bound's bookkeeping.
  bool grow(AllocParams& p, bool near_bound) RESERVOIR_REQUIRES(core_.source_lock());
  void after_free() override RESERVOIR_REQUIRES(core_.source_lock());
  void configure(const AllocatorConfig& config) override {
    slack_ = config.paging_slack;
    if (slack_ == kNoPagingBound) {
      shadow_.reset();
    } else if (shadow_ == nullptr) {
      shadow_ = std::make_unique<NativeShadow>(config);
    } else {
      shadow_->configure(config);
    }
  }
  void observe(const TraceEvent& e, bool default_pool) override {
    if (shadow_ == nullptr) return;
    if (e.action == TraceAction::alloc) {
      if (default_pool) {
        shadow_->allocated(e.addr, e.size, e.stream);
      } else if (shadow_->in_request()) {
        shadow_->abandon_request();  // served by a private pool (use_on_oom) after all
      }
    } else if (e.action == TraceAction::free_requested) {
      shadow_->freed(e.addr);
    } else if (e.action == TraceAction::oom) {
      shadow_->abandon_request();
    }
  }
  void stream_used(DevicePtr ptr, StreamId stream) override {
    if (shadow_ != nullptr) shadow_->stream_used(ptr, stream);
  }
  void cache_emptied() override {
    if (shadow_ != nullptr) shadow_->cache_emptied();
  }
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
  // The native bound: the most the default pools may reserve after this
  // request (what the native policy would, plus the slack per stream).
  std::size_t bound() const {
    const std::size_t streams = std::max<std::size_t>(shadow_->streams(), 1);
    return shadow_->reserved() + slack_ * streams;
  }
  // Gives free handles above the bound back (all but the block just served).
  void hold_bound(const Block* keep) RESERVOIR_REQUIRES(core_.source_lock()) {
    const std::size_t reserved = core_.default_reserved();
    if (reserved > bound_) {
      (void)core_.release_free_handles(reserved - bound_, keep, /*keep_served=*/true);
    }
  }

  // Cached bytes at the last look that found no whole handle to release.
  std::size_t release_floor_ = 0;
  std::unique_ptr<NativeShadow> shadow_;  // with the native bound
  std::size_t slack_ = kNoPagingBound;
  std::size_t bound_ = kNoPagingBound;  // for the request being served
};

bool PagingSegments::obtain(AllocParams& p) {
  bool near_bound = false;
  if (shadow_ != nullptr) {
    // What the native policy holds once it has served this request too (as
    // the caller asked for it).
    shadow_->begin_request(p.requested, p.stream);
    bound_ = bound();
    near_bound = core_.default_reserved() + p.size > bound_;
  }
  if (!grow(p, near_bound)) return false;
  if (shadow_ != nullptr) hold_bound(p.block);
  return true;
}

bool PagingSegments::grow(AllocParams& p, bool near_bound) {
  // Growth that may pass the native bound moves whole free handles from
  // elsewhere first, as under pressure.
  if (near_bound && core_.try_alloc_vm_block(p, /*recycling=*/true)) return true;
  if (core_.try_alloc_vm_block(p)) return true;
  // Under pressure: map whole free handles from elsewhere (any stream's,
  // once it has synchronized) where the arena grows; then give back just
  // enough of them (largest first) and try once more; the retry ladder
  // follows if not.
  if (!near_bound && core_.try_alloc_vm_block(p, /*recycling=*/true)) return true;
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
  std::size_t extra = std::min(wanted - bytes, (headroom - bytes) / 8);
  if (shadow_ != nullptr) {
    // Never ahead past the native bound (whole pages below it: a slack that
    // is not a whole number of pages must not round up past it).
    const std::size_t after = core_.default_reserved() + bytes;
    const std::size_t room = bound_ > after ? bound_ - after : 0;
    extra = std::min(extra, room / vm.page * vm.page);
  }
  return std::min(to_map->size, bytes + extra);
}

void PagingSegments::after_free() {
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
  } catch (const DeviceError&) {
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
