// The registered segment policies (segment_source.hpp): a policy is listed
// here once, by its factory.
#include <algorithm>
#include <array>

#include "segment_source.hpp"

namespace reservoir {
namespace detail {

std::unique_ptr<SegmentSource> make_native_segments(CachingAllocator::Impl& core);
std::unique_ptr<SegmentSource> make_expandable_segments(CachingAllocator::Impl& core);
std::unique_ptr<SegmentSource> make_paging_segments(CachingAllocator::Impl& core);
std::unique_ptr<SegmentSource> make_native_paged_segments(CachingAllocator::Impl& core);

namespace {

constexpr std::array kSources{
    SegmentSourceEntry{{Policy::native, "native",
                        "PyTorch's segments, one device allocation each (the default)", false, true},
                       &make_native_segments},
    SegmentSourceEntry{{Policy::expandable, "expandable",
                        "PyTorch's expandable segments (as expandable_segments:True)", true, false},
                       &make_expandable_segments},
    SegmentSourceEntry{{Policy::paging, "paging",
                        "reservoir's pages: mapped as needed, free handles given back whole",
                        true, false},
                       &make_paging_segments},
    SegmentSourceEntry{{Policy::native_paged, "native_paged",
                        "PyTorch's segments and decisions, mapped page by page as blocks use "
                        "them: never more than native reserves",
                        true, true},
                       &make_native_paged_segments},
};

constexpr std::array<PolicyInfo, kSources.size()> infos() {
  std::array<PolicyInfo, kSources.size()> out{};
  for (std::size_t i = 0; i < kSources.size(); ++i) out[i] = kSources[i].info;
  return out;
}
constexpr std::array kInfos = infos();

}  // namespace

std::span<const SegmentSourceEntry> segment_sources() noexcept { return kSources; }

const SegmentSourceEntry& segment_source(Policy policy) noexcept {
  const auto* it = std::find_if(kSources.begin(), kSources.end(), [policy](const auto& e) {
    return e.info.policy == policy;
  });
  return it != kSources.end() ? *it : kSources.front();
}

const SegmentSourceEntry* find_segment_source(std::string_view name) noexcept {
  const auto* it = std::find_if(kSources.begin(), kSources.end(),
                                [name](const auto& e) { return e.info.name == name; });
  return it != kSources.end() ? &*it : nullptr;
}

Policy configured_policy(const AllocatorConfig& config) noexcept {
  if (config.policy == Policy::native && config.expandable_segments) return Policy::expandable;
  return config.policy;
}

}  // namespace detail

std::span<const PolicyInfo> policies() noexcept { return detail::kInfos; }

std::string_view to_string(Policy policy) noexcept {
  return detail::segment_source(policy).info.name;
}

}  // namespace reservoir
