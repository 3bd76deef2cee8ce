// reservoir's text trace format, for hand-written and generated cases.
//
//   reservoir-trace 1                 first non-comment line
//   config max_split_size_mb:64      optional: settings it was written for
//   alloc ID SIZE [stream S]          ID: any unsigned number naming the block
//   free ID
//   empty_cache
//   # comment (also after a command)
//
// SIZE is bytes, or a number with a unit (512, 4KiB, 1.5MiB, 2GiB).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <string_view>
#include <unordered_set>

#include "release_bursts.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {
namespace {

// What a file that starts as no trace format is told: the formats reservoir
// reads (anything not recognised is read as the text format).
constexpr std::string_view kFormatsRead =
    "reservoir reads PyTorch memory snapshots (torch.cuda.memory._dump_snapshot's pickle, or "
    "its JSON), RMM's CSV logs and its own text traces (first line 'reservoir-trace 1')";

// Up to kMaxWords words of a line, before any '#': views into the text, so
// that reading a line allocates nothing.
constexpr std::size_t kMaxWords = 6;
struct Words {
  std::array<std::string_view, kMaxWords> word{};
  std::size_t count = 0;  // kMaxWords + 1 when the line has more
};

Words split_words(std::string_view line) {
  Words out;
  std::size_t i = 0;
  const std::size_t end = std::min(line.find('#'), line.size());
  while (i < end) {
    while (i < end && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r' || line[i] == '\v' ||
                       line[i] == '\f')) {
      ++i;
    }
    if (i >= end) break;
    std::size_t j = i;
    while (j < end && line[j] != ' ' && line[j] != '\t' && line[j] != '\r' && line[j] != '\v' &&
           line[j] != '\f') {
      ++j;
    }
    if (out.count == kMaxWords) {
      out.count = kMaxWords + 1;
      return out;
    }
    out.word[out.count++] = line.substr(i, j - i);
    i = j;
  }
  return out;
}

}  // namespace

Trace read_text_trace(const std::string& text, const std::string& name) {
  Trace trace;
  trace.name = name;
  trace.format = to_string(TraceFormat::text);
  std::size_t line_no = 0;
  bool header = false;
  std::unordered_set<std::uint64_t> live;
  auto fail = [&](const std::string& what) -> void {
    throw TraceError(fmt::format("trace {}: line {}: {}", name, line_no, what));
  };
  auto number = [&](std::string_view w, const char* what) {
    std::uint64_t v = 0;
    const auto [p, ec] = std::from_chars(w.data(), w.data() + w.size(), v, 10);
    if (w.empty() || ec != std::errc() || p != w.data() + w.size()) {
      fail(fmt::format("{} '{}' is not an unsigned number", what, w));
    }
    return v;
  };
  // Sizes are mostly plain bytes: read those directly, the rest by parse_size.
  auto size_of = [&](std::string_view w) {
    std::uint64_t v = 0;
    const auto [p, ec] = std::from_chars(w.data(), w.data() + w.size(), v, 10);
    if (ec == std::errc() && p == w.data() + w.size()) return v;
    // A whole number of KiB, MiB or GiB, as parse_size reads it, exactly.
    if (ec == std::errc() && p != w.data() && v < (std::uint64_t{1} << 40)) {
      const std::string_view unit(p, static_cast<std::size_t>(w.data() + w.size() - p));
      if (unit == "KiB") return v << 10;
      if (unit == "MiB") return v << 20;
      if (unit == "GiB") return v << 30;
    }
    try {
      return static_cast<std::uint64_t>(parse_size(std::string(w)));
    } catch (const UsageError& e) {
      fail(e.what());
    }
    return std::uint64_t{0};
  };
  const std::string_view all(text);
  trace.events.reserve(static_cast<std::size_t>(std::count(all.begin(), all.end(), '\n')) + 1);
  std::size_t at = 0;
  while (at < all.size()) {
    const std::size_t nl = std::min(all.find('\n', at), all.size());
    const std::string_view line = all.substr(at, nl - at);
    at = nl + 1;
    ++line_no;
    if (line.find('\0') != std::string_view::npos) {
      fail("contains a NUL byte (is this a binary file?)");
    }
    const Words words = split_words(line);
    if (words.count == 0) continue;
    const std::string_view cmd = words.word[0];
    if (!header) {
      if (cmd != "reservoir-trace" || words.count != 2) {
        fail(fmt::format("no trace format reservoir reads: {}", kFormatsRead));
      }
      if (words.word[1] != "1") {
        fail(fmt::format("unsupported version '{}' (supported: 1)", words.word[1]));
      }
      header = true;
      continue;
    }
    if (cmd == "alloc") {
      if (words.count != 3 && !(words.count == 5 && words.word[3] == "stream")) {
        fail("expected 'alloc ID SIZE [stream S]'");
      }
      const std::uint64_t id = number(words.word[1], "ID");
      const std::uint64_t size = size_of(words.word[2]);
      if (size == 0) fail("SIZE must be positive");
      const StreamId stream = words.count == 5 ? number(words.word[4], "stream") : 0;
      if (!live.insert(id).second) fail(fmt::format("block {} is allocated twice", id));
      trace.events.push_back({TraceAction::alloc, id, size, stream});
    } else if (cmd == "free") {
      if (words.count != 2) fail("expected 'free ID'");
      const std::uint64_t id = number(words.word[1], "ID");
      if (live.erase(id) == 0) fail(fmt::format("block {} is freed but not allocated", id));
      trace.events.push_back({TraceAction::free_requested, id, 0, 0});
    } else if (cmd == "empty_cache") {
      if (words.count != 1) fail("'empty_cache' takes no arguments");
      trace.events.push_back({TraceAction::empty_cache, 0, 0, 0});
    } else if (cmd == "config") {
      std::string_view value = line.substr(line.find("config") + 6);
      value = value.substr(0, std::min(value.find('#'), value.size()));
      const std::size_t first = value.find_first_not_of(" \t");
      value = first == std::string_view::npos ? std::string_view() : value.substr(first);
      value = value.substr(0, value.find_last_not_of(" \t\r") + 1);
      try {
        set_recorded_config(trace, std::string(value));
      } catch (const ConfigError& e) {
        fail(e.what());
      }
    } else {
      fail(fmt::format("unknown command '{}' (accepted: config, alloc, free, empty_cache)", cmd));
    }
  }
  if (!header) {
    line_no = line_no == 0 ? 1 : line_no;
    fail(fmt::format("an empty file: {}", kFormatsRead));
  }
  return trace;
}

std::string write_text_trace(const Trace& trace) {
  std::string out = "reservoir-trace 1\n";
  if (!trace.recorded_config.empty()) out += "config " + trace.recorded_config + "\n";
  // The program's empty_cache() calls, seen in a snapshot as runs of releases.
  const std::unordered_set<std::size_t> empty_cache_at = detail::empty_cache_points(trace);
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const TraceEvent& e = trace.events[i];
    if (empty_cache_at.count(i) != 0) out += "empty_cache\n";
    switch (e.action) {
      case TraceAction::alloc:
        out += e.stream == 0 ? fmt::format("alloc {} {}\n", e.addr, e.size)
                             : fmt::format("alloc {} {} stream {}\n", e.addr, e.size, e.stream);
        break;
      case TraceAction::free_requested: out += fmt::format("free {}\n", e.addr); break;
      case TraceAction::empty_cache: out += "empty_cache\n"; break;
      default: break;  // device-side events are not part of the text format
    }
  }
  return out;
}

}  // namespace reservoir
