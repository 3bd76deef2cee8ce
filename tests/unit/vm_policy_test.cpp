// Virtual-memory policies: expandable segments (PyTorch's behaviour, exact
// numbers) and the paging policy's mechanisms (a handle returned while its
// neighbours stay in use, a stitched range, hysteresis across iterations).
#include <gtest/gtest.h>

#include "allocator_fixture.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"

namespace reservoir::testing {
namespace {

class Expandable : public AllocatorTest {
 protected:
  void SetUp() override { make("expandable_segments:True"); }
  std::uint64_t calls(CallKind k) const { return device_->calls(k); }
};

TEST_F(Expandable, SmallRequestMapsOneTwoMiBPageOfAReservationSizedFromTheDevice) {
  const DevicePtr p = alloc(1000);
  EXPECT_EQ(calls(CallKind::reserve), 1u);
  EXPECT_EQ(calls(CallKind::create_physical), 1u);
  EXPECT_EQ(calls(CallKind::map), 1u);
  EXPECT_EQ(calls(CallKind::set_access), 1u);
  EXPECT_EQ(calls(CallKind::allocate_segment), 0u);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 2 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.small_pool.current"), 2 * kMiB);
  EXPECT_EQ(stat("num_device_alloc"), 1);
  EXPECT_EQ(stat("segment.all.current"), 0);  // PyTorch counts maps, not segments
  EXPECT_EQ(stat("allocated_bytes.all.current"), 1024);
  const Snapshot snap = allocator_->snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_TRUE(snap.segments[0].is_expandable);
  EXPECT_EQ(snap.segments[0].address, p);
  EXPECT_EQ(snap.segments[0].total_size, 2 * kMiB);
  ASSERT_EQ(snap.segments[0].blocks.size(), 2u);
  EXPECT_EQ(snap.segments[0].blocks[1].size, 2 * kMiB - 1024);
  // The reservation is 1 1/8 of the 80 GiB device, in 2 MiB pages.
  EXPECT_EQ(device_->live_reservations(), 1u);
}

TEST_F(Expandable, LargePagesAreTwentyMiBAndGrowAtTheLowestAddressThatFits) {
  const DevicePtr a = alloc(30 * kMiB);  // maps pages 0 and 1 (40 MiB)
  EXPECT_EQ(calls(CallKind::create_physical), 2u);
  EXPECT_EQ(calls(CallKind::map), 2u);
  EXPECT_EQ(calls(CallKind::set_access), 1u);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 40 * kMiB);
  const DevicePtr b = alloc(5 * kMiB);  // from the cached 10 MiB after a
  EXPECT_EQ(b, a + 30 * kMiB);
  EXPECT_EQ(stat("num_device_alloc"), 1);
  // 15 MiB: the cached 5 MiB before the unmapped space grows by one page.
  const DevicePtr c = alloc(15 * kMiB);
  EXPECT_EQ(c, a + 35 * kMiB);
  EXPECT_EQ(stat("num_device_alloc"), 2);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 60 * kMiB);
  EXPECT_EQ(calls(CallKind::create_physical), 3u);
  // Only fully free pages go, and only on empty_cache.
  release(a);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 60 * kMiB);
  allocator_->empty_cache();
  allocator_->validate();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 40 * kMiB);  // page 0 went; page 1 holds b
  EXPECT_EQ(stat("num_device_free"), 1);
  EXPECT_EQ(calls(CallKind::unmap), 1u);
  EXPECT_EQ(calls(CallKind::release_physical), 1u);
  const Snapshot snap = allocator_->snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].address, a + 20 * kMiB);  // the mapped range now starts at page 1
  EXPECT_EQ(snap.segments[0].total_size, 40 * kMiB);
}

TEST_F(Expandable, SplitsDownTo512Bytes) {
  // Native large-pool blocks keep a remainder of 1 MiB or less; expandable splits it.
  const DevicePtr a = alloc(40 * kMiB - 512);
  const DevicePtr b = alloc(512);  // small pool: a separate reservation
  EXPECT_NE(b, a + 40 * kMiB - 512);
  const Snapshot snap = allocator_->snapshot();
  const SegmentInfo* large = nullptr;
  for (const SegmentInfo& s : snap.segments) {
    if (s.is_large) large = &s;
  }
  ASSERT_NE(large, nullptr);
  ASSERT_EQ(large->blocks.size(), 2u);
  EXPECT_EQ(large->blocks[0].size, 40 * kMiB - 512);
  EXPECT_EQ(large->blocks[1].size, 512u);
  EXPECT_EQ(large->blocks[1].state, BlockState::inactive);
}

