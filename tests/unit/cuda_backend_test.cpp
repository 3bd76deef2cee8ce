// The CUDA backends on a fake CUDA: the calls they make, in which context,
// with which arguments, and how the allocator unwinds when one fails.
#include <gtest/gtest.h>

#include <algorithm>

#include "fake_cuda.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/cuda_device.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir::testing {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

const CudaDriverApi& driver() {
  static const CudaDriverApi kApi = FakeCuda::driver();
  return kApi;
}
const CudaRuntimeApi& runtime() {
  static const CudaRuntimeApi kApi = FakeCuda::runtime();
  return kApi;
}
FakeCuda& fake() { return FakeCuda::get(); }

TEST(CudaVmm, CreatesPinnedDeviceMemoryRdmaCapableWhereSupported) {
  fake().reset(256 * kMiB);
  {
    CudaVmmDevice d(driver(), {});
    EXPECT_TRUE(d.gpu_direct_rdma());
    EXPECT_EQ(d.granularity(), 2 * kMiB);
    PhysicalHandle h = 0;
    ASSERT_EQ(d.create_physical(4 * kMiB, &h), Status::ok);
    EXPECT_EQ(fake().last_prop.type, CU_MEM_ALLOCATION_TYPE_PINNED);
    EXPECT_EQ(fake().last_prop.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
    EXPECT_EQ(fake().last_prop.location.id, 0);
    EXPECT_EQ(fake().last_prop.allocFlags.gpuDirectRDMACapable, 1);
    EXPECT_EQ(d.release_physical(h), Status::ok);
  }
  {
    CudaVmmDevice d(driver(), {.device = 1, .peers = {}, .gpu_direct_rdma = false});  // asked not to
    PhysicalHandle h = 0;
    ASSERT_EQ(d.create_physical(2 * kMiB, &h), Status::ok);
    EXPECT_FALSE(d.gpu_direct_rdma());
    EXPECT_EQ(fake().last_prop.location.id, 1);
    EXPECT_EQ(fake().last_prop.allocFlags.gpuDirectRDMACapable, 0);
    EXPECT_EQ(d.release_physical(h), Status::ok);
  }
  fake().reset(256 * kMiB, 2 * kMiB, /*vmm=*/true, /*rdma=*/false);
  CudaVmmDevice d(driver(), {});  // the device cannot
  PhysicalHandle h = 0;
  ASSERT_EQ(d.create_physical(2 * kMiB, &h), Status::ok);
  EXPECT_FALSE(d.gpu_direct_rdma());
  EXPECT_EQ(fake().last_prop.allocFlags.gpuDirectRDMACapable, 0);
  EXPECT_EQ(d.release_physical(h), Status::ok);
}

TEST(CudaVmm, GrantsAccessToTheDeviceAndItsPeersPerMapping) {
  fake().reset(256 * kMiB);
  CudaVmmDevice d(driver(), {.device = 0, .peers = {1}});
  DevicePtr va = 0;
  PhysicalHandle a = 0, b = 0;
  ASSERT_EQ(d.reserve(8 * kMiB, 0, &va), Status::ok);
  ASSERT_EQ(d.create_physical(2 * kMiB, &a), Status::ok);
  ASSERT_EQ(d.create_physical(4 * kMiB, &b), Status::ok);
  ASSERT_EQ(d.map(va, 2 * kMiB, a, 0), Status::ok);
  ASSERT_EQ(d.map(va + 2 * kMiB, 4 * kMiB, b, 0), Status::ok);
  ASSERT_EQ(d.set_access(va, 6 * kMiB), Status::ok);
  EXPECT_EQ(fake().count("cuMemSetAccess"), 2u);  // one call per mapping
  ASSERT_EQ(fake().last_access.size(), 2u);
  EXPECT_EQ(fake().last_access[0].location.id, 0);
  EXPECT_EQ(fake().last_access[1].location.id, 1);
  for (const CUmemAccessDesc& desc : fake().last_access) {
    EXPECT_EQ(desc.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
    EXPECT_EQ(desc.flags, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  }
  EXPECT_TRUE(fake().mappings.at(va).accessible);
  EXPECT_TRUE(fake().mappings.at(va + 2 * kMiB).accessible);
  ASSERT_EQ(d.unmap(va, 6 * kMiB), Status::ok);
  EXPECT_EQ(fake().count("cuMemUnmap"), 2u);
  ASSERT_EQ(d.release_physical(a), Status::ok);
  ASSERT_EQ(d.release_physical(b), Status::ok);
  ASSERT_EQ(d.unreserve(va, 8 * kMiB), Status::ok);
  EXPECT_TRUE(fake().handles.empty());
  EXPECT_TRUE(fake().reservations.empty());
  EXPECT_EQ(fake().used, 0u);
}

TEST(CudaVmm, CallsRunInThePrimaryContextAndRestoreTheCallers) {
  fake().reset(64 * kMiB);
  CudaVmmDevice d(driver(), {});
  const auto callers = reinterpret_cast<CUcontext>(0x99);
  fake().current = callers;
  PhysicalHandle h = 0;
  ASSERT_EQ(d.create_physical(2 * kMiB, &h), Status::ok);
  ASSERT_EQ(fake().contexts_seen.size(), 1u);
  EXPECT_EQ(fake().contexts_seen[0], fake_primary_context());
  EXPECT_EQ(fake().current, callers);
  ASSERT_EQ(d.release_physical(h), Status::ok);
}

TEST(CudaVmm, NoVirtualMemoryIsAClearError) {
  fake().reset(64 * kMiB, 2 * kMiB, /*vmm=*/false);
  try {
    CudaVmmDevice d(driver(), {});
    FAIL() << "constructed";
  } catch (const DeviceUnavailableError& e) {
    EXPECT_STREQ(e.what(), "cuda-vmm: device 0 does not support virtual memory management");
  }
  fake().reset(64 * kMiB);
  EXPECT_THROW(CudaVmmDevice(driver(), {.device = 7, .peers = {}}), DeviceUnavailableError);
}

TEST(CudaVmm, DriverErrorsMapToStatuses) {
  fake().reset(64 * kMiB);
  CudaVmmDevice d(driver(), {});
  PhysicalHandle h = 0;
  EXPECT_EQ(d.create_physical(66 * kMiB, &h), Status::out_of_memory);
  fake().fail("cuMemCreate", 1, CUDA_ERROR_UNKNOWN);
  EXPECT_EQ(d.create_physical(2 * kMiB, &h), Status::device_error);
  fake().fail("cuMemCreate", 1, CUDA_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(d.create_physical(2 * kMiB, &h), Status::not_supported);
  EXPECT_TRUE(fake().handles.empty());  // nothing half-made
  DevicePtr va = 0;
  fake().fail("cuMemAddressReserve", 1, CUDA_ERROR_OUT_OF_MEMORY);
  EXPECT_EQ(d.reserve(2 * kMiB, 0, &va), Status::out_of_memory);
  EXPECT_TRUE(fake().reservations.empty());
}

TEST(CudaRuntime, OutOfMemoryClearsTheStickyErrorAndFreesAreChecked) {
  fake().reset(64 * kMiB);
  CudaRuntimeDevice d(runtime(), 0);
  DevicePtr p = 0;
  EXPECT_EQ(d.allocate_segment(65 * kMiB, &p), Status::out_of_memory);
  EXPECT_EQ(fake().sticky_error, 0);
  EXPECT_EQ(std::count(fake().calls.begin(), fake().calls.end(), "cudaGetLastError"), 1);
  ASSERT_EQ(d.allocate_segment(3 * kMiB, &p), Status::ok);
  EXPECT_EQ(fake().allocations.at(p), 3 * kMiB);
  EXPECT_EQ(d.free_segment(p + 512), Status::invalid_argument);  // never reaches cudaFree
  EXPECT_EQ(fake().count("cudaFree"), 0u);
  fake().fail("cudaFree", 1, cudaErrorLaunchFailure);
  EXPECT_EQ(d.free_segment(p), Status::device_error);
  EXPECT_EQ(d.free_segment(p), Status::ok);  // still ours after the failure
  EXPECT_TRUE(fake().allocations.empty());
}

// A segment for a request on a stream that captures a CUDA graph is made in
// CUDA's relaxed capture mode (the global mode refuses cudaMalloc and
// invalidates the capture), and the thread's mode comes back; on any other
// stream the mode is left alone. A failing capture query allocates nothing.
TEST(CudaRuntime, ASegmentForACapturingStreamIsMadeInTheRelaxedMode) {
  fake().reset(64 * kMiB);
  CudaRuntimeDevice d(runtime(), 0);
  const StreamId capturing = 0x9000;
  fake().capturing.insert(capturing);
  DevicePtr p = 0, q = 0;
  ASSERT_EQ(d.allocate_segment_on(2 * kMiB, capturing, &p), Status::ok);
  ASSERT_EQ(d.allocate_segment_on(2 * kMiB, 0x9100, &q), Status::ok);
  EXPECT_EQ(fake().malloc_modes, (std::vector<int>{cudaStreamCaptureModeRelaxed, cudaStreamCaptureModeGlobal}));
  EXPECT_EQ(fake().capture_mode, cudaStreamCaptureModeGlobal);
  fake().fail("cudaStreamIsCapturing", 1, cudaErrorStreamCaptureImplicit);
  DevicePtr r = 0;
  EXPECT_EQ(d.allocate_segment_on(2 * kMiB, 0, &r), Status::device_error);
  fake().fail("cudaThreadExchangeStreamCaptureMode", 1, cudaErrorInvalidValue);
  EXPECT_EQ(d.allocate_segment_on(2 * kMiB, capturing, &r), Status::invalid_argument);
  EXPECT_EQ(fake().allocations.size(), 2u);
  EXPECT_EQ(fake().capture_mode, cudaStreamCaptureModeGlobal);
  ASSERT_EQ(d.free_segment(p), Status::ok);
  ASSERT_EQ(d.free_segment(q), Status::ok);
}

// A capture's graph through the runtime, with CUDA 12's calls and with
// CUDA 13's (edges asked for with an array): a stream's last nodes and the
// capture's id, nothing for a stream that does not capture, a node's
// dependencies; an invalidated capture and a failing call are errors.
TEST(CudaRuntime, ACapturesGraphIsReadThroughEitherRuntimesCalls) {
  for (const bool v13 : {false, true}) {
    SCOPED_TRACE(v13 ? "CUDA 13" : "CUDA 12");
    fake().reset(64 * kMiB);
    const CudaRuntimeApi api = v13 ? FakeCuda::runtime13() : runtime();
    CudaRuntimeDevice d(api, 0);
    fake().frontiers[0x9000] = {0xa1, 0xa2};
    fake().node_deps = {{0xa1, {0xb1}}, {0xa2, {0xb1, 0xb2}}, {0xb1, {}}, {0xb2, {}}};
    CaptureFrontier f;
    ASSERT_EQ(d.capture_frontier(0x9000, &f), Status::ok);
    EXPECT_EQ(f.id, 77u);
    EXPECT_EQ(f.nodes, (std::vector<GraphNode>{0xa1, 0xa2}));
    ASSERT_EQ(d.capture_frontier(0x9100, &f), Status::ok);
    EXPECT_EQ(f.id, 0u);
    EXPECT_TRUE(f.nodes.empty());
    std::vector<GraphNode> deps{0x1};
    ASSERT_EQ(d.node_dependencies(0xa2, &deps), Status::ok);
    EXPECT_EQ(deps, (std::vector<GraphNode>{0xb1, 0xb2}));
    ASSERT_EQ(d.node_dependencies(0xb2, &deps), Status::ok);
    EXPECT_TRUE(deps.empty());
    EXPECT_EQ(d.node_dependencies(0xdead, &deps), Status::invalid_argument);
    fake().fail("cudaGraphNodeGetDependencies", 2, cudaErrorLaunchFailure);  // the second call: the array's
    EXPECT_EQ(d.node_dependencies(0xa1, &deps), Status::device_error);
    EXPECT_TRUE(deps.empty());
    fake().fail("cudaStreamGetCaptureInfo", 1, cudaErrorStreamCaptureImplicit);
    EXPECT_EQ(d.capture_frontier(0x9000, &f), Status::device_error);
    fake().invalidated = true;
    EXPECT_EQ(d.capture_frontier(0x9000, &f), Status::device_error);
  }
  // A runtime without the calls: nothing is seen to capture.
  CudaRuntimeApi none = runtime();
  none.cudaStreamGetCaptureInfo_v2 = nullptr;
  none.cudaGraphNodeGetDependencies = nullptr;
  CudaRuntimeDevice d(none, 0);
  CaptureFrontier f{5, {1}};
  ASSERT_EQ(d.capture_frontier(0x9000, &f), Status::ok);
  EXPECT_EQ(f.id, 0u);
  std::vector<GraphNode> deps;
  EXPECT_EQ(d.node_dependencies(0xa1, &deps), Status::not_supported);
}

TEST(CudaRuntime, CallsRunOnItsDeviceAndRestoreTheCallers) {
  fake().reset(64 * kMiB);
  fake().runtime_device = 0;
  CudaRuntimeDevice d(runtime(), 1);
  EXPECT_EQ(fake().runtime_device, 0);
  DevicePtr p = 0;
  ASSERT_EQ(d.allocate_segment(kMiB, &p), Status::ok);
  EXPECT_EQ(fake().runtime_device, 0);
  EXPECT_THROW(CudaRuntimeDevice(runtime(), 5), DeviceUnavailableError);
  ASSERT_EQ(d.free_segment(p), Status::ok);
}

TEST(CudaPinned, HostCacheOnCudaHostAlloc) {
  fake().reset(64 * kMiB);
  CudaPinnedMemory pinned(runtime());
  SimDevice events;
  {
    HostCachingAllocator cache(pinned, events);
    void* p = cache.allocate(3000);
    EXPECT_EQ(fake().allocations.at(reinterpret_cast<std::uintptr_t>(p)), 4096u);
    EXPECT_EQ(std::count(fake().calls.begin(), fake().calls.end(), "cudaHostAlloc(default)"), 1);
    cache.deallocate(p);
    EXPECT_EQ(cache.allocate(4096), p);
    cache.deallocate(p);
    EXPECT_THROW((void)cache.allocate(65 * kMiB), OutOfMemoryError);
    EXPECT_EQ(fake().sticky_error, 0);
  }
  EXPECT_TRUE(fake().allocations.empty());  // the cache gave everything back
  int local = 0;
  // Refused as not ours before it could reach cudaFreeHost.
  EXPECT_EQ(pinned.free(&local), Status::invalid_argument);  // NOLINT(clang-analyzer-unix.Malloc)
}

// A driver call failing in the middle of a multi-page allocation: the
// allocator raises DeviceError and leaves nothing behind (or, for a passing
// out-of-memory, recovers through its retry ladder).
struct Failure {
  const char* config;
  const char* function;
  int nth;
  CUresult result;
  // Out of memory: retries the ladder needs (paging recovers before it, by
  // mapping the free pages around the live block a second time).
  int retries = 1;
};

class CudaUnwind : public ::testing::TestWithParam<Failure> {};

TEST_P(CudaUnwind, FailingCallHalfwayLeavesNothingBehind) {
  const Failure& f = GetParam();
  fake().reset(std::size_t{1} << 30);
  {
    CudaVmmDevice device(driver(), {});
    CachingAllocator allocator(device, AllocatorConfig::parse(f.config));
    void* keep = allocator.allocate(kMiB);  // a live block (paging: in its stream's arena)
    fake().fail(f.function, f.nth, f.result);
    if (f.result == CUDA_ERROR_OUT_OF_MEMORY) {
      // A passing shortage: the retry ladder frees the cache and tries again.
      void* q = allocator.allocate(50 * kMiB);
      EXPECT_NE(q, nullptr);
      EXPECT_EQ(allocator.stats().num_alloc_retries, f.retries);
      allocator.deallocate(q);
    } else {
      EXPECT_THROW((void)allocator.allocate(50 * kMiB), DeviceError);
    }
    allocator.validate();
    EXPECT_EQ(allocator.stats().allocated_bytes[0].current, static_cast<std::int64_t>(kMiB));
    // The failed request's pages are neither mapped nor held.
    allocator.deallocate(keep);
    allocator.empty_cache();
    allocator.validate();
    EXPECT_TRUE(fake().mappings.empty());
    EXPECT_TRUE(fake().handles.empty());
    EXPECT_EQ(fake().used, 0u);
    // And the allocator still works.
    void* p = allocator.allocate(50 * kMiB);
    EXPECT_NE(p, nullptr);
    allocator.deallocate(p);
  }
  EXPECT_TRUE(fake().reservations.empty());
  EXPECT_TRUE(fake().handles.empty());
  EXPECT_EQ(fake().used, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Calls, CudaUnwind,
    ::testing::Values(Failure{"expandable_segments:True", "cuMemMap", 3, CUDA_ERROR_UNKNOWN},
                      Failure{"expandable_segments:True", "cuMemSetAccess", 2, CUDA_ERROR_UNKNOWN},
                      Failure{"expandable_segments:True", "cuMemCreate", 2, CUDA_ERROR_OUT_OF_MEMORY},
                      Failure{"expandable_segments:True", "cuMemCreate", 3, CUDA_ERROR_UNKNOWN},
                      Failure{"policy:paging", "cuMemMap", 1, CUDA_ERROR_UNKNOWN},
                      Failure{"policy:paging", "cuMemSetAccess", 1, CUDA_ERROR_UNKNOWN},
                      Failure{"policy:paging", "cuMemCreate", 1, CUDA_ERROR_OUT_OF_MEMORY, 0},
                      Failure{"", "cuMemAlloc", 1, CUDA_ERROR_UNKNOWN},
                      Failure{"", "cuMemAlloc", 1, CUDA_ERROR_OUT_OF_MEMORY}));

// On this machine: either CUDA loads (a GPU machine) and the backends open,
// or they say exactly what is missing.
TEST(CudaLoader, OpensOrSaysWhy) {
  const std::string why = cuda_unavailable_reason();
  if (why.empty()) {
    EXPECT_EQ(CudaVmmDevice::open()->name(), "cuda-vmm");
    EXPECT_EQ(CudaRuntimeDevice::open()->name(), "cuda-runtime");
    return;
  }
  EXPECT_TRUE(why.find("libcuda.so.1") != std::string::npos ||
              why.find("cuInit failed") != std::string::npos ||
              why.find("libcudart") != std::string::npos)
      << why;
  try {
    (void)CudaVmmDevice::open();
    FAIL() << "opened without CUDA";
  } catch (const DeviceUnavailableError& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)CudaRuntimeDevice::open(), DeviceUnavailableError);
}

}  // namespace
}  // namespace reservoir::testing
