// A private pool whose segments come from another allocator (PyTorch's
// MemPool(allocator=...)): its new segments are asked of that allocator, its
// blocks are cached, split and merged as any pool's, its released segments
// go back to it, and the pool's allocator lives as long as a segment of it.
// The other allocator here is a second SimDevice (its own addresses), which
// also runs out of memory and fails on demand for the error paths. Every
// call is validated (set_validate_each_call).
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir::testing {
namespace {

constexpr PoolId kPool{0, 5};
constexpr StreamId kStream = 0;
constexpr DevicePtr kOtherBase = 0x100000000000;  // the other allocator's addresses
constexpr std::size_t kMiB = std::size_t{1} << 20;

// An allocator of its own, as a CUDAPluggableAllocator over cudaMalloc.
class OtherAllocator final : public PoolSegmentAllocator {
 public:
  explicit OtherAllocator(std::size_t capacity)
      : memory_(SimDeviceOptions{.capacity = capacity, .base_address = kOtherBase}) {}
  DevicePtr allocate(std::size_t size, StreamId stream) override {
    calls.push_back("alloc " + std::to_string(size >> 20) + " MiB on " + std::to_string(stream));
    if (fail) throw std::runtime_error("the other allocator failed");
    DevicePtr p = 0;
    return memory_.allocate_segment(size, &p) == Status::ok ? p : 0;
  }
  void free(DevicePtr ptr, std::size_t size, StreamId stream) override {
    calls.push_back("free " + std::to_string(size >> 20) + " MiB on " + std::to_string(stream));
    if (fail) throw std::runtime_error("the other allocator failed to free");
    ASSERT_EQ(memory_.free_segment(ptr), Status::ok);
  }
  std::vector<std::string> calls;
  bool fail = false;

 private:
  SimDevice memory_;
};

class PoolAllocator : public ::testing::Test {
 protected:
  void make(const std::string& config, std::size_t other_capacity = 64 * kMiB) {
    device_ = std::make_unique<SimDevice>(SimDeviceOptions{.capacity = 256 * kMiB});
    allocator_ = std::make_unique<CachingAllocator>(*device_, AllocatorConfig::parse(config));
    allocator_->set_validate_each_call(true);
    other_ = std::make_shared<OtherAllocator>(other_capacity);
    allocator_->set_pool_allocator(kPool, other_);
  }
  void route() {
    allocator_->begin_allocate_to_pool(kPool, [](StreamId) { return true; });
  }
  void* alloc(std::size_t size) { return allocator_->allocate(size, kStream); }
  std::int64_t stat(const std::string& key) const { return allocator_->stats_map().at(key); }
  static bool from_other(void* p) { return from_other(reinterpret_cast<DevicePtr>(p)); }
  static bool from_other(DevicePtr p) { return p >= kOtherBase && p < kOtherBase + (DevicePtr{1} << 40); }

  std::unique_ptr<SimDevice> device_;
  std::unique_ptr<CachingAllocator> allocator_;
  std::shared_ptr<OtherAllocator> other_;
};

TEST_F(PoolAllocator, ThePoolsSegmentsComeFromItsAllocatorAndAreCachedAsAnyPools) {
  make("");
  route();
  void* a = alloc(3 * kMiB);  // a 20 MiB segment, split
  void* b = alloc(3 * kMiB);  // the rest of it
  void* s = alloc(4096);      // the small pool: a 2 MiB segment
  allocator_->end_allocate_to_pool(kPool);
  void* outside = alloc(3 * kMiB);  // the default pool: the device's
  EXPECT_TRUE(from_other(a));
  EXPECT_EQ(reinterpret_cast<char*>(b), reinterpret_cast<char*>(a) + 3 * kMiB);
  EXPECT_TRUE(from_other(s));
  EXPECT_FALSE(from_other(outside));
  EXPECT_EQ(other_->calls, (std::vector<std::string>{"alloc 20 MiB on 0", "alloc 2 MiB on 0"}));
  EXPECT_EQ(stat("segment.all.current"), 3);
  EXPECT_EQ(stat("reserved_bytes.all.current"), static_cast<std::int64_t>(42 * kMiB));
  EXPECT_EQ(stat("num_device_alloc"), 3);
  EXPECT_EQ(allocator_->private_pool_reserved().at(kPool)[0].current,
            static_cast<std::int64_t>(22 * kMiB));
  for (void* p : {a, b, s, outside}) allocator_->deallocate(p);
  // In use: empty_cache keeps the pool's segments (PyTorch too).
  allocator_->empty_cache();
  EXPECT_EQ(other_->calls.size(), 2U);
  EXPECT_EQ(stat("reserved_bytes.all.current"), static_cast<std::int64_t>(22 * kMiB));
  // The last user gone, they go back to the other allocator.
  allocator_->release_pool(kPool);
  allocator_->empty_cache();
  EXPECT_EQ(other_->calls, (std::vector<std::string>{"alloc 20 MiB on 0", "alloc 2 MiB on 0",
                                                     "free 2 MiB on 0", "free 20 MiB on 0"}));
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(stat("num_device_free"), 3);
}

TEST_F(PoolAllocator, ASegmentKeepsItsAllocatorAliveAfterThePoolAndItsOwnerAreGone) {
  make("");
  route();
  void* a = alloc(4096);
  allocator_->end_allocate_to_pool(kPool);
  allocator_->release_pool(kPool);
  std::weak_ptr<OtherAllocator> weak = other_;
  other_.reset();  // `del pool; del allocator` with a tensor alive
  ASSERT_FALSE(weak.expired());
  allocator_->deallocate(a);
  ASSERT_FALSE(weak.expired());  // cached until emptied
  allocator_->empty_cache();
  EXPECT_TRUE(weak.expired());
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
}

TEST_F(PoolAllocator, ItsOutOfMemoryIsTheDevicesOutOfMemory) {
  make("", 24 * kMiB);
  route();
  void* a = alloc(20 * kMiB);
  // The other allocator has 4 MiB left; nothing cached to free: the error,
  // with the allocator as it was.
  std::string message;
  try {
    (void)alloc(20 * kMiB);
  } catch (const OutOfMemoryError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("CUDA out of memory"), std::string::npos) << message;
  EXPECT_EQ(stat("num_ooms"), 1);
  EXPECT_EQ(stat("segment.all.current"), 1);
  allocator_->deallocate(a);
  // A cached 20 MiB block of the pool serves the next request.
  void* b = alloc(20 * kMiB);
  EXPECT_EQ(b, a);
  allocator_->deallocate(b);
  // A larger request: while the pool is routed, nothing cached is freed for
  // it (PyTorch frees cached segments only with no capture or pool routed):
  // one request to the other allocator, then the error, the block still cached.
  other_->calls.clear();
  EXPECT_THROW((void)alloc(22 * kMiB), OutOfMemoryError);
  EXPECT_EQ(other_->calls, (std::vector<std::string>{"alloc 22 MiB on 0"}));
  EXPECT_EQ(stat("reserved_bytes.all.current"), static_cast<std::int64_t>(20 * kMiB));
  allocator_->end_allocate_to_pool(kPool);
  // Released, the pool's cached segment goes back to its allocator.
  allocator_->release_pool(kPool);
  allocator_->empty_cache();
  EXPECT_EQ(other_->calls.back(), "free 20 MiB on 0");
  EXPECT_EQ(stat("num_ooms"), 2);
}

TEST_F(PoolAllocator, AFailureOfItsAllocatorIsAnErrorThatLeavesNothingBehind) {
  make("");
  route();
  other_->fail = true;
  EXPECT_THROW((void)alloc(4096), std::runtime_error);
  EXPECT_EQ(stat("segment.all.current"), 0);
  EXPECT_EQ(stat("allocation.all.current"), 0);
  other_->fail = false;
  void* a = alloc(4096);
  allocator_->deallocate(a);
  allocator_->end_allocate_to_pool(kPool);
  allocator_->release_pool(kPool);
  other_->fail = true;
  EXPECT_THROW(allocator_->empty_cache(), std::runtime_error);
  // The segment stays the pool's, and goes when its allocator recovers.
  EXPECT_EQ(stat("segment.all.current"), 1);
  other_->fail = false;
  allocator_->empty_cache();
  EXPECT_EQ(stat("segment.all.current"), 0);
}

TEST_F(PoolAllocator, VirtualMemoryPoliciesLeaveThePoolOnItsAllocator) {
  for (const char* config : {"expandable_segments:True", "policy:paging", "policy:native_paged"}) {
    SCOPED_TRACE(config);
    make(config);
    route();
    void* in_pool = alloc(4 * kMiB);
    allocator_->end_allocate_to_pool(kPool);
    void* outside = alloc(4 * kMiB);
    EXPECT_TRUE(from_other(in_pool));
    EXPECT_FALSE(from_other(outside));
    ASSERT_EQ(other_->calls.size(), 1U);
    EXPECT_EQ(other_->calls[0], "alloc 20 MiB on 0");
    const Snapshot snap = allocator_->snapshot();
    int pool_segments = 0;
    for (const SegmentInfo& seg : snap.segments) {
      if (from_other(seg.address)) {
        ++pool_segments;
        EXPECT_FALSE(seg.is_expandable);
      }
    }
    EXPECT_EQ(pool_segments, 1);
    allocator_->deallocate(in_pool);
    allocator_->deallocate(outside);
    allocator_->release_pool(kPool);
    allocator_->empty_cache();
    EXPECT_EQ(other_->calls.back(), "free 20 MiB on 0");
    allocator_.reset();
  }
}

TEST_F(PoolAllocator, AUseOnOomPoolOverAnotherAllocatorServesTheDefaultPoolWhenTheDeviceIsFull) {
  make("");
  allocator_->set_pool_use_on_oom(kPool, true);
  route();
  void* b = alloc(40 * kMiB);
  allocator_->end_allocate_to_pool(kPool);
  allocator_->deallocate(b);
  allocator_->set_memory_fraction(40.0 * kMiB / (256.0 * kMiB));
  void* c = alloc(30 * kMiB);  // the device allows no more: the pool's free block
  EXPECT_EQ(c, b);
  allocator_->deallocate(c);
}

TEST_F(PoolAllocator, TheAllocatorIsChosenBeforeThePoolsFirstSegment) {
  make("");
  route();
  void* a = alloc(4096);
  EXPECT_THROW(allocator_->set_pool_allocator(kPool, std::make_shared<OtherAllocator>(kMiB)),
               UsageError);
  allocator_->set_pool_allocator(kPool, other_);  // the same one: nothing changes
  allocator_->deallocate(a);
  allocator_->end_allocate_to_pool(kPool);
}

TEST_F(PoolAllocator, ForgettingANeverRoutedPoolsAllocatorDropsIt) {
  make("");
  std::weak_ptr<OtherAllocator> weak = other_;
  other_.reset();
  EXPECT_FALSE(weak.expired());
  allocator_->set_pool_allocator(kPool, nullptr);
  EXPECT_TRUE(weak.expired());
}

}  // namespace
}  // namespace reservoir::testing
