// Reading PyTorch snapshots (pickle) and our JSON export: corrupt fields and
// corrupt JSON get exact errors.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "error_text.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "shared_traces.hpp"
#include "trace_fixture.hpp"

namespace reservoir {
namespace {

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
  // An action the reader does not know (a newer PyTorch's) is skipped and
  // counted, never fatal: the pickle shares the string, so every
  // free_requested event becomes one.
  std::string renamed = good;
  renamed.replace(pos, 14, "free_requestex");
  EXPECT_EQ(read(renamed), "no error");
  const Trace back = read_pytorch_snapshot(
      std::span(reinterpret_cast<const std::uint8_t*>(renamed.data()), renamed.size()), "s.pickle");
  const auto frees = static_cast<std::uint64_t>(
      std::count_if(t.events.begin(), t.events.end(),
                    [](const TraceEvent& e) { return e.action == TraceAction::free_requested; }));
  ASSERT_GT(frees, 0u);
  EXPECT_EQ(back.skipped_actions, (std::map<std::string, std::uint64_t>{{"free_requestex", frees}}));
  EXPECT_EQ(back.events.size(), t.events.size() - frees);
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
            "snapshot s.json: device_traces[0][0].addr: expected a non-negative int, got -1");
  EXPECT_EQ(read("{\"segments\": [], \"device_traces\": [[{\"action\": \"alloc\", \"addr\": 1, "
                 "\"size\": 1, \"stream\": 0, \"frames\": [{\"filename\": \"f\", \"line\": 1.5, "
                 "\"name\": \"g\"}]}]]}"),
            "snapshot s.json: device_traces[0][0].frames[0].line: expected int, got float");
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

}  // namespace
}  // namespace reservoir
