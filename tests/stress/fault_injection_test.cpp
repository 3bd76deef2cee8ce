// Every device-call kind the allocator uses fails at every position of a
// workload in turn: the error surfaces as an exception with context, and the
// allocator stays consistent and leaks nothing.
#include <gtest/gtest.h>

#include <random>
#include <tuple>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

struct Outcome {
  int device_errors = 0;
  int ooms = 0;
};

// A workload that exercises every call kind: segments, frees under pressure,
// stream events, synchronization and empty_cache.
Outcome workload(SimDevice& device, CachingAllocator& allocator) {
  Outcome out;
  std::mt19937_64 rng(5);
  std::vector<void*> live;
  for (int step = 0; step < 400; ++step) {
    try {
      const unsigned r = rng() % 100;
      if (r < 45 || live.empty()) {
        const std::size_t size = rng() % 2 ? 1 + rng() % kMiB : kMiB + rng() % (60 * kMiB);
        live.push_back(allocator.allocate(size, rng() % 2));
      } else if (r < 85) {
        const std::size_t k = rng() % live.size();
        if (rng() % 3 == 0) allocator.record_stream(live[k], 7);
        allocator.deallocate(live[k]);  // throws before any change if the event fails
        live[k] = live.back();
        live.pop_back();
      } else if (r < 95) {
        device.complete_stream(7);
      } else {
        allocator.empty_cache();
      }
    } catch (const DeviceError&) {
      ++out.device_errors;
    } catch (const OutOfMemoryError&) {
      ++out.ooms;
    }
    allocator.validate();
  }
  for (void* p : live) {
    for (int attempt = 0;; ++attempt) {
      try {
        allocator.deallocate(p);
        break;
      } catch (const DeviceError&) {
        if (attempt >= 3) throw;
      }
    }
  }
  return out;
}

void check_no_leak(SimDevice& device, CachingAllocator& allocator) {
  device.clear_faults();
  device.complete_all_events();
  allocator.empty_cache();
  allocator.validate();
  EXPECT_EQ(device.live_segments(), 0u);
  EXPECT_EQ(device.used_bytes(), 0u);
}

class FaultAt : public ::testing::TestWithParam<CallKind> {};

TEST_P(FaultAt, EveryPositionLeavesTheAllocatorConsistent) {
  const CallKind kind = GetParam();
  // First count how often the workload makes this call.
  std::uint64_t total = 0;
  {
    SimDeviceOptions o;
    o.capacity = 400 * kMiB;
    SimDevice device(o);
    CachingAllocator allocator(device, AllocatorConfig{});
    (void)workload(device, allocator);
    total = device.calls(kind);
    check_no_leak(device, allocator);
  }
  ASSERT_GT(total, 0u) << "the workload never calls " << to_string(kind);
  const std::uint64_t stride = std::max<std::uint64_t>(1, total / 60);
  for (std::uint64_t n = 1; n <= total; n += stride) {
    SimDeviceOptions o;
    o.capacity = 400 * kMiB;
    SimDevice device(o);
    CachingAllocator allocator(device, AllocatorConfig{});
    device.fail_nth(kind, n, Status::device_error);
    const Outcome out = workload(device, allocator);
    EXPECT_EQ(device.failures(kind), 1u) << "n=" << n;
    EXPECT_GE(out.device_errors + out.ooms, 0);
    check_no_leak(device, allocator);
  }
}