TEST_F(Expandable, EachStreamHasItsOwnReservation) {
  const DevicePtr a = alloc(4 * kMiB, 0);
  const DevicePtr b = alloc(4 * kMiB, 1);
  EXPECT_EQ(device_->live_reservations(), 2u);
  EXPECT_NE(b, a + 4 * kMiB);
  release(a);
  EXPECT_NE(alloc(4 * kMiB, 1), a);  // never across streams
}

TEST_F(Expandable, HistoryRecordsMapsAndUnmaps) {
  std::vector<TraceEvent> seen;
  allocator_->attach_trace_tracker([&](const TraceEvent& e) { seen.push_back(e); });
  const DevicePtr a = alloc(30 * kMiB);
  release(a);
  allocator_->empty_cache();
  std::vector<TraceAction> actions;
  actions.reserve(seen.size());
  for (const TraceEvent& e : seen) actions.push_back(e.action);
  using A = TraceAction;
  EXPECT_EQ(actions, (std::vector<A>{A::segment_map, A::alloc, A::free_requested,
                                     A::free_completed, A::segment_unmap}));
  EXPECT_EQ(seen[0].addr, a);
  EXPECT_EQ(seen[0].size, 40 * kMiB);
  EXPECT_EQ(seen[4].addr, a);
  EXPECT_EQ(seen[4].size, 40 * kMiB);
}

// PyTorch asserts when the oversize release path meets an expandable block;
// reservoir unmaps its free pages and carries on.
TEST_F(Expandable, MaxSplitSizeReleasesOversizeBlocksByUnmapping) {
  make("expandable_segments:True,max_split_size_mb:64", 160 * kMiB);
  const DevicePtr big = alloc(100 * kMiB);  // pages 0-4
  const DevicePtr pin = alloc(20 * kMiB);   // page 5
  EXPECT_EQ(pin, big + 100 * kMiB);
  release(big);
  // 130 MiB needs 7 pages; 40 MiB are free on the device: the cached 100 MiB
  // oversize block is unmapped, then the retry maps 140 MiB. The reservation
  // is 1 1/8 of the 160 MiB device (180 MiB), too short past `pin`, and the
  // hole before `pin` is too short too: a second reservation takes it.
  const DevicePtr c = alloc(130 * kMiB);
  EXPECT_EQ(c, big + 180 * kMiB);
  EXPECT_EQ(device_->live_reservations(), 2u);
  EXPECT_EQ(stat("num_alloc_retries"), 1);
  EXPECT_EQ(stat("num_device_free"), 1);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 160 * kMiB);
}

TEST_F(Expandable, APartialMapFailureUnwindsCleanly) {
  // PyTorch is left with handles it cannot map; reservoir releases them.
  device_->fail_nth(CallKind::map, 2, Status::device_error);
  EXPECT_THROW(alloc(30 * kMiB), DeviceError);
  allocator_->validate();
  EXPECT_EQ(device_->live_physical(), 0u);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  const DevicePtr a = alloc(30 * kMiB);  // and the next request works
  EXPECT_EQ(stat("reserved_bytes.all.current"), 40 * kMiB);
  release(a);
}

TEST_F(Expandable, OutOfMemoryCreatingAPageReleasesThePagesCreatedSoFar) {
  device_->fail_nth(CallKind::create_physical, 2, Status::out_of_memory);
  const DevicePtr a = alloc(30 * kMiB);  // the retry ladder maps again
  EXPECT_EQ(stat("num_alloc_retries"), 1);
  EXPECT_EQ(device_->live_physical(), 2u);
  EXPECT_EQ(calls(CallKind::release_physical), 1u);
  release(a);
}

TEST_F(Expandable, SwitchingBackToNativeKeepsServingFromClassicSegmentsOnly) {
  const DevicePtr a = alloc(30 * kMiB);
  release(a);
  allocator_->set_config(AllocatorConfig{});
  const DevicePtr b = alloc(5 * kMiB);
  EXPECT_EQ(calls(CallKind::allocate_segment), 1u);  // the cached expandable block is skipped
  EXPECT_NE(b, a);
  release(b);
}

