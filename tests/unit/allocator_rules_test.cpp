// Each native-policy rule pinned with exact numbers.
#include <fmt/format.h>

#include "allocator_fixture.hpp"
#include "reservoir/errors.hpp"

namespace reservoir::testing {
namespace {

using Rules = AllocatorTest;

TEST(SizeRules, RoundSize) {
  const AllocatorConfig plain;
  EXPECT_EQ(CachingAllocator::round_size(1, plain), 512u);
  EXPECT_EQ(CachingAllocator::round_size(512, plain), 512u);
  EXPECT_EQ(CachingAllocator::round_size(513, plain), 1024u);
  EXPECT_EQ(CachingAllocator::round_size(kMiB + 1, plain), kMiB + 512);
  const AllocatorConfig four = AllocatorConfig::parse("roundup_power2_divisions:4");
  EXPECT_EQ(CachingAllocator::round_size(1200, four), 1536u);  // <= 512 * divisions: 512 rounding
  EXPECT_EQ(CachingAllocator::round_size(5000, four), 5120u);
  EXPECT_EQ(CachingAllocator::round_size(4096, four), 4096u);  // powers of two stay
  EXPECT_EQ(CachingAllocator::round_size(kMiB + 1, four), kMiB + 256 * kKiB);
  EXPECT_EQ(CachingAllocator::round_size(100 * kMiB, four), 112 * kMiB);
  const AllocatorConfig list = AllocatorConfig::parse("roundup_power2_divisions:[1:1,64:8,>:1]");
  EXPECT_EQ(CachingAllocator::round_size(65 * kMiB, list), 72 * kMiB);
  EXPECT_EQ(CachingAllocator::round_size(3 * kMiB + 1, list), 3 * kMiB + 512);
}

TEST(SizeRules, AllocationSize) {
  EXPECT_EQ(CachingAllocator::allocation_size(512), 2 * kMiB);
  EXPECT_EQ(CachingAllocator::allocation_size(kMiB), 2 * kMiB);
  EXPECT_EQ(CachingAllocator::allocation_size(kMiB + 512), 20 * kMiB);
  EXPECT_EQ(CachingAllocator::allocation_size(10 * kMiB - 512), 20 * kMiB);
  EXPECT_EQ(CachingAllocator::allocation_size(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(CachingAllocator::allocation_size(11 * kMiB + 512), 12 * kMiB);
}

TEST_F(Rules, AllocateZeroReturnsNull) {
  EXPECT_EQ(allocator_->allocate(0), nullptr);
  EXPECT_EQ(device_->calls(CallKind::allocate_segment), 0u);
  allocator_->deallocate(nullptr);
}

// PyTorch's check before its device allocator: 1 EiB and more is out of
// memory at once, with no statistic, no device call and no arithmetic on the
// size (2^64 - 1 rounded would wrap to 0).
TEST_F(Rules, RequestsOfAnExabyteOrMoreAreOutOfMemoryBeforeAnything) {
  for (const std::size_t size : {std::size_t{1} << 60, std::size_t{1} << 62, ~std::size_t{0},
                                 ~std::size_t{0} - 511}) {
    try {
      (void)allocator_->allocate(size);
      FAIL() << size << ": no error";
    } catch (const OutOfMemoryError& e) {
      EXPECT_EQ(std::string(e.what()),
                "CUDA out of memory. Tried to allocate more than 1EB memory (" + std::to_string(size) +
                    " bytes requested on device 0).");
      EXPECT_EQ(e.requested_bytes(), size);
    }
  }
  EXPECT_EQ(device_->calls(CallKind::allocate_segment), 0u);
  EXPECT_EQ(stat("num_ooms"), 0);
  EXPECT_EQ(stat("num_alloc_retries"), 0);
  EXPECT_EQ(stat("reserved_bytes.all.peak"), 0);
  // Just below: an ordinary out-of-memory error from the ladder.
  EXPECT_THROW((void)allocator_->allocate((std::size_t{1} << 60) - 1), OutOfMemoryError);
  EXPECT_EQ(stat("num_ooms"), 1);
}

TEST_F(Rules, SmallRequestsPackIntoTwoMiBSegments) {
  const DevicePtr a = alloc(1000);
  const DevicePtr b = alloc(1);
  const DevicePtr c = alloc(kMiB);
  EXPECT_EQ(a, kBase);
  EXPECT_EQ(b, kBase + 1024);
  EXPECT_EQ(c, kBase + 1536);
  EXPECT_EQ(stat("segment.small_pool.current"), 1);
  EXPECT_EQ(stat("reserved_bytes.small_pool.current"), 2 * 1048576);
  EXPECT_EQ(stat("allocated_bytes.small_pool.current"), 1024 + 512 + 1048576);
  EXPECT_EQ(stat("requested_bytes.small_pool.current"), 1000 + 1 + 1048576);
  EXPECT_EQ(stat("inactive_split_bytes.small_pool.current"), 2097152 - 1050112);
  // A request that no longer fits the remaining 1047040 bytes opens a new segment.
  const DevicePtr d = alloc(kMiB);
  EXPECT_EQ(d, kBase + 2 * kMiB);
  EXPECT_EQ(stat("num_device_alloc"), 2);
}

TEST_F(Rules, MidSizeRequestsShareTwentyMiBSegments) {
  const DevicePtr a = alloc(1536 * kKiB);  // 1.5 MiB: large pool, 20 MiB segment
  const DevicePtr b = alloc(2 * kMiB);
  EXPECT_EQ(a, kBase);
  EXPECT_EQ(b, kBase + 1536 * kKiB);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 20971520);
  EXPECT_EQ(stat("segment.large_pool.current"), 1);
  // An 11 MiB request still fits the 16.5 MiB left in that segment.
  EXPECT_EQ(alloc(11 * kMiB + 1), kBase + 3584 * kKiB);
  // Requests of 10 MiB and more that fit nowhere get a segment of their own, rounded to 2 MiB.
  const DevicePtr c = alloc(17 * kMiB + 1);
  EXPECT_EQ(c, kBase + 20 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 20971520 + 18874368);
}

// large_segment_size_mb (newer PyTorch) replaces the 20 MiB segment of a
// 1-10 MiB request, and max_split_size_mb may then go down to it.
TEST_F(Rules, LargeSegmentSizeSetsTheMidSizeSegment) {
  make("large_segment_size_mb:12,max_split_size_mb:12");
  const DevicePtr a = alloc(1536 * kKiB);
  EXPECT_EQ(a, kBase);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 12 * 1048576);
  EXPECT_EQ(alloc(10 * kMiB), kBase + 1536 * kKiB);  // fits the 10.5 MiB left
  EXPECT_EQ(alloc(5 * kMiB), kBase + 12 * kMiB);      // a second 12 MiB segment
  EXPECT_EQ(stat("segment.large_pool.current"), 2);
  // From 10 MiB up a request still gets a segment of its own, rounded to 2 MiB.
  EXPECT_EQ(alloc(17 * kMiB + 1), kBase + 24 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), (12 + 12 + 18) * 1048576);
}

TEST_F(Rules, LargeSegmentSizeIsTheExpandableLargePage) {
  make("expandable_segments:True,large_segment_size_mb:40");
  (void)alloc(5 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 40 * 1048576);
  (void)alloc(41 * kMiB);  // 36 MiB left in the page: one more page maps
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 80 * 1048576);
}

