// The retry ladder, memory fraction, garbage collection, stream events and
// private pools, with exact device-call counts.
#include <fmt/format.h>

#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "allocator_fixture.hpp"
#include "reservoir/errors.hpp"

namespace reservoir::testing {
namespace {

using Ladder = AllocatorTest;

TEST_F(Ladder, ReleasesAllCachedBlocksThenRetries) {
  make("", 40 * kMiB);
  const DevicePtr a = alloc(20 * kMiB);
  release(a);
  const DevicePtr b = alloc(30 * kMiB);  // 20 cached + 30 > 40: free the cache, retry
  EXPECT_EQ(b, kBase + 20 * kMiB);
  EXPECT_EQ(stat("num_alloc_retries"), 1);
  EXPECT_EQ(stat("num_sync_all_streams"), 1);
  EXPECT_EQ(stat("num_device_free"), 1);
  EXPECT_EQ(stat("num_device_alloc"), 2);
  EXPECT_EQ(device_->calls(CallKind::allocate_segment), 3u);  // first try failed
}

TEST_F(Ladder, ReleasesOneOversizeBlockThatCoversTheRequest) {
  make("max_split_size_mb:40", 130 * kMiB);
  const DevicePtr x = alloc(50 * kMiB);
  const DevicePtr y = alloc(60 * kMiB);
  release(x);
  release(y);
  const DevicePtr z = alloc(30 * kMiB);  // oversize blocks refused; 110 + 30 > 130
  EXPECT_EQ(z, kBase + 110 * kMiB);
  EXPECT_EQ(stat("num_device_free"), 1);  // only the 50 MiB block
  EXPECT_EQ(stat("num_alloc_retries"), 0);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 90 * 1048576);
  EXPECT_EQ(allocator_->largest_cached_block(), 60 * kMiB);
}

TEST_F(Ladder, ReleasesOversizeBlocksLargestFirstUntilEnough) {
  make("max_split_size_mb:40", 130 * kMiB);
  const DevicePtr x = alloc(50 * kMiB);
  const DevicePtr y = alloc(60 * kMiB);
  release(x);
  release(y);
  const DevicePtr z = alloc(100 * kMiB);
  EXPECT_EQ(z, kBase + 110 * kMiB);
  EXPECT_EQ(stat("num_device_free"), 2);
  EXPECT_EQ(stat("num_alloc_retries"), 0);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 100 * 1048576);
}

// The message's closing advice as each release writes it (the strings of
// each release's libc10_cuda.so): PYTORCH_CUDA_ALLOC_CONF and the old
// documentation address up to 2.9, PYTORCH_ALLOC_CONF in 2.10, the new
// address from 2.11.
TEST_F(Ladder, OutOfMemoryMessageEndsAsTheReleaseWritesIt) {
  const std::string old_docs = "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)";
  const std::string new_docs =
      "(https://docs.pytorch.org/docs/stable/notes/cuda.html"
      "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";
  const std::vector<std::tuple<std::string, std::string, std::string>> releases = {
      {"2.6", "PYTORCH_CUDA_ALLOC_CONF", old_docs}, {"2.9", "PYTORCH_CUDA_ALLOC_CONF", old_docs},
      {"2.10", "PYTORCH_ALLOC_CONF", old_docs},     {"2.11", "PYTORCH_CUDA_ALLOC_CONF", new_docs},
      {"2.15", "PYTORCH_CUDA_ALLOC_CONF", new_docs}, {"", "PYTORCH_CUDA_ALLOC_CONF", new_docs}};
  for (const auto& [release, variable, docs] : releases) {
    make(release.empty() ? "" : "pytorch_version:" + release, 30 * kMiB);
    try {
      (void)allocator_->allocate(40 * kMiB);
      ADD_FAILURE() << "expected OutOfMemoryError";
    } catch (const OutOfMemoryError& e) {
      const std::string what = e.what();
      const std::string tail = fmt::format(
          " If reserved but unallocated memory is large try setting {}=expandable_segments:True "
          "to avoid fragmentation.  See documentation for Memory Management  {}",
          variable, docs);
      ASSERT_GE(what.size(), tail.size());
      EXPECT_EQ(what.substr(what.size() - tail.size()), tail) << release;
    }
  }
}

