#include "support.hpp"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <limits>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"

namespace reservoir::tools {

CLI::Option* add_size_option(CLI::App& cmd, const std::string& name, std::string& value,
                             const std::string& help) {
  CLI::Validator size_with_unit(
      [](std::string& text) -> std::string {
        const bool bare = !text.empty() && text.find_first_not_of("0123456789.") == std::string::npos;
        if (bare) {
          return fmt::format("'{}' has no unit: write {}GiB, {}MiB or {}KiB ({}B for bytes)", text,
                             text, text, text, text);
        }
        try {
          if (parse_size(text) == 0) {
            return fmt::format("'{}' is no memory at all: give a size above 0", text);
          }
        } catch (const UsageError& e) {
          return e.what();
        }
        return "";
      },
      "SIZE");
  return cmd.add_option(name, value, help)->check(size_with_unit);
}

CLI::Validator whole_number(std::int64_t lo, std::int64_t hi, const std::string& what) {
  return CLI::Validator(
      [lo, hi, what](std::string& text) -> std::string {
        std::int64_t n = 0;
        const char* end = text.data() + text.size();
        const auto [at, ec] = std::from_chars(text.data(), end, n);
        if (text.empty() || at != end || ec == std::errc::invalid_argument) {
          return fmt::format("'{}' is not a whole number of {}", text, what);
        }
        if (ec == std::errc::result_out_of_range || n < lo || n > hi) {
          return fmt::format("{} {}: give {} to {}", text, what, lo, hi);
        }
        return "";
      },
      fmt::format("{}..{}", lo, hi));
}

CLI::Validator fraction(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& text) -> std::string {
        char* end = nullptr;
        const double f = text.empty() ? 0.0 : std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(f)) {
          return fmt::format("'{}' is not a fraction (a number such as 0.5)", text);
        }
        if (f < 0.0 || f > 1.0 || (!zero_allowed && f == 0.0)) {
          return fmt::format("{} is not a fraction {} of the device's memory", text,
                             zero_allowed ? "from 0 to 1" : "above 0 and at most 1");
        }
        return "";
      },
      zero_allowed ? "0..1" : "(0..1]");
}

CLI::Validator output_path() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.empty() ? "an empty path: give the file to write" : "";
      },
      "PATH");
}

void set_examples(CLI::App& cmd, const std::vector<std::pair<std::string, std::string>>& examples) {
  std::string footer = "Examples:\n";
  for (const auto& [line, what] : examples) footer += fmt::format("  {}\n      {}\n", line, what);
  cmd.footer(footer);
}

std::string base_name(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

void write_file(const std::string& path, const std::string& content, const std::string& command) {
  std::ofstream out(path, std::ios::binary);
  if (!out) throw UsageError(fmt::format("{}: cannot write '{}'", command, path));
  out << content;
  out.close();
  if (!out) throw UsageError(fmt::format("{}: writing '{}' failed", command, path));
}

std::string config_label(const std::string& config) {
  return config.empty() ? "native defaults" : config;
}

std::vector<std::string> wrap_setting(const std::string& setting, std::size_t width) {
  // Pieces end after a comma, or after a colon where an option alone is
  // wider than the column; each keeps its separator, so that the wrapped
  // lines read back as the setting.
  std::vector<std::string> pieces;
  std::size_t start = 0;
  while (start < setting.size()) {
    const std::size_t comma = setting.find(',', start);
    const std::size_t end = comma == std::string::npos ? setting.size() : comma + 1;
    std::string option = setting.substr(start, end - start);
    start = end;
    std::size_t colon = 0;
    while (option.size() > width && (colon = option.find(':')) != std::string::npos && colon + 1 < option.size()) {
      pieces.push_back(option.substr(0, colon + 1));
      option.erase(0, colon + 1);
    }
    pieces.push_back(option);
  }
  std::vector<std::string> lines;
  std::string line;
  for (const std::string& piece : pieces) {
    if (!line.empty() && line.size() + piece.size() > width) {
      lines.push_back(line);
      line.clear();
    }
    line += piece;
    while (line.size() > width) {
      lines.push_back(line.substr(0, width));
      line.erase(0, width);
    }
  }
  if (!line.empty() || lines.empty()) lines.push_back(line);
  return lines;
}

std::string wrap_words(const std::string& text, std::size_t first_width, std::size_t width,
                       const std::string& indent) {
  // Each word keeps the spaces before it (a table's alignment survives),
  // except where the line breaks.
  std::string out;
  std::size_t room = first_width;
  std::size_t used = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t start = text.find_first_not_of(' ', pos);
    if (start == std::string::npos) break;
    const std::size_t end = std::min(text.find(' ', start), text.size());
    const std::string gap = used > 0 ? text.substr(pos, start - pos) : "";
    const std::string word = text.substr(start, end - start);
    pos = end;
    if (used > 0 && used + gap.size() + word.size() > room) {
      out += "\n" + indent;
      room = width > indent.size() ? width - indent.size() : 1;
      used = 0;
    } else {
      out += gap;
      used += gap.size();
    }
    out += word;
    used += word.size();
  }
  return out;
}

