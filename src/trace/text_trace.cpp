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

#include <sstream>
#include <unordered_set>

#include "release_bursts.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {
namespace {

std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> words;
  std::istringstream in(line.substr(0, line.find('#')));
  std::string w;
  while (in >> w) words.push_back(w);
  return words;
}

}  // namespace

Trace read_text_trace(const std::string& text, const std::string& name) {
  Trace trace;
  trace.name = name;
  trace.format = to_string(TraceFormat::text);
  std::istringstream in(text);
  std::string line;
  std::size_t line_no = 0;
  bool header = false;
  std::unordered_set<std::uint64_t> live;
  auto fail = [&](const std::string& what) -> void {
    throw TraceError(fmt::format("trace {}: line {}: {}", name, line_no, what));
  };
  auto number = [&](const std::string& w, const char* what) {
    std::size_t used = 0;
    std::uint64_t v = 0;
    try {
      v = std::stoull(w, &used, 10);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != w.size() || w.empty() || w[0] == '-') {
      fail(fmt::format("{} '{}' is not an unsigned number", what, w));
    }
    return v;
  };
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find('\0') != std::string::npos) fail("contains a NUL byte (is this a binary file?)");
    const auto words = split_words(line);
    if (words.empty()) continue;
    const std::string& cmd = words[0];
    if (!header) {
      if (cmd != "reservoir-trace" || words.size() != 2) {
        fail("expected the header 'reservoir-trace 1'");
      }
      if (words[1] != "1") fail(fmt::format("unsupported version '{}' (supported: 1)", words[1]));
      header = true;
      continue;
    }
    if (cmd == "config") {
      const auto pos = line.find("config") + 6;
      std::string value = line.substr(
          pos, line.find('#') == std::string::npos ? std::string::npos : line.find('#') - pos);
      value.erase(0, value.find_first_not_of(" \t"));
      value.erase(value.find_last_not_of(" \t\r") + 1);
      try {
        set_recorded_config(trace, value);
      } catch (const ConfigError& e) {
        fail(e.what());
      }
    } else if (cmd == "alloc") {
      if (words.size() != 3 && !(words.size() == 5 && words[3] == "stream")) {
        fail("expected 'alloc ID SIZE [stream S]'");
      }
      const std::uint64_t id = number(words[1], "ID");
      std::uint64_t size = 0;
      try {
        size = parse_size(words[2]);
      } catch (const UsageError& e) {
        fail(e.what());
      }
      if (size == 0) fail("SIZE must be positive");
      const StreamId stream = words.size() == 5 ? number(words[4], "stream") : 0;
      if (!live.insert(id).second) fail(fmt::format("block {} is allocated twice", id));
      trace.events.push_back({TraceAction::alloc, id, size, stream});
    } else if (cmd == "free") {
      if (words.size() != 2) fail("expected 'free ID'");
      const std::uint64_t id = number(words[1], "ID");
      if (live.erase(id) == 0) fail(fmt::format("block {} is freed but not allocated", id));
      trace.events.push_back({TraceAction::free_requested, id, 0, 0});
    } else if (cmd == "empty_cache") {
      if (words.size() != 1) fail("'empty_cache' takes no arguments");
      trace.events.push_back({TraceAction::empty_cache, 0, 0, 0});
    } else {
      fail(fmt::format("unknown command '{}' (accepted: config, alloc, free, empty_cache)", cmd));
    }
  }
  if (!header) {
    line_no = line_no == 0 ? 1 : line_no;
    fail("empty trace: expected the header 'reservoir-trace 1'");
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