// From PyTorch 2.5 a private pool (a CUDA graph's, a MemPool's) has
// expandable segments of its own: one reservation per stream and pool,
// pages counted in the pool's reserved bytes, unmapped when the pool is
// released and the cache emptied, the reservation given back.
TEST_F(Expandable, APrivatePoolHasAReservationOfItsOwn) {
  const PoolId pool{0, 3};
  const DevicePtr outside = alloc(3 * kMiB);
  allocator_->begin_allocate_to_pool(pool, [](StreamId) { return true; });
  const DevicePtr a = alloc(3 * kMiB);
  const DevicePtr b = alloc(30 * kMiB);  // grows the pool's reservation: 20 MiB more
  const DevicePtr c = alloc(1000);       // the pool's small reservation
  allocator_->end_allocate_to_pool(pool);
  EXPECT_EQ(b, a + 3 * kMiB);
  EXPECT_EQ(calls(CallKind::reserve), 3u);
  EXPECT_EQ(calls(CallKind::allocate_segment), 0u);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 62 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 60 * kMiB);
  EXPECT_EQ(stat("num_device_alloc"), 4);
  const auto by_pool = allocator_->private_pool_reserved();
  ASSERT_EQ(by_pool.count(pool), 1u);
  EXPECT_EQ(by_pool.at(pool)[0].current, static_cast<std::int64_t>(42 * kMiB));
  EXPECT_EQ(by_pool.at(pool)[1].current, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(by_pool.at(pool)[2].current, static_cast<std::int64_t>(40 * kMiB));
  std::vector<std::pair<DevicePtr, PoolId>> segments;
  for (const SegmentInfo& seg : allocator_->snapshot().segments) {
    EXPECT_TRUE(seg.is_expandable);
    segments.emplace_back(seg.address, seg.pool_id);
  }
  EXPECT_EQ(segments, (std::vector<std::pair<DevicePtr, PoolId>>{
                          {outside, {0, 0}}, {a, pool}, {c, pool}}));
  // A pool in use keeps its pages through empty_cache.
  release(a);
  allocator_->empty_cache();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 62 * kMiB);
  release(b);
  release(c);
  allocator_->release_pool(pool);
  allocator_->empty_cache();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 20 * kMiB);  // outside's page
  EXPECT_EQ(allocator_->private_pool_reserved().at(pool)[0].current, 0);
  EXPECT_EQ(device_->live_reservations(), 1u);  // the default pool's stays, as PyTorch's
  release_all({outside});
}

// A private pool whose first mapping fails holds a reservation with nothing
// mapped: the failure is the caller's (a DeviceError for map), and the
// reservation goes back with the pool.
TEST_F(Expandable, AFailedFirstMappingOfAPrivatePoolLeavesNothingWhenThePoolGoes) {
  const PoolId pool{0, 4};
  allocator_->begin_allocate_to_pool(pool, [](StreamId) { return true; });
  device_->fail_nth(CallKind::map, 1, Status::device_error);
  EXPECT_THROW((void)alloc(3 * kMiB), DeviceError);
  allocator_->end_allocate_to_pool(pool);
  allocator_->validate();
  EXPECT_EQ(device_->live_reservations(), 1u);
  EXPECT_EQ(device_->live_physical(), 0u);
  allocator_->release_pool(pool);
  allocator_->empty_cache();
  allocator_->validate();
  EXPECT_EQ(device_->live_reservations(), 0u);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
}

// Before PyTorch 2.5 private pools kept ordinary segments.
TEST_F(Expandable, BeforePyTorch25APrivatePoolHasOrdinarySegments) {
  make("expandable_segments:True,pytorch_version:2.4");
  const PoolId pool{0, 3};
  allocator_->begin_allocate_to_pool(pool, [](StreamId) { return true; });
  const DevicePtr a = alloc(3 * kMiB);
  allocator_->end_allocate_to_pool(pool);
  EXPECT_EQ(calls(CallKind::allocate_segment), 1u);
  EXPECT_EQ(calls(CallKind::reserve), 0u);
  const Snapshot snap = allocator_->snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_FALSE(snap.segments[0].is_expandable);
  EXPECT_EQ(snap.segments[0].total_size, 20 * kMiB);
  release(a);
  allocator_->release_pool(pool);
  release_all({});
}

