// verify on every kind of recording a user brings: empty_cache() runs
// anywhere, the retry ladder's and garbage collection's releases, delayed
// frees on several streams, private pools, oom events, zero-byte events,
// several devices, ring buffers that dropped their oldest events, and
// snapshots of older PyTorch versions. Each recording is made by the
// allocator itself (which makes PyTorch's decisions) and read back from the
// pickle our writer makes.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <random>
#include <set>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/pickle.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "trace_fixture.hpp"
#include "per_call_validation.hpp"
#include "source_dir.hpp"

namespace reservoir {
namespace {

std::size_t count(const Trace& t, TraceAction a) {
  return static_cast<std::size_t>(std::count_if(
      t.events.begin(), t.events.end(), [a](const TraceEvent& e) { return e.action == a; }));
}

// Gives the events [first, last] a context of one frame.
void set_frames(Trace& t, std::size_t first, std::size_t last, std::string file, int line,
                std::string name) {
  Context c;
  c.frames.push_back({std::move(file), line, std::move(name)});
  t.final_state.contexts.push_back(c);
  const auto id = static_cast<std::uint32_t>(t.final_state.contexts.size() - 1);
  for (std::size_t i = first; i <= last; ++i) t.events[i].context = id;
}

std::size_t first_of(const Trace& t, TraceAction a, std::size_t from = 0) {
  for (std::size_t i = from; i < t.events.size(); ++i) {
    if (t.events[i].action == a) return i;
  }
  return t.events.size();
}

// ---- empty_cache() runs ---------------------------------------------------------

// Segments cached before recording began, freed by an empty_cache() called at
// once: they are reconstructed as wholly free segments of the pool their
// size implies, and the run is applied as empty_cache().
TEST(VerifyReleases, EmptyCacheAtTheStartFreesSegmentsCachedBeforeRecording) {
  Recorder r("");
  r.on = false;
  std::vector<void*> warm;
  for (std::size_t size : {kMiB / 10, kMiB * 6 / 10, 3 * kMiB, 12 * kMiB, 40 * kMiB}) {
    warm.push_back(r.alloc(size));
    warm.push_back(r.alloc(size, 7));
  }
  void* keep = r.alloc(std::size_t{200} * 1024);  // keeps one small segment in use
  for (void* p : warm) r.allocator.deallocate(p);
  // Per stream: a small segment, 20 MiB (3 and 12 MiB share it), 40 MiB; one
  // small segment stays in use.
  ASSERT_EQ(r.unused_segments(), 5u);
  r.on = true;
  EXPECT_EQ(r.empty_cache(), 5u);
  void* a =
      r.alloc(std::size_t{100} * 1024);  // from the small segment still held: no device request
  void* b = r.alloc(5 * kMiB);           // a new 20 MiB segment
  r.allocator.deallocate(a);
  r.allocator.deallocate(keep);
  void* c = r.alloc(70 * kMiB, 7);
  r.allocator.deallocate(c);
  const Trace t = pickled(r.finish());
  ASSERT_EQ(first_of(t, TraceAction::alloc), 5u);

  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.initial_segments, 6u);
  EXPECT_EQ(v.initial_free_segments, 5u);
  EXPECT_EQ(v.initial_live_blocks, 1u);
  EXPECT_EQ(v.segment_frees_checked, 5u);
  EXPECT_EQ(v.segment_allocs_checked, 2u);
  EXPECT_EQ(v.allocs_checked, 3u);
  EXPECT_EQ(v.empty_cache_calls, 1u);  // no device request followed: structure tells
  EXPECT_EQ(v.undecided_releases, 0u);
  (void)b;
}

// The same run followed at once by a device request: frames that name
// empty_cache decide; without frames it is the release of every unused
// segment, the same either way.
TEST(VerifyReleases, EmptyCacheBeforeADeviceRequestByFramesOrByEffect) {
  Recorder r("");
  r.on = false;
  void* x = r.alloc(40 * kMiB);
  void* y = r.alloc(std::size_t{300} * 1024);
  r.allocator.deallocate(x);
  r.allocator.deallocate(y);
  r.on = true;
  ASSERT_EQ(r.empty_cache(), 2u);
  void* z = r.alloc(50 * kMiB);
  r.allocator.deallocate(z);
  Trace t = r.finish();
  ASSERT_EQ(t.events[2].action, TraceAction::segment_alloc);

  const VerifyResult plain = verify(pickled(t));
  EXPECT_TRUE(plain.agreed) << plain.divergence;
  EXPECT_EQ(plain.undecided_releases, 1u);
  EXPECT_EQ(plain.empty_cache_calls, 0u);
  EXPECT_EQ(plain.segment_frees_checked, 2u);

  set_frames(t, 0, 1, "/usr/lib/python3/torch/cuda/memory.py", 222, "empty_cache");
  const VerifyResult framed = verify(pickled(t));
  EXPECT_TRUE(framed.agreed) << framed.divergence;
  EXPECT_EQ(framed.empty_cache_calls, 1u);
  EXPECT_EQ(framed.undecided_releases, 0u);

  // Replay applies it where the frames show it.
  const ReplayProgram program = compile(pickled(t));
  ASSERT_EQ(program.ops.size(), 3u);
  EXPECT_EQ(program.ops[0].kind, ReplayOp::Kind::empty_cache);
  EXPECT_EQ(program.ops[1].kind, ReplayOp::Kind::alloc);
}

// empty_cache() in the middle, back to back with a free between, one that
// frees nothing, one with a free still waiting on a stream, and one at the end.
TEST(VerifyReleases, EmptyCacheRunsInTheMiddleBackToBackAndAtTheEnd) {
  Recorder r("max_split_size_mb:64");
  r.device.set_auto_complete_events(false);
  StreamId side = 0;
  ASSERT_EQ(r.device.create_stream(&side), Status::ok);
  std::mt19937_64 rng(5);
  std::vector<void*> live;
  std::vector<std::size_t> freed_by_call;
  auto churn = [&](int steps) {
    for (int i = 0; i < steps; ++i) {
      if (!live.empty() && rng() % 100 < 45) {
        const std::size_t k = rng() % live.size();
        r.allocator.deallocate(live[k]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        const std::size_t size = rng() % 3 == 0 ? kMiB + rng() % (80 * kMiB) : 1 + rng() % kMiB;
        live.push_back(r.alloc(size, rng() % 4 == 0 ? side : 0));
      }
    }
  };
  churn(300);
  freed_by_call.push_back(r.empty_cache());  // middle
  r.allocator.deallocate(live.back());
  live.pop_back();
  freed_by_call.push_back(r.empty_cache());  // back to back, a free between
  freed_by_call.push_back(r.empty_cache());  // frees nothing: leaves no event
  churn(200);
  // A block used on the side stream, freed while that work is pending:
  // empty_cache() waits for it, then frees its segment.
  void* pending = r.alloc(30 * kMiB);
  r.allocator.record_stream(pending, side);
  r.allocator.deallocate(pending);
  churn(50);
  r.device.complete_stream(side);
  freed_by_call.push_back(r.empty_cache());
  churn(200);
  for (void* p : live) r.allocator.deallocate(p);
  freed_by_call.push_back(r.empty_cache());  // at the end: every segment
  const Trace t = pickled(r.finish());
  const std::size_t visible = static_cast<std::size_t>(std::count_if(
      freed_by_call.begin(), freed_by_call.end(), [](std::size_t n) { return n > 0; }));
  EXPECT_EQ(freed_by_call[2], 0u);
  EXPECT_GT(freed_by_call[0], 0u);
  EXPECT_GT(freed_by_call[4], 0u);

  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.empty_cache_calls + v.undecided_releases, visible);
  EXPECT_EQ(v.segment_frees_checked, count(t, TraceAction::segment_free));
  EXPECT_EQ(v.segment_allocs_checked, count(t, TraceAction::segment_alloc));
  EXPECT_EQ(v.allocs_checked, count(t, TraceAction::alloc));
  EXPECT_TRUE(t.final_state.segments.empty());
  EXPECT_TRUE(v.final_state_checked);

  // Replay runs from an empty cache: with the recorded settings it makes the
  // recorded device requests, empty_cache() calls included.
  const ReplayResult rr =
      replay(compile(t), AllocatorConfig::parse(t.recorded_config), t.recorded_config);
  EXPECT_EQ(static_cast<std::size_t>(rr.device_allocs), count(t, TraceAction::segment_alloc));
  EXPECT_EQ(static_cast<std::size_t>(rr.device_frees), count(t, TraceAction::segment_free));
  EXPECT_EQ(rr.final_reserved_bytes, 0u);
}

// A run the recording makes but reservoir's allocator would not is reported
// at the event where it happens.
TEST(VerifyReleases, AnEmptyCacheThatDidNotHappenIsADivergence) {
  Recorder r("");
  void* x = r.alloc(40 * kMiB);
  void* y = r.alloc(40 * kMiB);
  r.allocator.deallocate(x);
  r.empty_cache();
  void* z = r.alloc(std::size_t{100} * 1024);
  r.allocator.deallocate(z);
  r.allocator.deallocate(y);
  Trace t = r.finish();
  const std::size_t run = first_of(t, TraceAction::segment_free);
  ASSERT_LT(run, t.events.size());
  t.events[run].addr = y == nullptr ? 0 : reinterpret_cast<DevicePtr>(y);  // frees the other one
  // A device request follows: no frames tell, and as the run is not all
  // empty_cache() would free, it is the ladder's, which frees the other
  // segment when the request comes.
  const std::size_t request = first_of(t, TraceAction::alloc, run);
  const VerifyResult v = verify(pickled(t));
  EXPECT_FALSE(v.agreed);
  EXPECT_FALSE(v.cannot_verify);
  EXPECT_EQ(v.divergence_event, request);
  EXPECT_NE(v.divergence.find(fmt::format(
                "reservoir freed the segment at {:#x} ({} bytes); the recording frees {:#x}",
                reinterpret_cast<DevicePtr>(x), 40 * kMiB, reinterpret_cast<DevicePtr>(y))),
            std::string::npos)
      << v.divergence;
}

// ---- the allocator's own releases ------------------------------------------------

// Every unused segment freed by the ladder's last rung before the retried
// device request: with the allocation's frames it is the ladder's.
TEST(VerifyReleases, RetryLadderReleasesAllCachedSegments) {
  Recorder r("", 80 * kMiB);
  void* a = r.alloc(30 * kMiB);
  void* b = r.alloc(30 * kMiB);
  r.allocator.deallocate(a);
  void* c = r.alloc(40 * kMiB);  // 30 + 30 + 40 > 80: the ladder frees a's segment
  r.allocator.deallocate(c);
  r.allocator.deallocate(b);
  Trace t = r.finish();
  const std::size_t run = first_of(t, TraceAction::segment_free);
  ASSERT_EQ(t.events[run + 1].action, TraceAction::segment_alloc);
  ASSERT_EQ(t.events[run + 2].action, TraceAction::alloc);

  const VerifyResult plain = verify(pickled(t));
  EXPECT_TRUE(plain.agreed) << plain.divergence;
  EXPECT_EQ(plain.undecided_releases, 1u);

  set_frames(t, run, run + 2, "train.py", 41, "forward");
  const VerifyResult framed = verify(pickled(t));
  EXPECT_TRUE(framed.agreed) << framed.divergence;
  EXPECT_EQ(framed.allocator_releases, 1u);
  EXPECT_EQ(framed.undecided_releases, 0u);
  const ReplayProgram program = compile(pickled(t));
  EXPECT_TRUE(std::none_of(program.ops.begin(), program.ops.end(), [](const ReplayOp& op) {
    return op.kind == ReplayOp::Kind::empty_cache;
  }));
}

// PyTorch 2.0 gives every trace event its block's allocation stack (later
// releases the stack at the event): there a release's frames say where its
// segment was allocated, not who released it. An empty_cache() before an
// allocation from the same line looks like that allocation's ladder by its
// frames; verify takes the frames for evidence only where frees carry
// stacks of their own.
TEST(VerifyReleases, FramesOfFreesThatCarryTheirAllocationsStackAreNoEvidence) {
  Recorder r("");
  void* a = r.alloc(30 * kMiB);
  r.allocator.deallocate(a);
  r.empty_cache();
  void* b = r.alloc(30 * kMiB);
  r.allocator.deallocate(b);
  Trace t = r.finish();
  const std::size_t run = first_of(t, TraceAction::segment_free);
  const std::size_t request = first_of(t, TraceAction::alloc, run);
  ASSERT_LT(request, t.events.size());
  ASSERT_EQ(t.events[run + 1].action, TraceAction::segment_alloc);

  // 2.0: one stack (the line that allocates) on every event.
  set_frames(t, 0, t.events.size() - 1, "train.py", 52, "program");
  const VerifyResult v20 = verify(pickled(t));
  EXPECT_TRUE(v20.agreed) << v20.divergence;
  EXPECT_EQ(v20.undecided_releases, 1u);
  EXPECT_EQ(v20.allocator_releases, 0u);

  // 2.1 and later: the frees carry the stack that freed (another line), so
  // the same frames on the release and the allocation after it say the
  // ladder released, which reservoir's allocator would not have done here.
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    if (t.events[i].action == TraceAction::free_requested || t.events[i].action == TraceAction::free_completed) {
      set_frames(t, i, i, "train.py", 60, "program");
    }
  }
  const VerifyResult v21 = verify(pickled(t));
  EXPECT_FALSE(v21.agreed);
  EXPECT_EQ(v21.divergence_event, request) << v21.divergence;
  EXPECT_NE(v21.divergence.find("its frames are those of the allocation that follows"), std::string::npos)
      << v21.divergence;
}

