// Saver: regions and tags, pause and resume with and without backup, on real
// host memory (HostDevice) under every policy, with fault injection on every
// device call pause and resume make.
#include "reservoir/saver.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "error_text.hpp"
#include "faulty_device.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir {
namespace {

using testing::error_of;
using testing::FaultyDevice;
constexpr std::size_t kMiB = std::size_t{1} << 20;

void fill(void* p, std::size_t n, unsigned seed) {
  auto* b = static_cast<unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>((i * 131 + seed) >> 3);
}
// The index of the first byte that differs from fill(), or -1.
long mismatch(const void* p, std::size_t n, unsigned seed) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    if (b[i] != static_cast<unsigned char>((i * 131 + seed) >> 3)) return static_cast<long>(i);
  }
  return -1;
}

SaverOptions options(const std::string& config = "", BackupStorage storage = BackupStorage::pinned) {
  SaverOptions o;
  o.config = AllocatorConfig::parse(config);
  o.storage = storage;
  o.chunk_bytes = std::size_t{1} << 20;
  o.copy_streams = 3;
  return o;
}

std::string policy_name(const std::string& c) {
  if (c.empty()) return "native";
  if (c.find("expandable") != std::string::npos) return "expandable";
  if (c.find("paging") != std::string::npos) return "paging";
  return "native_tuned";
}

// ---- every policy: contents, addresses, memory ------------------------------------

class SaverPolicies : public ::testing::TestWithParam<const char*> {};

TEST_P(SaverPolicies, ContentsSurviveByteForByteAtTheSameAddresses) {
  HostDevice host;
  Saver saver(host, options(GetParam()));
  const std::vector<std::size_t> sizes = {4096, 700 * 1024, 3 * kMiB + 512, 25 * kMiB, 100};
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

// ---- tags and regions ---------------------------------------------------------------

TEST(Saver, TagsNeverShareSegmentsOrCachedBlocks) {
  HostDevice host;
  Saver saver(host, options());
  void* kv = nullptr;
  {
    auto region = saver.region("kv_cache");
    kv = saver.allocate(8 * kMiB);
  }
  const DevicePtr kv_addr = reinterpret_cast<DevicePtr>(kv);
  saver.deallocate(kv);  // a cached block of kv_cache now
  void* w = nullptr;
  {
    auto region = saver.region("weights");
    w = saver.allocate(8 * kMiB);  // must not get kv_cache's cached block
  }
  void* plain = saver.allocate(8 * kMiB);
  EXPECT_NE(reinterpret_cast<DevicePtr>(w), kv_addr);
  EXPECT_NE(reinterpret_cast<DevicePtr>(plain), kv_addr);
  // Every segment belongs to one allocator: no two segments overlap.
  const Snapshot snap = saver.snapshot();
  ASSERT_EQ(snap.segments.size(), 3u);
  for (std::size_t i = 1; i < snap.segments.size(); ++i) {
    EXPECT_LE(snap.segments[i - 1].address + snap.segments[i - 1].total_size,
              snap.segments[i].address);
  }
  // Pausing kv_cache (torch_memory_saver issue 85's crash) leaves weights alone.
  std::memset(w, 0x77, 8 * kMiB);
  saver.pause("kv_cache");
  EXPECT_EQ(static_cast<unsigned char*>(w)[8 * kMiB - 1], 0x77);
  std::memset(w, 0x78, 8 * kMiB);  // still mapped: writes do not fault
  saver.resume("kv_cache");
  saver.deallocate(w);
  saver.deallocate(plain);
  saver.validate();
}

TEST(Saver, RegionsNestAndUntaggedAllocatesOutsideEveryTag) {
  HostDevice host;
  Saver saver(host, options());
  EXPECT_EQ(saver.current_tag(), "");
  void* outer = nullptr;
  void* inner = nullptr;
  void* outside = nullptr;
  void* back = nullptr;
  {
    auto a = saver.region("outer");
    EXPECT_EQ(saver.current_tag(), "outer");
    outer = saver.allocate(1024);
    {
      auto b = saver.region("inner");
      EXPECT_EQ(saver.current_tag(), "inner");
      inner = saver.allocate(1024);
      {
        auto c = saver.untagged();
        EXPECT_EQ(saver.current_tag(), "");
        outside = saver.allocate(1024);
      }
    }
    EXPECT_EQ(saver.current_tag(), "outer");
    back = saver.allocate(1024);
  }
  EXPECT_EQ(saver.current_tag(), "");
  EXPECT_EQ(saver.tag_info("outer").allocated_bytes, 2048u);
  EXPECT_EQ(saver.tag_info("inner").allocated_bytes, 1024u);
  EXPECT_EQ(saver.untagged_allocator().stats().allocated_bytes[0].current, 1024);
  // Another thread is outside every region.
  {
    auto a = saver.region("outer");
    std::string seen = "?";
    std::thread t([&] { seen = saver.current_tag(); });
    t.join();
    EXPECT_EQ(seen, "");
  }
  for (void* p : {outer, inner, outside, back}) saver.deallocate(p);
  saver.validate();
}

TEST(Saver, RegionsCloseInnermostFirst) {
  HostDevice host;
  Saver saver(host, options());
  const std::uint64_t a = saver.push_region("a");
  const std::uint64_t b = saver.push_region("b");
  try {
    saver.pop_region(a);
    FAIL() << "closed out of order";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()),
              fmt::format("region: closing region {} while region {} ('b') opened inside it is "
                          "still open (regions close innermost first, on the thread that opened "
                          "them)",
                          a, b));
  }
  saver.pop_region(b);
  saver.pop_region(a);
  EXPECT_THROW(saver.pop_region(a), UsageError);
  EXPECT_EQ(saver.current_tag(), "");
}

