// The Saver's backup kinds per region (pinned, mmap, disk), retained
// backups, read_backup and the memory margin of tagged allocations.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/sim_device.hpp"
#include "saver_fixture.hpp"

namespace reservoir {
namespace {

namespace fs = std::filesystem;

// A 512 MiB device: small enough to run out of.
SimDeviceOptions small_device() { return SimDeviceOptions{.capacity = std::size_t{512} * kMiB}; }

void* allocate_in(Saver& saver, const std::string& tag, std::size_t bytes) {
  auto r = saver.region(tag);
  return saver.allocate(bytes);
}

fs::path fresh_directory(const std::string& name) {
  fs::path d = fs::temp_directory_path() / fmt::format("reservoir_{}_{}", name, ::getpid());
  fs::remove_all(d);
  return d;
}

TEST(SaverBackupKinds, EachRegionKeepsItsOwnStorageAndAllSurviveAPause) {
  HostDevice host;
  Saver saver(host, options());
  const fs::path dir = fresh_directory("disk");
  saver.set_disk_backup_dir((dir / "spill").string());
  EXPECT_TRUE(fs::is_directory(dir / "spill"));
  EXPECT_EQ(saver.disk_backup_dir(), (dir / "spill").string());
  std::vector<void*> blocks;
  const BackupStorage kinds[] = {BackupStorage::pinned, BackupStorage::mmap, BackupStorage::disk};
  for (const BackupStorage kind : kinds) {
    auto r = saver.region("w", {.cpu_backup = true, .storage = kind});
    blocks.push_back(saver.allocate(3 * kMiB));
  }
  {
    auto r = saver.region("w");  // no backup: a fourth pool of the same tag
    blocks.push_back(saver.allocate(kMiB));
  }
  for (std::size_t i = 0; i < 3; ++i) fill(blocks[i], 3 * kMiB, static_cast<unsigned>(i + 1));
  std::vector<std::string> storages;
  for (const TagInfo& t : saver.tags()) storages.push_back(t.backup_storage);
  EXPECT_EQ(storages, (std::vector<std::string>{"", "pinned", "mmap", "disk"}));
  saver.pause("w");
  for (const TagInfo& t : saver.tags()) {
    EXPECT_TRUE(t.paused);
    EXPECT_EQ(t.physical_bytes, 0u);
    EXPECT_EQ(t.backup_bytes, t.cpu_backup ? 3 * kMiB : 0u) << t.backup_storage;
  }
  saver.resume("w");
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(mismatch(blocks[i], 3 * kMiB, static_cast<unsigned>(i + 1)), -1) << i;
  }
  for (void* p : blocks) saver.deallocate(p);
  saver.validate();
  fs::remove_all(dir);
}

// What a pause keeps is chosen at the pause: a tag whose region asked for a
// backup paused with discard copies nothing (and its memory comes back
// holding whatever it holds), with zero copies nothing and comes back zeroed
// at the same addresses, and the next plain pause backs it up again. Blocks
// freed while paused are left out; names are parsed with a clear error.
TEST(SaverBackupKinds, WhatAPauseKeepsIsChosenAtEachPause) {
  HostDevice host;
  Saver saver(host, options());
  std::vector<void*> blocks;
  {
    auto r = saver.region("kv", {.cpu_backup = true});
    blocks = {saver.allocate(3 * kMiB), saver.allocate(5 * kMiB), saver.allocate(kMiB)};
  }
  auto fill_all = [&] {
    fill(blocks[0], 3 * kMiB, 1);
    fill(blocks[1], 5 * kMiB, 2);
  };
  fill_all();
  saver.pause("kv", PauseContents::zero);
  TagInfo t = saver.tag_info("kv");
  EXPECT_TRUE(t.paused);
  EXPECT_EQ(t.last_pause_copied, 0u);
  EXPECT_EQ(t.backup_bytes, 0u);  // nothing of the contents is held
  std::vector<unsigned char> out(16);
  EXPECT_FALSE(saver.read_backup(blocks[0], out.size(), out.data()));
  saver.deallocate(blocks[2]);  // freed while paused: not zeroed on resume
  saver.resume("kv");
  t = saver.tag_info("kv");
  EXPECT_EQ(t.last_resume_copied, 8 * kMiB);
  const std::vector<unsigned char> zeros(5 * kMiB, 0);
  EXPECT_EQ(std::memcmp(blocks[0], zeros.data(), 3 * kMiB), 0);
  EXPECT_EQ(std::memcmp(blocks[1], zeros.data(), 5 * kMiB), 0);
  // Discard: nothing copied either way.
  fill_all();
  saver.pause("kv", PauseContents::discard);
  EXPECT_EQ(saver.tag_info("kv").last_pause_copied, 0u);
  saver.resume("kv");
  EXPECT_EQ(saver.tag_info("kv").last_resume_copied, 0u);
  // As the region says: backed up and restored byte for byte.
  fill_all();
  saver.pause("kv");
  EXPECT_EQ(saver.tag_info("kv").last_pause_copied, 8 * kMiB);
  saver.resume("kv");
  EXPECT_EQ(mismatch(blocks[0], 3 * kMiB, 1), -1);
  EXPECT_EQ(mismatch(blocks[1], 5 * kMiB, 2), -1);
  // A region without a backup is never copied, whatever the pause says.
  void* plain = nullptr;
  {
    auto r = saver.region("scratch");
    plain = saver.allocate(kMiB);
  }
  saver.pause("scratch", PauseContents::as_regions);
  EXPECT_EQ(saver.tag_info("scratch").last_pause_copied, 0u);
  saver.resume("scratch");
  EXPECT_EQ(parse_pause_contents("zero", "sleep"), PauseContents::zero);
  EXPECT_EQ(to_string(PauseContents::discard), "discard");
  try {
    (void)parse_pause_contents("cpu", "sleep of 'kv'");
    ADD_FAILURE() << "no error";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(), "sleep of 'kv': 'cpu' is not a way to pause (as_regions, discard or zero)");
  }
  EXPECT_THROW(saver.pause("nosuch", PauseContents::zero), UsageError);
  saver.deallocate(plain);
  saver.deallocate(blocks[0]);
  saver.deallocate(blocks[1]);
}