TEST_F(Expandable, ConflictingPoliciesAreRefused) {
  SimDevice device;
  EXPECT_THROW(
      CachingAllocator(device, AllocatorConfig::parse("expandable_segments:True,policy:paging")),
      UsageError);
}

class Paging : public AllocatorTest {
 protected:
  void SetUp() override { make("policy:paging"); }
  std::uint64_t calls(CallKind k) const { return device_->calls(k); }
};

TEST_F(Paging, PagesMappedTogetherShareOneHandle) {
  const DevicePtr a = alloc(100 * kMiB);
  EXPECT_EQ(calls(CallKind::create_physical), 1u);
  EXPECT_EQ(calls(CallKind::map), 1u);
  EXPECT_EQ(calls(CallKind::set_access), 1u);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 100 * kMiB);
  release(a);
}

TEST_F(Paging, MapsAheadWhileMemoryIsPlentiful) {
  // 4 MiB asked, 20 MiB mapped (the large-pool floor): the next four fit.
  const DevicePtr a = alloc(4 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 20 * kMiB);
  for (std::size_t i = 1; i < 5; ++i) EXPECT_EQ(alloc(4 * kMiB), a + i * 4 * kMiB);
  EXPECT_EQ(calls(CallKind::map), 1u);
}

TEST_F(Paging, SmallAndLargeRequestsShareOneArenaPerStream) {
  const DevicePtr s = alloc(1000);
  const DevicePtr l = alloc(4 * kMiB);
  EXPECT_EQ(l, s + 1024);  // right after the small block, in the same pages
  EXPECT_EQ(calls(CallKind::reserve), 1u);
  EXPECT_EQ(calls(CallKind::map), 1u);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 20 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.large_pool.current"), 20 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.small_pool.current"), 0);
  EXPECT_EQ(stat("allocated_bytes.large_pool.current"), static_cast<std::int64_t>(4 * kMiB + 1024));
  // Another stream has an arena of its own.
  const DevicePtr t = alloc(1000, 1);
  EXPECT_EQ(calls(CallKind::reserve), 2u);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 40 * kMiB);
  release(s);
  release(l);
  release(t);
}

TEST_F(Paging, MapAheadFollowsWhatTheArenaHolds) {
  // Sixteen 100 MiB blocks: each maps just itself (a sixteenth of the arena
  // stays under 100 MiB), and nothing is left over.
  for (int i = 0; i < 16; ++i) alloc(100 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 1600 * kMiB);
  EXPECT_EQ(calls(CallKind::map), 16u);
  // Then a sixteenth of 1600 MiB: 100 MiB for a 10 MiB request...
  alloc(10 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 1700 * kMiB);
  alloc(90 * kMiB);  // ...which the next request uses
  EXPECT_EQ(calls(CallKind::map), 17u);
  // A request of 128 MiB or more brings room for half another like it.
  alloc(2000 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 4700 * kMiB);
  alloc(1000 * kMiB);
  EXPECT_EQ(calls(CallKind::map), 18u);
  // And the chunk stops at 160 MiB however large the arena grows.
  alloc(10 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 4860 * kMiB);
  EXPECT_EQ(calls(CallKind::create_physical), 19u);
  EXPECT_EQ(calls(CallKind::set_access), 19u);
}

TEST_F(Paging, NearTheLimitOnlyWhatIsAskedIsMapped) {
  make("policy:paging", 64 * kMiB);
  alloc(40 * kMiB);
  // 4 MiB asked of the 24 MiB left: rather than the 20 MiB chunk, 4 MiB and
  // an eighth of the other 20 (2.5 MiB), rounded up to the page.
  alloc(4 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 48 * kMiB);
}

