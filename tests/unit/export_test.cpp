// Export and import: allocator snapshots with history as PyTorch pickles and
// JSON, RMM's CSV log, and round trips through replay.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "error_text.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "shared_traces.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::span<const std::uint8_t> bytes(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

[[gnu::noinline]] void* allocate_in_layer(CachingAllocator& a, std::size_t size, StreamId s) {
  void* p = a.allocate(size, s);
  asm volatile("" ::: "memory");
  return p;
}

// A recorded workload with annotations, stacks on part of it, two streams,
// frees, empty_cache and blocks left live at the end.
Trace recorded_workload(std::uint64_t seed, int steps) {
  SimDevice device;
  CachingAllocator allocator(device, AllocatorConfig::parse("max_split_size_mb:64"));
  allocator.record_history({.stacks = true, .max_frames = 8});
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  for (int i = 0; i < steps; ++i) {
    if (i == steps / 2) allocator.record_history({.stacks = false});
    ScopedAnnotation step(fmt::format("step{}", i / 100));
    ScopedAnnotation phase(i % 3 == 0 ? "forward" : "backward");
    if (!live.empty() && (rng() % 100 < 45 || live.size() > 60)) {
      const std::size_t k = rng() % live.size();
      allocator.deallocate(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const std::size_t size = rng() % 4 == 0 ? kMiB + rng() % (90 * kMiB) : 1 + rng() % kMiB;
      live.push_back(allocate_in_layer(allocator, size, rng() % 5 == 0 ? 1 : 0));
    }
    if (i % 700 == 699) allocator.empty_cache();
  }
  return to_trace(allocator.snapshot(), "recorded", "max_split_size_mb:64");
}

void expect_same_trace(const Trace& a, const Trace& b) {
  EXPECT_EQ(a.recorded_config, b.recorded_config);
  EXPECT_EQ(a.has_addresses, b.has_addresses);
  ASSERT_EQ(a.events.size(), b.events.size());
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    const TraceEvent& x = a.events[i];
    const TraceEvent& y = b.events[i];
    ASSERT_EQ(x.action, y.action) << "event " << i;
    ASSERT_EQ(x.addr, y.addr) << "event " << i;
    ASSERT_EQ(x.size, y.size) << "event " << i;
    ASSERT_EQ(x.stream, y.stream) << "event " << i;
    ASSERT_EQ(x.time_us, y.time_us) << "event " << i;
    ASSERT_EQ(a.context(x.context), b.context(y.context)) << "event " << i;
  }
  ASSERT_EQ(a.final_state.segments.size(), b.final_state.segments.size());
  for (std::size_t i = 0; i < a.final_state.segments.size(); ++i) {
    SegmentInfo x = a.final_state.segments[i];
    SegmentInfo y = b.final_state.segments[i];
    ASSERT_EQ(x.blocks.size(), y.blocks.size());
    for (std::size_t j = 0; j < x.blocks.size(); ++j) {
      ASSERT_EQ(a.context(x.blocks[j].context), b.context(y.blocks[j].context));
      x.blocks[j].context = y.blocks[j].context = 0;
    }
    EXPECT_EQ(x, y) << "segment " << i;
  }
}

void expect_same_replay(const Trace& a, const Trace& b) {
  const AllocatorConfig config = AllocatorConfig::parse(a.recorded_config);
  const ReplayResult x = replay(compile(a), config, a.recorded_config);
  const ReplayResult y = replay(compile(b), config, b.recorded_config);
  EXPECT_EQ(x.ops, y.ops);
  EXPECT_EQ(x.peak_requested_bytes, y.peak_requested_bytes);
  EXPECT_EQ(x.peak_allocated_bytes, y.peak_allocated_bytes);
  EXPECT_EQ(x.peak_reserved_bytes, y.peak_reserved_bytes);
  EXPECT_EQ(x.peak_reserved_op, y.peak_reserved_op);
  EXPECT_EQ(x.final_reserved_bytes, y.final_reserved_bytes);
  EXPECT_EQ(x.device_allocs, y.device_allocs);
  EXPECT_EQ(x.device_frees, y.device_frees);
  EXPECT_EQ(x.device_calls, y.device_calls);
}

