// Trace readers, compile, replay and verify.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <filesystem>
#include <random>

#include "reservoir/errors.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "shared_traces.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::string text_error(const std::string& text) {
  try {
    (void)read_text_trace(text, "t.trace");
  } catch (const TraceError& e) {
    return e.what();
  }
  return "no error";
}

TEST(TextTrace, ReadsAndWritesBack) {
  const std::string text =
      "# a comment\nreservoir-trace 1\nconfig max_split_size_mb:64\nalloc 1 4096\n"
      "alloc 2 1.5MiB stream 3  # trailing comment\nfree 1\nempty_cache\nfree 2\n";
  const Trace t = read_text_trace(text, "t.trace");
  EXPECT_EQ(t.recorded_config, "max_split_size_mb:64");
  ASSERT_EQ(t.events.size(), 5u);
  EXPECT_EQ(t.events[1].size, 1572864u);
  EXPECT_EQ(t.events[1].stream, 3u);
  EXPECT_EQ(t.events[3].action, TraceAction::empty_cache);
  EXPECT_EQ(read_text_trace(write_text_trace(t), "again").events.size(), 5u);
  EXPECT_EQ(write_text_trace(read_text_trace(write_text_trace(t), "x")), write_text_trace(t));
}

TEST(TextTrace, ErrorsNameTheLine) {
  EXPECT_EQ(text_error(""),
            "trace t.trace: line 1: empty trace: expected the header 'reservoir-trace 1'");
  EXPECT_EQ(text_error("alloc 1 2\n"),
            "trace t.trace: line 1: expected the header 'reservoir-trace 1'");
  EXPECT_EQ(text_error("reservoir-trace 2\n"),
            "trace t.trace: line 1: unsupported version '2' (supported: 1)");
  EXPECT_EQ(text_error("reservoir-trace 1\nalloc 1\n"),
            "trace t.trace: line 2: expected 'alloc ID SIZE [stream S]'");
  EXPECT_EQ(text_error("reservoir-trace 1\nalloc x 5\n"),
            "trace t.trace: line 2: ID 'x' is not an unsigned number");
  EXPECT_EQ(text_error("reservoir-trace 1\nalloc 1 5\nalloc 1 6\n"),
            "trace t.trace: line 3: block 1 is allocated twice");
  EXPECT_EQ(text_error("reservoir-trace 1\nfree 4\n"),
            "trace t.trace: line 2: block 4 is freed but not allocated");
  EXPECT_EQ(text_error("reservoir-trace 1\nalloc 1 0\n"),
            "trace t.trace: line 2: SIZE must be positive");
  EXPECT_EQ(text_error("reservoir-trace 1\nresize 1\n"),
            "trace t.trace: line 2: unknown command 'resize' (accepted: config, alloc, free, "
            "empty_cache)");
  EXPECT_EQ(text_error("reservoir-trace 1\nconfig foo:1\n"),
            "trace t.trace: line 2: allocator config \"foo:1\": unknown key 'foo'; accepted keys: "
            "max_split_size_mb, max_non_split_rounding_mb, garbage_collection_threshold, "
            "roundup_power2_divisions, expandable_segments, release_lock_on_cudamalloc, "
            "pinned_use_cuda_host_register, pinned_num_register_threads, "
            "pinned_use_background_threads, backend, policy");
}

TEST(Compile, BlocksLiveAtTheStartComeFirstInAddressOrder) {
  Trace t;
  t.has_addresses = true;
  t.events = {{TraceAction::free_requested, 0x5000, 100, 0},
              {TraceAction::alloc, 0x9000, 200, 0},
              {TraceAction::free_requested, 0x1000, 300, 0},
              {TraceAction::free_requested, 0x9000, 200, 0}};
  SegmentInfo seg;
  seg.address = 0x0;
  seg.blocks = {{0x3000, 1024, 400, BlockState::active_allocated}};
  t.final_state.segments = {seg};
  const ReplayProgram p = compile(t);
  ASSERT_EQ(p.initial.size(), 3u);
  EXPECT_EQ(p.initial[0].size, 300u);  // 0x1000
  EXPECT_EQ(p.initial[1].size, 400u);  // 0x3000, untouched by any event
  EXPECT_EQ(p.initial[2].size, 100u);  // 0x5000
  ASSERT_EQ(p.ops.size(), 4u);
  EXPECT_EQ(p.ops[0].kind, ReplayOp::Kind::free);
  EXPECT_EQ(p.ops[0].id, p.initial[2].id);
}

