// The native policy's source: PyTorch's segments, one device allocation
// each, sized by the core's allocation_size (2 MiB for small requests,
// large_segment_size below 10 MiB, a multiple of 2 MiB beyond).
#include "allocator_impl.hpp"
#include "segment_source.hpp"

namespace reservoir::detail {

namespace {

class NativeSegments final : public SegmentSource {
 public:
  using SegmentSource::SegmentSource;
  Policy policy() const noexcept override { return Policy::native; }
  SourceTraits traits(const AllocatorConfig& /*config*/) const noexcept override { return {}; }
  bool obtain(AllocParams& p) override RESERVOIR_REQUIRES(core_.source_lock()) {
    return core_.new_segment(p);
  }
};

}  // namespace

std::unique_ptr<SegmentSource> make_native_segments(CachingAllocator::Impl& core) {
  return std::make_unique<NativeSegments>(core);
}

}  // namespace reservoir::detail