// Where the device lists the processes using it (NVML on a GPU), the
// message names each as PyTorch's does, before the allowed memory.
TEST_F(Ladder, OutOfMemoryMessageNamesTheProcessesUsingTheDevice) {
  SimDeviceOptions options;
  options.capacity = 30 * kMiB;
  options.lists_processes = true;
  device_ = std::make_unique<SimDevice>(options);
  allocator_ = std::make_unique<CachingAllocator>(*device_, AllocatorConfig::parse(""));
  allocator_->set_memory_fraction(0.9);
  const DevicePtr a = alloc(12 * kMiB);
  try {
    (void)allocator_->allocate(20 * kMiB);
    ADD_FAILURE() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.substr(0, what.find(" Of the allocated memory")),
              "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
              "30.00 MiB of which 18.00 MiB is free. Including non-PyTorch memory, this process "
              "has 12.00 MiB memory in use. 27.00 MiB allowed;");
  }
  release(a);
}

// PyTorch 2.15's expandable_segments_reserve: each segment reserves 5% of a
// 1 GiB device (51.20 MiB: three 20 MiB pages). A 55 MiB request fits a new
// segment; a 61 MiB one (62 MiB rounded) fits none, goes down the ladder
// (one retry) and fails with the message 2.15 writes, naming the stream's
// class where it has one. Measured on PyTorch 2.15 (simulated device, 1 GiB).
TEST_F(Ladder, ARequestBeyondTheExpandableSegmentReserveFailsAs215Says) {
  const std::string fits_none =
      " This allocation exceeds the expandable-segment reserve of 51.20 MiB {}, and a single allocation "
      "cannot span expandable segments. Raise PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve or "
      "expandable_segments_reserve_by_class (or unset it) so that a segment is at least 62.00 MiB.";
  for (const std::string config : {"expandable_segments_reserve:0.05", "expandable_segments_reserve:0.05G",
                                   "expandable_segments_reserve_by_class:[tiny:0.05]"}) {
    allocator_.reset();
    make("expandable_segments:True,pytorch_version:2.15," + config, 1024 * kMiB);
    const bool by_class = config.find("by_class") != std::string::npos;
    if (by_class) allocator_->set_stream_reserve_class(0, "tiny");
    const DevicePtr kept = alloc(30 * kMiB);
    const DevicePtr a = alloc(55 * kMiB);  // a segment of its own: 3 pages hold it
    release(a);
    try {
      (void)allocator_->allocate(61 * kMiB);
      ADD_FAILURE() << "expected OutOfMemoryError: " << config;
    } catch (const OutOfMemoryError& e) {
      const std::string what = e.what();
      const std::string unallocated = "reserved by PyTorch but unallocated.";
      EXPECT_EQ(what.substr(what.find(unallocated) + unallocated.size()),
                fmt::format(fmt::runtime(fits_none),
                            by_class ? "for stream reserve class 'tiny'" : "for this stream"))
          << config;
      EXPECT_TRUE(what.starts_with("CUDA out of memory. Tried to allocate 62.00 MiB.")) << what;
    }
    EXPECT_EQ(stat("num_ooms"), 1);
    EXPECT_EQ(stat("num_alloc_retries"), 1);
    allocator_->set_stream_reserve_class(0, "");
    if (by_class) {
      // Without its class the stream takes 9/8 of the device again.
      const DevicePtr big = alloc(61 * kMiB);
      release(big);
    }
    release(kept);
  }
}