TEST(SaverBackupKinds, BadRegionsAndADiskBackupWithoutADirectoryAreErrors) {
  HostDevice host;
  Saver saver(host, options());
  EXPECT_EQ(error_of<UsageError>([&] {
              auto r = saver.region("w", {.cpu_backup = false, .storage = BackupStorage::mmap});
            }),
            "region 'w': a backup storage ('mmap') needs cpu_backup");
  void* p = nullptr;
  {
    auto r = saver.region("kv", {.cpu_backup = true, .storage = BackupStorage::disk});
    p = saver.allocate(kMiB);
  }
  fill(p, kMiB, 4);
  EXPECT_EQ(error_of<UsageError>([&] { saver.pause("kv"); }),
            "pause of tag 'kv': its backup goes to disk, and no disk backup directory is set "
            "(Saver::set_disk_backup_dir, SaverOptions::disk_directory; the tag is left running, "
            "untouched)");
  EXPECT_FALSE(saver.is_paused("kv"));
  EXPECT_EQ(mismatch(p, kMiB, 4), -1);
  EXPECT_EQ(error_of<UsageError>([&] { saver.set_disk_backup_dir(""); }),
            "set_disk_backup_dir: the path is empty");
  const fs::path file = fresh_directory("file");
  { std::ofstream(file.string()) << "x"; }
  EXPECT_NE(error_of<UsageError>([&] { saver.set_disk_backup_dir(file.string()); })
                .find("set_disk_backup_dir: cannot make the directory '" + file.string() + "'"),
            std::string::npos);
  fs::remove(file);
  EXPECT_EQ(error_of<UsageError>([] { (void)parse_backup_storage("tape", "storage"); }),
            "storage: 'tape' is not 'pinned', 'mmap' or 'disk'");
  saver.deallocate(p);
  saver.validate();
}