// max_split_size_mb: the ladder's first rung frees one oversize block, not
// every unused segment; the structure alone tells it from empty_cache().
TEST(VerifyReleases, RetryLadderReleasesOneOversizeBlock) {
  Recorder r("max_split_size_mb:20", 130 * kMiB);
  void* a = r.alloc(70 * kMiB);
  void* b = r.alloc(25 * kMiB);
  void* s = r.alloc(kMiB);
  r.allocator.deallocate(a);
  r.allocator.deallocate(b);
  void* c = r.alloc(40 * kMiB);  // frees a only; b stays cached
  r.allocator.deallocate(c);
  r.allocator.deallocate(s);
  const Trace t = pickled(r.finish());
  ASSERT_EQ(count(t, TraceAction::segment_free), 1u);
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.allocator_releases, 1u);
  EXPECT_EQ(v.segment_frees_checked, 1u);
  EXPECT_EQ(v.segment_allocs_checked, 4u);
}

// Garbage collection (a memory fraction and garbage_collection_threshold)
// frees the older cached block before the device request.
TEST(VerifyReleases, GarbageCollectionFreesTheOlderBlock) {
  Recorder r("garbage_collection_threshold:0.5", 200 * kMiB);
  r.allocator.set_memory_fraction(1.0);  // GC above 100 MiB reserved
  void* a = r.alloc(30 * kMiB);
  void* b = r.alloc(30 * kMiB);
  void* e = r.alloc(32 * kMiB);
  r.allocator.deallocate(a);
  void* f = r.alloc(34 * kMiB);  // a cache miss: a ages
  r.allocator.deallocate(b);
  void* g = r.alloc(36 * kMiB);  // 126 MiB reserved: GC frees a (older), not b
  for (void* p : {e, f, g}) r.allocator.deallocate(p);
  const Trace t = pickled(r.finish());
  ASSERT_EQ(count(t, TraceAction::segment_free), 1u);
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.garbage_collections, 1u);
  EXPECT_EQ(v.segment_frees_checked, 1u);
}