TEST_F(Paging, AFreeHandleMovesWhereTheArenaGrowsWhileItsNeighboursStayInUse) {
  make("policy:paging", 80 * kMiB);
  const DevicePtr a = alloc(20 * kMiB);
  const DevicePtr b = alloc(20 * kMiB);
  const DevicePtr c = alloc(20 * kMiB);
  EXPECT_EQ(b, a + 20 * kMiB);
  EXPECT_EQ(c, a + 40 * kMiB);
  EXPECT_EQ(calls(CallKind::create_physical), 3u);
  release(b);
  // 40 MiB more than the 80 MiB device holds: b's handle alone is unmapped
  // and mapped again where the new block grows, beside 20 MiB of new memory.
  // (The first reservation is 90 MiB, 1 1/8 of the device: d starts a second.)
  const DevicePtr d = alloc(40 * kMiB);
  EXPECT_EQ(d, a + 90 * kMiB);
  EXPECT_EQ(calls(CallKind::unmap), 1u);
  EXPECT_EQ(calls(CallKind::release_physical), 0u);
  EXPECT_EQ(calls(CallKind::create_physical), 5u);  // the first 40 MiB was refused
  EXPECT_EQ(calls(CallKind::map), 5u);
  EXPECT_EQ(calls(CallKind::synchronize_stream), 1u);  // before b's pages moved
  EXPECT_EQ(stat("num_alloc_retries"), 0);             // no full flush was needed
  EXPECT_EQ(stat("reserved_bytes.all.current"), 80 * kMiB);
  EXPECT_EQ(device_->used_bytes(), 80 * kMiB);
  EXPECT_EQ(device_->live_physical(), 4u);
  release_all({a, c, d});  // freed and the cache emptied, everything goes back
}

// Stitching lends free physical handles whole: CUDA maps a handle from its
// start only (cuMemMap refuses any other offset), so free pages inside a
// handle that also holds live blocks cannot be lent. With the device full,
// such a request runs out of memory, as it would under PyTorch's allocator,
// and no device call fails.
TEST_F(Paging, FreePagesInsideAHandleStillInUseAreNotLent) {
  make("policy:paging", 100 * kMiB);
  const DevicePtr whole = alloc(100 * kMiB);  // one handle of 50 pages
  release(whole);
  std::vector<DevicePtr> part;
  part.reserve(5);
  for (int i = 0; i < 5; ++i) part.push_back(alloc(20 * kMiB));
  EXPECT_EQ(part[4], whole + 80 * kMiB);
  release(part[1]);
  release(part[3]);
  const std::uint64_t maps = calls(CallKind::map);
  EXPECT_THROW((void)alloc(40 * kMiB), OutOfMemoryError);
  allocator_->validate();
  EXPECT_EQ(calls(CallKind::map), maps);
  EXPECT_EQ(device_->live_physical(), 1u);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 100 * kMiB);
  for (int i : {0, 2, 4}) release(part[i]);
  allocator_->empty_cache();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(device_->used_bytes(), 0u);
}

// Whole free handles scattered between live ones serve a request the
// device has no memory left for: each moves whole, mapped from its start,
// into the range that serves it.
TEST_F(Paging, ScatteredFreeHandlesServeARequestOnAFullDevice) {
  make("policy:paging", 60 * kMiB);
  const DevicePtr a = alloc(20 * kMiB);
  const DevicePtr b = alloc(20 * kMiB);
  const DevicePtr c = alloc(20 * kMiB);
  ASSERT_EQ(device_->live_physical(), 3u);  // near the limit: one handle each
  EXPECT_EQ(b, a + 20 * kMiB);
  EXPECT_EQ(c, b + 20 * kMiB);
  release(a);
  release(c);
  // 40 MiB free in two handles on either side of b's, and the device is full.
  const std::uint64_t maps = calls(CallKind::map);
  const DevicePtr s = alloc(40 * kMiB);
  EXPECT_GE(s, c + 20 * kMiB);                 // a new range...
  EXPECT_EQ(device_->live_physical(), 3u);     // ...over the handles there are
  EXPECT_EQ(calls(CallKind::map), maps + 2);   // a's handle and c's, each whole
  EXPECT_EQ(device_->used_bytes(), 60 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 60 * kMiB);
  EXPECT_EQ(stat("allocated_bytes.all.current"), 60 * kMiB);
  // Freed, it stays cached: the same request gets it back with no device call.
  release(s);
  EXPECT_EQ(alloc(40 * kMiB), s);
  EXPECT_EQ(calls(CallKind::map), maps + 2);
  release(s);
  release(b);
  allocator_->empty_cache();
  allocator_->validate();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(device_->used_bytes(), 0u);
}