TEST(SaverBackupKinds, ReadBackupGivesThePausedBytesAndRetainKeepsThemAfterResume) {
  HostDevice host;
  Saver saver(host, options());
  void* p = nullptr;
  void* q = nullptr;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    p = saver.allocate(2 * kMiB + 100);
  }
  {
    auto r = saver.region("kv");
    q = saver.allocate(kMiB);
  }
  fill(p, 2 * kMiB + 100, 7);
  std::vector<unsigned char> out(2 * kMiB + 100);
  EXPECT_FALSE(saver.read_backup(p, out.size(), out.data()));  // running: no backup
  saver.pause();
  ASSERT_TRUE(saver.read_backup(p, out.size(), out.data()));
  EXPECT_EQ(mismatch(out.data(), out.size(), 7), -1);
  // From inside the allocation, across the copy chunks (1 MiB here).
  std::vector<unsigned char> part(kMiB + 10);
  ASSERT_TRUE(saver.read_backup(static_cast<char*>(p) + kMiB - 5, part.size(), part.data()));
  EXPECT_EQ(std::memcmp(part.data(), out.data() + kMiB - 5, part.size()), 0);
  EXPECT_FALSE(saver.read_backup(q, 16, out.data()));  // a tag without backup
  EXPECT_NE(error_of<UsageError>([&] { (void)saver.read_backup(p, out.size() + 1, out.data()); })
                .find("run past the backed-up allocation of tag 'w'"),
            std::string::npos);
  saver.resume();
  EXPECT_FALSE(saver.read_backup(p, 16, out.data()));  // dropped at resume
  saver.set_retain_backup(true);
  EXPECT_TRUE(saver.retain_backup());
  saver.pause("w");
  saver.resume("w");
  fill(p, 2 * kMiB + 100, 8);
  ASSERT_TRUE(saver.read_backup(p, out.size(), out.data()));  // as at the pause
  EXPECT_EQ(mismatch(out.data(), out.size(), 7), -1);
  EXPECT_EQ(saver.tag_info("w").backup_bytes, 2 * kMiB + 100);
  saver.set_retain_backup(false);  // drops the backups of running tags
  EXPECT_FALSE(saver.read_backup(p, 16, out.data()));
  EXPECT_EQ(saver.tag_info("w").backup_bytes, 0u);
  saver.deallocate(p);
  saver.deallocate(q);
  saver.validate();
}

TEST(SaverBackupKinds, TheMarginTurnsTaggedAllocationsIntoOutOfMemoryAndLeavesResumeAlone) {
  SimDevice sim(small_device());
  Saver saver(sim, options());
  void* a = allocate_in(saver, "kv", 64 * kMiB);
  saver.set_memory_margin(400 * kMiB);
  EXPECT_EQ(saver.memory_margin(), 400 * kMiB);
  {
    auto r = saver.region("kv");
    void* b = saver.allocate(20 * kMiB);  // 512 - 64 - 20 = 428 MiB free after
    EXPECT_THROW((void)saver.allocate(64 * kMiB), OutOfMemoryError);
    saver.deallocate(b);
  }
  void* untagged = saver.allocate(64 * kMiB);  // the margin is for tags only
  saver.pause("kv");
  saver.resume("kv");  // not limited
  saver.set_memory_margin(0);
  {
    auto r = saver.region("kv");
    void* c = saver.allocate(200 * kMiB);
    saver.deallocate(c);
  }
  saver.deallocate(untagged);
  saver.deallocate(a);
  saver.validate();
}

