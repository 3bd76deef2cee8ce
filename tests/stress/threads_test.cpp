// Many threads, seeded, every block filled with a pattern on a HostDevice and
// checked when freed; blocks are handed between threads.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/saver.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir {
namespace {

struct Handoff {
  std::mutex mutex;
  std::vector<std::pair<unsigned char*, std::size_t>> blocks;
};

TEST(Threads, ConcurrentAllocateFreeWithHandoff) {
  HostDeviceOptions options;
  options.capacity = std::size_t{2} << 30;
  HostDevice device(options);
  CachingAllocator allocator(device, AllocatorConfig{});
  Handoff handoff;
  std::atomic<int> bad{0};
  constexpr int kThreads = 4;
  constexpr int kSteps = 3000;
  auto worker = [&](int id) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(id) + 100);
    std::vector<std::pair<unsigned char*, std::size_t>> mine;
    auto check_and_free = [&](std::pair<unsigned char*, std::size_t> b) {
      const auto tag = static_cast<unsigned char>(b.second * 31);
      for (std::size_t i = 0; i < b.second; i += 97) bad += b.first[i] != tag;
      allocator.deallocate(b.first);
    };
    for (int step = 0; step < kSteps; ++step) {
      const unsigned r = rng() % 100;
      if (r < 50 || mine.empty()) {
        const std::size_t size = rng() % 4 == 0 ? (1 << 20) + rng() % (4 << 20) : 1 + rng() % 65536;
        auto* p =
            static_cast<unsigned char*>(allocator.allocate(size, static_cast<StreamId>(id % 2)));
        std::memset(p, static_cast<unsigned char>(size * 31), size);
        mine.emplace_back(p, size);
      } else if (r < 85) {
        const std::size_t k = rng() % mine.size();
        check_and_free(mine[k]);
        mine[k] = mine.back();
        mine.pop_back();
      } else if (r < 95) {
        std::lock_guard lock(handoff.mutex);  // give a block to whichever thread comes next
        handoff.blocks.push_back(mine.back());
        mine.pop_back();
      } else {
        std::lock_guard lock(handoff.mutex);
        if (!handoff.blocks.empty()) {
          mine.push_back(handoff.blocks.back());
          handoff.blocks.pop_back();
        }
      }
    }
    for (auto& b : mine) check_and_free(b);
  };
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (auto& t : threads) t.join();
  for (auto& b : handoff.blocks) allocator.deallocate(b.first);
  EXPECT_EQ(bad.load(), 0);
  allocator.validate();
  EXPECT_EQ(allocator.stats().allocation[0].current, 0);
  allocator.empty_cache();
  EXPECT_EQ(device.used_bytes(), 0u);
}

TEST(Threads, StatsSnapshotsAndEmptyCacheWhileAllocating) {
  SimDevice device;
  CachingAllocator allocator(device, AllocatorConfig{});
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    while (!stop) {
      (void)allocator.stats_map();
      (void)allocator.snapshot();
      (void)allocator.memory_summary();
      allocator.empty_cache();
    }
  });
  std::vector<std::thread> writers;
  writers.reserve(2);
  for (int t = 0; t < 2; ++t) {
    writers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      std::vector<void*> live;
      for (int i = 0; i < 20000; ++i) {
        if (live.size() < 50 && rng() % 2) {
          live.push_back(allocator.allocate(1 + rng() % (3 << 20)));
        } else if (!live.empty()) {
          allocator.deallocate(live.back());
          live.pop_back();
        }
      }
      for (void* p : live) allocator.deallocate(p);
    });
  }
  for (auto& w : writers) w.join();
  stop = true;
  reader.join();
  allocator.validate();
  EXPECT_EQ(allocator.stats().allocation[0].current, 0);
}

// History under contention: threads annotate and allocate while another
// switches history on and off, resizes it and takes snapshots.
TEST(Threads, HistoryWhileThreadsAnnotateAndAllocate) {
  SimDevice device;
  CachingAllocator allocator(device, AllocatorConfig{});
  allocator.record_history({.max_entries = 500, .stacks = true, .max_frames = 8});
  std::atomic<bool> done{false};
  // Workers go on past their 1500 steps until the observer has seen an
  // annotated event: on a loaded machine the observer may not be scheduled
  // before they finish, and their last events (the final frees) carry no
  // annotation. The bound keeps a broken observer from hanging the test.
  std::atomic<std::size_t> annotated{0};
  constexpr int kThreads = 3;
  std::vector<std::thread> workers;
  workers.reserve(kThreads);
  for (int id = 0; id < kThreads; ++id) {
    workers.emplace_back([&, id] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(id) + 7);
      std::vector<void*> live;
      for (int step = 0; step < 1500 || (annotated == 0 && step < 2'000'000); ++step) {
        ScopedAnnotation outer(fmt::format("worker{}", id));
        ScopedAnnotation inner(step % 2 == 0 ? "even" : "odd");
        if (!live.empty() && (live.size() >= 64 || rng() % 2 == 0)) {
          allocator.deallocate(live.back());
          live.pop_back();
        } else {
          live.push_back(allocator.allocate(1 + rng() % (4 << 20), rng() % 2));
        }
      }
      for (void* p : live) allocator.deallocate(p);
    });
  }
  std::size_t snapshots = 0;
  std::thread observer([&] {
    for (int i = 0; !done; ++i) {
      if (i % 7 == 3) allocator.record_history({.enabled = false});
      if (i % 7 == 4)
        allocator.record_history({.max_entries = 100u + i % 300u, .stacks = i % 2 == 0});
      const Snapshot s = allocator.snapshot();
      ++snapshots;
      for (const TraceEvent& e : s.history) {
        const Context& c = s.contexts.at(e.context);
        if (e.action != TraceAction::snapshot && !c.annotations.empty()) {
          ++annotated;
          ASSERT_EQ(c.annotations.size(), 2u);
          ASSERT_EQ(c.annotations[0].rfind("worker", 0), 0u);
        }
      }
    }
  });
  for (auto& t : workers) t.join();
  done = true;
  observer.join();
  allocator.validate();
  EXPECT_GT(snapshots, 0u);
  EXPECT_GT(annotated, 0u);
}

