// Trace files: the format told from the first bytes, each reader naming its
// format, corrupt files of every format naming the problem.
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
#include "trace_fixture.hpp"
#include "source_dir.hpp"

namespace reservoir {
namespace {

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

// The format table that reading, export and the fuzz targets go through:
// each format once, detection in the table's order with text last, and every
// writable format reading back what it writes through its own entry.
TEST(TraceFormat, TheTableListsEachFormatOnce) {
  const auto formats = trace_formats();
  ASSERT_EQ(formats.size(), 4u);
  std::vector<std::string_view> names;
  std::vector<std::string_view> exported;
  for (const TraceFormatInfo& f : formats) {
    EXPECT_EQ(&trace_format(f.id), &f);
    EXPECT_EQ(to_string(f.id), f.name);
    names.push_back(f.name);
    if (f.write != nullptr) {
      exported.push_back(f.export_name);
      EXPECT_EQ(exported_format(f.export_name), &f);
      EXPECT_FALSE(f.extensions.empty()) << f.name;
    }
  }
  EXPECT_EQ(names, (std::vector<std::string_view>{"pytorch-snapshot", "snapshot-json", "rmm-csv",
                                                  "reservoir-text"}));
  EXPECT_EQ(exported, (std::vector<std::string_view>{"pickle", "json", "text"}));
  EXPECT_EQ(exported_format("rmm"), nullptr);
  EXPECT_EQ(exported_format(""), nullptr);
  EXPECT_TRUE(formats.back().detect("anything at all"));

  const Trace t = recorded_workload(3, 300);
  for (const TraceFormatInfo& f : formats) {
    if (f.write == nullptr) continue;
    const std::string bytes = f.write(t);
    EXPECT_EQ(detect_trace_format(bytes), f.id) << f.name;
    const std::span<const std::uint8_t> span(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                             bytes.size());
    const std::vector<Trace> back = f.read(span, "x", {});
    ASSERT_EQ(back.size(), 1u) << f.name;
    EXPECT_EQ(back.front().format, f.name);
    // The snapshot formats keep every event; text keeps the requests (300 allocs and frees).
    EXPECT_EQ(back.front().events.size(), f.id == TraceFormat::text ? 300u : t.events.size()) << f.name;
    EXPECT_EQ(back.front().device_events,
              (std::vector<std::uint64_t>{back.front().events.size()})) << f.name;
    EXPECT_EQ(f.write(back.front()), bytes) << f.name;  // what it reads, it writes back the same
    if (f.read_device != nullptr) {
      EXPECT_EQ(f.read_device(span, "x", 0, {}).events, back.front().events) << f.name;
    }
  }
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

// One corrupt file of each format the tools read, with the exact error.
TEST(CorruptFiles, EachFormatNamesTheProblem) {
  const std::string dir = std::string(RESERVOIR_SOURCE_DIR) + "/tests/data/";
  auto error = [&](const std::string& name) {
    return error_of([&] { (void)read_trace_file(dir + name); });
  };
  // Cut short inside its one FRAME: the frame's length says so first.
  EXPECT_EQ(error("corrupt.pickle"), "snapshot " + dir +
                                         "corrupt.pickle: pickle: byte 2: truncated: the FRAME "
                                         "holds 90 bytes, 83 remain");
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