TEST(SaverBackupKinds, AFailedMemoryInfoUnderAMarginFailsTheAllocationAndChangesNothing) {
  HostDevice host;
  FaultyDevice faulty(host);
  Saver saver(faulty, options());
  saver.set_memory_margin(kMiB);
  void* a = nullptr;
  {
    auto r = saver.region("kv");
    a = saver.allocate(kMiB);
    faulty.fail_nth(CallKind::memory_info, 1, Status::device_error);
    EXPECT_THROW((void)saver.allocate(8 * kMiB), DeviceError);
  }
  const TagInfo t = saver.tag_info("kv");
  EXPECT_EQ(t.allocated_bytes, kMiB);
  EXPECT_EQ(t.reserved_bytes, 2 * kMiB);  // the first segment alone
  saver.validate();
  {
    auto r = saver.region("kv");
    void* b = saver.allocate(8 * kMiB);  // the fault was one call
    saver.deallocate(b);
  }
  saver.deallocate(a);
  saver.validate();
}

// ---- memory other allocators cache goes to a tag that runs out ---------------

TEST(SaverReclaim, ATagThatRunsOutTakesTheUntaggedCacheAndTriesAgain) {
  SimDevice sim(small_device());
  Saver saver(sim, options());
  saver.deallocate(saver.allocate(300 * kMiB));  // cached by the untagged allocator
  ASSERT_EQ(saver.untagged_allocator().stats().reserved_bytes[0].current, 300 * kMiB);
  void* t = allocate_in(saver, "kv", 300 * kMiB);
  EXPECT_EQ(saver.untagged_allocator().stats().reserved_bytes[0].current, 0);
  EXPECT_EQ(saver.tag_info("kv").physical_bytes, 300 * kMiB);
  saver.deallocate(t);
  saver.validate();
}

TEST(SaverReclaim, AResumeThatRunsOutTakesTheUntaggedCacheAndTriesAgain) {
  SimDevice sim(small_device());
  Saver saver(sim, options());
  void* t = allocate_in(saver, "kv", 300 * kMiB);
  saver.pause("kv");
  saver.deallocate(saver.allocate(300 * kMiB));  // the trainer's turn, then cached
  saver.resume("kv");
  EXPECT_FALSE(saver.is_paused("kv"));
  EXPECT_EQ(saver.untagged_allocator().stats().reserved_bytes[0].current, 0);
  // With nothing cached elsewhere, the error stands and the tag stays paused.
  saver.pause("kv");
  void* held = saver.allocate(300 * kMiB);
  EXPECT_THROW(saver.resume("kv"), OutOfMemoryError);
  EXPECT_TRUE(saver.is_paused("kv"));
  saver.deallocate(held);
  saver.resume("kv");
  saver.deallocate(t);
  saver.validate();
}

// ---- private pools across the saver's allocators (MemPool, CUDA graphs) ----

std::vector<std::pair<PoolId, std::size_t>> pools_of(const Saver& saver) {
  std::vector<std::pair<PoolId, std::size_t>> out;
  for (const SegmentInfo& s : saver.snapshot().segments) out.emplace_back(s.pool_id, s.total_size);
  std::sort(out.begin(), out.end());
  return out;
}

TEST(SaverPools, ARouteBegunOutsideARegionServesTheRegionFromThatTagsPool) {
  HostDevice host;
  Saver saver(host, options());
  const PoolId graph{0, 7};
  constexpr StreamId kCapture = 5;
  saver.begin_allocate_to_pool(graph, [](StreamId s) { return s == kCapture; });
  void* outside = saver.allocate(kMiB, kCapture);  // untagged pool (0, 7)
  void* inside = nullptr;
  void* other_stream = nullptr;
  {
    auto r = saver.region("g", {.cpu_backup = true});
    inside = saver.allocate(3 * kMiB, kCapture);      // tag g, pool (0, 7)
    other_stream = saver.allocate(kMiB, 0);           // tag g, its own pool
  }
  saver.end_allocate_to_pool(graph);
  void* after = saver.allocate(kMiB, kCapture);  // the route ended: default pool
  EXPECT_EQ(pools_of(saver), (std::vector<std::pair<PoolId, std::size_t>>{
                                 {{0, 0}, 2 * kMiB}, {{0, 0}, 2 * kMiB}, {graph, 2 * kMiB},
                                 {graph, 20 * kMiB}}));
  fill(inside, 3 * kMiB, 3);
  saver.pause("g");
  EXPECT_EQ(saver.tag_info("g").physical_bytes, 0u);  // the graph's memory paused too
  saver.resume("g");
  EXPECT_EQ(mismatch(inside, 3 * kMiB, 3), -1);
  for (void* p : {outside, inside, other_stream, after}) saver.deallocate(p);
  saver.empty_cache();
  EXPECT_EQ(pools_of(saver).size(), 2u);  // both pools still hold their segments
  saver.release_pool(graph);
  saver.empty_cache();
  EXPECT_TRUE(pools_of(saver).empty());
  saver.validate();
}

