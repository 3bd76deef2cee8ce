// Saver: pause and resume with and without backup, on real host memory
// (HostDevice) under every policy: contents, addresses, resident memory,
// chunked copies over several streams.
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

// ---- every policy: contents, addresses, memory ------------------------------------

class SaverPolicies : public ::testing::TestWithParam<const char*> {};

TEST_P(SaverPolicies, ContentsSurviveByteForByteAtTheSameAddresses) {
  HostDevice host;
  Saver saver(host, options(GetParam()));
  const std::vector<std::size_t> sizes = {4096, std::size_t{700} * 1024, 3 * kMiB + 512, 25 * kMiB, 100};
  std::vector<void*> kept;
  std::vector<void*> dropped;
  {
    auto region = saver.region("weights", {.cpu_backup = true});
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      kept.push_back(saver.allocate(sizes[i]));
      fill(kept.back(), sizes[i], static_cast<unsigned>(i));
      dropped.push_back(saver.allocate(sizes[i]));  // freed before pause: a cached block
    }
  }
  for (void* p : dropped) saver.deallocate(p);
  const TagInfo before = saver.tag_info("weights");
  ASSERT_GT(before.physical_bytes, 0u);
  const std::size_t used = host.used_bytes();

  saver.pause("weights");
  const TagInfo paused = saver.tag_info("weights");
  EXPECT_TRUE(paused.paused);
  EXPECT_EQ(paused.physical_bytes, 0u);
  EXPECT_EQ(paused.last_released_bytes, before.physical_bytes);  // cached blocks included
  std::size_t requested = 0;
  for (std::size_t s : sizes) requested += s;
  EXPECT_EQ(paused.last_pause_copied, requested);
  EXPECT_EQ(paused.backup_bytes, requested);
  EXPECT_EQ(host.used_bytes(), used - before.physical_bytes);
  EXPECT_EQ(paused.reserved_bytes, before.reserved_bytes);  // address space kept
  saver.validate();

  saver.resume("weights");
  const TagInfo resumed = saver.tag_info("weights");
  EXPECT_FALSE(resumed.paused);
  EXPECT_EQ(resumed.physical_bytes, before.physical_bytes);
  EXPECT_EQ(resumed.backup_bytes, 0u);
  EXPECT_EQ(resumed.last_resume_copied, requested);
  EXPECT_EQ(host.used_bytes(), used);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(mismatch(kept[i], sizes[i], static_cast<unsigned>(i)), -1) << "block " << i;
  }
  saver.validate();
  // A second cycle, and the blocks are still usable and freeable.
  saver.pause("weights");
  saver.resume("weights");
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(mismatch(kept[i], sizes[i], static_cast<unsigned>(i)), -1) << "block " << i;
    saver.deallocate(kept[i]);
  }
  EXPECT_EQ(saver.tag_info("weights").allocated_bytes, 0u);
  saver.validate();
}

TEST_P(SaverPolicies, WithoutBackupMemoryIsReleasedAndComesBackAtTheSameAddress) {
  HostDevice host;
  Saver saver(host, options(GetParam()));
  void* p = nullptr;
  {
    auto region = saver.region("kv_cache");
    p = saver.allocate(40 * kMiB);
  }
  std::memset(p, 0x5a, 40 * kMiB);
  const std::size_t used = host.used_bytes();
  saver.pause("kv_cache");
  EXPECT_EQ(saver.tag_info("kv_cache").last_pause_copied, 0u);
  EXPECT_LT(host.used_bytes(), used - 39 * kMiB);
  saver.resume("kv_cache");
  EXPECT_EQ(host.used_bytes(), used);
  // The memory is usable again, at the same address.
  std::memset(p, 0x11, 40 * kMiB);
  EXPECT_EQ(static_cast<unsigned char*>(p)[40 * kMiB - 1], 0x11);
  saver.deallocate(p);
  saver.validate();
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, SaverPolicies,
                         ::testing::Values("", "expandable_segments:True", "policy:paging",
                                           "max_split_size_mb:20,roundup_power2_divisions:4"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return policy_name(info.param);
                         });