TEST(Saver, BackupAndNoBackupUnderOneTagPauseTogether) {
  HostDevice host;
  Saver saver(host, options());
  void* a = nullptr;
  void* b = nullptr;
  {
    auto r = saver.region("model", {.cpu_backup = true});
    a = saver.allocate(kMiB);
  }
  {
    auto r = saver.region("model");
    b = saver.allocate(kMiB);
  }
  fill(a, kMiB, 1);
  saver.pause("model");
  EXPECT_TRUE(saver.is_paused("model"));
  EXPECT_EQ(saver.tag_info("model").physical_bytes, 0u);
  EXPECT_EQ(saver.tag_info("model").backup_bytes, kMiB);  // only the backed-up half
  saver.resume("model");
  EXPECT_EQ(mismatch(a, kMiB, 1), -1);
  ASSERT_EQ(saver.tags().size(), 2u);
  saver.deallocate(a);
  saver.deallocate(b);
}

TEST(Saver, PauseAndResumeEveryTag) {
  HostDevice host;
  Saver saver(host, options());
  saver.pause();  // no tags: nothing to do
  std::vector<void*> ps;
  for (const char* tag : {"a", "b", "c"}) {
    auto r = saver.region(tag, {.cpu_backup = true});
    ps.push_back(saver.allocate(2 * kMiB));
    fill(ps.back(), 2 * kMiB, static_cast<unsigned>(tag[0]));
  }
  void* plain = saver.allocate(kMiB);
  saver.pause("b");
  saver.pause();  // pauses a and c, skips b
  for (const TagInfo& t : saver.tags()) EXPECT_TRUE(t.paused) << t.tag;
  std::memset(plain, 1, kMiB);  // untagged memory is never paused
  saver.resume();
  for (const TagInfo& t : saver.tags()) EXPECT_FALSE(t.paused) << t.tag;
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(mismatch(ps[i], 2 * kMiB, static_cast<unsigned>("abc"[i])), -1);
  }
  saver.resume();  // all running: nothing to do
  for (void* p : ps) saver.deallocate(p);
  saver.deallocate(plain);
}

// ---- errors -----------------------------------------------------------------------

