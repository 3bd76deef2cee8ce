// PyTorch's expandable segments: one address reservation per stream and
// pool (private pools' too, from PyTorch 2.5), pages of 2 MiB (small pool) or large_segment_size (large pool), one
// physical handle per page; a request grows the lowest-address free range
// it fits in, and pages are mapped only as far as it needs.
#include "allocator_impl.hpp"
#include "segment_source.hpp"

namespace reservoir::detail {

namespace {

class ExpandableSegments final : public VmSegments {
 public:
  using VmSegments::VmSegments;
  Policy policy() const noexcept override { return Policy::expandable; }
  SourceTraits traits(const AllocatorConfig& config) const noexcept override {
    SourceTraits t;
    t.virtual_memory = true;
    t.private_pools = config.private_pools_expandable();
    return t;
  }
  bool obtain(AllocParams& p) override RESERVOIR_REQUIRES(core_.source_lock()) {
    return core_.try_alloc_vm_block(p);
  }
  std::size_t page_size(const BlockPool& pool, std::size_t /*granularity*/,
                        const AllocatorConfig& config) const noexcept override {
    return pool.is_small ? kSmallBuffer : config.large_segment_size;
  }
  bool shares_handles() const noexcept override { return false; }
  bool lowest_fit() const noexcept override { return true; }
};

}  // namespace

std::unique_ptr<SegmentSource> make_expandable_segments(CachingAllocator::Impl& core) {
  return std::make_unique<ExpandableSegments>(core);
}

}  // namespace reservoir::detail