// Programs that run out of memory under a memory fraction again and again
// and go on, with garbage collection: given the fraction and the device's
// memory, verify lets the allocator collect and refuse by itself, and agrees
// with every one; without them some runs mix the collection's releases with
// the retry ladder's, which the recorded run's total cannot tell apart.
TEST(VerifyReleases, GarbageCollectionUnderAKnownMemoryFraction) {
  const std::size_t capacity = 1024 * kMiB;
  const VerifyOptions limit{.memory_fraction = 0.5, .device_memory = capacity, .settings = std::nullopt};
  int collections = 0;
  int ooms = 0;
  int unverified_without = 0;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    Recorder r("garbage_collection_threshold:0.6,max_split_size_mb:40", capacity);
    r.allocator.set_memory_fraction(0.5);
    std::mt19937_64 rng(seed);
    std::vector<void*> live;
    for (int step = 0; step < 300; ++step) {
      if (live.empty() || rng() % 100 < 60) {
        const std::size_t bytes = std::size_t{1} << (10 + rng() % 19);  // 1 KiB to 256 MiB
        try {
          live.push_back(r.alloc(bytes + rng() % bytes));
        } catch (const OutOfMemoryError&) {
          std::shuffle(live.begin(), live.end(), rng);
          for (std::size_t k = 0; k < (live.size() + 1) / 2; ++k) r.allocator.deallocate(live[k]);
          live.erase(live.begin(), live.begin() + static_cast<std::ptrdiff_t>((live.size() + 1) / 2));
        }
      } else {
        const std::size_t k = rng() % live.size();
        r.allocator.deallocate(live[k]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
    const Trace t = pickled(r.finish());
    const VerifyResult v = verify(t, limit);
    EXPECT_TRUE(v.agreed) << "seed " << seed << ": " << v.divergence;
    collections += static_cast<int>(v.garbage_collections);
    ooms += static_cast<int>(v.ooms_checked);
    const VerifyResult without = verify(t);
    if (!without.agreed) {
      EXPECT_TRUE(without.cannot_verify) << without.divergence;
      EXPECT_NE(without.divergence.find("--memory-fraction and --device-memory"),
                std::string::npos);
      ++unverified_without;
    }
  }
  EXPECT_GT(collections, 40);
  EXPECT_GT(ooms, 40);
  EXPECT_GT(unverified_without, 0);
}

TEST(VerifyReleases, AMemoryFractionNeedsTheDevicesMemory) {
  Recorder r("");
  r.allocator.deallocate(r.alloc(kMiB));
  const Trace t = pickled(r.finish());
  const auto refusal = [&](const VerifyOptions& o) -> std::string {
    try {
      (void)verify(t, o);
    } catch (const UsageError& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(refusal({.memory_fraction = 0.5, .device_memory = std::nullopt, .settings = std::nullopt}),
            "verify: a memory fraction needs the device's total memory (the limit is the "
            "fraction of the total: give both)");
  // The total alone: a device of that size (this one fits the recording).
  EXPECT_EQ(refusal({.memory_fraction = std::nullopt, .device_memory = 64 * kMiB, .settings = std::nullopt}),
            "accepted");
  EXPECT_EQ(refusal({.memory_fraction = 0.0, .device_memory = kMiB, .settings = std::nullopt}),
            "verify: invalid memory fraction 0; accepted: above 0.0, up to 1.0");
  EXPECT_EQ(refusal({.memory_fraction = 1.5, .device_memory = kMiB, .settings = std::nullopt}),
            "verify: invalid memory fraction 1.5; accepted: above 0.0, up to 1.0");
  EXPECT_EQ(refusal({.memory_fraction = 1.0, .device_memory = 0, .settings = std::nullopt}),
            "verify: the device's total memory must be more than 0 bytes");
  EXPECT_TRUE(verify(t, VerifyOptions{.memory_fraction = 1.0, .device_memory = 64 * kMiB, .settings = std::nullopt}).agreed);
}

// ---- streams, oom, private pools, zero bytes ---------------------------------------

TEST(VerifyCases, OomEventsAreCheckedAndTheRecordingGoesOn) {
  Recorder r("", 64 * kMiB);
  void* a = r.alloc(40 * kMiB);
  EXPECT_THROW(r.alloc(30 * kMiB), OutOfMemoryError);
  r.allocator.deallocate(a);
  void* b = r.alloc(30 * kMiB);  // from a's cached segment
  r.allocator.deallocate(b);
  const Trace t = pickled(r.finish());
  ASSERT_EQ(count(t, TraceAction::oom), 1u);
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.ooms_checked, 1u);
  EXPECT_EQ(v.allocs_checked, 2u);
}

// pytorch/pytorch#189504 recorded: the ladder waits for a free pending on
// another stream and raises though that wait put a fitting block in the
// pool (PyTorch's ladder); reservoir's live ladder serves the request from
// it. Each recording verifies as the ladder it was made by.
Trace pending_free_recording(const std::string& config, bool* raised) {
  Recorder r(config, 1000 * kMiB);
  r.device.set_auto_complete_events(false);
  StreamId side = 0;
  EXPECT_EQ(r.device.create_stream(&side), Status::ok);
  void* whole = r.alloc(600 * kMiB);
  r.allocator.deallocate(whole);
  void* front = r.alloc(400 * kMiB);
  void* tail = r.alloc(200 * kMiB);
  void* filler = r.alloc(400 * kMiB);
  r.allocator.record_stream(front, side);
  r.allocator.deallocate(front);
  void* got = nullptr;
  *raised = false;
  try {
    got = r.alloc(400 * kMiB);
  } catch (const OutOfMemoryError&) {
    *raised = true;
    got = r.alloc(400 * kMiB);  // the same request an instant later
  }
  EXPECT_EQ(got, front);
  for (void* p : {got, tail, filler}) r.allocator.deallocate(p);
  Trace t = r.finish();
  set_recorded_config(t, "");  // as PyTorch (and reservoir's live allocator) record their settings
  return pickled(t);
}

TEST(VerifyCases, ASpuriousOutOfMemoryErrorOfPyTorchsLadderVerifies) {
  bool raised = false;
  const Trace t = pending_free_recording("retry_searches_pool:False", &raised);
  ASSERT_TRUE(raised);
  ASSERT_EQ(count(t, TraceAction::oom), 1u);
  VerifyOptions options;
  options.device_memory = 1000 * kMiB;
  for (const VerifyResult& v : {verify(t), verify(t, options)}) {
    EXPECT_TRUE(v.agreed) << v.divergence;
    EXPECT_EQ(v.ooms_checked, 1u);
    EXPECT_EQ(v.allocs_checked, 5u);
  }
}

TEST(VerifyCases, ReservoirsLadderServingAPendingFreeVerifies) {
  bool raised = true;
  const Trace t = pending_free_recording("", &raised);
  ASSERT_FALSE(raised);
  EXPECT_EQ(count(t, TraceAction::oom), 0u);
  VerifyOptions options;
  options.device_memory = 1000 * kMiB;
  for (const VerifyResult& v : {verify(t), verify(t, options)}) {
    EXPECT_TRUE(v.agreed) << v.divergence;
    EXPECT_EQ(v.allocs_checked, 5u);
  }
}

TEST(VerifyCases, FreesDelayedByRecordStreamOnSeveralStreams) {
  Recorder r("");
  r.device.set_auto_complete_events(false);
  StreamId s1 = 0;
  StreamId s2 = 0;
  ASSERT_EQ(r.device.create_stream(&s1), Status::ok);
  ASSERT_EQ(r.device.create_stream(&s2), Status::ok);
  std::mt19937_64 rng(9);
  std::vector<void*> live;
  for (int i = 0; i < 600; ++i) {
    if (i % 97 == 0) r.device.complete_stream(i % 2 == 0 ? s1 : s2);
    if (!live.empty() && rng() % 100 < 45) {
      const std::size_t k = rng() % live.size();
      if (rng() % 3 == 0) r.allocator.record_stream(live[k], rng() % 2 == 0 ? s1 : s2);
      r.allocator.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const StreamId stream = rng() % 3 == 0 ? s1 : rng() % 2 == 0 ? s2 : 0;
      live.push_back(
          r.alloc(rng() % 2 == 0 ? 1 + rng() % kMiB : kMiB + rng() % (40 * kMiB), stream));
    }
  }
  const Trace t = pickled(r.finish());
  std::size_t delayed = 0;
  for (std::size_t i = 0; i + 1 < t.events.size(); ++i) {
    delayed += t.events[i].action == TraceAction::free_requested &&
               !(t.events[i + 1].action == TraceAction::free_completed &&
                 t.events[i + 1].addr == t.events[i].addr);
  }
  EXPECT_GT(delayed, 20u);
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.allocs_checked, count(t, TraceAction::alloc));
}

TEST(VerifyCases, PrivatePoolsCannotBeVerifiedAndSaySoWhere) {
  Recorder r("");
  void* a = r.alloc(5 * kMiB);
  r.allocator.begin_allocate_to_pool({1, 0}, [](StreamId) { return true; });
  void* g = r.alloc(3 * kMiB);
  r.allocator.end_allocate_to_pool({1, 0});
  void* b = r.alloc(6 * kMiB);
  r.allocator.deallocate(a);
  r.allocator.deallocate(b);
  const Trace t = pickled(r.finish());
  const std::size_t private_segment = first_of(t, TraceAction::segment_alloc, 1);
  ASSERT_EQ(t.events[private_segment + 1].addr, reinterpret_cast<DevicePtr>(g));
  const VerifyResult v = verify(t);
  EXPECT_FALSE(v.agreed);
  EXPECT_TRUE(v.cannot_verify);
  EXPECT_EQ(v.divergence_event, private_segment);
  EXPECT_EQ(v.private_pool_segments, 1u);
  EXPECT_EQ(v.private_pool_bytes, 20 * kMiB);  // a 3 MiB request's segment
  EXPECT_NE(v.divergence.find("private pool (1, 0)"), std::string::npos) << v.divergence;
  EXPECT_EQ(v.allocs_checked, 1u);
}

// A private pool's segment no event touches is left out, and the rest verifies.
TEST(VerifyCases, APrivatePoolOutsideTheRecordingIsLeftOut) {
  Recorder r("");
  r.on = false;
  r.allocator.begin_allocate_to_pool({2, 0}, [](StreamId) { return true; });
  void* g = r.alloc(3 * kMiB);
  r.allocator.end_allocate_to_pool({2, 0});
  r.on = true;
  void* a = r.alloc(5 * kMiB);
  r.allocator.deallocate(a);
  const Trace t = pickled(r.finish());
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.private_pool_segments, 1u);
  EXPECT_EQ(v.allocs_checked, 1u);
  EXPECT_TRUE(v.final_state_checked);
  (void)g;
}

TEST(VerifyCases, ZeroByteEventsAreSkipped) {
  Trace t = record(3, 300);
  const std::size_t at = first_of(t, TraceAction::alloc, 50);
  t.events.insert(t.events.begin() + static_cast<std::ptrdiff_t>(at),
                  TraceEvent{TraceAction::alloc, 0, 0, 0});
  t.events.insert(t.events.begin() + static_cast<std::ptrdiff_t>(at + 3),
                  TraceEvent{TraceAction::free_requested, 0, 0, 0});
  const Trace back = pickled(t);
  const VerifyResult v = verify(back);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.zero_size_skipped, 2u);
  const ReplayProgram program = compile(back);
  EXPECT_EQ(program.ops.size(), compile(t).ops.size());
  EXPECT_EQ(program.ops.size(),
            count(t, TraceAction::alloc) - 1 + count(t, TraceAction::free_requested) - 1);
}