TEST(Saver, MisuseGetsClearErrorsAndChangesNothing) {
  HostDevice host;
  Saver saver(host, options());
  void* p = nullptr;
  {
    auto r = saver.region("kv");
    p = saver.allocate(3 * kMiB);
  }
  EXPECT_EQ(error_of<UsageError>([&] { saver.pause("nope"); }),
            "pause: unknown tag 'nope' (known tags: 'kv')");
  EXPECT_EQ(error_of<UsageError>([&] { saver.resume("kv"); }), "resume: tag 'kv' is not paused");
  saver.pause("kv");
  EXPECT_EQ(error_of<UsageError>([&] { saver.pause("kv"); }), "pause: tag 'kv' is paused already");
  EXPECT_EQ(error_of<UsageError>([&] {
              auto r = saver.region("kv");
              (void)saver.allocate(100);
            }),
            "allocation of 100 bytes into tag 'kv', which is paused (resume it first, or "
            "allocate outside it)");
  EXPECT_EQ(saver.current_tag(), "");  // the region closed on the way out
  EXPECT_EQ(error_of<UsageError>([&] { (void)saver.region(""); }), "region: the tag is empty");
  // A free while paused is applied on resume; a second free of it is refused.
  saver.deallocate(p);
  EXPECT_EQ(saver.tag_info("kv").pending_frees, 1u);
  EXPECT_EQ(saver.tag_info("kv").allocated_bytes, 3 * kMiB);
  EXPECT_EQ(error_of<InvalidPointerError>([&] { saver.deallocate(p); }),
            fmt::format("free of {}: not a live allocation of tag 'kv' (paused): freed already, "
                        "or not the start of a block",
                        p));
  EXPECT_THROW(saver.deallocate(static_cast<char*>(p) + 512), InvalidPointerError);
  saver.validate();
  saver.resume("kv");
  EXPECT_EQ(saver.tag_info("kv").pending_frees, 0u);
  EXPECT_EQ(saver.tag_info("kv").allocated_bytes, 0u);
  EXPECT_THROW(saver.deallocate(p), InvalidPointerError);  // running: the allocator says so
  int local = 0;
  EXPECT_THROW(saver.deallocate(&local), InvalidPointerError);
  saver.validate();
}

TEST(Saver, BadOptionsAndDevicesWithoutVirtualMemory) {
  HostDevice host;
  SaverOptions o = options();
  o.chunk_bytes = 3 << 20;
  EXPECT_EQ(error_of<UsageError>([&] { Saver s(host, o); }),
            "SaverOptions::chunk_bytes = 3145728: must be a power of two of at least 65536");
  o = options();
  o.copy_streams = 0;
  EXPECT_EQ(error_of<UsageError>([&] { Saver s(host, o); }),
            "SaverOptions::copy_streams = 0: must be 1 to 64");
  FaultyDevice no_vm(host, /*virtual_memory=*/false);
  Saver saver(no_vm, options());
  EXPECT_EQ(error_of<UsageError>([&] { (void)saver.region("w"); }),
            "region 'w': tagged memory needs a device with virtual memory, and 'host' has none "
            "(use cuda-vmm, or give SaverOptions::tag_device)");
  // A separate device for tags serves them.
  SaverOptions with_tag_device = options();
  with_tag_device.tag_device = &host;
  Saver split(no_vm, with_tag_device);
  {
    auto r = split.region("w");
    void* p = split.allocate(kMiB);
    split.pause("w");
    split.resume("w");
    split.deallocate(p);
  }
}

TEST(Saver, MmapStorageInADirectoryAndABadDirectory) {
  HostDevice host;
  SaverOptions o = options("", BackupStorage::mmap);
  o.mmap_directory = ::testing::TempDir();
  Saver saver(host, o);
  void* p = nullptr;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    p = saver.allocate(6 * kMiB + 4096);
  }
  fill(p, 6 * kMiB + 4096, 4);
  saver.pause("w");
  saver.resume("w");
  EXPECT_EQ(mismatch(p, 6 * kMiB + 4096, 4), -1);
  saver.deallocate(p);

  SaverOptions bad = options("", BackupStorage::mmap);
  bad.mmap_directory = "/nonexistent/reservoir";
  Saver other(host, bad);
  {
    auto r = other.region("w", {.cpu_backup = true});
    p = other.allocate(kMiB);
  }
  fill(p, kMiB, 5);
  const std::string message = error_of<UsageError>([&] { other.pause("w"); });
  EXPECT_EQ(message.rfind("backup: cannot create a file in mmap directory '/nonexistent/reservoir': ", 0), 0u)
      << message;
  EXPECT_FALSE(other.is_paused("w"));
  EXPECT_EQ(mismatch(p, kMiB, 5), -1);
  other.validate();
  other.deallocate(p);
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