// per_process_memory_fraction in the config string caps reserved memory as
// torch.cuda.set_per_process_memory_fraction does.
TEST_F(Rules, PerProcessMemoryFractionFromTheConfig) {
  make("per_process_memory_fraction:0.5", 100 * kMiB);
  const DevicePtr a = alloc(40 * kMiB);
  EXPECT_THROW((void)allocator_->allocate(20 * kMiB, 0), OutOfMemoryError);  // 60 > 50 MiB
  release(a);
  // Set at run time, as PyTorch's _set_allocator_settings would.
  allocator_->set_config(AllocatorConfig::parse("per_process_memory_fraction:0.8"));
  const DevicePtr b = alloc(70 * kMiB);  // 70 <= 80 MiB (the 40 MiB segment went back first)
  release(b);
}

TEST_F(Rules, LargeRemainderOfOneMiBOrLessIsNotSplit) {
  const DevicePtr a = alloc(19 * kMiB + 512 * kKiB);  // 20 MiB segment, 512 KiB left over
  EXPECT_EQ(a, kBase);
  EXPECT_EQ(stat("allocated_bytes.large_pool.current"), 20971520);
  EXPECT_EQ(stat("inactive_split.large_pool.current"), 0);
  release(a);
  const DevicePtr b = alloc(18 * kMiB + 1);  // remainder just under 2 MiB > 1 MiB: split
  EXPECT_EQ(b, kBase);
  EXPECT_EQ(stat("allocated_bytes.large_pool.current"), 18 * 1048576 + 512);
  EXPECT_EQ(stat("inactive_split_bytes.large_pool.current"), 2 * 1048576 - 512);
}

