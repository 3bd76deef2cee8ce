// RMM's memory event log (rmm::mr::logging_resource_adaptor), one CSV row per
// call:
//
//   Thread,Time,Action,Pointer,Size,Stream
//   140573312345856,10:30:45.123456,allocate,0x7f8a40000000,1024,0x0
//   140573312345856,10:30:45.234567,free,0x7f8a40000000,1024,0x0
//
// Time is a time of day (HH:MM:SS.ffffff) or seconds since the epoch; Action
// is allocate, free (also deallocate) or "allocate failure"; Pointer and
// Stream are hex (0x...) or decimal. Streams become dense ids in order of
// first use, the default stream (0) staying 0. The pointers are another
// allocator's, so the trace carries no addresses of ours: replay decides.
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

class CsvReader {
 public:
  explicit CsvReader(const std::string& name) : name_(name) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw TraceError(fmt::format("RMM log {}: line {}: {}", name_, line_, what));
  }

  std::uint64_t number(std::string_view field, const char* what) const {
    std::uint64_t v = 0;
    int base = 10;
    std::string_view digits = field;
    if (digits.starts_with("0x") || digits.starts_with("0X")) {
      base = 16;
      digits.remove_prefix(2);
    }
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v, base);
    if (digits.empty() || ec != std::errc{} || end != digits.data() + digits.size()) {
      fail(fmt::format("{} '{}' is not an unsigned {} number", what, field,
                       base == 16 ? "hexadecimal" : "decimal"));
    }
    return v;
  }

  // HH:MM:SS.ffffff (RMM's pattern) or seconds since the epoch, in microseconds.
  std::int64_t time_us(std::string_view field) const {
    unsigned h = 0, m = 0;
    double sec = 0;
    const std::string text(field);
    char tail = 0;
    if (std::sscanf(text.c_str(), "%2u:%2u:%lf%c", &h, &m, &sec, &tail) == 3 && h < 24 &&
        m < 60 && sec >= 0 && sec < 61) {
      return std::llround((h * 3600.0 + m * 60.0 + sec) * 1e6);
    }
    double seconds = 0;
    const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), seconds);
    if (field.empty() || ec != std::errc{} || end != field.data() + field.size() || seconds < 0 ||
        seconds > 1e11) {
      fail(fmt::format("Time '{}' is neither HH:MM:SS.ffffff nor seconds since the epoch", field));
    }
    return std::llround(seconds * 1e6);
  }

  Trace read(const std::string& text) {
    Trace trace;
    trace.name = name_;
    trace.format = to_string(TraceFormat::rmm_csv);
    std::size_t pos = 0;
    bool header = false;
    while (pos < text.size()) {
      const std::size_t eol = std::min(text.find('\n', pos), text.size());
      const std::string_view line = trim(std::string_view(text).substr(pos, eol - pos));
      pos = eol + 1;
      ++line_;
      if (line.find('\0') != std::string_view::npos) fail("contains a NUL byte");
      if (line.empty()) continue;
      std::vector<std::string_view> fields;
      std::size_t start = 0;
      while (true) {
        const std::size_t comma = line.find(',', start);
        fields.push_back(trim(line.substr(start, comma - start)));
        if (comma == std::string_view::npos) break;
        start = comma + 1;
      }
      if (!header) {
        if (line != "Thread,Time,Action,Pointer,Size,Stream") {
          fail(fmt::format("expected the header 'Thread,Time,Action,Pointer,Size,Stream', found '{}'",
                           line.substr(0, 80)));
        }
        header = true;
        continue;
      }
      if (fields.size() != 6) {
        fail(fmt::format("expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), found {}",
                         fields.size()));
      }
      row(fields, trace);
    }
    if (!header) {
      line_ = std::max<std::size_t>(line_, 1);
      fail("empty log: expected the header 'Thread,Time,Action,Pointer,Size,Stream'");
    }
    return trace;
  }

 private:
  void row(const std::vector<std::string_view>& f, Trace& trace) {
    (void)number(f[0], "Thread");
    TraceEvent ev;
    ev.time_us = time_us(f[1]);
    const std::string_view action = f[2];
    ev.addr = number(f[3], "Pointer");
    ev.size = number(f[4], "Size");
    ev.stream = stream(number(f[5], "Stream"));
    if (action == "allocate") {
      if (ev.size == 0) return;  // RMM hands out nullptr for 0 bytes
      if (ev.addr == 0) fail("allocate returned a null Pointer");
      auto [it, inserted] = live_.try_emplace(ev.addr, Live{ev.size, line_});
      if (!inserted) {
        fail(fmt::format("Pointer {:#x} is allocated again while live (allocated on line {})",
                         ev.addr, it->second.line));
      }
      ev.action = TraceAction::alloc;
    } else if (action == "free" || action == "deallocate") {
      if (ev.addr == 0) return;  // freeing nullptr is a no-op
      auto it = live_.find(ev.addr);
      if (it != live_.end()) {
        if (it->second.size != ev.size) {
          fail(fmt::format("Pointer {:#x} is freed with Size {} but was allocated with {} (line {})",
                           ev.addr, ev.size, it->second.size, it->second.line));
        }
        live_.erase(it);
      } else if (!freed_unknown_.insert(ev.addr).second) {
        fail(fmt::format("Pointer {:#x} is freed twice", ev.addr));
      }
      ev.action = TraceAction::free_requested;
    } else if (action == "allocate failure") {
      ev.action = TraceAction::oom;
      ev.addr = 0;
    } else {
      fail(fmt::format("unknown Action '{}' (accepted: allocate, free, deallocate, allocate failure)",
                       action.substr(0, 40)));
    }
    trace.events.push_back(ev);
  }

  StreamId stream(std::uint64_t raw) {
    if (raw == 0) return 0;
    auto [it, inserted] = streams_.try_emplace(raw, streams_.size() + 1);
    return it->second;
  }

  struct Live {
    std::uint64_t size;
    std::size_t line;
  };
  const std::string& name_;
  std::size_t line_ = 0;
  std::unordered_map<std::uint64_t, Live> live_;
  std::unordered_set<std::uint64_t> freed_unknown_;
  std::unordered_map<std::uint64_t, StreamId> streams_;
};

}  // namespace

Trace read_rmm_csv(const std::string& text, const std::string& name) {
  return CsvReader(name).read(text);
}

}  // namespace reservoir