// ---- what a real file holds ----------------------------------------------------

// The ring buffer keeps the latest max_entries events: the recording then
// starts anywhere, inside a run of releases too.
TEST(VerifyCases, RingBufferThatDroppedItsOldestEvents) {
  for (std::size_t entries : {40u, 333u, 1000u, 2500u}) {
    SimDevice device;
    CachingAllocator allocator(device, AllocatorConfig::parse("max_split_size_mb:64"));
    allocator.record_history({.max_entries = entries});
    std::mt19937_64 rng(entries);
    std::vector<void*> live;
    for (int i = 0; i < 3000; ++i) {
      if (!live.empty() && (rng() % 100 < 45 || live.size() > 60)) {
        const std::size_t k = rng() % live.size();
        allocator.deallocate(live[k]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        const std::size_t size = rng() % 4 == 0 ? kMiB + rng() % (90 * kMiB) : 1 + rng() % kMiB;
        live.push_back(allocator.allocate(size, rng() % 5 == 0 ? 1 : 0));
      }
      if (i % 150 == 149) allocator.empty_cache();
    }
    const Trace t = pickled(to_trace(allocator.snapshot(), "ring", "max_split_size_mb:64"));
    ASSERT_LE(t.events.size(), entries + 1);
    const VerifyResult v = verify(t);
    EXPECT_TRUE(v.agreed) << entries << ": " << v.divergence;
    EXPECT_EQ(v.allocs_checked, count(t, TraceAction::alloc)) << entries;
    EXPECT_EQ(v.segment_frees_checked, count(t, TraceAction::segment_free)) << entries;
  }
}

// A ring buffer's cut can fall between an allocation's segment_alloc and
// its alloc, and between a free and its free_completed.
TEST(VerifyCases, CutsInsideOneAllocationAndInsideADelayedFree) {
  Recorder r("max_split_size_mb:64");
  r.device.set_auto_complete_events(false);
  StreamId side = 0;
  ASSERT_EQ(r.device.create_stream(&side), Status::ok);
  void* big = r.alloc(63 * kMiB + 5000);  // a 64 MiB segment, oversize when cached
  void* held = r.alloc(3 * kMiB);
  r.allocator.record_stream(held, side);
  r.allocator.deallocate(held);
  void* other = r.alloc(3 * kMiB);  // cannot reuse `held` yet
  r.device.complete_stream(side);
  void* again = r.alloc(3 * kMiB);  // now it can
  EXPECT_EQ(again, held);
  for (void* p : {big, other, again}) r.allocator.deallocate(p);
  r.empty_cache();
  const Trace full = pickled(r.finish());
  ASSERT_EQ(full.events[0].action, TraceAction::segment_alloc);
  ASSERT_EQ(full.events[1].action, TraceAction::alloc);

  Trace from_alloc = full;  // the 64 MiB segment_alloc lost
  from_alloc.events.erase(from_alloc.events.begin());
  const VerifyResult a = verify(from_alloc);
  EXPECT_TRUE(a.agreed) << a.divergence;
  EXPECT_EQ(a.initial_segments, 0u);
  EXPECT_EQ(a.segment_allocs_checked, count(full, TraceAction::segment_alloc));

  Trace from_pending = full;  // starts after `held` was freed, its work pending
  const std::size_t freed = first_of(full, TraceAction::free_requested);
  ASSERT_NE(full.events[freed + 1].action, TraceAction::free_completed);
  from_pending.events.erase(from_pending.events.begin(),
                            from_pending.events.begin() + static_cast<std::ptrdiff_t>(freed + 1));
  const VerifyResult b = verify(from_pending);
  EXPECT_TRUE(b.agreed) << b.divergence;
  EXPECT_EQ(b.initial_live_blocks, 2u);  // big, and held while pending
  EXPECT_EQ(b.allocs_checked, 2u);
}

// Random programs under random settings, cut at random points: every one
// verifies (no false divergence, whatever the cut).
TEST(VerifyCases, RandomRecordingsCutAnywhereAllVerify) {
  const char* configs[] = {"", "max_split_size_mb:64", "roundup_power2_divisions:4",
                           "max_split_size_mb:32,roundup_power2_divisions:2",
                           "expandable_segments:True"};
  const auto seeds = static_cast<std::uint64_t>(testing::scaled_for_validation(60));
  for (std::uint64_t seed = 1; seed <= seeds; ++seed) {
    const std::string config = configs[seed % 5];
    Recorder r(config);
    r.device.set_auto_complete_events(false);
    StreamId side = 0;
    ASSERT_EQ(r.device.create_stream(&side), Status::ok);
    std::mt19937_64 rng(seed);
    std::vector<void*> live;
    for (int i = 0; i < 1500; ++i) {
      const std::uint64_t dice = rng() % 1000;
      if (dice < 4) {
        r.allocator.empty_cache();
      } else if (dice < 12) {
        r.device.complete_stream(side);
      } else if (!live.empty() && (dice < 450 || live.size() > 70)) {
        const std::size_t k = rng() % live.size();
        if (rng() % 8 == 0) r.allocator.record_stream(live[k], side);
        r.allocator.deallocate(live[k]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        const std::size_t size = rng() % 4 == 0 ? kMiB + rng() % (100 * kMiB) : 1 + rng() % kMiB;
        live.push_back(r.alloc(size, rng() % 6 == 0 ? side : 0));
      }
    }
    const Trace full = pickled(r.finish());
    for (int cut = 0; cut < 6; ++cut) {
      Trace t = full;
      const std::size_t drop = cut == 0 ? 0 : rng() % t.events.size();
      t.events.erase(t.events.begin(), t.events.begin() + static_cast<std::ptrdiff_t>(drop));
      const VerifyResult v = verify(t);
      EXPECT_TRUE(v.agreed) << "seed " << seed << " (" << config << "), first " << drop
                            << " events dropped: " << v.divergence;
      EXPECT_EQ(v.allocs_checked, count(t, TraceAction::alloc));
    }
  }
}

// ---- expandable segments ------------------------------------------------------
// No real recording made with expandable_segments:True is at hand: these
// recordings are the allocator's own (its expandable policy makes PyTorch's
// decisions), written and read back as snapshots.

Trace expandable_workload(std::uint64_t seed, std::size_t capacity, int steps) {
  Recorder r("expandable_segments:True", capacity);
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  for (int i = 0; i < steps; ++i) {
    if (i % 211 == 210) r.allocator.empty_cache();
    if (!live.empty() && (rng() % 100 < 45 || live.size() > 50)) {
      const std::size_t k = rng() % live.size();
      r.allocator.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const std::size_t size = rng() % 3 == 0 ? kMiB + rng() % (60 * kMiB) : 1 + rng() % kMiB;
      try {
        live.push_back(r.alloc(size, rng() % 5 == 0 ? 1 : 0));
      } catch (const OutOfMemoryError&) {
      }
    }
  }
  return pickled(r.finish());
}

TEST(VerifyExpandable, ReservationsMapsAndUnmapsAreChecked) {
  const Trace t = expandable_workload(3, std::size_t{1} << 40, 1500);
  ASSERT_GT(count(t, TraceAction::segment_unmap), 5u);
  ASSERT_TRUE(std::any_of(t.final_state.segments.begin(), t.final_state.segments.end(),
                          [](const SegmentInfo& s) { return s.is_expandable; }));
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.reservations_checked, 4u);  // small and large, streams 0 and 1
  EXPECT_EQ(v.segment_maps_checked, count(t, TraceAction::segment_map));
  EXPECT_EQ(v.segment_unmaps_checked, count(t, TraceAction::segment_unmap));
  EXPECT_EQ(v.allocs_checked, count(t, TraceAction::alloc));
  EXPECT_EQ(v.empty_cache_calls, 7u);  // every 211 steps, each unmapping something
  EXPECT_TRUE(v.final_state_checked);
}

// empty_cache() unmaps everything and releases the reservation; the driver
// gives the same address space back for the next one.
TEST(VerifyExpandable, AReleasedReservationsAddressComesBack) {
  Recorder r("expandable_segments:True");
  r.device.set_reservation_source([](std::size_t, DevicePtr* va) {
    *va = DevicePtr{0x900000000000};
    return Status::ok;
  });
  for (int round = 0; round < 3; ++round) {
    void* a = r.alloc(30 * kMiB);
    void* b = r.alloc(50 * kMiB);
    r.allocator.deallocate(a);
    r.allocator.deallocate(b);
    EXPECT_EQ(r.device.live_reservations(), 1u);
    r.allocator.empty_cache();
    EXPECT_EQ(r.device.live_reservations(), 0u);
  }
  const Trace t = pickled(r.finish());
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.reservations_checked, 3u);
  // The first two come right before a device request, with no frames: undecided.
  EXPECT_EQ(v.undecided_releases, 2u);
  EXPECT_EQ(v.empty_cache_calls, 1u);
  EXPECT_EQ(v.segment_unmaps_checked, 3u);
}

