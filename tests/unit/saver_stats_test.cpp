// Saver: observation across tags: snapshots, summaries, statistics (exact
// peaks of the sum), live allocations, history.
#include "reservoir/saver.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/sim_device.hpp"
#include "saver_fixture.hpp"

namespace reservoir {
namespace {

// ---- observation -----------------------------------------------------------------------

TEST(Saver, SnapshotSummaryAndStatsCoverEveryTag) {
  HostDevice host;
  Saver saver(host, options());
  void* a = nullptr;
  {
    auto r = saver.region("weights");
    a = saver.allocate(kMiB);
  }
  void* b = saver.allocate(2 * kMiB);
  const Snapshot snap = saver.snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  int tagged = 0;
  for (const SegmentInfo& seg : snap.segments) {
    for (const BlockInfo& blk : seg.blocks) {
      const Context& c = snap.contexts.at(blk.context);
      if (!c.annotations.empty() && c.annotations.front() == "reservoir.tag=weights") ++tagged;
    }
  }
  EXPECT_GE(tagged, 1);
  const DeviceStats s = saver.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, static_cast<std::int64_t>(3 * kMiB));
  EXPECT_EQ(saver.stats("weights").allocated_bytes[0].current, static_cast<std::int64_t>(kMiB));
  EXPECT_EQ(saver.stats_map().at("allocated_bytes.all.current"),
            static_cast<std::int64_t>(3 * kMiB));
  saver.pause("weights");
  const std::string summary = saver.memory_summary();
  EXPECT_NE(summary.find("Untagged memory"), std::string::npos);
  EXPECT_NE(summary.find("Tag 'weights': paused, 0 bytes of physical memory, 0 bytes backed up"),
            std::string::npos)
      << summary;
  saver.resume("weights");
  saver.deallocate(a);
  saver.deallocate(b);
}

// The size of the block an allocation holds (what PyTorch's profiler is
// told), tagged or not, paused or not; 0 for what starts no live block.
TEST(Saver, BlockSizeIsTheRoundedBlockOfALiveAllocation) {
  HostDevice host;
  Saver saver(host, options());
  void* small = saver.allocate(1000);   // 512-byte rounding: 1024
  void* large = saver.allocate(3 * kMiB + 1);  // large pool: 3 MiB + 512
  void* tagged = nullptr;
  {
    auto r = saver.region("weights");
    tagged = saver.allocate(kMiB + 5);  // the large pool's rounding: 1 MiB + 512
  }
  EXPECT_EQ(saver.block_size(small), 1024u);
  EXPECT_EQ(saver.block_size(large), 3 * kMiB + 512);
  EXPECT_EQ(saver.block_size(tagged), kMiB + 512);
  EXPECT_EQ(saver.block_size(static_cast<char*>(large) + 512), 0u);  // inside, not a start
  EXPECT_EQ(saver.untagged_allocator().block_size(tagged), 0u);  // the tag's, not the untagged one's
  saver.pause("weights");
  EXPECT_EQ(saver.block_size(tagged), kMiB + 512);
  saver.resume("weights");
  saver.deallocate(large);
  EXPECT_EQ(saver.block_size(large), 0u);  // freed
  saver.deallocate(small);
  saver.deallocate(tagged);
  EXPECT_EQ(saver.block_size(nullptr), 0u);
}

// Sum-of-peaks would say 20 MiB here: the untagged 10 MiB were gone before
// the tag's 10 MiB came.
TEST(SaverStats, PeaksAreThoseOfTheSumNotTheSumOfPeaks) {
  SimDeviceOptions so;
  so.auto_complete_events = true;
  SimDevice sim(so);
  Saver saver(sim, options());
  void* u = saver.allocate(10 * kMiB);
  // Before any tag the saver's statistics are the untagged allocator's.
  EXPECT_EQ(saver.stats(), saver.untagged_allocator().stats());
  saver.deallocate(u);
  saver.empty_cache();
  void* kv = nullptr;
  {
    auto r = saver.region("kv");
    kv = saver.allocate(10 * kMiB);
  }
  const auto mib = [](std::size_t n) { return static_cast<std::int64_t>(n * kMiB); };
  DeviceStats s = saver.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, mib(10));
  EXPECT_EQ(s.allocated_bytes[0].peak, mib(10));
  EXPECT_EQ(s.reserved_bytes[0].peak, mib(10));
  EXPECT_EQ(s.allocation[0].peak, 1);
  EXPECT_EQ(s.segment[0].peak, 1);
  EXPECT_EQ(s.allocated_bytes[0].allocated, mib(20));  // totals still add up
  EXPECT_EQ(s.allocated_bytes[0].freed, mib(10));
  EXPECT_EQ(s.num_device_alloc, 2);
  void* more = saver.allocate(4 * kMiB);  // untagged, beside the tag's 10
  s = saver.stats();
  EXPECT_EQ(s.allocated_bytes[0].peak, mib(14));
  EXPECT_EQ(s.allocated_bytes[2].peak, mib(14));  // large pool
  EXPECT_EQ(s.reserved_bytes[0].peak, mib(30));   // the 4 MiB came in a 20 MiB segment
  EXPECT_EQ(s.allocation[0].peak, 2);
  saver.deallocate(more);
  saver.empty_cache();
  s = saver.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, mib(10));
  EXPECT_EQ(s.allocated_bytes[0].peak, mib(14));
  EXPECT_EQ(s.reserved_bytes[0].current, mib(10));
  saver.reset_peak_stats();
  s = saver.stats();
  EXPECT_EQ(s.allocated_bytes[0].peak, mib(10));
  EXPECT_EQ(s.reserved_bytes[0].peak, mib(10));
  EXPECT_EQ(saver.stats("kv").allocated_bytes[0].peak, mib(10));
  EXPECT_EQ(saver.untagged_allocator().stats().allocated_bytes[0].peak, 0);
  // Pausing keeps the tag's allocations and segments counted (as it keeps
  // their addresses).
  saver.pause("kv");
  EXPECT_EQ(saver.stats().allocated_bytes[0].current, mib(10));
  saver.resume("kv");
  saver.reset_accumulated_stats();
  s = saver.stats();
  EXPECT_EQ(s.allocated_bytes[0].allocated, 0);
  EXPECT_EQ(s.num_device_alloc, 0);
  EXPECT_EQ(s.allocated_bytes[0].current, mib(10));
  saver.validate();
  saver.deallocate(kv);
  EXPECT_EQ(saver.stats().allocated_bytes[0].current, 0);
  EXPECT_EQ(saver.stats().allocated_bytes[0].peak, mib(10));
  saver.validate();
}