// ---- resident memory ------------------------------------------------------------

TEST(Saver, ResidentMemoryFallsAfterPauseAndRisesAfterResume) {
  HostDevice host;
  SaverOptions o = options("", BackupStorage::mmap);
  Saver saver(host, o);
  constexpr std::size_t kBytes = 96 * kMiB;
  void* p = nullptr;
  {
    auto region = saver.region("weights", {.cpu_backup = true});
    p = saver.allocate(kBytes);
  }
  fill(p, kBytes, 9);
  const std::size_t rss_running = current_rss_bytes();
  saver.pause("weights");
  const std::size_t rss_paused = current_rss_bytes();
  EXPECT_LT(rss_paused + 80 * kMiB, rss_running) << rss_running << " -> " << rss_paused;
  saver.resume("weights");
  const std::size_t rss_resumed = current_rss_bytes();
  EXPECT_GT(rss_resumed, rss_paused + 80 * kMiB) << rss_paused << " -> " << rss_resumed;
  EXPECT_EQ(mismatch(p, kBytes, 9), -1);
  saver.deallocate(p);
}

TEST(Saver, PinnedBackupBuffersAreReusedAcrossCyclesAndTrimmed) {
  HostDevice host;
  HostPinnedMemory pinned;
  SaverOptions o = options();
  o.pinned_source = &pinned;
  Saver saver(host, o);
  // This measures the process's resident memory, which the validator's own
  // allocations would add to when the suite runs in validation mode.
  saver.set_validate_each_call(false);
  void* p = nullptr;
  {
    auto region = saver.region("w", {.cpu_backup = true});
    p = saver.allocate(5 * kMiB);
  }
  fill(p, 5 * kMiB, 3);
  saver.pause("w");
  saver.resume("w");
  const std::size_t rss_after_first = current_rss_bytes();
  for (int i = 0; i < 3; ++i) {
    saver.pause("w");
    saver.resume("w");
  }
  // No new host memory after the first cycle (5 chunks of 1 MiB, cached).
  EXPECT_LT(current_rss_bytes(), rss_after_first + kMiB);
  EXPECT_EQ(mismatch(p, 5 * kMiB, 3), -1);
  saver.trim_backup();
  saver.deallocate(p);
}

// ---- copies: chunks and streams ------------------------------------------------------

TEST(Saver, CopiesAreChunkedAndSpreadOverStreams) {
  HostDevice host;
  FaultyDevice dev(host);
  SaverOptions o = options();
  o.chunk_bytes = std::size_t{1} << 20;
  o.copy_streams = 3;
  Saver saver(dev, o);
  void* p = nullptr;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    p = saver.allocate(5 * kMiB + 1000);
  }
  fill(p, 5 * kMiB + 1000, 6);
  dev.reset_log();
  saver.pause("w");
  EXPECT_EQ(dev.copy_sizes(), (std::vector<std::size_t>{kMiB, kMiB, kMiB, kMiB, kMiB, 1000}));
  EXPECT_EQ(dev.copy_streams(), (std::vector<StreamId>{100, 101, 102, 100, 101, 102}));
  EXPECT_EQ(dev.calls(CallKind::synchronize_stream), 3);
  dev.reset_log();
  saver.resume("w");
  EXPECT_EQ(dev.copy_sizes(), (std::vector<std::size_t>{kMiB, kMiB, kMiB, kMiB, kMiB, 1000}));
  EXPECT_EQ(mismatch(p, 5 * kMiB + 1000, 6), -1);
  saver.deallocate(p);
}