// A device too small for the program: the ladder unmaps cached pages before
// retrying, and some allocations still run out of memory.
TEST(VerifyExpandable, TheLadderUnmapsAndOomsAreChecked) {
  const Trace t = expandable_workload(8, 400 * kMiB, 1500);
  ASSERT_GT(count(t, TraceAction::oom), 0u);
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.ooms_checked, count(t, TraceAction::oom));
  EXPECT_GT(v.allocator_releases + v.undecided_releases, 0u);
  EXPECT_EQ(v.segment_unmaps_checked, count(t, TraceAction::segment_unmap));
}

// Verified under other settings than it was recorded with, a consistent
// recording diverges where the first decision differs.
TEST(VerifyExpandable, AMappingThatDiffersIsADivergence) {
  Trace t = expandable_workload(3, std::size_t{1} << 40, 400);
  set_recorded_config(t, "expandable_segments:True,roundup_power2_divisions:2");
  const VerifyResult v = verify(t);
  EXPECT_FALSE(v.agreed);
  EXPECT_FALSE(v.cannot_verify);
  EXPECT_GT(v.divergence_event, 0u);
  const TraceEvent& e = t.events[v.divergence_event];
  ASSERT_EQ(e.action, TraceAction::alloc);
  EXPECT_NE(v.divergence.find(fmt::format("expected {:#x}, got", e.addr)), std::string::npos)
      << v.divergence;
}

