// One typed suite every Device backend passes. The CUDA backends run it here
// on a fake CUDA (tests/unit/fake_cuda.hpp), and on a GPU in the gpu suite;
// TagDevice (a tag's view of a device, src/saver/) on HostDevice.
#include <gtest/gtest.h>

#include <memory>
#include <type_traits>

#include "reservoir/host_device.hpp"
#include "reservoir/sim_device.hpp"
#include "tag_device.hpp"
#if RESERVOIR_WITH_CUDA
#include "reservoir/cuda_device.hpp"
#include "unit/fake_cuda.hpp"
#endif

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

template <typename D>
std::shared_ptr<Device> make_device(std::size_t capacity);
template <>
std::shared_ptr<Device> make_device<SimDevice>(std::size_t capacity) {
  SimDeviceOptions o;
  o.capacity = capacity;
  o.auto_complete_events = true;
  return std::make_unique<SimDevice>(o);
}
template <>
std::shared_ptr<Device> make_device<HostDevice>(std::size_t capacity) {
  HostDeviceOptions o;
  o.capacity = capacity;
  return std::make_unique<HostDevice>(o);
}

// A tag's view of host memory, with the device and the index it lives on.
struct TagOnHost {
  explicit TagOnHost(std::size_t capacity) : host(HostDeviceOptions{capacity, 2 * kMiB}) {}
  HostDevice host;
  detail::RangeIndex index;
  detail::TagDevice tag{host, index, this};
};
template <>
std::shared_ptr<Device> make_device<detail::TagDevice>(std::size_t capacity) {
  auto holder = std::make_shared<TagOnHost>(capacity);
  return std::shared_ptr<Device>(holder, &holder->tag);
}

#if RESERVOIR_WITH_CUDA
struct FakeCudaRuntime {};
struct FakeCudaVmm {};
template <>
std::shared_ptr<Device> make_device<FakeCudaRuntime>(std::size_t capacity) {
  testing::FakeCuda::get().reset(capacity);
  static const CudaRuntimeApi kApi = testing::FakeCuda::runtime();
  return std::make_unique<CudaRuntimeDevice>(kApi, 0);
}
template <>
std::shared_ptr<Device> make_device<FakeCudaVmm>(std::size_t capacity) {
  testing::FakeCuda::get().reset(capacity);
  static const CudaDriverApi kApi = testing::FakeCuda::driver();
  return std::make_unique<CudaVmmDevice>(kApi, CudaVmmOptions{});
}
#endif

