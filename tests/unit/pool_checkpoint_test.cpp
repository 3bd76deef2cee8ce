// A private pool's checkpoint and its restoration (what PyTorch's CUDA graph
// trees do with getCheckpointState / setCheckpointPoolState): exact layouts,
// statistics and history, and every refusal leaving the allocator as it was.
#include <string>
#include <vector>

#include "allocator_fixture.hpp"
#include "reservoir/errors.hpp"

namespace reservoir::testing {
namespace {

using Checkpoint = AllocatorTest;
using CheckpointBlock = PoolCheckpoint::BlockState;

constexpr PoolId kPool{0, 7};

bool same(const CheckpointBlock& a, const CheckpointBlock& b) {
  return a.ptr == b.ptr && a.size == b.size && a.stream == b.stream && a.allocated == b.allocated &&
         a.mapped == b.mapped;
}

// The pool's blocks now, as a checkpoint would list them.
std::vector<CheckpointBlock> blocks_now(CachingAllocator& allocator) {
  std::vector<CheckpointBlock> out;
  for (const SegmentInfo& seg : allocator.snapshot().segments) {
    if (seg.pool_id != kPool) continue;
    for (const BlockInfo& b : seg.blocks) {
      out.push_back({b.address, b.size, seg.stream, b.state == reservoir::BlockState::active_allocated});
    }
  }
  return out;
}

class PoolCheckpointTest : public Checkpoint {
 protected:
  // a (3 MiB), b (4 MiB) and c (5 MiB) in one 20 MiB segment of the pool.
  void fill_pool() {
    route();
    a_ = alloc(3 * kMiB);
    b_ = alloc(4 * kMiB);
    c_ = alloc(5 * kMiB);
    allocator_->end_allocate_to_pool(kPool);
  }
  // Frees the blocks and the pool: the device must hold nothing.
  void finish(std::initializer_list<DevicePtr> blocks) {
    for (DevicePtr p : blocks) release(p);
    for (; begun_ > 0; --begun_) allocator_->release_pool(kPool);  // each route was a use
    release_all({});
  }
  // Routes this thread's allocations to the pool (one use of it each time).
  void route() {
    allocator_->begin_allocate_current_thread_to_pool(kPool);
    ++begun_;
  }
  int begun_ = 0;
  DevicePtr a_ = 0;
  DevicePtr b_ = 0;
  DevicePtr c_ = 0;
};

TEST_F(PoolCheckpointTest, ListsThePoolsSegmentsBlockByBlock) {
  const DevicePtr outside = alloc(3 * kMiB);  // the default pool's: not in the checkpoint
  fill_pool();
  const PoolCheckpoint cp = allocator_->checkpoint_pool(kPool);
  EXPECT_EQ(cp.pool, kPool);
  ASSERT_EQ(cp.segments.size(), 1u);
  EXPECT_FALSE(cp.segments[0].is_small);
  const std::vector<CheckpointBlock> expected{{a_, 3 * kMiB, 0, true},
                                         {a_ + 3 * kMiB, 4 * kMiB, 0, true},
                                         {a_ + 7 * kMiB, 5 * kMiB, 0, true},
                                         {a_ + 12 * kMiB, 8 * kMiB, 0, false}};
  ASSERT_EQ(cp.segments[0].blocks.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(same(cp.segments[0].blocks[i], expected[i])) << i;
  }
  EXPECT_EQ(a_, outside + 20 * kMiB);
  release(outside);
  finish({a_, b_, c_});
}

TEST_F(PoolCheckpointTest, RestoreLaysThePoolOutAgain) {
  fill_pool();
  const PoolCheckpoint cp = allocator_->checkpoint_pool(kPool);
  const std::vector<CheckpointBlock> before = blocks_now(*allocator_);
  // After the checkpoint: b dies, d takes half its place.
  release(b_);
  route();
  const DevicePtr d = alloc(2 * kMiB);
  allocator_->end_allocate_to_pool(kPool);
  EXPECT_EQ(d, b_);
  const std::int64_t allocs_before = stat("allocation.all.allocated");

  allocator_->record_history({.enabled = true, .max_entries = 100});
  const PoolRestore r = allocator_->restore_pool(cp);
  allocator_->validate();
  EXPECT_EQ(r.freed, (std::vector<DevicePtr>{a_, d, c_}));
  EXPECT_EQ(r.allocated, (std::vector<DevicePtr>{a_, b_, c_}));
  const std::vector<CheckpointBlock> after = blocks_now(*allocator_);
  ASSERT_EQ(after.size(), before.size());
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(same(after[i], before[i])) << i;

  // Statistics as PyTorch's: four blocks allocated (the free one too), one freed again;
  // the requested size of a restored block is its size.
  EXPECT_EQ(stat("allocation.all.allocated"), allocs_before + 4);
  EXPECT_EQ(stat("allocation.all.current"), 3);
  EXPECT_EQ(stat("allocated_bytes.all.current"), static_cast<std::int64_t>(12 * kMiB));
  EXPECT_EQ(stat("requested_bytes.all.current"), static_cast<std::int64_t>(12 * kMiB));
  EXPECT_EQ(stat("allocated_bytes.all.peak"), static_cast<std::int64_t>(20 * kMiB));
  EXPECT_EQ(stat("inactive_split.all.current"), 1);
  EXPECT_EQ(stat("segment.all.current"), 1);
  EXPECT_EQ(stat("num_device_alloc"), 1);

  // The history PyTorch writes: the pool's allocations freed, then every
  // checkpointed block allocated, then its free ones freed.
  std::vector<std::string> events;
  for (const TraceEvent& e : allocator_->snapshot().history) {
    if (e.action == TraceAction::snapshot) continue;
    events.push_back(std::string(to_string(e.action)) + "@" + std::to_string((e.addr - a_) >> 20));
  }
  EXPECT_EQ(events, (std::vector<std::string>{
                        "free_requested@0", "free_completed@0", "free_requested@3", "free_completed@3",
                        "free_requested@7", "free_completed@7", "alloc@0", "alloc@3", "alloc@7",
                        "alloc@12", "free_requested@12", "free_completed@12"}));
  finish({a_, b_, c_});
}

TEST_F(PoolCheckpointTest, RestoreAfterTheCheckpointsFreeBlockWasUsed) {
  fill_pool();
  release(c_);  // the checkpoint holds a and b, then 13 MiB free
  const PoolCheckpoint cp = allocator_->checkpoint_pool(kPool);
  route();
  const DevicePtr e = alloc(10 * kMiB);  // at c's place
  const DevicePtr f = alloc(12 * kMiB);  // a second segment of the pool
  allocator_->end_allocate_to_pool(kPool);
  release(a_);
  const PoolRestore r = allocator_->restore_pool(cp);
  // f's segment is not in the checkpoint: f is freed and its segment stays cached.
  EXPECT_EQ(r.freed, (std::vector<DevicePtr>{b_, e, f}));
  EXPECT_EQ(r.allocated, (std::vector<DevicePtr>{a_, b_}));
  EXPECT_EQ(stat("allocation.all.current"), 2);
  EXPECT_EQ(stat("segment.all.current"), 2);
  EXPECT_EQ(stat("allocated_bytes.all.current"), static_cast<std::int64_t>(7 * kMiB));
  finish({a_, b_});
}

TEST_F(PoolCheckpointTest, SmallSegmentsAreCheckpointedToo) {
  route();
  const DevicePtr s1 = alloc(1000);
  const DevicePtr s2 = alloc(700);
  allocator_->end_allocate_to_pool(kPool);
  const PoolCheckpoint cp = allocator_->checkpoint_pool(kPool);
  ASSERT_EQ(cp.segments.size(), 1u);
  EXPECT_TRUE(cp.segments[0].is_small);
  ASSERT_EQ(cp.segments[0].blocks.size(), 3u);
  EXPECT_EQ(cp.segments[0].blocks[1].size, 1024u);
  release(s1);
  const PoolRestore r = allocator_->restore_pool(cp);
  EXPECT_EQ(r.freed, (std::vector<DevicePtr>{s2}));
  EXPECT_EQ(r.allocated, (std::vector<DevicePtr>{s1, s2}));
  EXPECT_EQ(stat("requested_bytes.small_pool.current"), 1024 + 1024);
  finish({s1, s2});
}

TEST_F(PoolCheckpointTest, UnknownAndReleasedPoolsAreRefused) {
  EXPECT_THROW(
      {
        try {
          (void)allocator_->checkpoint_pool({3, 4});
        } catch (const UsageError& e) {
          EXPECT_STREQ(e.what(), "checkpoint_pool: no pool (3, 4)");
          throw;
        }
      },
      UsageError);
  fill_pool();
  const PoolCheckpoint cp = allocator_->checkpoint_pool(kPool);
  release(a_);
  release(b_);
  release(c_);
  allocator_->release_pool(kPool);
  EXPECT_THROW(
      {
        try {
          (void)allocator_->restore_pool(cp);
        } catch (const UsageError& e) {
          EXPECT_STREQ(e.what(),
                       "restore_pool: pool (0, 7) was released (its memory is being given back)");
          throw;
        }
      },
      UsageError);
  allocator_->empty_cache();
  EXPECT_EQ(device_->used_bytes(), 0u);
}

// A checkpoint that does not fit the pool changes nothing.
TEST_F(PoolCheckpointTest, AMismatchedCheckpointChangesNothing) {
  fill_pool();
  const PoolCheckpoint good = allocator_->checkpoint_pool(kPool);
  const auto stats = allocator_->stats_map();
  const std::vector<CheckpointBlock> layout = blocks_now(*allocator_);
  const auto refused = [&](const PoolCheckpoint& cp, const std::string& says) {
    try {
      (void)allocator_->restore_pool(cp);
      ADD_FAILURE() << "expected UsageError: " << says;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    allocator_->validate();
    EXPECT_EQ(allocator_->stats_map(), stats);
    const std::vector<CheckpointBlock> now = blocks_now(*allocator_);
    ASSERT_EQ(now.size(), layout.size());
    for (std::size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(same(now[i], layout[i]));
  };
  PoolCheckpoint moved = good;
  for (CheckpointBlock& b : moved.segments[0].blocks) b.ptr += 2 * kMiB;
  refused(moved, "pool (0, 7) holds no segment at");
  PoolCheckpoint gap = good;
  gap.segments[0].blocks[1].size -= kMiB;
  refused(gap, "block 2 (");
  PoolCheckpoint truncated = good;
  truncated.segments[0].blocks.pop_back();
  refused(truncated, "its blocks cover 12582912 bytes of a segment of 20971520");
  PoolCheckpoint two_free = good;
  two_free.segments[0].blocks[2].allocated = false;
  refused(two_free, "blocks 2 and 3 are both free");
  PoolCheckpoint twice = good;
  twice.segments.push_back(good.segments[0]);
  refused(twice, "is given twice");
  PoolCheckpoint kind = good;
  kind.segments[0].is_small = true;
  refused(kind, "is in the large pool, the checkpoint says small");
  // An allocation used on another stream cannot be freed at once.
  allocator_->record_stream(reinterpret_cast<void*>(b_), 5);
  refused(good, "the block at");
  finish({a_, b_, c_});
}

TEST_F(PoolCheckpointTest, PendingStreamEventsRefuseACheckpoint) {
  fill_pool();
  allocator_->record_stream(reinterpret_cast<void*>(b_), 5);
  release(b_);
  try {
    (void)allocator_->checkpoint_pool(kPool);
    ADD_FAILURE() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("waits for 1 stream event(s); synchronize its streams first"),
              std::string::npos)
        << e.what();
  }
  device_->complete_stream(5);
  allocator_->process_completed_frees();
  EXPECT_EQ(allocator_->checkpoint_pool(kPool).segments[0].blocks.size(), 4u);
  finish({a_, c_});
}

// Under expandable segments (PyTorch 2.5 and later) the pool's memory is
// pages of a reservation of its own: the checkpoint lists the mapped blocks
// and the unmapped rest, and restoring lays the mapped part out again.
class ExpandablePoolCheckpoint : public PoolCheckpointTest {
 protected:
  void SetUp() override { make("expandable_segments:True"); }
};

TEST_F(ExpandablePoolCheckpoint, TheUnmappedRestOfTheReservationIsListedAndKept) {
  fill_pool();
  const PoolCheckpoint cp = allocator_->checkpoint_pool(kPool);
  ASSERT_EQ(cp.segments.size(), 1u);
  const std::vector<CheckpointBlock>& blocks = cp.segments[0].blocks;
  ASSERT_EQ(blocks.size(), 5u);
  EXPECT_TRUE(same(blocks[0], {a_, 3 * kMiB, 0, true, true}));
  EXPECT_TRUE(same(blocks[1], {a_ + 3 * kMiB, 4 * kMiB, 0, true, true}));
  EXPECT_TRUE(same(blocks[2], {a_ + 7 * kMiB, 5 * kMiB, 0, true, true}));
  EXPECT_TRUE(same(blocks[3], {a_ + 12 * kMiB, 8 * kMiB, 0, false, true}));
  EXPECT_EQ(blocks[4].ptr, a_ + 20 * kMiB);
  EXPECT_FALSE(blocks[4].mapped);
  EXPECT_FALSE(blocks[4].allocated);

  release(b_);
  route();
  const DevicePtr d = alloc(2 * kMiB);
  allocator_->end_allocate_to_pool(kPool);
  EXPECT_EQ(d, b_);
  const std::int64_t maps = stat("num_device_alloc");
  const PoolRestore r = allocator_->restore_pool(cp);
  allocator_->validate();
  EXPECT_EQ(r.freed, (std::vector<DevicePtr>{a_, d, c_}));
  EXPECT_EQ(r.allocated, (std::vector<DevicePtr>{a_, b_, c_}));
  const PoolCheckpoint again = allocator_->checkpoint_pool(kPool);
  ASSERT_EQ(again.segments.size(), 1u);
  ASSERT_EQ(again.segments[0].blocks.size(), blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) EXPECT_TRUE(same(again.segments[0].blocks[i], blocks[i])) << i;
  EXPECT_EQ(stat("num_device_alloc"), maps);  // nothing mapped or unmapped
  EXPECT_EQ(stat("allocated_bytes.all.current"), static_cast<std::int64_t>(12 * kMiB));
  EXPECT_EQ(stat("reserved_bytes.all.current"), static_cast<std::int64_t>(20 * kMiB));
  finish({a_, b_, c_});
}

TEST_F(ExpandablePoolCheckpoint, PagesMappedSinceTheCheckpointRefuseIt) {
  fill_pool();
  const PoolCheckpoint cp = allocator_->checkpoint_pool(kPool);
  route();
  const DevicePtr big = alloc(30 * kMiB);  // maps 20 MiB more of the pool's reservation
  allocator_->end_allocate_to_pool(kPool);
  const auto stats = allocator_->stats_map();
  try {
    (void)allocator_->restore_pool(cp);
    ADD_FAILURE() << "expected UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("has 1 unmapped range(s) now and 1 in the checkpoint, or at "
                                         "other addresses"),
              std::string::npos)
        << e.what();
  }
  allocator_->validate();
  EXPECT_EQ(allocator_->stats_map(), stats);
  finish({a_, b_, c_, big});
}

}  // namespace
}  // namespace reservoir::testing