// Tagged allocations on three threads while another pauses and resumes one
// of the tags (its thread is refused while paused).
TEST(SaverThreads, AllocationsRaceWithPauseAndResumeOfOtherTags) {
  HostDevice host;
  SaverOptions o;
  o.config = AllocatorConfig::parse("expandable_segments:True");
  o.chunk_bytes = std::size_t{1} << 20;
  Saver saver(host, o);
  std::atomic<bool> stop{false};
  std::atomic<int> refused{0};
  std::vector<std::thread> workers;
  workers.reserve(3);
  for (int t = 0; t < 3; ++t) {
    workers.emplace_back([&, t] {
      const std::string tag = t == 2 ? "paused_often" : "steady" + std::to_string(t);
      auto r = saver.region(tag, {.cpu_backup = true});
      std::vector<std::pair<void*, unsigned>> live;
      unsigned seed = static_cast<unsigned>(t) * 1000;
      for (int i = 0; i < 400 && !stop; ++i) {
        try {
          const std::size_t size = 4096 + (seed % 7) * 300'000;
          void* p = saver.allocate(size);
          // The paused tag's memory may go at any moment: only the others write.
          if (t != 2) std::memset(p, static_cast<int>(seed & 0xff), 64);
          live.emplace_back(p, seed++);
        } catch (const UsageError&) {
          refused++;  // its tag is paused right now
        }
        if (live.size() > 8) {
          if (t != 2) {
            const auto* q = static_cast<const unsigned char*>(live.front().first);
            EXPECT_EQ(q[63], static_cast<unsigned char>(live.front().second & 0xff));
          }
          saver.deallocate(live.front().first);
          live.erase(live.begin());
        }
      }
      for (auto& [p, s] : live) saver.deallocate(p);
    });
  }
  std::thread pauser([&] {
    for (int i = 0; i < 30; ++i) {
      try {
        saver.pause("paused_often");
        saver.resume("paused_often");
      } catch (const UsageError&) {
        // not created yet
      }
    }
  });
  for (auto& w : workers) w.join();
  stop = true;
  pauser.join();
  saver.validate();
  EXPECT_EQ(saver.stats().allocated_bytes[0].current, 0);
}

// Untagged and tagged allocations on four threads change the combined
// statistics, each thread claiming the sum in turn, while another reads them
// and resets their peaks: the sum stays the allocators' sum, and its peak lies
// within the sum of their peaks.
TEST(SaverThreads, CombinedStatisticsStayTheSumWhileOwnersChange) {
  HostDevice host;
  SaverOptions o;
  o.config = AllocatorConfig::parse("expandable_segments:True");
  Saver saver(host, o);
  { auto r = saver.region("a"); }  // the tags exist: statistics are combined
  { auto r = saver.region("b"); }
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  workers.reserve(4);
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      std::optional<Saver::Region> r;
      if (t >= 2) r.emplace(saver.region(t == 2 ? "a" : "b"));
      std::vector<void*> live;
      for (int i = 0; i < 600; ++i) {
        live.push_back(saver.allocate(4096 + static_cast<std::size_t>((i * 7 + t) % 13) * 65536));
        if (live.size() > 6) {
          saver.deallocate(live.front());
          live.erase(live.begin());
        }
      }
      for (void* p : live) saver.deallocate(p);
    });
  }
  std::thread reader([&] {
    for (int i = 0; !stop; ++i) {
      const DeviceStats s = saver.stats();
      EXPECT_GE(s.allocated_bytes[0].peak, s.allocated_bytes[0].current);
      if (i % 16 == 0) saver.reset_peak_stats();
    }
  });
  for (auto& w : workers) w.join();
  stop = true;
  reader.join();
  saver.validate();  // the combined values are the allocators' sum
  const DeviceStats all = saver.stats();
  EXPECT_EQ(all.allocated_bytes[0].current, 0);
  // The allocators' peaks were reset before the sum's, each time: theirs
  // cover the sum's.
  std::int64_t summed = saver.untagged_allocator().stats().allocated_bytes[0].peak;
  for (const char* tag : {"a", "b"}) summed += saver.stats(tag).allocated_bytes[0].peak;
  EXPECT_LE(all.allocated_bytes[0].peak, summed);
  saver.reset_peak_stats();
  EXPECT_EQ(saver.stats().allocated_bytes[0].peak, 0);
}

}  // namespace
}  // namespace reservoir