void print_wrapped(const std::string& text) {
  const std::string out = wrapped(text);
  std::fwrite(out.data(), 1, out.size(), stdout);
}

std::string wrapped(const std::string& text) {
  std::string out;
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t nl = text.find('\n', start);
    const std::size_t end = nl == std::string::npos ? text.size() : nl;
    const std::string line = text.substr(start, end - start);
    const std::size_t lead = line.find_first_not_of(' ');
    // A command to copy ("$ ...") stays whole.
    if (line.size() <= kTextWidth || line.compare(lead == std::string::npos ? 0 : lead, 2, "$ ") == 0) {
      out += line;
    } else {
      const std::string indent(lead == std::string::npos ? 0 : lead, ' ');
      out += indent;
      out += wrap_words(line.substr(indent.size()), kTextWidth - indent.size(), kTextWidth, indent + "  ");
    }
    if (nl != std::string::npos) out += '\n';
    start = end + 1;
  }
  return out;
}

ReplayResult Recorder::run(const std::string& config, ReplayOptions options) {
  options.observer = this;
  return replay(compile(source_), AllocatorConfig::parse(config), config, options);
}

const Frame* telling_frame(const Context& c) {
  auto first = [&](auto&& pred) -> const Frame* {
    for (const Frame& f : c.frames) {
      if (pred(f)) return &f;
    }
    return nullptr;
  };
  auto python = [](const Frame& f) { return f.filename.ends_with(".py"); };
  auto installed = [](const Frame& f) {
    return f.filename.find("/site-packages/") != std::string::npos ||
           f.filename.find("/dist-packages/") != std::string::npos;
  };
  // The interpreter's own modules (runpy, threading, ...): .../lib/python3.X/*.py
  // outside site-packages, or frozen ones.
  auto stdlib = [&](const Frame& f) {
    return f.filename.starts_with("<") ||
           (f.filename.find("/lib/python3") != std::string::npos && !installed(f));
  };
  auto torch_itself = [](const Frame& f) {
    return f.filename.find("/torch/") != std::string::npos;
  };
  // User code first: Python outside the installed packages and the standard
  // library; then an installed library's Python that is not torch itself
  // (a training framework: torchtitan, transformers, ...); then any Python
  // but the standard library's; then any frame with a line; then the innermost.
  if (const Frame* f = first([&](const Frame& f) { return python(f) && !installed(f) && !stdlib(f); })) {
    return f;
  }
  if (const Frame* f = first([&](const Frame& f) { return python(f) && !torch_itself(f) && !stdlib(f); })) {
    return f;
  }
  if (const Frame* f = first([&](const Frame& f) { return python(f) && !stdlib(f); })) return f;
  if (const Frame* f = first(python)) return f;
  // C++ frames alone (stacks="cpp", or Python frames not recorded): the
  // operator PyTorch was running (at::_ops::<op>::call), then a frame of the
  // program's own (not the unwinder's, the allocator's, PyTorch's, the C++
  // library's or the interpreter's), then any frame with a line; never the
  // unwinder or an unknown (??) one while there is another.
  auto op = [](const Frame& f) { return f.name.find("at::_ops::") != std::string::npos; };
  auto internal = [](const Frame& f) {
    static constexpr std::string_view kInternal[] = {"torch::", "c10::", "at::", "std::", "_Py", "Py",
                                                      "pybind11::", "__libc", "_start", "clone"};
    for (std::string_view prefix : kInternal) {
      if (std::string_view(f.name).starts_with(prefix)) return true;
    }
    return f.filename == "??" || f.name.empty() || f.name == "??";
  };
  if (const Frame* f = first(op)) return f;
  if (const Frame* f = first([&](const Frame& f) { return !internal(f); })) return f;
  if (const Frame* f = first([](const Frame& f) { return f.line > 0; })) return f;
  auto unwinder = [](const Frame& f) { return f.name.find("unwind") != std::string::npos; };
  if (const Frame* f = first([&](const Frame& f) { return !unwinder(f) && f.filename != "??"; })) return f;
  if (const Frame* f = first([&](const Frame& f) { return !unwinder(f); })) return f;
  return c.frames.empty() ? nullptr : &c.frames.front();
}