TEST_F(Paging, ATrainingLoopMakesNoDeviceCallsAfterItsFirstStep) {
  make("policy:paging", 160 * kMiB);
  auto step = [&] {
    std::vector<DevicePtr> live;
    for (std::size_t mib : {30, 50, 10, 40, 3}) live.push_back(alloc(mib * kMiB));
    for (DevicePtr p : live) release(p);
  };
  step();
  std::uint64_t after_first = 0;
  for (CallKind k : kMemoryCallKinds) after_first += calls(k);
  for (int i = 0; i < 20; ++i) step();
  std::uint64_t after_all = 0;
  for (CallKind k : kMemoryCallKinds) after_all += calls(k);
  EXPECT_EQ(after_all, after_first);
}

TEST_F(Paging, AFreeHandleOfTheSizeAboutToBeCreatedMovesInstead) {
  make("policy:paging", 1024 * kMiB);
  const DevicePtr x = alloc(20 * kMiB, 1);
  release(x);  // cached on stream 1: a whole free 20 MiB handle
  const std::uint64_t syncs = calls(CallKind::synchronize_stream);
  const DevicePtr a = alloc(20 * kMiB, 0);  // stream 0 would create 20 MiB: x's moves
  EXPECT_EQ(calls(CallKind::create_physical), 1u);
  EXPECT_EQ(calls(CallKind::unmap), 1u);
  EXPECT_EQ(calls(CallKind::map), 2u);
  EXPECT_EQ(calls(CallKind::synchronize_stream), syncs + 1);  // stream 1's work done first
  EXPECT_EQ(device_->used_bytes(), 20 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 20 * kMiB);
  // A free handle smaller than the mapping planned stays where it is...
  const DevicePtr y = alloc(20 * kMiB, 1);
  release(y);
  const DevicePtr b = alloc(100 * kMiB, 0);
  EXPECT_EQ(calls(CallKind::unmap), 1u);
  EXPECT_EQ(device_->used_bytes(), 140 * kMiB);
  // ...and so does one more than twice as large.
  release(b);
  const DevicePtr c = alloc(20 * kMiB, 1);  // stream 1 reuses y; then would create 20
  const DevicePtr d = alloc(20 * kMiB, 1);
  EXPECT_EQ(c, y);
  EXPECT_EQ(calls(CallKind::unmap), 1u);
  EXPECT_EQ(device_->used_bytes(), 160 * kMiB);
  for (DevicePtr p : {a, c, d}) release(p);
}

TEST_F(Paging, UnderPressureAnotherStreamsFreeHandleMovesAfterItsStreamSynchronizes) {
  make("policy:paging", 60 * kMiB);
  const DevicePtr x = alloc(20 * kMiB, 1);
  release(x);  // cached on stream 1: smaller than the 30 MiB mappings below
  const DevicePtr a = alloc(30 * kMiB, 0);
  EXPECT_EQ(calls(CallKind::unmap), 0u);
  const std::uint64_t syncs = calls(CallKind::synchronize_stream);
  const DevicePtr b = alloc(30 * kMiB, 0);  // 10 MiB free on the device, 20 cached on stream 1
  EXPECT_EQ(b, a + 30 * kMiB);
  EXPECT_EQ(calls(CallKind::synchronize_stream), syncs + 1);
  EXPECT_EQ(calls(CallKind::unmap), 1u);
  EXPECT_EQ(calls(CallKind::release_physical), 0u);
  EXPECT_EQ(device_->used_bytes(), 60 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 60 * kMiB);
  EXPECT_EQ(stat("num_alloc_retries"), 0);
  // Stream 1 gets memory again, and all of it goes back at the end.
  release(b);
  const DevicePtr y = alloc(20 * kMiB, 1);
  release_all({y, a});
}

// Moving a free handle fails at each of its device calls: a clear error, and
// the allocator stays whole (the handle stays where it was, or goes back to
// the device, and is counted either way).
class PagingMoveFails : public AllocatorTest,
                        public ::testing::WithParamInterface<CallKind> {};