// Bytes of device memory a segment of `bytes` takes: its size, except on
// TagDevice, whose segments are physical handles of whole granules.
template <typename D>
std::size_t segment_footprint(std::size_t bytes) {
  if constexpr (std::is_same_v<D, detail::TagDevice>) {
    return (bytes + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
  }
  return bytes;
}

template <typename D>
class DeviceConformance : public ::testing::Test {
 protected:
  std::shared_ptr<Device> device_ = make_device<D>(64 * kMiB);
};
TYPED_TEST_SUITE_P(DeviceConformance);

TYPED_TEST_P(DeviceConformance, SegmentsAreAlignedDisjointAndCounted) {
  Device& d = *this->device_;
  DevicePtr a = 0, b = 0;
  ASSERT_EQ(d.allocate_segment(3 * kMiB, &a), Status::ok);
  ASSERT_EQ(d.allocate_segment(kMiB, &b), Status::ok);
  EXPECT_EQ(a % 512, 0u);
  EXPECT_EQ(b % 512, 0u);
  EXPECT_TRUE(b >= a + 3 * kMiB || a >= b + kMiB);
  MemoryInfo info;
  ASSERT_EQ(d.memory_info(&info), Status::ok);
  EXPECT_EQ(info.total, 64 * kMiB);
  EXPECT_EQ(info.free, 64 * kMiB - segment_footprint<TypeParam>(3 * kMiB) -
                           segment_footprint<TypeParam>(kMiB));  // 60 MiB; 58 on TagDevice
  EXPECT_EQ(d.free_segment(a), Status::ok);
  EXPECT_EQ(d.free_segment(a), Status::invalid_argument);  // double free
  EXPECT_EQ(d.free_segment(b), Status::ok);
  ASSERT_EQ(d.memory_info(&info), Status::ok);
  EXPECT_EQ(info.free, 64 * kMiB);
}

TYPED_TEST_P(DeviceConformance, OutOfMemoryAndBadArguments) {
  Device& d = *this->device_;
  DevicePtr a = 0;
  EXPECT_EQ(d.allocate_segment(65 * kMiB, &a), Status::out_of_memory);
  EXPECT_EQ(d.allocate_segment(0, &a), Status::invalid_argument);
  EXPECT_EQ(d.free_segment(0x1234), Status::invalid_argument);
  PhysicalHandle h = 0;
  if (!d.supports_virtual_memory()) {
    EXPECT_EQ(d.create_physical(2 * kMiB, &h), Status::not_supported);
    return;
  }
  EXPECT_EQ(d.create_physical(d.granularity() + 1, &h), Status::invalid_argument);
  EXPECT_EQ(d.create_physical(66 * kMiB, &h), Status::out_of_memory);
}

TYPED_TEST_P(DeviceConformance, VirtualMemoryProtocol) {
  Device& d = *this->device_;
  if (!d.supports_virtual_memory()) {
    // A backend without virtual memory says so for every operation.
    DevicePtr va = 0;
    PhysicalHandle h = 0;
    EXPECT_EQ(d.granularity(), 0u);
    EXPECT_EQ(d.reserve(2 * kMiB, 0, &va), Status::not_supported);
    EXPECT_EQ(d.unreserve(0x200000, 2 * kMiB), Status::not_supported);
    EXPECT_EQ(d.create_physical(2 * kMiB, &h), Status::not_supported);
    EXPECT_EQ(d.release_physical(1), Status::not_supported);
    EXPECT_EQ(d.map(0x200000, 2 * kMiB, 1, 0), Status::not_supported);
    EXPECT_EQ(d.unmap(0x200000, 2 * kMiB), Status::not_supported);
    EXPECT_EQ(d.set_access(0x200000, 2 * kMiB), Status::not_supported);
    return;
  }
  const std::size_t g = d.granularity();
  DevicePtr va = 0;
  ASSERT_EQ(d.reserve(8 * g, 0, &va), Status::ok);
  EXPECT_EQ(va % g, 0u);
  PhysicalHandle h1 = 0, h2 = 0;
  ASSERT_EQ(d.create_physical(2 * g, &h1), Status::ok);
  ASSERT_EQ(d.create_physical(g, &h2), Status::ok);
  EXPECT_EQ(d.map(va + g / 2, g, h1, 0), Status::invalid_argument);      // misaligned
  EXPECT_EQ(d.map(va + 7 * g, 2 * g, h1, 0), Status::invalid_argument);  // past the reservation
  // A handle maps from its start, and no further than its end: CUDA answers
  // CUDA_ERROR_NOT_SUPPORTED (an H100, driver 580: cuMemMap(base, g, offset
  // g/2) and cuMemMap(base, 2g, handle of g) give 801, tests/data/gpu).
  EXPECT_EQ(d.map(va, g, h1, g / 2), Status::not_supported);
  EXPECT_EQ(d.map(va, g, h1, g), Status::not_supported);      // aligned, inside the handle
  EXPECT_EQ(d.map(va, g, h1, 2 * g), Status::not_supported);  // past the handle
  EXPECT_EQ(d.map(va, 2 * g, h2, 0), Status::not_supported);  // larger than the handle
  ASSERT_EQ(d.map(va, 2 * g, h1, 0), Status::ok);
  EXPECT_EQ(d.map(va + g, g, h2, 0), Status::invalid_argument);  // overlaps a mapping
  ASSERT_EQ(d.map(va + 2 * g, g, h2, 0), Status::ok);
  ASSERT_EQ(d.set_access(va, 3 * g), Status::ok);
  EXPECT_EQ(d.set_access(va, 4 * g), Status::invalid_argument);  // the fourth page is unmapped
  MemoryInfo info;
  ASSERT_EQ(d.memory_info(&info), Status::ok);
  EXPECT_EQ(info.free, 64 * kMiB - 3 * g);
  // Release while mapped: memory stays until the mapping goes (cuMemRelease semantics).
  ASSERT_EQ(d.release_physical(h2), Status::ok);
  EXPECT_EQ(d.release_physical(h2), Status::invalid_argument);
  ASSERT_EQ(d.memory_info(&info), Status::ok);
  EXPECT_EQ(info.free, 64 * kMiB - 3 * g);
  EXPECT_EQ(d.unmap(va, g), Status::invalid_argument);          // part of a mapping
  EXPECT_EQ(d.unreserve(va, 8 * g), Status::invalid_argument);  // still mapped
  ASSERT_EQ(d.unmap(va, 3 * g), Status::ok);
  ASSERT_EQ(d.memory_info(&info), Status::ok);
  EXPECT_EQ(info.free, 64 * kMiB - 2 * g);  // h1 is not released yet
  ASSERT_EQ(d.release_physical(h1), Status::ok);
  ASSERT_EQ(d.memory_info(&info), Status::ok);
  EXPECT_EQ(info.free, 64 * kMiB);
  EXPECT_EQ(d.unreserve(va, 4 * g), Status::invalid_argument);  // not the whole reservation
  EXPECT_EQ(d.unreserve(va, 8 * g), Status::ok);
}

TYPED_TEST_P(DeviceConformance, EventsCompleteAndSynchronize) {
  Device& d = *this->device_;
  EventId e = 0;
  ASSERT_EQ(d.create_event(&e), Status::ok);
  ASSERT_EQ(d.record_event(e, 3), Status::ok);
  EXPECT_EQ(d.synchronize_event(e), Status::ok);
  EXPECT_EQ(d.query_event(e), Status::ok);
  EXPECT_EQ(d.synchronize_stream(3), Status::ok);
  EXPECT_EQ(d.synchronize_device(), Status::ok);
  EXPECT_EQ(d.destroy_event(e), Status::ok);
  EXPECT_EQ(d.query_event(e), Status::invalid_argument);
  EXPECT_EQ(d.record_event(e, 0), Status::invalid_argument);
}

TYPED_TEST_P(DeviceConformance, CopiesValidateArguments) {
  Device& d = *this->device_;
  DevicePtr a = 0;
  ASSERT_EQ(d.allocate_segment(kMiB, &a), Status::ok);
  std::vector<char> host(4096, 'x');
  EXPECT_EQ(d.copy_to_device(a, host.data(), host.size(), 0), Status::ok);
  EXPECT_EQ(d.copy_to_host(host.data(), a, host.size(), 0), Status::ok);
  EXPECT_EQ(d.copy_to_host(nullptr, a, 16, 0), Status::invalid_argument);
  EXPECT_EQ(d.copy_to_device(a, nullptr, 16, 0), Status::invalid_argument);
  EXPECT_EQ(d.free_segment(a), Status::ok);
}

REGISTER_TYPED_TEST_SUITE_P(DeviceConformance, SegmentsAreAlignedDisjointAndCounted,
                            OutOfMemoryAndBadArguments, VirtualMemoryProtocol,
                            EventsCompleteAndSynchronize, CopiesValidateArguments);
#if RESERVOIR_WITH_CUDA
using Backends =
    ::testing::Types<SimDevice, HostDevice, detail::TagDevice, FakeCudaRuntime, FakeCudaVmm>;
#else
using Backends = ::testing::Types<SimDevice, HostDevice, detail::TagDevice>;
#endif
INSTANTIATE_TYPED_TEST_SUITE_P(All, DeviceConformance, Backends);

// SimDevice-only controls.
TEST(SimDevice, FaultInjectionCountersAndLatency) {
  SimDeviceOptions o;
  o.latency = LatencyModel::zero();
  o.latency.ns_per_call[static_cast<std::size_t>(CallKind::allocate_segment)] = 100;
  o.latency.ns_per_mib[static_cast<std::size_t>(CallKind::allocate_segment)] = 10;
  SimDevice d(o);
  d.fail_nth(CallKind::allocate_segment, 2);
  DevicePtr a = 0;
  EXPECT_EQ(d.allocate_segment(kMiB, &a), Status::ok);
  EXPECT_EQ(d.allocate_segment(kMiB, &a), Status::out_of_memory);
  EXPECT_EQ(d.allocate_segment(kMiB, &a), Status::ok);
  EXPECT_EQ(d.calls(CallKind::allocate_segment), 3u);
  EXPECT_EQ(d.failures(CallKind::allocate_segment), 1u);
  EXPECT_DOUBLE_EQ(d.estimated_ns(), 3 * 110.0);
  d.fail_fraction(CallKind::free_segment, 0.5, 42);
  int failed = 0;
  for (int i = 0; i < 1000; ++i) failed += d.free_segment(0x1) == Status::device_error;
  EXPECT_GT(failed, 430);
  EXPECT_LT(failed, 570);
  SimDevice again(o);
  again.fail_fraction(CallKind::free_segment, 0.5, 42);
  int failed_again = 0;
  for (int i = 0; i < 1000; ++i) failed_again += again.free_segment(0x1) == Status::device_error;
  EXPECT_EQ(failed, failed_again);  // seeded: repeatable
}

TEST(SimDevice, EventsWaitForTheCaller) {
  SimDevice d;
  EventId e = 0;
  ASSERT_EQ(d.create_event(&e), Status::ok);
  ASSERT_EQ(d.record_event(e, 4), Status::ok);
  EXPECT_EQ(d.query_event(e), Status::not_ready);
  d.complete_stream(3);
  EXPECT_EQ(d.query_event(e), Status::not_ready);
  d.complete_event(e);
  EXPECT_EQ(d.query_event(e), Status::ok);
}

TEST(SimDevice, AddressesComeFromTheSourceWhenSet) {
  SimDevice d;
  d.set_address_source([](std::size_t bytes, DevicePtr* addr) {
    *addr = 0x100000 + bytes;
    return Status::ok;
  });
  DevicePtr a = 0;
  ASSERT_EQ(d.allocate_segment(4096, &a), Status::ok);
  EXPECT_EQ(a, 0x100000u + 4096);
  EXPECT_EQ(d.allocate_segment(4096, &a), Status::invalid_argument);  // would overlap
}

TEST(SimDevice, ReusingFreedAddressesGivesTheLowestRangeThatFits) {
  SimDeviceOptions o;
  o.reuse_freed_addresses = true;
  SimDevice d(o);
  DevicePtr a = 0;
  DevicePtr b = 0;
  DevicePtr c = 0;
  DevicePtr e = 0;
  ASSERT_EQ(d.allocate_segment(20 * kMiB, &a), Status::ok);
  ASSERT_EQ(d.allocate_segment(4 * kMiB, &b), Status::ok);
  ASSERT_EQ(d.allocate_segment(20 * kMiB, &c), Status::ok);
  EXPECT_EQ(a, o.base_address);
  EXPECT_EQ(b, a + 20 * kMiB);
  EXPECT_EQ(c, b + 4 * kMiB);
  ASSERT_EQ(d.free_segment(b), Status::ok);
  ASSERT_EQ(d.free_segment(a), Status::ok);  // merges with b's range: 24 MiB free at a
  ASSERT_EQ(d.allocate_segment(22 * kMiB, &e), Status::ok);
  EXPECT_EQ(e, a);  // below c, which a device always allocating upwards would not give
  DevicePtr f = 0;
  ASSERT_EQ(d.allocate_segment(4 * kMiB, &f), Status::ok);  // 2 MiB left at a + 22: too small
  EXPECT_EQ(f, c + 20 * kMiB);
  DevicePtr g = 0;
  ASSERT_EQ(d.allocate_segment(2 * kMiB, &g), Status::ok);
  EXPECT_EQ(g, a + 22 * kMiB);
  // Without the option, the freed range stays unused.
  SimDevice plain;
  ASSERT_EQ(plain.allocate_segment(20 * kMiB, &a), Status::ok);
  ASSERT_EQ(plain.free_segment(a), Status::ok);
  ASSERT_EQ(plain.allocate_segment(20 * kMiB, &b), Status::ok);
  EXPECT_EQ(b, a + 20 * kMiB);
}

}  // namespace
}  // namespace reservoir