// ---- fault injection: every device call of pause and resume -------------------------

struct Fixture {
  HostDevice host;
  FaultyDevice dev{host};
  std::unique_ptr<Saver> saver;
  std::vector<void*> ps;
  std::vector<std::size_t> sizes = {3 * kMiB, 30 * kMiB, 5000};

  explicit Fixture(const std::string& config) {
    SaverOptions o = options(config);
    saver = std::make_unique<Saver>(dev, o);
    auto r = saver->region("w", {.cpu_backup = true});
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ps.push_back(saver->allocate(sizes[i]));
      fill(ps.back(), sizes[i], static_cast<unsigned>(i + 40));
    }
  }
  void expect_contents() {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(mismatch(ps[i], sizes[i], static_cast<unsigned>(i + 40)), -1) << "block " << i;
    }
  }
  // Frees everything and destroys the saver: nothing may be left on the device.
  void finish() {
    for (void* p : ps) saver->deallocate(p);
    saver->validate();
    saver.reset();
    EXPECT_EQ(host.used_bytes(), 0u);
  }
};

struct FaultCase {
  CallKind call;
  int nth;
  Status status;
};
void PrintTo(const FaultCase& f, std::ostream* os) {
  *os << to_string(f.call) << " #" << f.nth << " -> " << to_string(f.status);
}

template <typename Param>
std::string fault_name(const ::testing::TestParamInfo<Param>& info) {
  const FaultCase& f = std::get<1>(info.param);
  return fmt::format("{}_{}_{}_{}", policy_name(std::get<0>(info.param)), to_string(f.call), f.nth,
                     to_string(f.status));
}

class PauseFaults : public ::testing::TestWithParam<std::tuple<const char*, FaultCase>> {};