// Recordings that start mid-run: the ranges mapped at the start are rebuilt
// from the final segments and the maps and unmaps, inside reservations whose
// bases are inferred.
TEST(VerifyExpandable, SegmentsMappedBeforeTheRecordingAreRebuilt) {
  for (std::uint64_t seed : {3u, 4u, 5u}) {
    const Trace full = expandable_workload(seed, std::size_t{1} << 40, 1500);
    std::mt19937_64 rng(seed);
    for (int k = 0; k < 6; ++k) {
      Trace t = full;
      const std::size_t cut = 1 + rng() % (t.events.size() - 1);
      t.events.erase(t.events.begin(), t.events.begin() + static_cast<std::ptrdiff_t>(cut));
      const VerifyResult v = verify(t);
      EXPECT_TRUE(v.agreed) << "seed " << seed << ", cut " << cut << ": " << v.divergence;
      EXPECT_GT(v.initial_reservations, 0u) << "seed " << seed << ", cut " << cut;
      EXPECT_EQ(v.allocs_checked, count(t, TraceAction::alloc));
      EXPECT_EQ(v.segment_maps_checked, count(t, TraceAction::segment_map));
    }
  }
}

// A recording that contradicts itself gets a reason, not a divergence.
TEST(VerifyExpandable, AContradictoryRecordingCannotBeVerified) {
  Trace t = expandable_workload(3, std::size_t{1} << 40, 600);
  const std::size_t map = first_of(t, TraceAction::segment_map);
  TraceEvent twice = t.events[map];
  t.events.insert(t.events.begin() + static_cast<std::ptrdiff_t>(map) + 1, twice);
  const VerifyResult v = verify(t);
  EXPECT_FALSE(v.agreed);
  EXPECT_TRUE(v.cannot_verify);
  EXPECT_EQ(v.divergence_event, 0u);
  EXPECT_NE(v.divergence.find(fmt::format("segment_map at {:#x}", twice.addr)), std::string::npos)
      << v.divergence;
}

// A private pool under expandable segments (PyTorch 2.5 and later): its
// pages mapped into a reservation of its own, unmapped when the pool is let
// go and the cache emptied. With each event's pool recorded (PyTorch 2.15)
// verify follows it; pages of a pool mapped before the recording began
// cannot be rebuilt, and verify says so.
TEST(VerifyExpandable, PrivatePoolsAreFollowedByTheirEventsPoolIds) {
  Recorder r("expandable_segments:True");
  const PoolId pool{1, 0};
  void* a = r.alloc(5 * kMiB);
  r.allocator.begin_allocate_to_pool(pool, [](StreamId) { return true; });
  void* g = r.alloc(3 * kMiB);
  void* h = r.alloc(100);
  void* k = r.alloc(30 * kMiB);
  r.allocator.end_allocate_to_pool(pool);
  void* b = r.alloc(6 * kMiB);
  std::vector<std::pair<DevicePtr, DevicePtr>> pages;  // the pool's mapped ranges
  for (const SegmentInfo& seg : r.allocator.snapshot().segments) {
    if (seg.pool_id == pool) pages.emplace_back(seg.address, seg.address + seg.total_size);
  }
  ASSERT_EQ(pages.size(), 2u);  // small and large
  for (void* p : {g, h, k}) r.allocator.deallocate(p);
  r.allocator.release_pool(pool);
  r.allocator.empty_cache();
  r.allocator.deallocate(a);
  Trace t = pickled(r.finish());
  t.event_pools_recorded = true;
  std::size_t in_pool = 0;
  for (std::size_t i = 0; i < t.events.size(); ++i) {
    for (const auto& [lo, hi] : pages) {
      if (t.events[i].addr >= lo && t.events[i].addr < hi) {
        t.event_pools[i] = pool;
        ++in_pool;
      }
    }
  }
  EXPECT_EQ(in_pool, 14u);  // 3 maps, 3 allocs, 3 frees (requested, completed), 2 unmaps
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.agreed) << v.divergence;
  EXPECT_EQ(v.allocs_checked, count(t, TraceAction::alloc));
  EXPECT_EQ(v.segment_maps_checked, count(t, TraceAction::segment_map));
  EXPECT_EQ(v.segment_unmaps_checked, count(t, TraceAction::segment_unmap));
  EXPECT_TRUE(v.final_state_checked);

  // Cut after the pool's first mapping: its pages were mapped before the
  // recording began.
  const std::size_t first_map = first_of(t, TraceAction::segment_map, 1);
  ASSERT_EQ(t.event_pools.count(first_map), 1u);
  Trace cut = t;
  cut.events.erase(cut.events.begin(), cut.events.begin() + static_cast<std::ptrdiff_t>(first_map) + 1);
  cut.event_pools.clear();
  for (const auto& [i, id] : t.event_pools) {
    if (i > first_map) cut.event_pools[i - first_map - 1] = id;
  }
  const VerifyResult c = verify(cut);
  EXPECT_FALSE(c.agreed);
  EXPECT_TRUE(c.cannot_verify);
  EXPECT_NE(c.divergence.find(fmt::format("{} bytes at {:#x} of a private pool", 20 * kMiB,
                                          t.events[first_map].addr)),
            std::string::npos)
      << c.divergence;
  (void)b;
}