TEST_F(Rules, BestFitBySizeThenAddress) {
  // Three 12 MiB segments, carved so that free blocks of 4, 2 and 2 MiB remain.
  const DevicePtr s1 = alloc(12 * kMiB);
  const DevicePtr s2 = alloc(12 * kMiB);
  const DevicePtr s3 = alloc(12 * kMiB);
  release(s1);
  release(s2);
  release(s3);
  const DevicePtr x = alloc(8 * kMiB);   // smallest fit: 12 MiB at s1
  const DevicePtr y = alloc(10 * kMiB);  // s2
  const DevicePtr z = alloc(10 * kMiB);  // s3
  EXPECT_EQ(x, s1);
  EXPECT_EQ(y, s2);
  EXPECT_EQ(z, s3);
  // Free blocks now: 4 MiB at s1+8, 2 MiB at s2+10 and at s3+10.
  EXPECT_EQ(alloc(1536 * kKiB), s2 + 10 * kMiB);  // 2 MiB blocks first, lowest address first
  EXPECT_EQ(alloc(3 * kMiB), s1 + 8 * kMiB);      // only the 4 MiB block fits
}

TEST_F(Rules, FreeBlocksServeOnlyTheirStream) {
  const DevicePtr a = alloc(4096, 1);
  release(a);
  const DevicePtr b = alloc(4096, 2);
  EXPECT_EQ(b, kBase + 2 * kMiB);  // a second segment: stream 1's cache is not for stream 2
  EXPECT_EQ(alloc(4096, 1), a);
}

TEST_F(Rules, FreedBlocksMergeWithFreeNeighbours) {
  const DevicePtr a = alloc(512);
  const DevicePtr b = alloc(512);
  const DevicePtr c = alloc(512);
  release(a);
  release(c);
  EXPECT_EQ(stat("inactive_split.small_pool.current"), 2);  // [a] and [c + rest]
  release(b);
  EXPECT_EQ(stat("inactive_split.small_pool.current"), 0);  // one unsplit 2 MiB block
  const Snapshot snap = allocator_->snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 1u);
  EXPECT_EQ(snap.segments[0].blocks[0].size, 2 * kMiB);
}