TEST(Saver, StagedCopiesThroughPinnedChunksKeepEveryByte) {
  HostDevice host;
  FaultyDevice dev(host);
  SaverOptions o = options("", BackupStorage::mmap);
  o.copy_streams = 2;
  Saver saver(dev, o);
  std::vector<void*> ps;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    for (std::size_t i = 0; i < 4; ++i) {
      ps.push_back(saver.allocate((i + 1) * 700 * 1024));
      fill(ps.back(), (i + 1) * 700 * 1024, static_cast<unsigned>(i + 20));
    }
  }
  dev.reset_log();
  saver.pause("w");
  // Staging waits for a stream before reusing its buffer.
  EXPECT_GE(dev.calls(CallKind::synchronize_stream), static_cast<int>(dev.copy_sizes().size()));
  saver.resume("w");
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(mismatch(ps[i], (i + 1) * 700 * 1024, static_cast<unsigned>(i + 20)), -1) << i;
    saver.deallocate(ps[i]);
  }
}

TEST(Saver, ResumeCopiesEachSegmentBackAsSoonAsItIsMapped) {
  HostDevice host;
  FaultyDevice dev(host);
  Saver saver(dev, options());
  std::vector<void*> ps;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    for (int i = 0; i < 3; ++i) {
      ps.push_back(saver.allocate(30 * kMiB));  // a segment each
      fill(ps.back(), 30 * kMiB, static_cast<unsigned>(i));
    }
  }
  saver.pause("w");
  dev.reset_log();
  saver.resume("w");
  // create, map, open, then that segment's 30 copies, before the next segment.
  std::vector<CallKind> expected;
  for (int i = 0; i < 3; ++i) {
    expected.insert(expected.end(), {CallKind::create_physical, CallKind::map, CallKind::set_access});
    expected.insert(expected.end(), 30, CallKind::copy_to_device);
  }
  expected.insert(expected.end(), 3, CallKind::synchronize_stream);
  EXPECT_EQ(dev.order(), expected);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(mismatch(ps[i], 30 * kMiB, static_cast<unsigned>(i)), -1);
    saver.deallocate(ps[i]);
  }
}

TEST_P(SaverPolicies, EmptyCacheWhilePausedGivesUpCachedSegmentsForGood) {
  HostDevice host;
  Saver saver(host, options(GetParam()));
  void* keep = nullptr;
  void* drop = nullptr;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    keep = saver.allocate(30 * kMiB);
    drop = saver.allocate(40 * kMiB);
  }
  fill(keep, 30 * kMiB, 77);
  saver.deallocate(drop);  // cached, not live
  saver.pause("w");
  const std::size_t reserved = saver.tag_info("w").reserved_bytes;
  saver.empty_cache();  // the cached segment goes, address space and all
  EXPECT_LT(saver.tag_info("w").reserved_bytes, reserved);
  saver.validate();
  saver.resume("w");
  const TagInfo t = saver.tag_info("w");
  EXPECT_EQ(t.physical_bytes, t.reserved_bytes);  // only what is left comes back
  EXPECT_LT(t.physical_bytes, 60 * kMiB);
  EXPECT_EQ(mismatch(keep, 30 * kMiB, 77), -1);
  saver.deallocate(keep);
  saver.empty_cache();
  EXPECT_EQ(saver.tag_info("w").physical_bytes, 0u);
  EXPECT_EQ(host.used_bytes(), 0u);
  saver.validate();
}

TEST(Saver, BlocksFreedWhilePausedAreNotCopiedBack) {
  HostDevice host;
  FaultyDevice dev(host);
  Saver saver(dev, options());
  void* a = nullptr;
  void* b = nullptr;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    a = saver.allocate(25 * kMiB);
    b = saver.allocate(25 * kMiB);
  }
  fill(b, 25 * kMiB, 8);
  saver.pause("w");
  saver.deallocate(a);
  dev.reset_log();
  saver.resume("w");
  EXPECT_EQ(saver.tag_info("w").last_resume_copied, 25 * kMiB);
  EXPECT_EQ(mismatch(b, 25 * kMiB, 8), -1);
  saver.deallocate(b);
}

}  // namespace
}  // namespace reservoir