// MemPool(allocator=...) in a region: the pool's segment comes from its own
// allocator (another HostDevice here: real memory) in the tag too; pausing
// the tag releases the tag's own memory and keeps that segment, contents
// and address intact; the tag's allocator gives it back to its allocator
// when the pool goes.
TEST(SaverPools, APoolOverAnotherAllocatorInARegionKeepsItsSegmentThroughPause) {
  class Other final : public PoolSegmentAllocator {
   public:
    DevicePtr allocate(std::size_t size, StreamId) override {
      DevicePtr p = 0;
      if (memory.allocate_segment(size, &p) != Status::ok) return 0;
      ++allocated;
      return p;
    }
    void free(DevicePtr ptr, std::size_t, StreamId) override {
      ASSERT_EQ(memory.free_segment(ptr), Status::ok);
      ++freed;
    }
    HostDevice memory;
    int allocated = 0;
    int freed = 0;
  };
  HostDevice host;
  Saver saver(host, options());
  auto other = std::make_shared<Other>();
  const PoolId pool{0, 11};
  saver.set_pool_allocator(pool, other);
  saver.begin_allocate_to_pool(pool, [](StreamId) { return true; });
  void* in_pool = nullptr;
  void* own = nullptr;
  {
    auto r = saver.region("kv", {.cpu_backup = true});
    in_pool = saver.allocate(3 * kMiB, 0);  // tag kv, pool (0, 11): the other allocator's
  }
  saver.end_allocate_to_pool(pool);
  {
    auto r = saver.region("kv", {.cpu_backup = true});
    own = saver.allocate(3 * kMiB, 0);  // tag kv's own memory
  }
  EXPECT_EQ(other->allocated, 1);
  EXPECT_TRUE(saver.tagged(in_pool));
  fill(in_pool, 3 * kMiB, 5);
  fill(own, 3 * kMiB, 6);
  saver.pause("kv");
  EXPECT_EQ(other->freed, 0);
  EXPECT_EQ(mismatch(in_pool, 3 * kMiB, 5), -1);  // never unmapped
  saver.resume("kv");
  EXPECT_EQ(mismatch(in_pool, 3 * kMiB, 5), -1);
  EXPECT_EQ(mismatch(own, 3 * kMiB, 6), -1);
  saver.deallocate(in_pool);
  saver.deallocate(own);
  saver.release_pool(pool);
  saver.empty_cache();
  EXPECT_EQ(other->freed, 1);
  saver.validate();
}

TEST(SaverPools, RoutesAreCheckedAsTheAllocatorChecksThem) {
  HostDevice host;
  Saver saver(host, options());
  EXPECT_EQ(error_of<UsageError>([&] { saver.end_allocate_to_pool({0, 9}); }),
            "end_allocate_to_pool: not allocating to pool (0, 9)");
  EXPECT_EQ(error_of<UsageError>([&] { saver.release_pool({0, 9}); }),
            "release_pool: no live pool (0, 9)");
  saver.begin_allocate_to_pool({0, 9}, [](StreamId) { return true; });
  EXPECT_EQ(error_of<UsageError>([&] {
              saver.begin_allocate_to_pool({0, 9}, [](StreamId) { return true; });
            }),
            "begin_allocate_to_pool: already allocating to pool (0, 9)");
  saver.end_allocate_to_pool({0, 9});
  saver.release_pool({0, 9});
  saver.validate();
}

