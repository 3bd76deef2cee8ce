// Saver: tags and regions (nesting, threads, segments never shared), and the
// errors of misuse, bad options and devices without virtual memory.
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

}  // namespace
}  // namespace reservoir