TEST_F(Rules, MaxSplitSizeKeepsOversizeBlocksWhole) {
  make("max_split_size_mb:40");
  const DevicePtr big = alloc(70 * kMiB);
  release(big);
  // A splittable request does not take an oversize cached block.
  EXPECT_EQ(alloc(30 * kMiB), kBase + 70 * kMiB);
  // An oversize request takes one only if it is less than 20 MiB larger.
  EXPECT_EQ(alloc(45 * kMiB), kBase + 100 * kMiB);  // 70 >= 45 + 20: a new segment
  const DevicePtr over = alloc(55 * kMiB);          // 70 < 55 + 20: taken whole, not split
  EXPECT_EQ(over, big);
  // The 45 MiB request got a 46 MiB segment, kept whole: oversize blocks never split.
  EXPECT_EQ(stat("allocated_bytes.all.current"), (30 + 46 + 70) * 1048576);
  EXPECT_EQ(stat("requested_bytes.all.current"), (30 + 45 + 55) * 1048576);
  EXPECT_EQ(stat("oversize_allocations.current"), 2);
  EXPECT_EQ(stat("oversize_segments.current"), 2);
  EXPECT_EQ(stat("inactive_split.all.current"), 0);
  EXPECT_EQ(stat("max_split_size"), 40 * 1048576);
}

TEST_F(Rules, MaxNonSplitRoundingWidensTheLimit) {
  make("max_split_size_mb:40,max_non_split_rounding_mb:30");
  const DevicePtr big = alloc(70 * kMiB);
  release(big);
  EXPECT_EQ(alloc(41 * kMiB), big);  // 70 < 41 + 30
  EXPECT_EQ(stat("allocated_bytes.all.current"), 70 * 1048576);
}

TEST_F(Rules, EmptyCacheReleasesOnlyUnsplitFreeSegments) {
  const DevicePtr a = alloc(512);        // small segment, stays split while a lives
  const DevicePtr b = alloc(12 * kMiB);  // large segment
  release(b);
  allocator_->empty_cache();
  allocator_->validate();
  EXPECT_EQ(stat("num_device_free"), 1);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 2 * 1048576);
  release(a);
  allocator_->empty_cache();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(device_->live_segments(), 0u);
}

TEST_F(Rules, RuntimeConfigChangeAppliesToLaterRequests) {
  const DevicePtr a = alloc(50 * kMiB);
  release(a);
  allocator_->set_config(AllocatorConfig::parse("max_split_size_mb:40"));
  EXPECT_EQ(alloc(30 * kMiB), kBase + 50 * kMiB);
  EXPECT_EQ(allocator_->config().max_split_size, 40 * kMiB);
}

TEST_F(Rules, ConflictingPoliciesAreRefusedClearly) {
  SimDevice device;
  try {
    CachingAllocator a(device, AllocatorConfig::parse("expandable_segments:True,policy:paging"));
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              "allocator config \"policy:paging,expandable_segments:True\": policy:paging and "
              "expandable_segments:True exclude each other; choose one");
  }
}

// Of two cached blocks of equal size, PyTorch 2.11 and before take the one
// at the lower address; 2.12 and later the one whose segment was made first
// (read off the real 2.11 to 2.15 wheels on the simulated CUDA device). Here
// the older segment lies higher: the first segment's space, freed, takes
// the newest one.
TEST_F(Rules, EqualSizeTiesByAddressBefore212AndOldestSegmentFrom212) {
  for (const char* version : {"", "pytorch_version:2.11", "pytorch_version:2.12",
                              "pytorch_version:2.15"}) {
    SCOPED_TRACE(version);
    make(version);
    const DevicePtr low = kBase;
    const DevicePtr high = kBase + (1u << 30);
    std::vector<DevicePtr> places{low, high, low};  // x, a, then b where x was
    std::size_t next = 0;
    device_->set_address_source([&](std::size_t, DevicePtr* addr) {
      *addr = places.at(next++);
      return Status::ok;
    });
    const DevicePtr x = alloc(400 * kMiB);
    const DevicePtr a = alloc(300 * kMiB + 41);  // segment 302 MiB: a 2 MiB - 512 tail
    release(x);
    allocator_->empty_cache();
    const DevicePtr b = alloc(300 * kMiB + 41);  // the same tail, lower, newer
    EXPECT_EQ(a, high);
    EXPECT_EQ(b, low);
    const DevicePtr c = alloc(kMiB + 44);
    // Here the older segment's tail is also the older block (2.12's rule).
    const AllocatorConfig parsed = AllocatorConfig::parse(version);
    const bool oldest_first = parsed.oldest_segment_first() || parsed.oldest_block_first();
    EXPECT_EQ(oldest_first, std::string_view(version).ends_with("2.12") ||
                                std::string_view(version).ends_with("2.15"));
    EXPECT_EQ(c, (oldest_first ? a : b) + 300 * kMiB + 512);
    // The order holds as blocks are cached again and the setting changes.
    release(c);
    AllocatorConfig flipped = allocator_->config();
    flipped.pytorch_version = oldest_first ? "2.11" : "2.13";
    allocator_->set_config(flipped);
    const DevicePtr d = alloc(kMiB + 44);
    EXPECT_EQ(d, (oldest_first ? b : a) + 300 * kMiB + 512);
    release_all({a, b, d});
  }
}