// torch_memory_saver's TMS_INIT_ENABLE: a thread that opened no region
// allocates into the initial tag, here and on another thread; regions and
// untagged regions nest inside it; its backup survives a pause.
TEST(SaverInitialRegion, EveryThreadStartsInsideTheInitialTagAndRegionsNestInIt) {
  HostDevice host;
  SaverOptions o = options();
  o.initial_region = SaverOptions::InitialRegion{.tag = "default", .options = {.cpu_backup = true}};
  Saver saver(host, o);
  void* a = saver.allocate(3 * kMiB);
  void* b = nullptr;
  std::thread([&] { b = saver.allocate(kMiB); }).join();
  void* plain = nullptr;
  void* other = nullptr;
  {
    auto r = saver.untagged();
    plain = saver.allocate(kMiB);
  }
  {
    auto r = saver.region("kv");
    other = saver.allocate(kMiB);
  }
  void* again = saver.allocate(kMiB);  // back in the initial tag once the regions close
  for (void* p : {a, b, other, again}) EXPECT_TRUE(saver.tagged(p));
  EXPECT_FALSE(saver.tagged(plain));
  EXPECT_EQ(saver.tag_info("default").allocated_bytes, 5 * kMiB);  // a, b and again
  EXPECT_EQ(saver.tag_info("kv").allocated_bytes, kMiB);
  EXPECT_EQ(saver.untagged_allocator().stats().allocated_bytes[0].current, static_cast<std::int64_t>(kMiB));
  fill(a, 3 * kMiB, 7);
  saver.pause("default");
  saver.resume("default");
  EXPECT_EQ(mismatch(a, 3 * kMiB, 7), -1);
  for (void* p : {a, b, plain, other, again}) saver.deallocate(p);
}

TEST(SaverInitialRegion, TheEnvironmentNamesTheBackupAndABadValueIsAnErrorNamingTheVariable) {
  EXPECT_FALSE(initial_region_from_tms_env(nullptr, "1", nullptr, nullptr).has_value());
  EXPECT_FALSE(initial_region_from_tms_env("0", nullptr, nullptr, nullptr).has_value());
  const auto plain = initial_region_from_tms_env("1", nullptr, nullptr, nullptr);
  ASSERT_TRUE(plain.has_value());
  EXPECT_EQ(plain->tag, "default");
  EXPECT_FALSE(plain->options.cpu_backup);
  const auto mmap = initial_region_from_tms_env("true", "yes", nullptr, "mmap");
  ASSERT_TRUE(mmap.has_value());
  EXPECT_TRUE(mmap->options.cpu_backup);
  EXPECT_EQ(mmap->options.storage, BackupStorage::mmap);
  const auto disk = initial_region_from_tms_env("ON", "1", "1", nullptr);
  ASSERT_TRUE(disk.has_value());
  EXPECT_EQ(disk->options.storage, BackupStorage::disk);
  EXPECT_THAT(error_of<UsageError>([] { (void)initial_region_from_tms_env("maybe", nullptr, nullptr, nullptr); }),
              ::testing::HasSubstr("TMS_INIT_ENABLE=maybe: not a flag"));
  EXPECT_THAT(error_of<UsageError>([] { (void)initial_region_from_tms_env("1", "1", nullptr, "floppy"); }),
              ::testing::HasSubstr("TMS_INIT_CPU_BACKUP_BACKEND"));
}

TEST(SaverInitialRegion, ADeviceWithoutVirtualMemoryRefusesTheInitialTagWhenTheSaverIsMade) {
  HostDevice host;
  FaultyDevice no_vm(host, /*virtual_memory=*/false);
  SaverOptions o = options();
  o.initial_region = SaverOptions::InitialRegion{};
  EXPECT_THAT(error_of<UsageError>([&] { Saver saver(no_vm, o); }),
              ::testing::HasSubstr("region 'default': tagged memory needs a device with virtual memory"));
}

}  // namespace
}  // namespace reservoir
