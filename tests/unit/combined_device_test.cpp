// CombinedDevice: ordinary segments, events, streams and copies go to one
// device, virtual memory to the other; an allocator on it changes its kind
// of segments at run time, as PyTorch's own allocator does.
#include <gtest/gtest.h>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/combined_device.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir::testing {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Two simulated devices standing for one GPU's runtime and driver: one
// address space, so the second hands out addresses apart from the first's.
SimDeviceOptions apart() {
  SimDeviceOptions o;
  o.base_address = 0x7e0000000000;
  return o;
}

TEST(CombinedDevice, EachCallGoesToTheDeviceThatServesIt) {
  SimDevice segments;
  SimDevice vm(apart());
  CombinedDevice both(segments, vm);
  DevicePtr seg = 0;
  ASSERT_EQ(both.allocate_segment(20 * kMiB, &seg), Status::ok);
  EXPECT_EQ(segments.calls(CallKind::allocate_segment), 1u);
  EXPECT_EQ(vm.calls(CallKind::allocate_segment), 0u);
  DevicePtr va = 0;
  ASSERT_EQ(both.reserve(20 * kMiB, 0, &va), Status::ok);
  PhysicalHandle h = 0;
  ASSERT_EQ(both.create_physical(2 * kMiB, &h), Status::ok);
  ASSERT_EQ(both.map(va, 2 * kMiB, h, 0), Status::ok);
  ASSERT_EQ(both.set_access(va, 2 * kMiB), Status::ok);
  EXPECT_EQ(vm.calls(CallKind::reserve), 1u);
  EXPECT_EQ(vm.calls(CallKind::map), 1u);
  EXPECT_EQ(segments.calls(CallKind::reserve), 0u);
  EXPECT_EQ(segments.used_bytes(), 20 * kMiB);
  EXPECT_EQ(vm.used_bytes(), 2 * kMiB);
  EXPECT_EQ(both.granularity(), vm.granularity());
  EXPECT_TRUE(both.supports_virtual_memory());
  EXPECT_EQ(both.name(), segments.name());
  ASSERT_EQ(both.unmap(va, 2 * kMiB), Status::ok);
  ASSERT_EQ(both.release_physical(h), Status::ok);
  ASSERT_EQ(both.unreserve(va, 20 * kMiB), Status::ok);
  ASSERT_EQ(both.free_segment(seg), Status::ok);
  // A segment of one device is not the other's to free.
  EXPECT_EQ(both.free_segment(va), Status::invalid_argument);
  EXPECT_EQ(segments.used_bytes() + vm.used_bytes(), 0u);
}

TEST(CombinedDevice, AnAllocatorChangesItsKindOfSegmentsAtRunTime) {
  SimDevice segments;
  SimDevice vm(apart());
  CombinedDevice both(segments, vm);
  CachingAllocator a(both);
  void* ordinary = a.allocate(3 * kMiB);
  a.set_config(AllocatorConfig::parse("expandable_segments:True"));
  void* expandable = a.allocate(30 * kMiB);  // the ordinary segment's 17 MiB free do not fit
  EXPECT_EQ(segments.calls(CallKind::allocate_segment), 1u);
  EXPECT_EQ(vm.calls(CallKind::reserve), 1u);
  const Snapshot snap = a.snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  EXPECT_NE(snap.segments[0].is_expandable, snap.segments[1].is_expandable);
  a.deallocate(ordinary);
  a.deallocate(expandable);
  a.empty_cache();
  a.validate();
  EXPECT_EQ(segments.used_bytes() + vm.used_bytes(), 0u);
}

}  // namespace
}  // namespace reservoir::testing