TEST(Export, HistoryCarriesAnnotationsAndStacks) {
  const Trace t = recorded_workload(5, 400);
  ASSERT_GT(t.events.size(), 400u);
  std::size_t with_frames = 0;
  std::size_t annotated = 0;
  for (const TraceEvent& e : t.events) {
    const Context& c = t.context(e.context);
    if (!c.frames.empty()) {
      ++with_frames;
      if (e.action == TraceAction::alloc) {
        EXPECT_NE(c.frames[0].name.find("allocate_in_layer"), std::string::npos) << c.frames[0].name;
      }
    }
    if (e.action != TraceAction::snapshot) {
      ASSERT_EQ(c.annotations.size(), 2u) << to_string(e.action);
      annotated++;
    }
  }
  EXPECT_GT(with_frames, 100u);  // the first half had stacks
  EXPECT_LT(with_frames, t.events.size());
  EXPECT_EQ(annotated + 1, t.events.size());  // all but the snapshot event
}

TEST(Export, PickleRoundTripIsExact) {
  const Trace t = recorded_workload(1, 1500);
  const std::string data = write_pytorch_snapshot(t);
  const Trace back = read_pytorch_snapshot(bytes(data), "back.pickle");
  expect_same_trace(t, back);
  expect_same_replay(t, back);
  // Written again, byte for byte the same.
  EXPECT_TRUE(write_pytorch_snapshot(back) == data);
  // And it still verifies against the allocator's rules.
  const VerifyResult v = verify(back);
  EXPECT_TRUE(v.agreed) << v.divergence;
}

TEST(Export, JsonRoundTripIsExact) {
  const Trace t = recorded_workload(2, 1500);
  const std::string json = write_snapshot_json(t);
  const Trace back = read_snapshot_json(json, "back.json");
  EXPECT_EQ(back.format, "snapshot-json");
  expect_same_trace(t, back);
  expect_same_replay(t, back);
  EXPECT_TRUE(write_snapshot_json(back) == json);
  // JSON and pickle describe the same snapshot.
  const std::string data = write_pytorch_snapshot(t);
  expect_same_trace(read_pytorch_snapshot(bytes(data), "p"), back);
}

TEST(Export, FilesAreRecognizedByContent) {
  const Trace t = recorded_workload(3, 300);
  const auto dir = std::filesystem::temp_directory_path() / "reservoir_export_test";
  std::filesystem::create_directories(dir);
  auto write = [&](const char* name, const std::string& content) {
    const auto path = dir / name;
    std::ofstream(path, std::ios::binary) << content;
    return path.string();
  };
  EXPECT_EQ(read_trace_file(write("a.bin", write_pytorch_snapshot(t))).format, "pytorch-snapshot");
  EXPECT_EQ(read_trace_file(write("b.bin", "\n " + write_snapshot_json(t))).format,
            "snapshot-json");
  EXPECT_EQ(read_trace_file(write("c.bin", "Thread,Time,Action,Pointer,Size,Stream\n")).format,
            "rmm-csv");
  EXPECT_EQ(read_trace_file(write("d.bin", write_text_trace(t))).format, "reservoir-text");
  std::filesystem::remove_all(dir);
}

TEST(Export, TextRoundTripReplaysTheSame) {
  const Trace t = recorded_workload(4, 800);
  const Trace back = read_text_trace(write_text_trace(t), "t.trace");
  // Text keeps requests only: the program (and so the replay) is the same
  // when the trace has no blocks live at the start.
  const ReplayProgram a = compile(t);
  const ReplayProgram b = compile(back);
  ASSERT_EQ(a.initial.size(), 0u);
  ASSERT_EQ(a.ops.size(), b.ops.size());
  for (std::size_t i = 0; i < a.ops.size(); ++i) {
    ASSERT_EQ(a.ops[i].kind, b.ops[i].kind);
    ASSERT_EQ(a.ops[i].size, b.ops[i].size);
    ASSERT_EQ(a.ops[i].id, b.ops[i].id);
  }
}

TEST(Export, SharedTracesRoundTrip) {
  if (!std::filesystem::exists(testing::shared_trace_dir())) {
    GTEST_SKIP() << "no real traces at " << testing::shared_trace_dir();
  }
  const auto paths = testing::shared_traces();
  EXPECT_FALSE(paths.empty()) << "no .pickle in " << testing::shared_trace_dir();
  for (const auto& path : paths) {
    const Trace t = read_trace_file(path.string());
    const Trace p = read_pytorch_snapshot(bytes(write_pytorch_snapshot(t)), "p");
    const Trace j = read_snapshot_json(write_snapshot_json(t), "j");
    expect_same_trace(t, p);
    expect_same_trace(t, j);
    expect_same_replay(t, p);
    EXPECT_TRUE(verify(j).agreed) << path;
  }
}

