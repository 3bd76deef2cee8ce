// Stats keys, memory_summary layout, snapshots, trace events and pointer errors.
#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include "allocator_fixture.hpp"
#include "reservoir/errors.hpp"
#include "source_dir.hpp"

namespace reservoir::testing {
namespace {

using Observability = AllocatorTest;

std::string read_data(const std::string& name) {
  std::ifstream in(std::string(RESERVOIR_SOURCE_DIR) + "/tests/data/" + name);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST_F(Observability, StatsHaveExactlyPyTorchsKeys) {
  const auto stats = allocator_->stats_map();
  EXPECT_EQ(stats.size(), 9u * 3u * 4u + 2u * 4u + 6u);
  for (const char* name :
       {"allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
        "active_bytes", "inactive_split_bytes", "requested_bytes"}) {
    for (const char* type : {"all", "small_pool", "large_pool"}) {
      for (const char* field : {"current", "peak", "allocated", "freed"}) {
        EXPECT_EQ(stats.count(std::string(name) + "." + type + "." + field), 1u) << name;
      }
    }
  }
  for (const char* key : {"num_alloc_retries", "num_ooms", "num_sync_all_streams",
                          "num_device_alloc", "num_device_free", "max_split_size",
                          "oversize_allocations.peak", "oversize_segments.freed"}) {
    EXPECT_EQ(stats.count(key), 1u) << key;
  }
  EXPECT_EQ(stats.at("max_split_size"), -1);
}

TEST_F(Observability, PeakAndAccumulatedResets) {
  const DevicePtr a = alloc(3 * kMiB);
  release(a);
  EXPECT_EQ(stat("allocated_bytes.all.peak"), 3 * 1048576);
  EXPECT_EQ(stat("allocated_bytes.all.allocated"), 3 * 1048576);
  EXPECT_EQ(stat("allocated_bytes.all.freed"), 3 * 1048576);
  allocator_->reset_peak_stats();
  EXPECT_EQ(stat("allocated_bytes.all.peak"), 0);
  EXPECT_EQ(stat("reserved_bytes.all.peak"), 20 * 1048576);
  allocator_->reset_accumulated_stats();
  EXPECT_EQ(stat("allocated_bytes.all.allocated"), 0);
  EXPECT_EQ(stat("allocated_bytes.all.freed"), 0);
  EXPECT_EQ(stat("num_device_alloc"), 0);
  EXPECT_EQ(stat("reserved_bytes.all.current"), 20 * 1048576);
}

// Totals of increases and decreases count from the reset, while memory held
// across it stays current (and peaks fall to the current value): small and
// large pools and "all" alike.
TEST_F(Observability, AccumulatedTotalsCountFromTheResetWithMemoryHeld) {
  const DevicePtr small = alloc(4096);      // small pool: 4 KiB
  const DevicePtr large = alloc(3 * kMiB);  // large pool: 3 MiB
  allocator_->reset_accumulated_stats();
  allocator_->reset_peak_stats();
  EXPECT_EQ(stat("allocated_bytes.all.allocated"), 0);
  EXPECT_EQ(stat("allocated_bytes.all.current"), 4096 + 3 * 1048576);
  const DevicePtr more = alloc(5 * kMiB);
  release(large);
  release(small);
  EXPECT_EQ(stat("allocated_bytes.large_pool.allocated"), 5 * 1048576);
  EXPECT_EQ(stat("allocated_bytes.large_pool.freed"), 3 * 1048576);
  EXPECT_EQ(stat("allocated_bytes.small_pool.allocated"), 0);
  EXPECT_EQ(stat("allocated_bytes.small_pool.freed"), 4096);
  EXPECT_EQ(stat("allocated_bytes.all.allocated"), 5 * 1048576);
  EXPECT_EQ(stat("allocated_bytes.all.freed"), 3 * 1048576 + 4096);
  EXPECT_EQ(stat("allocation.all.allocated"), 1);
  EXPECT_EQ(stat("allocation.all.freed"), 2);
  EXPECT_EQ(stat("allocated_bytes.all.peak"), 4096 + 8 * 1048576);
  EXPECT_EQ(stat("allocated_bytes.small_pool.peak"), 4096);
  EXPECT_EQ(stat("allocated_bytes.all.current"), 5 * 1048576);
  release(more);
  EXPECT_EQ(stat("allocated_bytes.all.current"), 0);
  EXPECT_EQ(stat("allocated_bytes.all.freed"), 8 * 1048576 + 4096);
}

// Expected text produced by torch/cuda/memory.py's memory_summary on the same stats.
TEST(MemorySummary, MatchesPyTorchsLayout) {
  const char* names[] = {
      "allocation",      "segment",        "active",       "inactive_split",
      "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes",
      "requested_bytes"};
  const char* types[] = {"all", "small_pool", "large_pool"};
  const char* fields[] = {"current", "peak", "allocated", "freed"};
  std::map<std::string, std::int64_t> stats;
  for (int n = 0; n < 9; ++n) {
    const bool counts = n < 4;
    for (int t = 0; t < 3; ++t) {
      for (int f = 0; f < 4; ++f) {
        std::int64_t base = 1;
        for (int k = 0; k < f; ++k) base *= counts ? 1000 : 1024;
        stats[std::string(names[n]) + "." + types[t] + "." + fields[f]] =
            std::int64_t{n + 1} * (t + 1) * (f + 1) * base + std::int64_t{7} * f;
      }
    }
  }
  for (const char* name : {"oversize_allocations", "oversize_segments"}) {
    for (int f = 0; f < 4; ++f)
      stats[std::string(name) + "." + fields[f]] = std::int64_t{f + 3} * 999999;
  }
  stats["num_alloc_retries"] = 3;
  stats["num_ooms"] = 12;
  EXPECT_EQ(memory_summary(stats, 1), read_data("memory_summary_device1.txt"));
  EXPECT_EQ(memory_summary(stats, 0, true), read_data("memory_summary_abbreviated.txt"));
}

TEST_F(Observability, SnapshotDescribesSegmentsAndBlocks) {
  const DevicePtr a = alloc(1000);
  const DevicePtr b = alloc(5 * kMiB, 3);
  const Snapshot snap = allocator_->snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  const SegmentInfo& small = snap.segments[0];
  EXPECT_EQ(small.address, a);
  EXPECT_EQ(small.total_size, 2 * kMiB);
  EXPECT_FALSE(small.is_large);
  EXPECT_EQ(small.allocated_size, 1024u);
  EXPECT_EQ(small.requested_size, 1000u);
  ASSERT_EQ(small.blocks.size(), 2u);
  EXPECT_EQ(small.blocks[0].state, BlockState::active_allocated);
  EXPECT_EQ(small.blocks[1].state, BlockState::inactive);
  EXPECT_EQ(small.blocks[1].address, a + 1024);
  const SegmentInfo& large = snap.segments[1];
  EXPECT_EQ(large.address, b);
  EXPECT_EQ(large.stream, 3u);
  EXPECT_TRUE(large.is_large);
  EXPECT_EQ(large.total_size, 20 * kMiB);
  EXPECT_EQ(large.blocks[1].size, 15 * kMiB);
}

TEST_F(Observability, TraceEventsComeInPyTorchsOrder) {
  std::vector<std::string> seen;
  allocator_->attach_trace_tracker([&](const TraceEvent& e) {
    seen.push_back(std::string(to_string(e.action)) + ":" + std::to_string(e.size));
  });
  const DevicePtr a = alloc(12 * kMiB);
  release(a);
  allocator_->empty_cache();
  EXPECT_EQ(seen, (std::vector<std::string>{"segment_alloc:12582912", "alloc:12582912",
                                            "free_requested:12582912", "free_completed:12582912",
                                            "segment_free:12582912"}));
}

TEST_F(Observability, BadPointersGetClearErrorsAndChangeNothing) {
  const DevicePtr a = alloc(4096);
  const auto message = [&](DevicePtr p) -> std::string {
    try {
      allocator_->deallocate(reinterpret_cast<void*>(p));
    } catch (const InvalidPointerError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(message(a + 16),
            fmt::format("deallocate: pointer {:#x} points 16 bytes into a block at "
                        "{:#x}; pass the pointer allocate() returned",
                        a + 16, a));
  EXPECT_EQ(message(0x1234),
            "deallocate: pointer 0x1234 was not allocated by this allocator (device 0)");
  release(a);
  EXPECT_EQ(message(a), fmt::format("deallocate: pointer {:#x} is not allocated (already freed, or "
                                    "never returned by allocate())",
                                    a));
  EXPECT_THROW(allocator_->record_stream(reinterpret_cast<void*>(a), 1), InvalidPointerError);
  allocator_->validate();
  EXPECT_EQ(stat("allocation.all.current"), 0);
}

TEST_F(Observability, RestoreRebuildsALayoutAndRefusesBadOnes) {
  const DevicePtr a = alloc(1000);
  const DevicePtr b = alloc(3000);
  release(a);
  const Snapshot layout = allocator_->snapshot();
  SimDevice device;
  std::vector<DevicePtr> addresses;
  for (const auto& s : layout.segments) addresses.push_back(s.address);
  std::size_t next = 0;
  device.set_address_source([&](std::size_t, DevicePtr* addr) {
    *addr = addresses[next++];
    return Status::ok;
  });
  CachingAllocator copy(device, AllocatorConfig{});
  copy.restore(layout);
  copy.validate();
  EXPECT_EQ(copy.stats_map().at("allocated_bytes.all.current"), 3072);
  EXPECT_EQ(copy.snapshot().segments[0].blocks.size(), 3u);
  copy.deallocate(reinterpret_cast<void*>(b));
  copy.validate();
  EXPECT_THROW(copy.restore(layout), UsageError);  // not empty
  Snapshot bad = layout;
  bad.segments[0].blocks[1].size += 512;
  SimDevice other;
  CachingAllocator fresh(other, AllocatorConfig{});
  EXPECT_THROW(fresh.restore(bad), UsageError);
  EXPECT_EQ(other.live_segments(), 0u);  // all or nothing
  fresh.validate();
  release(b);
}

// Expandable segments: the mapped ranges are rebuilt inside reservations at
// the given bases, stats and all; a bad layout leaves nothing behind.
TEST(Restore, RebuildsExpandableSegmentsInsideTheirReservations) {
  SimDevice device;
  CachingAllocator original(device, AllocatorConfig::parse("expandable_segments:True"));
  std::vector<void*> kept;
  std::vector<void*> freed;
  for (int i = 0; i < 12; ++i) {
    kept.push_back(original.allocate(std::size_t{3} << 20, i % 2 == 0 ? 0 : 5));
    freed.push_back(original.allocate(std::size_t{25} << 20, 0));
    kept.push_back(original.allocate(70000 + 512 * i, 0));
  }
  for (void* p : freed) original.deallocate(p);
  original.empty_cache();  // unmaps the freed pages: the ranges have holes
  const Snapshot layout = original.snapshot();
  ASSERT_GT(layout.segments.size(), 3u);

  // Reservations: one per stream and pool, at the lowest mapped address.
  std::vector<ExpandableReservation> reservations;
  for (const SegmentInfo& s : layout.segments) {
    auto it = std::find_if(reservations.begin(), reservations.end(), [&](const auto& r) {
      return r.stream == s.stream && r.is_large == s.is_large;
    });
    if (it == reservations.end()) {
      reservations.push_back({s.address, s.stream, s.is_large});
    } else {
      it->base = std::min(it->base, s.address);
    }
  }
  std::sort(reservations.begin(), reservations.end(),
            [](const auto& a, const auto& b) { return a.base < b.base; });
  ASSERT_EQ(reservations.size(), 3u);  // large 0 and 5, small 0

  SimDevice copy_device;
  std::size_t next = 0;
  copy_device.set_reservation_source([&](std::size_t, DevicePtr* va) {
    *va = reservations[next++].base;
    return Status::ok;
  });
  CachingAllocator copy(copy_device, AllocatorConfig::parse("expandable_segments:True"));
  copy.restore(layout, reservations);
  copy.validate();
  const Snapshot back = copy.snapshot();
  ASSERT_EQ(back.segments.size(), layout.segments.size());
  for (std::size_t i = 0; i < back.segments.size(); ++i) {
    SegmentInfo a = back.segments[i];
    SegmentInfo b = layout.segments[i];
    for (auto& blk : a.blocks) blk.context = 0;
    for (auto& blk : b.blocks) blk.context = 0;
    EXPECT_EQ(a, b) << "segment " << i;
  }
  for (const char* key : {"allocated_bytes.all.current", "reserved_bytes.all.current",
                          "requested_bytes.all.current", "active.all.current"}) {
    EXPECT_EQ(copy.stats_map().at(key), original.stats_map().at(key)) << key;
  }
  EXPECT_EQ(copy_device.live_reservations(), 3u);
  for (void* p : kept) copy.deallocate(p);
  copy.empty_cache();
  copy.validate();
  EXPECT_EQ(copy_device.live_reservations(), 0u);
  EXPECT_EQ(copy_device.live_physical(), 0u);

  // A range outside every reservation: refused, nothing held.
  SimDevice bad_device;
  next = 0;
  bad_device.set_reservation_source([&](std::size_t, DevicePtr* va) {
    *va = reservations[next++].base;
    return Status::ok;
  });
  CachingAllocator bad(bad_device, AllocatorConfig::parse("expandable_segments:True"));
  std::vector<ExpandableReservation> missing(reservations.begin() + 1, reservations.end());
  next = 1;
  EXPECT_THROW(bad.restore(layout, missing), UsageError);
  EXPECT_EQ(bad_device.live_reservations(), 0u);
  EXPECT_EQ(bad_device.live_physical(), 0u);
  bad.validate();
  for (void* p : kept) original.deallocate(p);
}

}  // namespace
}  // namespace reservoir::testing