using pickle::Document;
using pickle::Kind;
using pickle::Value;

// A copy of `v` without the dict keys in `drop`, with `edit` applied to each dict.
const Value* copy(Document& doc, const Value& v, const std::set<std::string>& drop,
                  const std::function<void(Document&, Value&)>& edit = {}) {
  Value* out = doc.make(v.kind);
  *out = v;
  out->items.clear();
  out->entries.clear();
  for (const Value* item : v.items) out->items.push_back(copy(doc, *item, drop, edit));
  for (const auto& [k, x] : v.entries) {
    if (k->kind == Kind::string && drop.count(k->text) != 0) continue;
    out->entries.emplace_back(copy(doc, *k, drop, edit), copy(doc, *x, drop, edit));
  }
  if (v.kind == Kind::dict && edit) edit(doc, *out);
  return out;
}

// PyTorch 2.1-2.3 snapshots: no allocator_settings, no time_us, no
// is_expandable, no requested_size.
TEST(VerifyCases, OlderSnapshotsWithoutTheNewerFields) {
  auto old = [](const Trace& t) {
    const std::string full = write_pytorch_snapshot(t);
    const Document in = pickle::decode(bytes(full));
    Document out;
    out.set_root(
        copy(out, in.root(), {"allocator_settings", "time_us", "is_expandable", "requested_size"}));
    const std::string stripped = pickle::encode(out.root());
    return read_pytorch_snapshot(bytes(stripped), "old.pickle");
  };
  const Trace plain = old(record(4, 2000));
  EXPECT_FALSE(plain.settings_recorded);
  const VerifyResult v = verify(plain);
  EXPECT_TRUE(v.agreed) << v.divergence;

  // Recorded with max_split_size_mb:64, which the file no longer says: a
  // difference is not a divergence but a recording verify cannot check.
  const Trace tuned = old(recorded_workload(6, 3000));
  const VerifyResult w = verify(tuned);
  EXPECT_FALSE(w.agreed);
  EXPECT_TRUE(w.cannot_verify);
  EXPECT_NE(w.divergence.find("does not record its allocator settings"), std::string::npos)
      << w.divergence;
  EXPECT_NE(w.divergence.find("give them as verify's --settings"), std::string::npos) << w.divergence;

  // Told the settings it ran under (verify --settings), verify checks it.
  VerifyOptions told;
  told.settings = AllocatorConfig::parse("max_split_size_mb:64");
  const VerifyResult t64 = verify(tuned, told);
  EXPECT_TRUE(t64.agreed) << t64.divergence;
  // Other settings than those: a difference verify cannot check, naming them.
  VerifyOptions wrong;
  wrong.settings = AllocatorConfig::parse("max_split_size_mb:128");
  const VerifyResult t128 = verify(tuned, wrong);
  EXPECT_FALSE(t128.agreed);
  EXPECT_TRUE(t128.cannot_verify);
  EXPECT_NE(t128.divergence.find("verify took those given (max_split_size_mb:128)"), std::string::npos)
      << t128.divergence;

  // A snapshot that records its settings: the same given are accepted,
  // others refused with both named.
  const Trace recorded = recorded_workload(6, 3000);
  ASSERT_TRUE(recorded.settings_recorded);
  EXPECT_TRUE(verify(recorded, told).agreed);
  try {
    verify(recorded, wrong);
    ADD_FAILURE() << "settings other than those recorded were accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("the snapshot records its allocator settings "
                                         "(max_split_size_mb:64), not those given "
                                         "(max_split_size_mb:128)"),
              std::string::npos)
        << e.what();
  }
}

// A snapshot of two devices: each is read and verified on its own.
TEST(VerifyCases, SeveralDevices) {
  const Trace t0 = record(21, 800);
  const Trace t1 = record(22, 900);
  const Document d0 = pickle::decode(bytes(write_pytorch_snapshot(t0)));
  const Document d1 = pickle::decode(bytes(write_pytorch_snapshot(t1)));
  Document out;
  Value* root = out.make(Kind::dict);
  *root = d0.root();
  auto on_device_1 = [](Document& doc, Value& dict) {
    for (auto& [k, x] : dict.entries) {
      if (k->kind == Kind::string && k->text == "device") {
        Value* one = doc.make(Kind::integer);
        one->integer = 1;
        x = one;
      }
    }
  };
  Value* segments = out.make(Kind::list);
  for (const Value* s : d0.root().find("segments")->items) segments->items.push_back(s);
  for (const Value* s : d1.root().find("segments")->items) {
    segments->items.push_back(copy(out, *s, {}, on_device_1));
  }
  Value* traces = out.make(Kind::list);
  traces->items = {d0.root().find("device_traces")->items[0],
                   d1.root().find("device_traces")->items[0]};
  for (auto& [k, x] : root->entries) {
    if (k->text == "segments") x = segments;
    if (k->text == "device_traces") x = traces;
  }
  out.set_root(root);
  const std::string both = pickle::encode(out.root());
  for (int device : {0, 1}) {
    const Trace t = read_pytorch_snapshot(bytes(both), "two.pickle", device);
    EXPECT_EQ(t.device_count, 2u);
    EXPECT_EQ(t.device, device);
    EXPECT_EQ(t.events.size(), (device == 0 ? t0 : t1).events.size());
    const VerifyResult v = verify(t);
    EXPECT_TRUE(v.agreed) << "device " << device << ": " << v.divergence;
    EXPECT_TRUE(v.final_state_checked);
  }
}

// ---- what cannot be checked is said to be so --------------------------------------

// The history stopped (recording switched off) before the snapshot was
// taken: allocations and frees after it show in the recorded state only.
TEST(VerifyCases, AHistoryThatStopsBeforeTheStateCannotBeVerified) {
  Recorder r("");
  void* a = r.alloc(5 * kMiB);
  void* b = r.alloc(7 * kMiB);
  r.allocator.deallocate(a);
  r.on = false;  // the recording stops here; the program goes on
  r.allocator.deallocate(b);
  void* c = r.alloc(5 * kMiB);  // at a's address, which the history leaves free
  const Trace t = pickled(r.finish());
  ASSERT_EQ(t.events.size(), 5u);  // segment_alloc, alloc, alloc, free_requested, free_completed
  const VerifyResult v = verify(t);
  EXPECT_FALSE(v.agreed);
  EXPECT_TRUE(v.cannot_verify);
  EXPECT_EQ(v.divergence_event, t.events.size());
  EXPECT_EQ(v.divergence,
            fmt::format("cannot verify: the history stops before the state was taken (recording "
                        "stopped early, or its last events were lost): 1 allocation the history "
                        "leaves live is free in the recorded state and 1 it frees is allocated "
                        "there; the latest, free_completed of {} bytes at {:#x} (event 4), is "
                        "allocated there. The starting state is rebuilt from the recorded one, "
                        "so nothing can be checked.",
                        5 * kMiB, reinterpret_cast<DevicePtr>(a)));
  EXPECT_EQ(c, a);
}