// 2.15 under expandable segments ends on the address space instead.
TEST_F(Ladder, OutOfMemoryMessageUnderExpandableSegmentsEndsAs215WritesIt) {
  for (const std::string release : {"2.14", "2.15"}) {
    allocator_.reset();  // before the device it maps on
    make("expandable_segments:True,pytorch_version:" + release, 30 * kMiB);
    try {
      (void)allocator_->allocate(40 * kMiB);
      ADD_FAILURE() << "expected OutOfMemoryError";
    } catch (const OutOfMemoryError& e) {
      const std::string what = e.what();
      const std::string unallocated = "reserved by PyTorch but unallocated.";
      const std::string tail = what.substr(what.find(unallocated) + unallocated.size());
      if (release == "2.15") {
        EXPECT_EQ(tail,
                  " expandable_segments is enabled. If instead the process is running out of "
                  "virtual address space (VSZ), expandable segments may be over-reserving VA (each "
                  "segment reserves ~9/8 of device memory, times the number of streams); reduce it "
                  "via PYTORCH_CUDA_ALLOC_CONF expandable_segments_reserve / "
                  "expandable_segments_reserve_by_class.");
      } else {
        EXPECT_TRUE(tail.starts_with(" If reserved but unallocated memory is large")) << tail;
      }
    }
  }
}

TEST_F(Ladder, OutOfMemoryMessageCarriesPyTorchsFields) {
  make("", 30 * kMiB);
  const DevicePtr a = alloc(12 * kMiB);
  const DevicePtr b = alloc(512);
  (void)b;
  std::vector<std::size_t> observed;
  allocator_->attach_oom_observer(
      [&](int device, std::size_t size, std::size_t limit, std::size_t free) {
        observed = {static_cast<std::size_t>(device), size, limit, free};
      });
  try {
    (void)allocator_->allocate(20 * kMiB);
    ADD_FAILURE() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(std::string(e.what()),
              "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
              "30.00 MiB of which 16.00 MiB is free. Of the allocated memory 12.00 MiB is "
              "allocated by PyTorch, and 2.00 MiB is reserved by PyTorch but unallocated. If "
              "reserved but unallocated memory is large try setting "
              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
              "documentation for Memory Management  "
              "(https://docs.pytorch.org/docs/stable/notes/cuda.html"
              "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)");
    EXPECT_EQ(e.requested_bytes(), 20 * kMiB);
    EXPECT_EQ(e.device_free(), 16 * kMiB);
    EXPECT_EQ(e.device_total(), 30 * kMiB);
  }
  allocator_->validate();
  EXPECT_EQ(observed, (std::vector<std::size_t>{0, 20 * kMiB, 30 * kMiB, 16 * kMiB}));
  EXPECT_EQ(stat("num_ooms"), 1);
  EXPECT_EQ(stat("num_alloc_retries"), 1);
  release(a);
}