TEST(Replay, ReportsPeaksAndDeviceCalls) {
  const Trace t = read_text_trace(
      "reservoir-trace 1\nalloc 1 12MiB\nalloc 2 1000\nfree 1\nalloc 3 30MiB\nfree 2\nfree 3\n"
      "empty_cache\n",
      "r");
  const ReplayResult r = replay(compile(t), AllocatorConfig{}, "");
  EXPECT_EQ(r.peak_requested_bytes, 30 * kMiB + 1000);
  EXPECT_EQ(r.peak_allocated_bytes, 30 * kMiB + 1024);
  EXPECT_EQ(r.peak_reserved_bytes, (12 + 2 + 30) * kMiB);
  EXPECT_EQ(r.device_allocs, 3);
  EXPECT_EQ(r.device_frees, 3);
  EXPECT_EQ(r.num_ooms, 0);
  ReplayOptions small;
  small.capacity = 40 * kMiB;
  const ReplayResult s = replay(compile(t), AllocatorConfig{}, "", small);
  EXPECT_EQ(s.peak_reserved_bytes, (2 + 30) * kMiB);  // the 12 MiB segment was released first
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.device_frees, 3);
  small.capacity = 20 * kMiB;
  const ReplayResult o = replay(compile(t), AllocatorConfig{}, "", small);
  EXPECT_EQ(o.num_ooms, 1);
  EXPECT_EQ(o.first_oom.find("op 3: CUDA out of memory. Tried to allocate 30.00 MiB. GPU 0 has a "
                             "total capacity of 20.00 MiB of which 18.00 MiB is free."),
            0u)
      << o.first_oom;
}

// Records what the allocator does, as PyTorch's history would.
Trace record(std::uint64_t seed, int steps) {
  SimDevice device;
  CachingAllocator allocator(device, AllocatorConfig{});
  Trace t;
  t.name = "recorded";
  t.format = "pytorch-snapshot";
  t.has_addresses = true;
  allocator.attach_trace_tracker([&](const TraceEvent& e) {
    t.events.push_back({static_cast<TraceAction>(e.action), e.addr, e.size, e.stream});
  });
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  for (int i = 0; i < steps; ++i) {
    if (!live.empty() && (rng() % 100 < 45 || live.size() > 80)) {
      const std::size_t k = rng() % live.size();
      allocator.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const std::size_t kind = rng() % 10;
      const std::size_t size = kind < 5   ? 1 + rng() % kMiB
                               : kind < 9 ? kMiB + rng() % (30 * kMiB)
                                          : 30 * kMiB + rng() % (200 * kMiB);
      live.push_back(allocator.allocate(size, rng() % 4 == 0 ? 1 : 0));
    }
  }
  t.final_state = allocator.snapshot();
  return t;
}

TEST(Verify, AgreesWithARecordingOfTheNativeRules) {
  const Trace t = record(7, 3000);
  const std::string pickled = write_pytorch_snapshot(t);
  const Trace back = read_pytorch_snapshot(
      std::span(reinterpret_cast<const std::uint8_t*>(pickled.data()), pickled.size()), "rec");
  ASSERT_EQ(back.events.size(), t.events.size());
  const VerifyResult r = verify(back);
  EXPECT_TRUE(r.agreed) << r.divergence;
  EXPECT_GT(r.segment_allocs_checked, 20u);
  EXPECT_TRUE(r.final_state_checked);
}

TEST(Verify, ReconstructsTracesThatStartMidRun) {
  const Trace full = record(11, 4000);
  for (std::size_t cut : {500u, 1500u, 2500u}) {
    Trace t = full;
    t.events.erase(t.events.begin(), t.events.begin() + static_cast<std::ptrdiff_t>(cut));
    const VerifyResult r = verify(t);
    EXPECT_TRUE(r.agreed) << "cut " << cut << ": " << r.divergence;
    EXPECT_GT(r.initial_live_blocks, 0u);
  }
}

TEST(Verify, ReportsTheFirstDivergence) {
  Trace t = record(7, 400);
  std::size_t target = 0;
  for (std::size_t i = 100; i < t.events.size(); ++i) {
    if (t.events[i].action == TraceAction::alloc) {
      target = i;
      break;
    }
  }
  ASSERT_GT(target, 0u);
  const DevicePtr recorded = t.events[target].addr;
  t.events[target].addr += 512;
  for (std::size_t i = target + 1; i < t.events.size(); ++i) {
    if (t.events[i].addr != recorded) continue;
    if (t.events[i].action == TraceAction::alloc) break;  // a later block at that address
    t.events[i].addr += 512;                              // this block's own free events
  }
  const VerifyResult r = verify(t);
  EXPECT_FALSE(r.agreed);
  EXPECT_EQ(r.divergence_event, target);
  EXPECT_NE(r.divergence.find(fmt::format("expected {:#x}, got {:#x}", recorded + 512, recorded)),
            std::string::npos)
      << r.divergence;
  EXPECT_NE(r.divergence.find("free blocks of the pool that fit"), std::string::npos);
}