TEST(SaverStats, WithoutExactPeaksThePeaksAreSummed) {
  SimDeviceOptions so;
  so.auto_complete_events = true;
  SimDevice sim(so);
  SaverOptions o = options();
  o.exact_peaks = false;
  Saver saver(sim, o);
  saver.deallocate(saver.allocate(10 * kMiB));
  void* kv = nullptr;
  {
    auto r = saver.region("kv");
    kv = saver.allocate(10 * kMiB);
  }
  const DeviceStats s = saver.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, static_cast<std::int64_t>(10 * kMiB));
  EXPECT_EQ(s.allocated_bytes[0].peak, static_cast<std::int64_t>(20 * kMiB));  // an upper bound
  saver.reset_peak_stats();
  EXPECT_EQ(saver.stats().allocated_bytes[0].peak, static_cast<std::int64_t>(10 * kMiB));
  saver.deallocate(kv);
  saver.validate();
}

// After the peaks are reset, one operation on one allocator must leave every
// peak of the sum at (the others' current) + (that allocator's peak): the
// highest point inside the operation counts, nothing else does.
class SaverPeakPolicies : public ::testing::TestWithParam<const char*> {};
TEST_P(SaverPeakPolicies, EveryPeakOfTheSumIsExactAfterEachOperation) {
  SimDeviceOptions so;
  so.capacity = 512 * kMiB;
  so.auto_complete_events = true;
  SimDevice sim(so);
  Saver saver(sim, options(GetParam()));
  const std::vector<std::string> owners = {"", "a", "b"};
  std::vector<std::vector<void*>> live(owners.size());
  std::mt19937 rng(11);
  auto own_stats = [&](std::size_t i) {
    return i == 0 ? saver.untagged_allocator().stats() : saver.stats(owners[i]);
  };
  int checked = 0;
  int ooms = 0;
  for (int step = 0; step < 600; ++step) {
    const std::uint32_t roll = rng() % 100;
    const std::size_t i = roll >= 95 ? 0 : rng() % owners.size();  // only untagged empties alone
    std::optional<Saver::Region> region;
    if (i != 0) region.emplace(saver.region(owners[i]));
    saver.reset_peak_stats();
    const auto at_reset = to_map(saver.stats());
    if (roll < 50 || (roll < 95 && live[i].empty())) {
      const std::size_t size = roll % 3 == 0 ? 1 + rng() % 600'000 : 1 + rng() % (40 * kMiB);
      try {
        live[i].push_back(saver.allocate(size));
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
    } else if (roll < 95) {
      const std::size_t k = rng() % live[i].size();
      saver.deallocate(live[i][k]);
      live[i].erase(live[i].begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      saver.untagged_allocator().empty_cache();
    }
    region.reset();
    const auto sum = to_map(saver.stats());
    const auto own = to_map(own_stats(i));
    for (const auto& [key, peak] : sum) {
      if (key.size() < 5 || key.compare(key.size() - 5, 5, ".peak") != 0) continue;
      const std::string cur = key.substr(0, key.size() - 5) + ".current";
      // The others' values are constant through the step, unless a tag that
      // ran out took back their cached memory (Saver's reclaim): then they
      // only fell, and the peak may be the sum as it stood at the reset.
      ASSERT_EQ(peak, std::max(at_reset.at(cur), sum.at(cur) - own.at(cur) + own.at(key)))
          << key << " after step " << step << " on '" << owners[i] << "'";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
  saver.validate();
  for (auto& l : live) {
    for (void* p : l) saver.deallocate(p);
  }
  saver.validate();
  EXPECT_EQ(saver.stats().allocated_bytes[0].current, 0);
  RecordProperty("ooms", ooms);
}
INSTANTIATE_TEST_SUITE_P(Policies, SaverPeakPolicies,
                         ::testing::Values("", "expandable_segments:True", "policy:paging",
                                           "max_split_size_mb:20,garbage_collection_threshold:0.6"),
                         [](const auto& info) { return policy_name(info.param); });

// The sum's peak follows whichever allocator changes: each change is made by
// the owner of the sum, and every rise of its values past the sum's peak
// moves the peak, whoever held memory before. A member that joins later
// adds its values (and with carry_peaks, its peak on top of the sum).
TEST(SaverStats, TheSumsPeakFollowsEachOwnersChanges) {
  SimDevice sim;
  const auto mib = [](std::size_t n) { return static_cast<std::int64_t>(n * kMiB); };
  CachingAllocator a(sim, AllocatorConfig{});
  CachingAllocator b(sim, AllocatorConfig{});
  void* a8 = a.allocate(8 * kMiB);
  a.deallocate(a.allocate(4 * kMiB));  // a's own peak: 12 MiB
  auto combined = std::make_shared<CombinedStats>();
  a.combine_stats(combined, true);  // carries a's peak
  b.combine_stats(combined, false);
  const auto allocated = [&] { return combined->read().allocated_bytes[0]; };
  EXPECT_EQ(allocated().current, mib(8));
  EXPECT_EQ(allocated().peak, mib(12));
  void* b4 = b.allocate(4 * kMiB);  // b owns: 8 + 4
  EXPECT_EQ(allocated().current, mib(12));
  EXPECT_EQ(allocated().peak, mib(12));
  a.deallocate(a8);                 // a owns: 4
  void* b6 = b.allocate(6 * kMiB);  // 10
  EXPECT_EQ(allocated().current, mib(10));
  EXPECT_EQ(allocated().peak, mib(12));
  void* a3 = a.allocate(3 * kMiB);  // 13: a new peak made by a, over b's 10
  EXPECT_EQ(allocated().peak, mib(13));
  EXPECT_EQ(a.stats().allocated_bytes[0].peak, mib(12));  // a's own peak stays its own
  EXPECT_EQ(b.stats().allocated_bytes[0].peak, mib(10));
  combined->reset_peaks();
  EXPECT_EQ(allocated().peak, mib(13));
  b.deallocate(b4);  // 9
  EXPECT_EQ(allocated().peak, mib(13));
  void* b2 = b.allocate(2 * kMiB);  // 11: below the peak
  EXPECT_EQ(allocated().peak, mib(13));
  a.deallocate(a3);
  combined->reset_peaks();  // peak = current = 8
  EXPECT_EQ(allocated().peak, mib(8));
  void* a1 = a.allocate(kMiB);  // 9: a passes the fallen peak
  EXPECT_EQ(allocated().peak, mib(9));
  CachingAllocator c(sim, AllocatorConfig{});
  void* c5 = c.allocate(5 * kMiB);
  c.combine_stats(combined, false);  // joins while a owns: 14
  EXPECT_EQ(allocated().current, mib(14));
  EXPECT_EQ(allocated().peak, mib(14));
  a.deallocate(a.allocate(kMiB));  // a's threshold moved with c's values: 15
  EXPECT_EQ(allocated().peak, mib(15));
  combined->check();
  for (void* p : {b6, b2}) b.deallocate(p);
  a.deallocate(a1);
  c.deallocate(c5);
  EXPECT_EQ(allocated().current, 0);
  EXPECT_EQ(allocated().peak, mib(15));
  combined->check();
}

TEST(SaverStats, CombiningAnAllocatorTwiceOrWithNothingIsRefused) {
  SimDevice sim;
  CachingAllocator allocator(sim, AllocatorConfig{});
  EXPECT_EQ(error_of<UsageError>([&] { allocator.combine_stats(nullptr, false); }),
            "combine_stats: no combined statistics given");
  void* p = allocator.allocate(3 * kMiB);
  auto combined = std::make_shared<CombinedStats>();
  allocator.combine_stats(combined, true);
  EXPECT_EQ(combined->read().allocated_bytes[0].current, static_cast<std::int64_t>(3 * kMiB));
  EXPECT_EQ(error_of<UsageError>([&] { allocator.combine_stats(combined, false); }),
            "combine_stats: this allocator's statistics are combined already");
  EXPECT_EQ(combined->read().allocated_bytes[0].current, static_cast<std::int64_t>(3 * kMiB));
  allocator.deallocate(p);
  EXPECT_EQ(combined->read().allocated_bytes[0].current, 0);
  EXPECT_EQ(combined->read().allocated_bytes[0].peak, static_cast<std::int64_t>(3 * kMiB));
}

TEST(Saver, LiveAllocationsAreWhatSnapshotsCallActive) {
  HostDevice host;
  CachingAllocator allocator(host, AllocatorConfig::parse("expandable_segments:True"));
  void* a = allocator.allocate(1000);
  void* b = allocator.allocate(3 * kMiB);
  void* c = allocator.allocate(5000);
  allocator.deallocate(c);
  std::vector<std::pair<DevicePtr, std::size_t>> from_snapshot;
  for (const SegmentInfo& seg : allocator.snapshot().segments) {
    for (const BlockInfo& blk : seg.blocks) {
      if (blk.state == BlockState::active_allocated) {
        from_snapshot.emplace_back(blk.address, blk.requested_size);
      }
    }
  }
  const auto live = allocator.live_allocations();
  EXPECT_EQ(live, from_snapshot);
  ASSERT_EQ(live.size(), 2u);
  std::set<std::pair<DevicePtr, std::size_t>> got(live.begin(), live.end());
  EXPECT_EQ(got, (std::set<std::pair<DevicePtr, std::size_t>>{
                     {reinterpret_cast<DevicePtr>(a), 1000},
                     {reinterpret_cast<DevicePtr>(b), 3 * kMiB}}));
  allocator.deallocate(a);
  allocator.deallocate(b);
  EXPECT_TRUE(allocator.live_allocations().empty());
}

TEST(Saver, HistoryCoversEveryTagInTimeOrder) {
  HostDevice host;
  Saver saver(host, options());
  saver.record_history({.enabled = true, .max_entries = 100, .stacks = false, .max_frames = 8});
  void* a = saver.allocate(4096);
  void* b = nullptr;
  {
    auto r = saver.region("kv");  // created after history was turned on
    b = saver.allocate(8192);
  }
  // Pause and resume are not allocator events: they add nothing to history.
  saver.pause("kv");
  saver.resume("kv");
  saver.deallocate(a);
  saver.deallocate(b);
  const Snapshot snap = saver.snapshot();
  std::vector<std::pair<TraceAction, std::string>> seen;
  for (const TraceEvent& e : snap.history) {
    const Context& c = snap.contexts.at(e.context);
    seen.emplace_back(e.action, c.annotations.empty() ? "" : c.annotations.front());
  }
  using A = TraceAction;
  const std::vector<std::pair<TraceAction, std::string>> expected = {
      {A::segment_alloc, ""},
      {A::alloc, ""},
      {A::segment_alloc, "reservoir.tag=kv"},
      {A::alloc, "reservoir.tag=kv"},
      {A::free_requested, ""},
      {A::free_completed, ""},
      {A::free_requested, "reservoir.tag=kv"},
      {A::free_completed, "reservoir.tag=kv"},
      {A::snapshot, ""}};
  EXPECT_EQ(seen, expected);
  EXPECT_THROW(
      saver.record_history({.enabled = true, .max_entries = 0, .stacks = false, .max_frames = 8}),
      UsageError);
}

}  // namespace
}  // namespace reservoir