// Within one segment, PyTorch 2.12 takes the cached block made first (a
// split's front is a new block, the rest keeps the old one's age), where
// 2.11 and 2.13 on take the lower address (read off the real 2.12.1 and
// 2.13.0 wheels: tests/torch/test_oracle.py). Here the older block lies
// higher: what is left of a freed block after two splits.
// roundup_power2_divisions with one division (the list form's intervals
// below its first key take that key's divisions): before PyTorch 2.4 a
// request keeps its size, unaligned (2.3.1's snapshots: 4233 bytes, the next
// block 4233 bytes on); from 2.4 it is rounded to 512 bytes.
TEST_F(Rules, OneDivisionKeepsTheSizeBefore24) {
  for (const char* release : {"2.3", "2.4", "2.15"}) {
    SCOPED_TRACE(release);
    make(fmt::format("roundup_power2_divisions:[256:1,512:2,>:8],pytorch_version:{}", release));
    const DevicePtr a = alloc(4233);
    const DevicePtr b = alloc(628);
    const DevicePtr c = alloc(300);  // below 512 bytes: 512 either way
    const DevicePtr d = alloc(100);
    const bool keeps = std::string_view(release) == "2.3";
    EXPECT_EQ(b, a + (keeps ? 4233 : 4608));
    EXPECT_EQ(c, b + (keeps ? 628 : 1024));
    EXPECT_EQ(d, c + 512);
    release_all({a, b, c, d});
  }
}

TEST_F(Rules, WithinASegmentPyTorch212TakesTheOlderOfEqualBlocks) {
  for (const char* version : {"pytorch_version:2.11", "pytorch_version:2.12", "pytorch_version:2.13",
                              "pytorch_version:2.15"}) {
    SCOPED_TRACE(version);
    make(version);
    const DevicePtr a = alloc(512);
    const DevicePtr big = alloc(1536);
    const DevicePtr c = alloc(512);
    EXPECT_EQ(big, a + 512);
    EXPECT_EQ(c, a + 2048);
    release(big);
    const DevicePtr p1 = alloc(512);  // the front of big's block: a new block
    const DevicePtr p2 = alloc(512);  // the front of what is left: another
    EXPECT_EQ(p1, a + 512);
    EXPECT_EQ(p2, a + 1024);
    release(p1);  // 512 bytes at a + 512, newer than big's 512 at a + 1536
    const DevicePtr q = alloc(100);
    const bool block_age = std::string_view(version).ends_with("2.12");
    EXPECT_EQ(AllocatorConfig::parse(version).oldest_block_first(), block_age);
    EXPECT_EQ(q, block_age ? a + 1536 : a + 512);
    // A merge keeps the freed block's age: freeing p2 joins it with its
    // free neighbour (and, under 2.12, with big's old rest too when q took
    // the other).
    release_all({a, c, p2, q});
  }
}

}  // namespace
}  // namespace reservoir::testing