TEST_P(PauseFaults, AFailedPauseLeavesTheTagRunningAndUntouched) {
  const auto& [config, fault] = GetParam();
  Fixture f(config);
  const std::size_t physical = f.saver->tag_info("w").physical_bytes;
  f.dev.fail_nth(fault.call, fault.nth, fault.status);
  try {
    f.saver->pause("w");
    FAIL() << "pause succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.call(), fault.call);
    EXPECT_EQ(std::string(e.what()).rfind("pause of tag 'w': ", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("the tag is left running, untouched"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(f.saver->is_paused("w"));
  EXPECT_EQ(f.saver->tag_info("w").physical_bytes, physical);
  EXPECT_EQ(f.saver->tag_info("w").backup_bytes, 0u);
  f.saver->validate();
  f.expect_contents();
  // And it can be paused and resumed afterwards.
  f.saver->pause("w");
  f.saver->resume("w");
  f.expect_contents();
  f.finish();
}

INSTANTIATE_TEST_SUITE_P(
    EveryCall, PauseFaults,
    ::testing::Combine(::testing::Values("", "expandable_segments:True", "policy:paging"),
                       ::testing::Values(FaultCase{CallKind::synchronize_device, 1, Status::device_error},
                                         FaultCase{CallKind::copy_to_host, 1, Status::device_error},
                                         FaultCase{CallKind::copy_to_host, 7, Status::device_error},
                                         FaultCase{CallKind::synchronize_stream, 2, Status::device_error},
                                         FaultCase{CallKind::unmap, 1, Status::device_error},
                                         FaultCase{CallKind::unmap, 2, Status::device_error})),
    fault_name<PauseFaults::ParamType>);

TEST(SaverFaults, AFailedReleaseStillPausesAndIsRetriedSoNothingLeaks) {
  for (const char* config : {"", "expandable_segments:True", "policy:paging"}) {
    SCOPED_TRACE(config);
    Fixture f(config);
    f.dev.fail_nth(CallKind::release_physical, 1, Status::device_error);
    f.saver->pause("w");  // unmapped: the memory is out of reach either way
    EXPECT_TRUE(f.saver->is_paused("w"));
    EXPECT_EQ(f.saver->tag_info("w").physical_bytes, 0u);
    f.saver->resume("w");  // retries the release first
    f.expect_contents();
    f.finish();
  }
}

class ResumeFaults : public ::testing::TestWithParam<std::tuple<const char*, FaultCase>> {};

TEST_P(ResumeFaults, AFailedResumeStaysPausedWithItsBackup) {
  const auto& [config, fault] = GetParam();
  Fixture f(config);
  f.saver->pause("w");
  f.saver->deallocate(f.ps[2]);  // a pending free survives the failed resume too
  const TagInfo paused = f.saver->tag_info("w");
  const std::size_t used = f.host.used_bytes();
  f.dev.fail_nth(fault.call, fault.nth, fault.status);
  if (fault.status == Status::out_of_memory) {
    try {
      f.saver->resume("w");
      FAIL() << "resume succeeded";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("the tag stays paused with its backup"), std::string::npos)
          << e.what();
    }
  } else {
    try {
      f.saver->resume("w");
      FAIL() << "resume succeeded";
    } catch (const DeviceError& e) {
      EXPECT_EQ(e.call(), fault.call);
      EXPECT_NE(std::string(e.what()).find("the tag stays paused with its backup"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_TRUE(f.saver->is_paused("w"));
  const TagInfo after = f.saver->tag_info("w");
  EXPECT_EQ(after.physical_bytes, 0u);
  EXPECT_EQ(after.backup_bytes, paused.backup_bytes);
  EXPECT_EQ(after.pending_frees, 1u);
  EXPECT_EQ(f.host.used_bytes(), used);  // what was created was given back
  f.saver->validate();
  f.saver->resume("w");
  f.sizes.pop_back();
  f.ps.pop_back();
  f.expect_contents();
  EXPECT_EQ(f.saver->tag_info("w").pending_frees, 0u);
  f.finish();
}

INSTANTIATE_TEST_SUITE_P(
    EveryCall, ResumeFaults,
    ::testing::Combine(::testing::Values("", "expandable_segments:True", "policy:paging"),
                       ::testing::Values(FaultCase{CallKind::create_physical, 1, Status::out_of_memory},
                                         FaultCase{CallKind::create_physical, 2, Status::out_of_memory},
                                         FaultCase{CallKind::create_physical, 2, Status::device_error},
                                         FaultCase{CallKind::map, 2, Status::device_error},
                                         FaultCase{CallKind::set_access, 2, Status::device_error},
                                         FaultCase{CallKind::copy_to_device, 1, Status::device_error},
                                         FaultCase{CallKind::copy_to_device, 9, Status::device_error},
                                         FaultCase{CallKind::synchronize_stream, 1, Status::device_error})),
    fault_name<ResumeFaults::ParamType>);

TEST(SaverFaults, ResumeRunsOutOfMemoryHalfwayOnARealCapacityAndRollsBack) {
  SimDeviceOptions so;
  so.capacity = 64 * kMiB;
  so.auto_complete_events = true;
  SimDevice sim(so);
  Saver saver(sim, options());
  void* a = nullptr;
  void* b = nullptr;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    a = saver.allocate(20 * kMiB);
    b = saver.allocate(20 * kMiB);
  }
  saver.pause("w");
  EXPECT_EQ(sim.used_bytes(), 0u);
  void* other = saver.allocate(30 * kMiB);  // untagged memory takes the room meanwhile
  // The first 20 MiB segment fits, the second does not: both are given back.
  const std::uint64_t creates = sim.calls(CallKind::create_physical);
  EXPECT_THROW(saver.resume("w"), OutOfMemoryError);
  EXPECT_EQ(sim.calls(CallKind::create_physical), creates + 2);
  EXPECT_TRUE(saver.is_paused("w"));
  EXPECT_EQ(sim.used_bytes(), 30 * kMiB);
  saver.deallocate(other);
  saver.empty_cache();
  saver.resume("w");
  EXPECT_FALSE(saver.is_paused("w"));
  EXPECT_EQ(sim.used_bytes(), 40 * kMiB);
  saver.deallocate(a);
  saver.deallocate(b);
  saver.validate();
}

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
  EXPECT_EQ(saver.stats_map().at("allocated_bytes.all.current"), static_cast<std::int64_t>(3 * kMiB));
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
      ASSERT_EQ(peak, sum.at(cur) - own.at(cur) + own.at(key))
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

// A section that rises 3 MiB and ends 2 MiB down sets the peak 3 MiB above
// where the sum stood; sections apply one after the other.
TEST(SaverStats, ASectionsHighestPointSetsThePeak) {
  CombinedStats combined;
  DeviceStats start;
  start.reserved_bytes[0].increase(8 * kMiB);
  start.reserved_bytes[0].increase(4 * kMiB);
  start.reserved_bytes[0].decrease(4 * kMiB);  // current 8 MiB, peak 12 MiB
  combined.add(start, false);
  EXPECT_EQ(combined.read().reserved_bytes[0].current, static_cast<std::int64_t>(8 * kMiB));
  EXPECT_EQ(combined.read().reserved_bytes[0].peak, static_cast<std::int64_t>(8 * kMiB));
  const std::uint64_t version = combined.version();
  const auto mib = [](std::size_t n) { return static_cast<std::int64_t>(n * kMiB); };
  DeviceStats layout;  // the Stats a section names
  CombinedStats::Section rise_then_fall;
  rise_then_fall.note(layout, layout.reserved_bytes[0], mib(1));
  rise_then_fall.note(layout, layout.reserved_bytes[0], mib(2));
  rise_then_fall.note(layout, layout.reserved_bytes[0], -mib(5));
  EXPECT_FALSE(rise_then_fall.empty());
  combined.publish(rise_then_fall);
  EXPECT_TRUE(rise_then_fall.empty());
  EXPECT_NE(combined.version(), version);
  DeviceStats s = combined.read();
  EXPECT_EQ(s.reserved_bytes[0].current, mib(6));
  EXPECT_EQ(s.reserved_bytes[0].peak, mib(11));
  CombinedStats::Section up;
  up.note(layout, layout.reserved_bytes[0], mib(4));
  up.note(layout, layout.oversize_segments, 1);
  combined.publish(up);
  s = combined.read();
  EXPECT_EQ(s.reserved_bytes[0].current, mib(10));
  EXPECT_EQ(s.reserved_bytes[0].peak, mib(11));
  EXPECT_EQ(s.oversize_segments.current, 1);
  EXPECT_EQ(s.oversize_segments.peak, 1);
  combined.publish(rise_then_fall);  // emptied: changes nothing
  EXPECT_EQ(combined.read().reserved_bytes[0].current, mib(10));
  EXPECT_EQ(s.reserved_bytes[1].peak, 0);  // other stats untouched
  combined.add(start, true);  // carried peak: on top of the current 10 MiB
  EXPECT_EQ(combined.read().reserved_bytes[0].peak, static_cast<std::int64_t>(22 * kMiB));
  combined.reset_peaks();
  EXPECT_EQ(combined.read().reserved_bytes[0].peak, static_cast<std::int64_t>(18 * kMiB));
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
                     {reinterpret_cast<DevicePtr>(a), 1000}, {reinterpret_cast<DevicePtr>(b), 3 * kMiB}}));
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
      {A::segment_alloc, ""},        {A::alloc, ""},
      {A::segment_alloc, "reservoir.tag=kv"}, {A::alloc, "reservoir.tag=kv"},
      {A::free_requested, ""},       {A::free_completed, ""},
      {A::free_requested, "reservoir.tag=kv"}, {A::free_completed, "reservoir.tag=kv"},
      {A::snapshot, ""}};
  EXPECT_EQ(seen, expected);
  EXPECT_THROW(saver.record_history({.enabled = true, .max_entries = 0, .stacks = false, .max_frames = 8}),
               UsageError);
}

}  // namespace
}  // namespace reservoir