// ---- errors ----------------------------------------------------------------

// Every error here is a TraceError.
template <typename F>
std::string error_of(F&& f) {
  return testing::error_of<TraceError>(std::forward<F>(f));
}

TEST(Export, CorruptJsonGetsExactErrors) {
  const Trace t = recorded_workload(6, 50);
  const std::string good = write_snapshot_json(t);
  auto read = [](const std::string& s) { return error_of([&] { (void)read_snapshot_json(s, "s.json"); }); };
  EXPECT_EQ(read(good), "no error");
  EXPECT_EQ(read("{\"segments\": [1, 2"),
            "snapshot s.json: byte 18: invalid JSON: [json.exception.parse_error.101] parse error "
            "at line 1, column 19: syntax error while parsing array - unexpected end of input; "
            "expected ']'");
  EXPECT_EQ(read("{\"segments\": []}"), "snapshot s.json: top level: 'device_traces' is missing");
  EXPECT_EQ(read("{\"segments\": [], \"device_traces\": [[{\"action\": \"alloc\", \"addr\": -1, "
                 "\"size\": 1, \"stream\": 0}]]}"),
            "snapshot s.json: device_traces[0][0]: 'addr' is negative (-1)");
  EXPECT_EQ(read("{\"segments\": [], \"device_traces\": [[{\"action\": \"alloc\", \"addr\": 1, "
                 "\"size\": 1, \"stream\": 0, \"frames\": [{\"filename\": \"f\", \"line\": 1.5, "
                 "\"name\": \"g\"}]}]]}"),
            "snapshot s.json: device_traces[0][0].frames[0]: 'line' should be an int, found float");
  EXPECT_EQ(read("{\"segments\": [1e999]}"),
            "snapshot s.json: invalid JSON: [json.exception.out_of_range.406] number overflow "
            "parsing '1e999'");
  EXPECT_EQ(read(std::string(100, '[') + std::string(100, ']')),
            "snapshot s.json: JSON nested deeper than 64");
  EXPECT_EQ(read("{\"segments\": [], \"device_traces\": [[{\"action\": \"alloc\", \"addr\": 1, "
                 "\"size\": 1, \"stream\": 0, \"frames\": [{\"filename\": \"<annotation>\", "
                 "\"line\": 0, \"name\": \"a\"}, {\"filename\": \"f.py\", \"line\": 3, \"name\": "
                 "\"g\"}]}]]}"),
            "snapshot s.json: device_traces[0][0].frames[1]: a stack frame follows an annotation "
            "frame (annotations come last)");
}

// ---- RMM's CSV log ---------------------------------------------------------------

TEST(RmmCsv, ReadsAllocationsFreesFailuresAndStreams) {
  const Trace t = read_rmm_csv(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "140573312345856,10:30:45.123456,allocate,0x7f8a40000000,1024,0x0\n"
      "140573312345856,10:30:45.234567,allocate,0x7f8a40000400,2048,0x7f8a38001020\r\n"
      "140573312345857,10:30:45.300000,allocate failure,0x0,4294967296,0x7f8a38001020\n"
      "\n"
      "140573312345856,1634567890.5,free,0x7f8a40000000,1024,0x0\n"
      "140573312345856,10:30:46.000001,deallocate,0x7f8a40000400,2048,0x7f8a38001020\n"
      "140573312345856,10:30:46.000002,free,0x7f0000000000,4096,0x7f8a38001090\n",
      "log.csv");
  EXPECT_EQ(t.format, "rmm-csv");
  EXPECT_FALSE(t.has_addresses);
  const std::vector<TraceEvent> want = {
      {TraceAction::alloc, 0x7f8a40000000, 1024, 0, 37845123456, 0},
      {TraceAction::alloc, 0x7f8a40000400, 2048, 1, 37845234567, 0},
      {TraceAction::oom, 0, 4294967296, 1, 37845300000, 0},
      {TraceAction::free_requested, 0x7f8a40000000, 1024, 0, 1634567890500000, 0},
      {TraceAction::free_requested, 0x7f8a40000400, 2048, 1, 37846000001, 0},
      {TraceAction::free_requested, 0x7f0000000000, 4096, 2, 37846000002, 0},
  };
  EXPECT_EQ(t.events, want);
  // The block freed but never allocated in the log was live at the start.
  const ReplayProgram p = compile(t);
  ASSERT_EQ(p.initial.size(), 1u);
  EXPECT_EQ(p.initial[0].size, 4096u);
  const ReplayResult r = replay(p, AllocatorConfig{}, "");
  EXPECT_EQ(r.peak_requested_bytes, 4096u + 1024 + 2048);
}