TEST_P(PagingMoveFails, TheErrorLeavesTheAllocatorConsistent) {
  make("policy:paging", 80 * kMiB);
  const DevicePtr a = alloc(20 * kMiB);
  const DevicePtr b = alloc(20 * kMiB);
  const DevicePtr c = alloc(20 * kMiB);
  release(b);
  const CallKind kind = GetParam();
  // The next call of the kind fails: for map, the moved handle's.
  device_->fail_nth(kind, 1, Status::device_error);
  EXPECT_THROW((void)allocator_->allocate(40 * kMiB), DeviceError);
  allocator_->validate();
  EXPECT_EQ(stat("allocated_bytes.all.current"), 40 * kMiB);
  EXPECT_EQ(stat("reserved_bytes.all.current"),
            static_cast<std::int64_t>(device_->used_bytes()));
  // A failure before the unmap keeps b's handle cached; after, it is gone.
  const bool before_unmap = kind == CallKind::synchronize_stream || kind == CallKind::unmap;
  EXPECT_EQ(device_->used_bytes(), before_unmap ? 60 * kMiB : 40 * kMiB);
  const DevicePtr d = alloc(40 * kMiB);  // and the request can be made again
  EXPECT_EQ(device_->used_bytes(), 80 * kMiB);
  release_all({a, c, d});
}

INSTANTIATE_TEST_SUITE_P(Calls, PagingMoveFails,
                         ::testing::Values(CallKind::synchronize_stream, CallKind::unmap,
                                           CallKind::map, CallKind::set_access),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST_F(Paging, AReleaseThresholdGivesBackWholeFreeHandlesBeyondIt) {
  make("policy:paging,paging_release_threshold_mb:150");
  const DevicePtr a = alloc(100 * kMiB);
  const DevicePtr b = alloc(100 * kMiB);
  const DevicePtr c = alloc(100 * kMiB);
  EXPECT_EQ(calls(CallKind::create_physical), 3u);
  release(a);  // 100 MiB cached: under the threshold, kept
  EXPECT_EQ(stat("reserved_bytes.all.current"), 300 * kMiB);
  EXPECT_EQ(calls(CallKind::release_physical), 0u);
  release(b);  // 200 MiB cached: one whole handle goes, 100 MiB stay
  EXPECT_EQ(stat("reserved_bytes.all.current"), 200 * kMiB);
  EXPECT_EQ(calls(CallKind::unmap), 1u);
  EXPECT_EQ(calls(CallKind::release_physical), 1u);
  EXPECT_EQ(device_->used_bytes(), 200 * kMiB);
  EXPECT_EQ(alloc(100 * kMiB), a);  // the cached one serves with no device call
  EXPECT_EQ(calls(CallKind::create_physical), 3u);
  release(a);
  release(c);
}

TEST_F(Paging, AtAZeroThresholdAHandleGoesWhenItsLastBlockIsFreed) {
  make("policy:paging,paging_release_threshold_mb:0");
  const DevicePtr a = alloc(4 * kMiB);  // both in one 20 MiB handle
  const DevicePtr b = alloc(4 * kMiB);
  release(a);  // the handle still holds b: nothing can go
  EXPECT_EQ(stat("reserved_bytes.all.current"), 20 * kMiB);
  EXPECT_EQ(calls(CallKind::unmap), 0u);
  release(b);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(calls(CallKind::release_physical), 1u);
  EXPECT_EQ(device_->used_bytes(), 0u);
  // A failing unmap leaves the handle cached, and the free itself succeeds.
  const DevicePtr c = alloc(4 * kMiB);
  device_->fail_nth(CallKind::unmap, 1, Status::device_error);
  release(c);
  EXPECT_EQ(stat("allocated_bytes.all.current"), 0);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 20 * kMiB);
  allocator_->empty_cache();
  EXPECT_EQ(device_->used_bytes(), 0u);
}

TEST_F(Paging, StitchingBorrowsFromAnotherStreamAfterSynchronizingIt) {
  make("policy:paging", 60 * kMiB);
  const DevicePtr a = alloc(20 * kMiB, 1);  // three handles on stream 1
  const DevicePtr keep = alloc(20 * kMiB, 1);
  const DevicePtr c = alloc(20 * kMiB, 1);
  ASSERT_EQ(device_->live_physical(), 3u);
  release(a);
  release(c);
  const std::uint64_t syncs = calls(CallKind::synchronize_stream);
  const DevicePtr b = alloc(40 * kMiB, 0);  // stream 0: only stream 1's free handles remain
  EXPECT_GT(calls(CallKind::synchronize_stream), syncs);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 60 * kMiB);
  release(b);
  release(keep);
}

}  // namespace
}  // namespace reservoir::testing
