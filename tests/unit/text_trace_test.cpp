// The text trace format: reading, writing back, errors that name the line.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <filesystem>
#include <random>

#include "reservoir/config.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "shared_traces.hpp"

namespace reservoir {
namespace {

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
            "trace t.trace: line 1: an empty file: reservoir reads PyTorch memory snapshots "
            "(torch.cuda.memory._dump_snapshot's pickle, or its JSON), RMM's CSV logs and its own "
            "text traces (first line 'reservoir-trace 1')");
  EXPECT_EQ(text_error("alloc 1 2\n"),
            "trace t.trace: line 1: no trace format reservoir reads: reservoir reads PyTorch memory "
            "snapshots (torch.cuda.memory._dump_snapshot's pickle, or its JSON), RMM's CSV logs and "
            "its own text traces (first line 'reservoir-trace 1')");
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
  // The config's own error (config_test checks its words), after the line.
  std::string config_error;
  try {
    (void)AllocatorConfig::parse("foo:1");
  } catch (const ConfigError& e) {
    config_error = e.what();
  }
  EXPECT_EQ(config_error.rfind("allocator config \"foo:1\": unknown key 'foo'; accepted keys: ", 0), 0u);
  EXPECT_EQ(text_error("reservoir-trace 1\nconfig foo:1\n"), "trace t.trace: line 2: " + config_error);
}

}  // namespace
}  // namespace reservoir