TEST(RmmCsv, ErrorsNameTheLine) {
  auto read = [](const std::string& body) {
    return error_of([&] {
      (void)read_rmm_csv("Thread,Time,Action,Pointer,Size,Stream\n" + body, "log.csv");
    });
  };
  EXPECT_EQ(error_of([] { (void)read_rmm_csv("", "log.csv"); }),
            "RMM log log.csv: line 1: empty log: expected the header "
            "'Thread,Time,Action,Pointer,Size,Stream'");
  EXPECT_EQ(error_of([] { (void)read_rmm_csv("Thread,Time,Action\n", "log.csv"); }),
            "RMM log log.csv: line 1: expected the header "
            "'Thread,Time,Action,Pointer,Size,Stream', found 'Thread,Time,Action'");
  EXPECT_EQ(read("1,10:00:00.0,allocate,0x10,5\n"),
            "RMM log log.csv: line 2: expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), "
            "found 5");
  EXPECT_EQ(read("1,10:00:00.0,allocate,0x1g,5,0\n"),
            "RMM log log.csv: line 2: Pointer '0x1g' is not an unsigned hexadecimal number");
  EXPECT_EQ(read("1,10:00:00.0,allocate,0x10,-5,0\n"),
            "RMM log log.csv: line 2: Size '-5' is not an unsigned decimal number");
  EXPECT_EQ(read("1,yesterday,allocate,0x10,5,0\n"),
            "RMM log log.csv: line 2: Time 'yesterday' is neither HH:MM:SS.ffffff nor seconds "
            "since the epoch");
  EXPECT_EQ(read("1,1.0,reallocate,0x10,5,0\n"),
            "RMM log log.csv: line 2: unknown Action 'reallocate' (accepted: allocate, free, "
            "deallocate, allocate failure)");
  EXPECT_EQ(read("1,1.0,allocate,0x10,5,0\n1,1.0,allocate,0x10,7,0\n"),
            "RMM log log.csv: line 3: Pointer 0x10 is allocated again while live (allocated on "
            "line 2)");
  EXPECT_EQ(read("1,1.0,allocate,0x10,5,0\n1,1.0,free,0x10,7,0\n"),
            "RMM log log.csv: line 3: Pointer 0x10 is freed with Size 7 but was allocated with 5 "
            "(line 2)");
  EXPECT_EQ(read("1,1.0,free,0x10,7,0\n1,1.0,free,0x10,7,0\n"),
            "RMM log log.csv: line 3: Pointer 0x10 is freed twice");
  EXPECT_EQ(read("1,1.0,allocate,0x0,7,0\n"),
            "RMM log log.csv: line 2: allocate returned a null Pointer");
  EXPECT_EQ(read(std::string("1,1.0,allocate,0x10,7,0\0\n", 24)),
            "RMM log log.csv: line 2: contains a NUL byte");
}

// One corrupt file of each format the tools read, with the exact error.
TEST(CorruptFiles, EachFormatNamesTheProblem) {
  const std::string dir = std::string(RESERVOIR_SOURCE_DIR) + "/tests/data/";
  auto error = [&](const std::string& name) {
    return error_of([&] { (void)read_trace_file(dir + name); });
  };
  EXPECT_EQ(error("corrupt.pickle"), "snapshot " + dir +
                                         "corrupt.pickle: pickle: byte 94: truncated: the pickle "
                                         "ends before its STOP opcode");
  EXPECT_EQ(error("corrupt.json"),
            "snapshot " + dir +
                "corrupt.json: byte 92: invalid JSON: [json.exception.parse_error.101] parse error "
                "at line 1, column 93: syntax error while parsing object - unexpected end of "
                "input; expected '}'");
  EXPECT_EQ(error("corrupt.csv"), "RMM log " + dir +
                                      "corrupt.csv: line 4: Pointer 0x7f8a40000000 is freed with "
                                      "Size 4096 but was allocated with 1048576 (line 2)");
  EXPECT_EQ(error("corrupt.trace"),
            "trace " + dir + "corrupt.trace: line 3: block 2 is freed but not allocated");
  EXPECT_EQ(error("no_such_file"), "trace " + dir + "no_such_file: cannot open the file");
}

}  // namespace
}  // namespace reservoir