INSTANTIATE_TEST_SUITE_P(DeviceCalls, FaultAt,
                         ::testing::Values(CallKind::allocate_segment, CallKind::free_segment,
                                           CallKind::create_event, CallKind::record_event,
                                           CallKind::query_event, CallKind::synchronize_event),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// The virtual-memory policies: every call kind they use fails at positions
// spread over the workload (tight capacity, so pages are released, handles
// returned and, under paging, free pages stitched).
class VmFaultAt : public ::testing::TestWithParam<std::tuple<const char*, CallKind>> {};

TEST_P(VmFaultAt, EveryPositionLeavesTheAllocatorConsistent) {
  // Plain copies: lambdas below use them (clang before 16 cannot capture a
  // structured binding).
  const std::string config_text = std::get<0>(GetParam());
  const CallKind kind = std::get<1>(GetParam());
  const AllocatorConfig config = AllocatorConfig::parse(config_text);
  auto run = [&](std::uint64_t fail_at) {
    SimDeviceOptions o;
    o.capacity = 300 * kMiB;
    SimDevice device(o);
    std::uint64_t calls = 0;
    {
      CachingAllocator allocator(device, config);
      if (fail_at > 0) device.fail_nth(kind, fail_at, Status::device_error);
      (void)workload(device, allocator);
      calls = device.calls(kind);  // made by the workload itself
      if (fail_at > 0) {
        EXPECT_EQ(device.failures(kind), 1u) << "n=" << fail_at;
      }
      check_no_leak(device, allocator);
      EXPECT_EQ(device.live_physical(), 0u);
    }
    // Destroying the allocator returns its address space too.
    EXPECT_EQ(device.live_reservations(), 0u);
    EXPECT_EQ(device.live_physical(), 0u);
    return calls;
  };
  const std::uint64_t total = run(0);
  ASSERT_GT(total, 0u) << "the workload never calls " << to_string(kind);
  const std::uint64_t stride = std::max<std::uint64_t>(1, total / 40);
  for (std::uint64_t n = 1; n <= total; n += stride) run(n);
}

INSTANTIATE_TEST_SUITE_P(
    DeviceCalls, VmFaultAt,
    ::testing::Combine(::testing::Values("expandable_segments:True", "policy:paging"),
                       ::testing::Values(CallKind::reserve, CallKind::create_physical,
                                         CallKind::map, CallKind::set_access, CallKind::unmap,
                                         CallKind::release_physical,
                                         CallKind::synchronize_stream)),
    [](const auto& info) {
      std::string name = std::get<0>(info.param)[0] == 'e' ? "expandable_" : "paging_";
      return name + std::string(to_string(std::get<1>(info.param)));
    });

TEST(FaultInjection, DeviceErrorsCarryContext) {
  SimDevice device;
  CachingAllocator allocator(device, AllocatorConfig{});
  device.fail_nth(CallKind::allocate_segment, 1, Status::device_error);
  try {
    (void)allocator.allocate(4096);
    FAIL();
  } catch (const DeviceError& e) {
    EXPECT_EQ(std::string(e.what()),
              "allocating a segment of 2097152 bytes: device call allocate_segment failed with "
              "device_error");
    EXPECT_EQ(e.call(), CallKind::allocate_segment);
  }
  void* p = allocator.allocate(4096);
  allocator.record_stream(p, 2);
  device.fail_nth(CallKind::record_event, 1, Status::device_error);
  EXPECT_THROW(allocator.deallocate(p), DeviceError);
  EXPECT_EQ(allocator.stats().allocation[0].current, 1);  // still the caller's
  allocator.deallocate(p);
  EXPECT_EQ(allocator.stats().allocation[0].current, 0);
  allocator.validate();
}

TEST(FaultInjection, FailedFreeKeepsTheSegmentCached) {
  SimDevice device;
  CachingAllocator allocator(device, AllocatorConfig{});
  void* p = allocator.allocate(12 * kMiB);
  allocator.deallocate(p);
  device.fail_nth(CallKind::free_segment, 1, Status::device_error);
  EXPECT_THROW(allocator.empty_cache(), DeviceError);
  allocator.validate();
  EXPECT_EQ(allocator.stats().reserved_bytes[0].current, 12 * 1048576);
  allocator.empty_cache();
  EXPECT_EQ(device.live_segments(), 0u);
}

TEST(FaultInjection, MemoryInfoFailureStillReportsOutOfMemory) {
  SimDeviceOptions o;
  o.capacity = 4 * kMiB;
  SimDevice device(o);
  CachingAllocator allocator(device, AllocatorConfig{});
  device.fail_nth(CallKind::memory_info, 1, Status::device_error);
  try {
    (void)allocator.allocate(12 * kMiB);
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("total capacity of 0 bytes of which 0 bytes is free"),
              std::string::npos)
        << e.what();
  }
  device.fail_nth(CallKind::memory_info, 1, Status::device_error);
  EXPECT_THROW(allocator.set_memory_fraction(0.5), DeviceError);
  allocator.validate();
}

}  // namespace
}  // namespace reservoir