TEST(Verify, RefusesTracesWithoutAddresses) {
  const Trace t = read_text_trace("reservoir-trace 1\nalloc 1 5\n", "x.trace");
  EXPECT_THROW(verify(t), TraceError);
}

TEST(Snapshot, CorruptFieldsGetExactErrors) {
  Trace t = record(3, 50);
  std::string good = write_pytorch_snapshot(t);
  auto read = [](const std::string& data) -> std::string {
    try {
      (void)read_pytorch_snapshot(
          std::span(reinterpret_cast<const std::uint8_t*>(data.data()), data.size()), "s.pickle");
    } catch (const TraceError& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(read(good), "no error");
  EXPECT_EQ(read(good.substr(0, good.size() / 2)).substr(0, 31), "snapshot s.pickle: pickle: byte");
  const auto pos = good.find("free_requested");
  ASSERT_NE(pos, std::string::npos);
  std::string renamed = good;
  renamed.replace(pos, 14, "free_requestex");
  EXPECT_EQ(read(renamed).substr(0, 60).find("snapshot s.pickle: device_traces[0]["), 0u);
  EXPECT_NE(read(renamed).find("unknown action 'free_requestex'"), std::string::npos);
}

TEST(SharedTraces, EveryRealSnapshotVerifies) {
  if (!std::filesystem::exists(testing::shared_trace_dir())) {
    GTEST_SKIP() << "no real traces at " << testing::shared_trace_dir();
  }
  const auto paths = testing::shared_traces();
  EXPECT_FALSE(paths.empty()) << "no .pickle in " << testing::shared_trace_dir();
  for (const auto& path : paths) {
    const Trace t = read_trace_file(path.string());
    const VerifyResult r = verify(t);
    EXPECT_TRUE(r.agreed) << path << ": " << r.divergence;
    EXPECT_EQ(r.allocs_checked, static_cast<std::uint64_t>(std::count_if(
                                    t.events.begin(), t.events.end(), [](const TraceEvent& e) {
                                      return e.action == TraceAction::alloc;
                                    })));
  }
}

TEST(TraceFormat, DetectedFromTheFirstBytes) {
  EXPECT_EQ(detect_trace_format(std::string("\x80\x04\x95", 3)), TraceFormat::pytorch_pickle);
  EXPECT_EQ(detect_trace_format(" \n\t{\"segments\": []}"), TraceFormat::snapshot_json);
  EXPECT_EQ(detect_trace_format("Thread,Time,Action,Pointer,Size,Stream\n"), TraceFormat::rmm_csv);
  EXPECT_EQ(detect_trace_format("reservoir-trace 1\n"), TraceFormat::text);
  EXPECT_EQ(detect_trace_format(""), TraceFormat::text);
  EXPECT_EQ(detect_trace_format("thread,time"), TraceFormat::text);  // RMM's header is exact
  EXPECT_EQ(to_string(TraceFormat::pytorch_pickle), "pytorch-snapshot");
  EXPECT_EQ(to_string(TraceFormat::snapshot_json), "snapshot-json");
  EXPECT_EQ(to_string(TraceFormat::rmm_csv), "rmm-csv");
  EXPECT_EQ(to_string(TraceFormat::text), "reservoir-text");
}

TEST(TraceFormat, EachReaderNamesItsFormat) {
  const Trace text = read_text_trace("reservoir-trace 1\nalloc 1 512\nfree 1\n", "t");
  EXPECT_EQ(text.format, "reservoir-text");
  const Trace json = read_snapshot_json(write_snapshot_json(text), "j");
  EXPECT_EQ(json.format, "snapshot-json");
  const std::string pickled = write_pytorch_snapshot(text);
  const Trace pickle = read_pytorch_snapshot(
      std::span(reinterpret_cast<const std::uint8_t*>(pickled.data()), pickled.size()), "p");
  EXPECT_EQ(pickle.format, "pytorch-snapshot");
}

}  // namespace
}  // namespace reservoir
