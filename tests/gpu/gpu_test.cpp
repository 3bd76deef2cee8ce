// The CUDA backends on a real GPU (ctest label gpu). Where CUDA cannot run,
// the program says why and exits with 77, which ctest reports as skipped.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/cuda_device.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "reservoir/saver.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Writes a pattern to device memory and reads it back.
void round_trip(Device& d, DevicePtr p, std::size_t bytes, unsigned char seed) {
  std::vector<unsigned char> out(bytes), in(bytes, 0);
  for (std::size_t i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(seed + i * 7);
  ASSERT_EQ(d.copy_to_device(p, out.data(), bytes, 0), Status::ok);
  ASSERT_EQ(d.copy_to_host(in.data(), p, bytes, 0), Status::ok);
  ASSERT_EQ(d.synchronize_stream(0), Status::ok);
  ASSERT_EQ(std::memcmp(in.data(), out.data(), bytes), 0);
}

TEST(Gpu, RuntimeDeviceSegmentsEventsAndCopies) {
  auto d = CudaRuntimeDevice::open(0);
  MemoryInfo before;
  ASSERT_EQ(d->memory_info(&before), Status::ok);
  EXPECT_GT(before.total, 0u);
  DevicePtr p = 0;
  ASSERT_EQ(d->allocate_segment(4 * kMiB, &p), Status::ok);
  EXPECT_EQ(p % 512, 0u);
  round_trip(*d, p, 4 * kMiB, 3);
  EventId e = 0;
  ASSERT_EQ(d->create_event(&e), Status::ok);
  ASSERT_EQ(d->record_event(e, 0), Status::ok);
  ASSERT_EQ(d->synchronize_event(e), Status::ok);
  EXPECT_EQ(d->query_event(e), Status::ok);
  ASSERT_EQ(d->destroy_event(e), Status::ok);
  EXPECT_EQ(d->free_segment(p), Status::ok);
  EXPECT_EQ(d->free_segment(p), Status::invalid_argument);
  DevicePtr huge = 0;
  EXPECT_EQ(d->allocate_segment(before.total * 2, &huge), Status::out_of_memory);
  DevicePtr again = 0;  // the out-of-memory error did not stick
  ASSERT_EQ(d->allocate_segment(kMiB, &again), Status::ok);
  EXPECT_EQ(d->free_segment(again), Status::ok);
}

TEST(Gpu, VmmDeviceMapsAndUnmapsRealMemory) {
  auto d = CudaVmmDevice::open();
  const std::size_t g = d->granularity();
  ASSERT_GT(g, 0u);
  std::printf("granularity %zu, GPUDirect RDMA %s\n", g, d->gpu_direct_rdma() ? "yes" : "no");
  DevicePtr va = 0;
  ASSERT_EQ(d->reserve(8 * g, 0, &va), Status::ok);
  PhysicalHandle a = 0, b = 0;
  ASSERT_EQ(d->create_physical(2 * g, &a), Status::ok);
  ASSERT_EQ(d->create_physical(g, &b), Status::ok);
  ASSERT_EQ(d->map(va, 2 * g, a, 0), Status::ok);
  ASSERT_EQ(d->map(va + 2 * g, g, b, 0), Status::ok);
  EXPECT_EQ(d->map(va + g, g, b, 0), Status::invalid_argument);
  ASSERT_EQ(d->set_access(va, 3 * g), Status::ok);
  round_trip(*d, va, 3 * g, 11);  // across both handles
  ASSERT_EQ(d->release_physical(b), Status::ok);  // mapped memory stays usable
  round_trip(*d, va + 2 * g, g, 17);
  ASSERT_EQ(d->unmap(va, 3 * g), Status::ok);
  ASSERT_EQ(d->release_physical(a), Status::ok);
  EXPECT_EQ(d->release_physical(a), Status::invalid_argument);
  ASSERT_EQ(d->unreserve(va, 8 * g), Status::ok);
}

// A backend ("runtime": cudaMalloc; "vmm": the driver's virtual-memory
// calls, with cuMemAlloc for classic segments) and an allocator config.
struct Backend {
  const char* device;
  const char* config;
  const char* name;
};

std::unique_ptr<Device> open_backend(const Backend& b) {
  if (std::strcmp(b.device, "runtime") == 0) return CudaRuntimeDevice::open(0);
  return CudaVmmDevice::open();
}

class GpuAllocator : public ::testing::TestWithParam<Backend> {};

// Random requests with every block's bytes written and checked when freed.
TEST_P(GpuAllocator, RandomWorkloadKeepsEveryBlocksBytes) {
  auto d = open_backend(GetParam());
  MemoryInfo start;
  ASSERT_EQ(d->memory_info(&start), Status::ok);
  {
    CachingAllocator a(*d, AllocatorConfig::parse(GetParam().config));
    std::mt19937_64 rng(42);
    struct Live {
      void* p;
      std::size_t size;
      unsigned char seed;
    };
    std::vector<Live> live;
    for (int step = 0; step < 1500; ++step) {
      if (!live.empty() && (rng() % 100 < 45 || live.size() > 60)) {
        const std::size_t k = rng() % live.size();
        const Live b = live[k];
        std::vector<unsigned char> in(std::min<std::size_t>(b.size, 4096));
        ASSERT_EQ(d->copy_to_host(in.data(), reinterpret_cast<DevicePtr>(b.p), in.size(), 0), Status::ok);
        ASSERT_EQ(d->synchronize_stream(0), Status::ok);
        for (std::size_t i = 0; i < in.size(); ++i) {
          ASSERT_EQ(in[i], static_cast<unsigned char>(b.seed + i)) << "block of " << b.size;
        }
        a.deallocate(b.p);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        const std::size_t size = rng() % 4 == 0 ? kMiB + rng() % (60 * kMiB) : 1 + rng() % kMiB;
        void* p = a.allocate(size);
        const auto seed = static_cast<unsigned char>(rng());
        std::vector<unsigned char> out(std::min<std::size_t>(size, 4096));
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<unsigned char>(seed + i);
        ASSERT_EQ(d->copy_to_device(reinterpret_cast<DevicePtr>(p), out.data(), out.size(), 0), Status::ok);
        live.push_back({p, size, seed});
      }
      if (step % 100 == 0) a.validate();
    }
    for (const Live& b : live) a.deallocate(b.p);
    a.empty_cache();
    a.validate();
    EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
  }
  MemoryInfo end;
  ASSERT_EQ(d->memory_info(&end), Status::ok);
  // Everything went back (other processes may move free memory a little).
  EXPECT_GE(end.free + 64 * kMiB, start.free);
}

INSTANTIATE_TEST_SUITE_P(
    Policies, GpuAllocator,
    ::testing::Values(
        Backend{"runtime", "", "RuntimeNative"},
        Backend{"runtime", "max_split_size_mb:64,roundup_power2_divisions:4,garbage_collection_threshold:0.6",
                "RuntimeTuned"},
        Backend{"vmm", "", "VmmNative"}, Backend{"vmm", "expandable_segments:True", "VmmExpandable"},
        Backend{"vmm", "policy:paging", "VmmPaging"},
        Backend{"vmm", "policy:native_paged", "VmmNativePaged"}),
    [](const ::testing::TestParamInfo<Backend>& info) { return std::string(info.param.name); });

class GpuSaver : public ::testing::TestWithParam<const char*> {};

// A tag with backup and one without are paused and resumed: the GPU's free
// memory rises by what they held, the backed-up bytes come back at the same
// addresses, and the memory is usable after.
TEST_P(GpuSaver, PauseReleasesGpuMemoryAndResumeRestoresEveryByte) {
  auto d = CudaVmmDevice::open();
  auto pinned = CudaPinnedMemory::open();
  SaverOptions o;
  o.config = AllocatorConfig::parse(GetParam());
  o.pinned_source = pinned.get();
  o.chunk_bytes = std::size_t{8} << 20;
  Saver saver(*d, o);
  const std::vector<std::size_t> sizes = {4096, 3 * kMiB + 512, 100 * kMiB, std::size_t{700} * 1024};
  std::vector<std::pair<void*, std::vector<unsigned char>>> blocks;
  void* kv = nullptr;
  {
    auto r = saver.region("weights", {.cpu_backup = true});
    std::mt19937_64 rng(7);
    for (std::size_t n : sizes) {
      void* p = saver.allocate(n);
      std::vector<unsigned char> bytes(n);
      for (auto& b : bytes) b = static_cast<unsigned char>(rng());
      ASSERT_EQ(d->copy_to_device(reinterpret_cast<DevicePtr>(p), bytes.data(), n, 0), Status::ok);
      blocks.emplace_back(p, std::move(bytes));
    }
  }
  {
    auto r = saver.region("kv_cache");
    kv = saver.allocate(256 * kMiB);
  }
  ASSERT_EQ(d->synchronize_device(), Status::ok);
  MemoryInfo before;
  ASSERT_EQ(d->memory_info(&before), Status::ok);
  saver.pause();
  MemoryInfo paused;
  ASSERT_EQ(d->memory_info(&paused), Status::ok);
  const std::size_t released =
      saver.tag_info("weights").last_released_bytes + saver.tag_info("kv_cache").last_released_bytes;
  EXPECT_GE(paused.free + 32 * kMiB, before.free + released);
  saver.validate();
  saver.resume();
  for (const auto& [p, bytes] : blocks) {
    std::vector<unsigned char> in(bytes.size());
    ASSERT_EQ(d->copy_to_host(in.data(), reinterpret_cast<DevicePtr>(p), in.size(), 0), Status::ok);
    ASSERT_EQ(d->synchronize_stream(0), Status::ok);
    EXPECT_EQ(std::memcmp(in.data(), bytes.data(), in.size()), 0) << "block of " << bytes.size();
  }
  round_trip(*d, reinterpret_cast<DevicePtr>(kv), 256 * kMiB, 3);
  for (auto& [p, bytes] : blocks) saver.deallocate(p);
  saver.deallocate(kv);
  saver.validate();
}

INSTANTIATE_TEST_SUITE_P(Policies, GpuSaver,
                         ::testing::Values("", "expandable_segments:True", "policy:paging",
                                           "policy:native_paged"));

}  // namespace
}  // namespace reservoir

int main(int argc, char** argv) {
  const std::string why = reservoir::cuda_unavailable_reason();
  if (!why.empty()) {
    std::printf("SKIPPED: no usable GPU here: %s\n", why.c_str());
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