TEST(VerifyCases, ASnapshotWithoutHistoryCannotBeVerified) {
  Recorder r("");
  r.on = false;
  (void)r.alloc(5 * kMiB);
  const Trace t = pickled(r.finish());
  ASSERT_TRUE(t.events.empty());
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.cannot_verify);
  EXPECT_FALSE(v.agreed);
  EXPECT_EQ(v.divergence,
            "nothing to check: the snapshot holds no recorded events for this device (its state "
            "only: memory history was not recording here)");
}

// A history of markers only (a snapshot mark) has no request to compare:
// "nothing to check", never "agrees".
TEST(VerifyCases, AHistoryOfMarkersOnlyHasNothingToCheck) {
  const VerifyResult v = verify(markers_only());
  EXPECT_FALSE(v.agreed);
  EXPECT_TRUE(v.cannot_verify);
  EXPECT_EQ(v.allocs_checked, 0u);
  EXPECT_EQ(v.divergence,
            "nothing to check: the one recorded event is a marker (no allocation, free or segment "
            "to replay)");
}

// Ascend's torch_npu writes the same format from its own allocator: read,
// but not verified against CUDA's rules.
TEST(VerifyCases, AnNpuRecordingIsReadButNotVerified) {
  const std::string json = R"({"segments": [{"device": 0, "address": 4194304,
      "total_size": 2097152, "stream": 0, "segment_type": "small",
      "blocks": [{"address": 4194304, "size": 512, "requested_size": 500,
                  "state": "active_allocated"},
                 {"address": 4194816, "size": 2096640, "state": "inactive"}]}],
    "device_traces": [[
      {"action": "segment_alloc", "addr": 4194304, "size": 2097152, "stream": 0,
       "frames": [{"name": "c10_npu::NPUCachingAllocator::malloc", "filename": "??", "line": 0},
                  {"name": "forward", "filename": "/x/site-packages/torch_npu/npu/m.py",
                   "line": 3}]},
      {"action": "alloc", "addr": 4194304, "size": 500, "stream": 0}]]})";
  const Trace t = read_snapshot_json(json, "npu.json");
  EXPECT_EQ(t.port, "npu");
  EXPECT_EQ(t.events.size(), 2u);
  const VerifyResult v = verify(t);
  EXPECT_TRUE(v.cannot_verify);
  EXPECT_EQ(v.divergence_event, 2u);
  EXPECT_EQ(v.divergence.rfind("cannot verify: recorded by torch_npu's allocator (npu device)", 0),
            0u)
      << v.divergence;
  // A CUDA recording's frames do not make it one.
  EXPECT_EQ(record(3, 20).port, "cuda");
}

// Snapshots the real PyTorch 2.11 to 2.15 wrote on the simulated CUDA device
// (tests/data/torch, each made by the script beside it): two 302 MiB
// segments whose tails are free blocks of equal size, the older at the
// higher address, and a request that takes one. 2.11 takes the lower
// address, 2.12 on the older segment; 2.12 writes the settings 2.11 does,
// so verify finds its rules by trying them; 2.13 on show their release.
TEST(VerifyCases, EachPyTorchReleaseTakesEqualSizeBlocksByItsRule) {
  const std::string dir = std::string(RESERVOIR_SOURCE_DIR) + "/tests/data/torch/";
  const std::pair<const char*, const char*> cases[] = {
      {"2.11.0", "2.9"}, {"2.12.0", "2.12"}, {"2.13.0", "2.13"}, {"2.14.0", "2.13"}, {"2.15.0", "2.13"}};
  for (const auto& [release, rules] : cases) {
    SCOPED_TRACE(release);
    const Trace t = read_trace_file(dir + "equal_size_tie_" + release + ".pickle");
    const VerifyResult r = verify(t);
    EXPECT_TRUE(r.agreed) << r.divergence;
    EXPECT_EQ(r.pytorch_rules, rules);
    EXPECT_EQ(r.allocs_checked, 4u);
    EXPECT_EQ(r.segment_allocs_checked, 3u);
    EXPECT_EQ(r.empty_cache_calls, 1u);
    // Under the other rule the request lands in the other tail.
    Trace other = t;
    other.settings.pytorch_version = compare_versions(rules, "2.12") >= 0 ? "2.11" : "2.12";
    const VerifyResult wrong = verify(other);
    EXPECT_FALSE(wrong.agreed);
    EXPECT_EQ(wrong.divergence_event, 9u);
  }
  for (const char* name : {"mixed_sizes_2.15.0.pickle", "mixed_sizes_expandable_2.15.0.pickle"}) {
    SCOPED_TRACE(name);
    const VerifyResult r = verify(read_trace_file(dir + name));
    EXPECT_TRUE(r.agreed) << r.divergence;
    EXPECT_EQ(r.pytorch_rules, "2.13");
  }
}

// A recording reservoir's own allocator made under PyTorch 2.12.1 with
// policy:native_paged through out-of-memory errors (tests/data/torch,
// native_paged_oom.sh): the device's memory is not recorded, so under the
// rules of the release the snapshot shows (2.9's, the lowest address) the
// address that differs cannot be told from a device of another size; that
// is no reason not to try 2.12's rules, under which every address agrees.
TEST(VerifyCases, ARecordingThatCannotBeVerifiedUnderOneReleaseIsTriedUnderTheNext) {
  const std::string dir = std::string(RESERVOIR_SOURCE_DIR) + "/tests/data/torch/";
  const Trace t = read_trace_file(dir + "native_paged_oom_2.12.1.pickle");
  EXPECT_EQ(t.pytorch_since, "2.9");
  const VerifyResult r = verify(t);
  EXPECT_TRUE(r.agreed) << r.divergence;
  EXPECT_EQ(r.pytorch_rules, "2.12");
  EXPECT_EQ(r.events, 263u);
  EXPECT_EQ(r.allocs_checked, 128u);
  EXPECT_EQ(r.ooms_checked, 1u);
  EXPECT_EQ(r.segment_maps_checked, 48u);
  EXPECT_EQ(r.segment_unmaps_checked, 8u);
  Trace as_shown = t;
  as_shown.settings.pytorch_version = "2.9";
  const VerifyResult shown = verify(as_shown);
  EXPECT_TRUE(shown.cannot_verify);
  EXPECT_EQ(shown.divergence_event, 227u);
  EXPECT_NE(shown.divergence.find("alloc of 2 bytes (rounded to 512, small pool, stream 0)"),
            std::string::npos)
      << shown.divergence;
}

}  // namespace
}  // namespace reservoir