TEST_F(Ladder, MemoryFractionLimitsReservation) {
  make("", 100 * kMiB);
  allocator_->set_memory_fraction(0.5);
  const DevicePtr a = alloc(40 * kMiB);
  try {
    (void)allocator_->allocate(20 * kMiB);
    ADD_FAILURE() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("of which 60.00 MiB is free. 50.00 MiB allowed; Of the "
                                         "allocated memory 40.00 MiB"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(device_->calls(CallKind::allocate_segment), 1u);  // the fraction check needs no call
  release(a);
  EXPECT_THROW(allocator_->set_memory_fraction(1.5), UsageError);
}

TEST_F(Ladder, FreeMemoryCallbackRunsBeforeTheDevice) {
  const DevicePtr held = alloc(12 * kMiB);
  int calls = 0;
  allocator_->add_free_memory_callback([&] {
    ++calls;
    allocator_->deallocate(reinterpret_cast<void*>(held));  // the lock is released here
    return true;
  });
  const DevicePtr again = alloc(12 * kMiB);
  EXPECT_EQ(again, held);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(stat("num_device_alloc"), 1);
}

TEST_F(Ladder, GarbageCollectionFreesBlocksOlderThanAverage) {
  make("garbage_collection_threshold:0.5", 200 * kMiB);
  allocator_->set_memory_fraction(1.0);  // allowed 200 MiB, GC above 100 MiB
  const DevicePtr a = alloc(40 * kMiB, 0);
  release(a);                               // cached at search count 1
  const DevicePtr b = alloc(30 * kMiB, 1);  // search 2: no stream-1 block
  release(b);
  const DevicePtr c = alloc(35 * kMiB, 1);  // search 3: 30 < 35, a new 36 MiB segment: 106 MiB
  release(c);
  // Search 4 finds nothing for stream 2; ages are 3, 2 and 1, average 2:
  // the 40 and 30 MiB blocks go, the youngest stays.
  const DevicePtr d = alloc(10 * kMiB, 2);
  EXPECT_EQ(stat("num_device_free"), 2);
  EXPECT_EQ(stat("reserved_bytes.all.current"), (36 + 10) * 1048576);
  EXPECT_EQ(allocator_->largest_cached_block(), 36 * kMiB);
  EXPECT_EQ(stat("num_alloc_retries"), 0);
  release(d);
}

TEST_F(Ladder, GarbageCollectionNeedsAMemoryFraction) {
  make("garbage_collection_threshold:0.5", 200 * kMiB);
  const DevicePtr a = alloc(150 * kMiB);
  release(a);
  const DevicePtr b = alloc(20 * kMiB, 1);
  EXPECT_EQ(stat("num_device_free"), 0);
  release(b);
}

TEST_F(Ladder, RecordStreamDefersReuseUntilTheEventCompletes) {
  const DevicePtr a = alloc(4096, 0);
  allocator_->record_stream(reinterpret_cast<void*>(a), 5);
  allocator_->record_stream(reinterpret_cast<void*>(a), 0);  // the allocation stream: ignored
  release(a);
  EXPECT_EQ(stat("active.all.current"), 1);
  EXPECT_EQ(stat("allocation.all.current"), 0);
  EXPECT_EQ(allocator_->snapshot().segments[0].blocks[0].state, BlockState::active_pending_free);
  const DevicePtr b = alloc(4096, 0);
  EXPECT_EQ(b, kBase + 4096);  // a is still in use on stream 5
  device_->complete_stream(5);
  release(b);
  const DevicePtr c = alloc(4096, 0);  // events processed first: a is free again
  EXPECT_EQ(c, kBase);
  EXPECT_EQ(device_->live_events(), 1u);  // the event is kept for reuse
  release(c);
}

// pytorch/pytorch#189504: a block that fits, freed but pending on another
// stream's event, while the device is full. The ladder waits for the event
// (release_cached_blocks) and then only asks the device again: PyTorch
// raises, and the same request an instant later is served from the pool.
// reservoir's live ladder searches the pool after that wait.
class PendingFree : public AllocatorTest {
 protected:
  DevicePtr segment_ = 0;  // a 600 MiB segment: 400 (freed, pending) + 200 (live)
  DevicePtr tail_ = 0;
  DevicePtr filler_ = 0;   // the rest of the 1000 MiB device

  void make_case(const std::string& config) {
    make(config, 1000 * kMiB);
    const DevicePtr whole = alloc(600 * kMiB);
    release(whole);
    segment_ = alloc(400 * kMiB);
    tail_ = alloc(200 * kMiB);
    EXPECT_EQ(tail_, segment_ + 400 * kMiB);
    filler_ = alloc(400 * kMiB);
    allocator_->record_stream(reinterpret_cast<void*>(segment_), 5);
    release(segment_);  // pending: stream 5 has not reached the event
    EXPECT_EQ(device_->used_bytes(), 1000 * kMiB);
  }
};

TEST_F(PendingFree, TheBlockTheLaddersWaitFreedServesTheRequest) {
  make_case("");
  const DevicePtr got = alloc(400 * kMiB);
  EXPECT_EQ(got, segment_);  // the block the wait freed
  EXPECT_EQ(stat("num_sync_all_streams"), 1);
  EXPECT_EQ(stat("num_alloc_retries"), 0);  // served by the search, not the device
  EXPECT_EQ(stat("num_ooms"), 0);
  EXPECT_EQ(stat("num_device_alloc"), 2);
  EXPECT_EQ(device_->calls(CallKind::allocate_segment), 3u);  // 600, the filler, one refused
  release_all({got, tail_, filler_});
}

TEST_F(PendingFree, PyTorchsLadderRaisesWhereOnlyTheWaitFreedABlock) {
  make_case("retry_searches_pool:False");
  EXPECT_THROW(alloc(400 * kMiB), OutOfMemoryError);
  EXPECT_EQ(stat("num_ooms"), 1);
  EXPECT_EQ(stat("num_alloc_retries"), 1);
  EXPECT_EQ(stat("num_sync_all_streams"), 1);
  // The same request an instant later: the wait left the block in the pool.
  const DevicePtr again = alloc(400 * kMiB);
  EXPECT_EQ(again, segment_);
  release_all({again, tail_, filler_});
}

TEST_F(Ladder, EmptyCacheSynchronizesPendingFrees) {
  const DevicePtr a = alloc(12 * kMiB, 0);
  allocator_->record_stream(reinterpret_cast<void*>(a), 3);
  release(a);
  allocator_->empty_cache();
  EXPECT_EQ(stat("num_sync_all_streams"), 1);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(device_->calls(CallKind::synchronize_event), 1u);
}

TEST_F(Ladder, PrivatePoolsKeepTheirOwnSegments) {
  const PoolId pool{1, 1};
  allocator_->begin_allocate_to_pool(pool, [](StreamId s) { return s == 7; });
  const DevicePtr p = alloc(4096, 7);
  const DevicePtr q = alloc(4096, 0);
  allocator_->end_allocate_to_pool(pool);
  const Snapshot snap = allocator_->snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  EXPECT_EQ(snap.segments[0].pool_id, pool);
  EXPECT_EQ(snap.segments[1].pool_id, (PoolId{0, 0}));
  release(p);
  release(q);
  allocator_->empty_cache();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 2 * 1048576);  // the pool's segment stays
  EXPECT_EQ(alloc(4096, 7), kBase + 4 * kMiB);  // not routed now: a new default segment
  allocator_->release_pool(pool);
  allocator_->empty_cache();
  EXPECT_EQ(device_->live_segments(), 1u);
  EXPECT_THROW(allocator_->release_pool(pool), UsageError);
  EXPECT_THROW(allocator_->end_allocate_to_pool(pool), UsageError);
}

// Routes nest (torch.cuda.use_mem_pool inside another): the innermost
// route whose filter takes the stream serves it, and ending it gives the
// stream back to the route outside.
TEST_F(Ladder, TheInnermostRouteServesTheStream) {
  const PoolId outer{1, 1};
  const PoolId inner{1, 2};
  allocator_->begin_allocate_to_pool(outer, [](StreamId) { return true; });
  const DevicePtr a = alloc(4096, 0);
  allocator_->begin_allocate_to_pool(inner, [](StreamId s) { return s == 0; });
  const DevicePtr b = alloc(4096, 0);
  const DevicePtr c = alloc(4096, 5);  // not the inner filter's: the outer pool's
  allocator_->end_allocate_to_pool(inner);
  const DevicePtr d = alloc(4096, 0);
  allocator_->end_allocate_to_pool(outer);
  const Snapshot snap = allocator_->snapshot();
  ASSERT_EQ(snap.segments.size(), 3u);  // outer's small segments on streams 0 and 5, inner's on 0
  std::map<DevicePtr, PoolId> pool_of;
  for (const auto& seg : snap.segments) {
    for (DevicePtr p : {a, b, c, d}) {
      if (p >= seg.address && p < seg.address + seg.total_size) pool_of[p] = seg.pool_id;
    }
  }
  EXPECT_EQ(pool_of[a], outer);
  EXPECT_EQ(pool_of[b], inner);
  EXPECT_EQ(pool_of[c], outer);
  EXPECT_EQ(pool_of[d], outer);
  EXPECT_EQ(d, a + 4096);  // the outer pool's segment again, after a
  for (DevicePtr p : {a, b, c, d}) release(p);
  allocator_->release_pool(inner);
  allocator_->release_pool(outer);
  allocator_->empty_cache();
  EXPECT_EQ(device_->live_segments(), 0u);
}

TEST_F(Ladder, CurrentThreadRoutingLeavesOtherThreadsAlone) {
  const PoolId pool{0, 9};
  allocator_->begin_allocate_current_thread_to_pool(pool);
  const DevicePtr mine = alloc(4096);
  DevicePtr theirs = 0;
  std::thread other([&] { theirs = reinterpret_cast<DevicePtr>(allocator_->allocate(4096)); });
  other.join();
  allocator_->end_allocate_to_pool(pool);
  const Snapshot snap = allocator_->snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  EXPECT_EQ(snap.segments[0].address, mine);
  EXPECT_EQ(snap.segments[0].pool_id, pool);
  EXPECT_EQ(snap.segments[1].address, theirs);
  EXPECT_EQ(snap.segments[1].pool_id, (PoolId{0, 0}));
  release(mine);
  release(theirs);
}

// PyTorch's MemPool(use_on_oom=True): when the device cannot give a new
// segment, a free block cached in the pool serves the request (on its
// stream), before anything cached is freed; pools marked later are asked
// later, a released pool's mark goes with it, and a request routed to a
// private pool runs out without borrowing.
TEST_F(Ladder, UseOnOomPoolsServeWhatTheDeviceCannot) {
  make("", 60 * kMiB);
  const PoolId first{0, 1};
  const PoolId second{0, 2};
  allocator_->begin_allocate_current_thread_to_pool(first);
  const DevicePtr in_first = alloc(20 * kMiB);  // a 20 MiB segment of the pool
  allocator_->end_allocate_to_pool(first);
  allocator_->begin_allocate_current_thread_to_pool(second);
  const DevicePtr in_second = alloc(20 * kMiB);
  allocator_->end_allocate_to_pool(second);
  release(in_first);
  release(in_second);
  allocator_->set_pool_use_on_oom(second, true);
  allocator_->set_pool_use_on_oom(first, true);
  const DevicePtr own = alloc(20 * kMiB);  // the last 20 MiB of the device
  EXPECT_EQ(own, kBase + 40 * kMiB);
  // The device is full and nothing of the default pools is cached: the
  // pool marked first lends its block, then the next.
  EXPECT_EQ(alloc(12 * kMiB), in_second);
  EXPECT_EQ(alloc(6 * kMiB), in_second + 12 * kMiB);  // the rest of the lent block, split off
  EXPECT_EQ(alloc(20 * kMiB), in_first);
  EXPECT_EQ(stat("num_ooms"), 0);
  // Borrowed before freeing anything cached (PyTorch 2.11 on): no retry.
  EXPECT_EQ(stat("num_alloc_retries"), 0);
  EXPECT_EQ(stat("num_sync_all_streams"), 0);
  EXPECT_THROW(alloc(20 * kMiB), OutOfMemoryError);
  EXPECT_EQ(stat("num_ooms"), 1);
  allocator_->validate();
}

TEST_F(Ladder, UseOnOomIsNotForRequestsRoutedToAPoolNorForAReleasedPool) {
  make("", 40 * kMiB);
  const PoolId lender{0, 1};
  const PoolId other{0, 2};
  allocator_->begin_allocate_current_thread_to_pool(lender);
  release(alloc(20 * kMiB));
  allocator_->end_allocate_to_pool(lender);
  allocator_->set_pool_use_on_oom(lender, true);
  alloc(20 * kMiB);  // the device is full
  allocator_->begin_allocate_current_thread_to_pool(other);
  EXPECT_THROW(alloc(4 * kMiB), OutOfMemoryError);  // routed to `other`: no borrowing
  allocator_->end_allocate_to_pool(other);
  allocator_->set_pool_use_on_oom(lender, false);
  EXPECT_THROW(alloc(4 * kMiB), OutOfMemoryError);  // unmarked
  allocator_->set_pool_use_on_oom(lender, true);
  allocator_->release_pool(lender);  // released: its mark goes, its memory is given back on the retry
  EXPECT_NE(alloc(20 * kMiB), 0u);
  EXPECT_EQ(stat("num_device_free"), 1);  // the lender's segment
  EXPECT_EQ(device_->live_segments(), 2u);
  allocator_->validate();
}

// PyTorch's emptyCache(pool), which MemPool's destructor calls: a pool
// still in use keeps its segments; a released one gives back those it no
// longer uses at once (with one synchronization), and the rest as they empty.
TEST_F(Ladder, EmptyPoolCacheReleasesAReleasedPoolAlone) {
  const PoolId pool{0, 9};
  allocator_->begin_allocate_current_thread_to_pool(pool);
  const DevicePtr a = alloc(3 * kMiB);   // a 20 MiB segment
  const DevicePtr b = alloc(25 * kMiB);  // a 26 MiB segment
  allocator_->end_allocate_to_pool(pool);
  const DevicePtr outside = alloc(3 * kMiB);
  release(outside);  // cached in the default pool: stays
  release(a);
  allocator_->empty_pool_cache(pool);  // in use: nothing goes
  allocator_->empty_pool_cache({5, 5});  // unknown: nothing either
  EXPECT_EQ(stat("segment.all.current"), 3);
  EXPECT_EQ(stat("num_sync_all_streams"), 0);
  allocator_->release_pool(pool);
  allocator_->empty_pool_cache(pool);
  EXPECT_EQ(stat("segment.all.current"), 2);  // b's segment and the default pool's
  EXPECT_EQ(stat("reserved_bytes.all.current"), static_cast<std::int64_t>(46 * kMiB));
  EXPECT_EQ(stat("num_sync_all_streams"), 1);
  release(b);
  allocator_->empty_pool_cache(pool);
  EXPECT_EQ(stat("reserved_bytes.all.current"), static_cast<std::int64_t>(20 * kMiB));
  allocator_->empty_pool_cache(pool);  // gone: nothing more, no synchronization
  EXPECT_EQ(stat("num_sync_all_streams"), 2);
  release_all({});
}

// PyTorch's MemPool(no_split=True): a request takes a whole block of the
// pool, which the default pools would have split.
TEST_F(Ladder, NoSplitPoolsHandOutWholeBlocks) {
  const PoolId pool{0, 3};
  allocator_->set_pool_no_split(pool);
  allocator_->begin_allocate_current_thread_to_pool(pool);
  const DevicePtr a = alloc(3 * kMiB);  // a 20 MiB segment, not split
  const DevicePtr b = alloc(3 * kMiB);  // a second segment
  const DevicePtr small = alloc(4096);  // a 2 MiB small segment, whole
  allocator_->end_allocate_to_pool(pool);
  EXPECT_EQ(b, a + 20 * kMiB);
  EXPECT_EQ(stat("allocated_bytes.all.current"), (20 + 20 + 2) * kMiB);  // whole blocks
  EXPECT_EQ(stat("requested_bytes.all.current"), (3 + 3) * kMiB + 4096);
  const DevicePtr outside = alloc(3 * kMiB);  // the default pool splits as ever
  EXPECT_EQ(stat("allocated_bytes.all.current"), (20 + 20 + 2 + 3) * kMiB);
  for (DevicePtr p : {a, b, small, outside}) release(p);
  allocator_->validate();
}

// reserved_bytes_by_private_pools (PyTorch 2.13 and later): from a pool's first
// segment on, kept once the pool is gone, reset with the rest; not reported
// under earlier releases' rules.
TEST_F(Ladder, PrivatePoolReservedBytesUnderTheRulesOf215) {
  make("pytorch_version:2.15");
  const PoolId pool{0, 4};
  const std::string key = "reserved_bytes_by_private_pools.0_4.";
  allocator_->begin_allocate_current_thread_to_pool(pool);
  EXPECT_EQ(allocator_->stats_map().count(key + "all.current"), 0u);
  const DevicePtr big = alloc(3 * kMiB);
  const DevicePtr small = alloc(700);
  allocator_->end_allocate_to_pool(pool);
  auto stats = allocator_->stats_map();
  EXPECT_EQ(stats.at(key + "all.current"), static_cast<std::int64_t>(22 * kMiB));
  EXPECT_EQ(stats.at(key + "large_pool.current"), static_cast<std::int64_t>(20 * kMiB));
  EXPECT_EQ(stats.at(key + "small_pool.peak"), static_cast<std::int64_t>(2 * kMiB));
  release(big);
  release(small);
  allocator_->release_pool(pool);
  allocator_->empty_cache();
  stats = allocator_->stats_map();
  EXPECT_EQ(stats.at(key + "all.current"), 0);
  EXPECT_EQ(stats.at(key + "all.freed"), static_cast<std::int64_t>(22 * kMiB));
  EXPECT_EQ(stats.at(key + "all.peak"), static_cast<std::int64_t>(22 * kMiB));
  allocator_->reset_peak_stats();
  allocator_->reset_accumulated_stats();
  stats = allocator_->stats_map();
  EXPECT_EQ(stats.at(key + "all.peak"), 0);
  EXPECT_EQ(stats.at(key + "all.allocated"), 0);
  EXPECT_EQ(stats.at(key + "all.freed"), 0);
}

TEST_F(Ladder, PrivatePoolReservedBytesAreNotReportedBefore213) {
  make("pytorch_version:2.12");
  allocator_->begin_allocate_current_thread_to_pool({0, 5});
  const DevicePtr p = alloc(3 * kMiB);
  allocator_->end_allocate_to_pool({0, 5});
  for (const auto& [key, value] : allocator_->stats_map()) {
    EXPECT_FALSE(key.starts_with("reserved_bytes_by_private_pools.")) << key;
  }
  EXPECT_EQ(allocator_->private_pool_reserved().at({0, 5})[0].current, static_cast<std::int64_t>(20 * kMiB));
  release(p);
}


// Before PyTorch 2.15, empty_cache leaves the default pools' cache alone
// while a pool route is open (a capture, use_mem_pool) and releases only the
// private pools no longer in use; 2.15 releases both (measured under both
// releases by tests/torch/test_graphs.py).
TEST_F(Ladder, EmptyCacheWhileAPoolRouteIsOpenFollowsTheRelease) {
  for (const std::string config : {"", "pytorch_version:2.15"}) {
    make(config);
    release(alloc(12 * kMiB, 0));
    const PoolId done{1, 1};
    const PoolId open{1, 2};
    allocator_->begin_allocate_to_pool(done, [](StreamId s) { return s == 7; });
    release(alloc(4096, 7));
    allocator_->end_allocate_to_pool(done);
    allocator_->release_pool(done);
    allocator_->begin_allocate_to_pool(open, [](StreamId s) { return s == 9; });
    EXPECT_EQ(stat("reserved_bytes.all.current"), 12 * kMiB + 2 * kMiB) << config;
    allocator_->empty_cache();
    EXPECT_EQ(stat("reserved_bytes.all.current"), config.empty() ? 12 * kMiB : 0) << config;
    allocator_->end_allocate_to_pool(open);
    allocator_->empty_cache();
    EXPECT_EQ(stat("reserved_bytes.all.current"), 0) << config;
  }
}

}  // namespace
}  // namespace reservoir::testing