std::string context_label(const Trace& trace, std::uint32_t context) {
  if (context == 0 || context >= trace.final_state.contexts.size()) return "(no context)";
  const Context& c = trace.context(context);
  std::string out = fmt::format("{}", fmt::join(c.annotations, "/"));
  if (const Frame* telling = telling_frame(c)) {
    const Frame& f = *telling;
    if (!out.empty()) out += "  ";
    // An operator's frame reads as the operator; an unknown file ("??") is left out.
    const std::size_t op = f.name.find("at::_ops::");
    if (op != std::string::npos) {
      const std::size_t start = op + std::string_view("at::_ops::").size();
      out += fmt::format("aten::{} (C++)", f.name.substr(start, f.name.find("::", start) - start));
    } else if (f.filename.empty() || f.filename == "??") {
      out += f.name;
    } else {
      out += f.line > 0 ? fmt::format("{}:{} {}", base_name(f.filename), f.line, f.name)
                        : fmt::format("{} {}", base_name(f.filename), f.name);
    }
  }
  return out.empty() ? "(no context)" : out;
}

void Recorder::on_start(CachingAllocator& allocator, const ReplayProgram& program) {
  program_ = &program;
  alloc_contexts_.clear();
  allocator.record_history({.max_entries = std::numeric_limits<std::uint32_t>::max()});
}

void Recorder::on_op(std::uint64_t, const ReplayOp& op, const void* ptr) {
  if (op.kind == ReplayOp::Kind::alloc && ptr != nullptr) {
    alloc_contexts_.push_back(op.id < program_->contexts.size() ? program_->contexts[op.id] : 0);
  }
}

void Recorder::on_finish(CachingAllocator& allocator) {
  snapshot_ = allocator.snapshot();
  summary_ = allocator.memory_summary(abbreviated_);
}

Trace Recorder::trace(const std::string& name, const std::string& config) const {
  Trace out = to_trace(snapshot_, name, config);
  out.final_state.contexts = source_.final_state.contexts;
  std::unordered_map<DevicePtr, std::uint32_t> live;
  std::size_t next = 0;
  for (TraceEvent& e : out.events) {
    e.context = 0;
    if (e.action == TraceAction::alloc) {
      e.context = next < alloc_contexts_.size() ? alloc_contexts_[next] : 0;
      ++next;
      live[e.addr] = e.context;
    } else if (e.action == TraceAction::free_requested || e.action == TraceAction::free_completed) {
      auto it = live.find(e.addr);
      if (it != live.end()) {
        e.context = it->second;
        if (e.action == TraceAction::free_completed) live.erase(it);
      }
    }
  }
  for (SegmentInfo& s : out.final_state.segments) {
    for (BlockInfo& b : s.blocks) {
      auto it = live.find(b.address);
      b.context = b.state != BlockState::inactive && it != live.end() ? it->second : 0;
    }
  }
  return out;
}

std::vector<Trace> load_devices(const std::string& path, std::optional<int> device,
                                const ReadOptions& options) {
  std::vector<Trace> all = read_trace_devices(path, options);
  std::vector<int> left_out;
  if (device) {
    for (const Trace& t : all) {
      if (t.device != *device && !t.events.empty()) left_out.push_back(t.device);
    }
  }
  std::vector<Trace> used = select_devices(std::move(all), device);
  if (!left_out.empty()) {
    fmt::print(stderr, "note: {}: --device {} leaves out the events of device{} {}\n", path,
               *device, left_out.size() > 1 ? "s" : "", fmt::join(left_out, ", "));
  }
  for (Trace& t : used) {
    if (t.device_count > 1) t.name = fmt::format("{} (device {})", path, t.device);
    for (const auto& [action, n] : t.skipped_actions) {
      fmt::print(stderr, "note: {}: {} event{} of action '{}', which reservoir does not know, "
                 "left out\n", t.name, n, n == 1 ? "" : "s", action);
    }
    if (!t.unknown_keys.empty()) {
      std::vector<std::string> keys;
      for (const auto& [key, n] : t.unknown_keys) keys.push_back(fmt::format("{} ({}x)", key, n));
      fmt::print(stderr, "note: {}: keys reservoir does not know, read past: {}\n", t.name,
                 fmt::join(keys, ", "));
    }
  }
  return used;
}

void add_device_option(CLI::App& cmd, std::optional<int>& device) {
  cmd.add_option("--device", device,
                 "only this device of a snapshot (default: every device with events, each "
                 "labelled)")
      ->check(whole_number(0, 1023, "(a device index)"));
}

Trace state_of(const std::string& path, std::optional<int> device) {
  std::vector<Trace> devices = load_devices(path, device);
  if (devices.size() > 1) {
    fmt::print(stderr, "note: {}: {} devices hold events; device {} is used (--device picks)\n",
               path, devices.size(), devices.front().device);
  }
  Trace trace = std::move(devices.front());
  if (!trace.final_state.segments.empty() || trace.events.empty()) return trace;
  Recorder recorder(trace);
  (void)recorder.run(trace.recorded_config);
  Trace replayed = recorder.trace(trace.name, trace.recorded_config);
  replayed.format = trace.format + " (replayed)";
  return replayed;
}

}  // namespace reservoir::tools
