// Helpers shared by the subcommands.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <CLI/CLI.hpp>

#include "reservoir/trace.hpp"

namespace reservoir::tools {

// The exit statuses of every subcommand (docs/tools.md, `reservoir --help`).
enum ExitStatus : int {
  kExitOk = 0,
  kExitDiverges = 1,       // verify: a recording diverges from its replay
  kExitBadInput = 2,       // a bad argument, file, trace or setting
  kExitCannotVerify = 3,   // verify, advise: a recording that cannot be checked or read
  kExitOutOfMemory = 4,    // replay: a replay ran out of memory
};

// Adds an option whose value is a size with a unit (80GiB, 512MiB, 4096B).
// A bare number is refused at parsing (exit 2), saying what to write: sizes
// of GPUs are read wrongly far too easily without one.
CLI::Option* add_size_option(CLI::App& cmd, const std::string& name, std::string& value,
                             const std::string& help);

// Validators that say what was wrong in a person's words, checked on the
// text before CLI11 converts it (so "-1" never wraps into an unsigned):
// a whole number from lo to hi, `what` naming the unit ("programs");
CLI::Validator whole_number(std::int64_t lo, std::int64_t hi, const std::string& what);
// a fraction in [0, 1], or in (0, 1] when zero is not allowed;
CLI::Validator fraction(bool zero_allowed);
// a path to write to (not empty).
CLI::Validator output_path();

// Sets a subcommand's `--help` footer: lines of examples, each a command
// line and what it does.
void set_examples(CLI::App& cmd, const std::vector<std::pair<std::string, std::string>>& examples);

// The frame that best says where an allocation came from: user Python code
// before framework Python, before native frames with a line, before the
// innermost frame. Null when the context has no frames.
const Frame* telling_frame(const Context& context);

// A context in one line: annotations joined by '/', then the innermost
// stack frame (file:line function), or "(no context)".
std::string context_label(const Trace& trace, std::uint32_t context);

// The file name of a path, for tables.
std::string base_name(const std::string& path);

// Writes `content` to `path`; UsageError naming the command when it cannot.
void write_file(const std::string& path, const std::string& content, const std::string& command);

// A config string for people: "native defaults" for the empty one.
std::string config_label(const std::string& config);

// The configs replay and report run when none is named: PyTorch's defaults,
// and policy:native_paged (never more reserved than them at any call, less
// where memory runs short: the policy to leave on, docs/config.md).
inline const std::vector<std::string>& default_configs() {
  static const std::vector<std::string> kConfigs{"", "policy:native_paged"};
  return kConfigs;
}

// The width text output keeps to: lines of at most 100 columns.
inline constexpr std::size_t kTextWidth = 100;

// A setting split at its commas into pieces of at most `width` characters
// (a single longer option is cut), for a table column that wraps instead of
// truncating: "a:1,b:2" in width 4 gives {"a:1,", "b:2"}.
std::vector<std::string> wrap_setting(const std::string& setting, std::size_t width);

// Words wrapped to `width` columns; lines after the first start with
// `indent` (the first carries whatever the caller printed before it).
std::string wrap_words(const std::string& text, std::size_t first_width, std::size_t width,
                       const std::string& indent);

// Text with each line longer than kTextWidth wrapped at its spaces;
// continuation lines are indented two more than the line they continue. A
// command to copy (a line whose text starts with "$ ") is never wrapped.
std::string wrapped(const std::string& text);
void print_wrapped(const std::string& text);

// Replays with history on and gives the result as a trace whose events and
// live blocks carry the contexts of the source trace's requests (the k-th
// alloc the allocator records is the k-th request that succeeded).
class Recorder : public ReplayObserver {
 public:
  explicit Recorder(const Trace& source, bool summary_abbreviated = false)
      : source_(source), abbreviated_(summary_abbreviated) {}
  void on_start(CachingAllocator& allocator, const ReplayProgram& program) override;
  void on_op(std::uint64_t index, const ReplayOp& op, const void* ptr) override;
  void on_finish(CachingAllocator& allocator) override;

  // Replays the source trace under `config`, watching it (options.observer
  // is replaced by this recorder).
  ReplayResult run(const std::string& config, ReplayOptions options = {});

  // The replayed trace: events, final segments, the source's contexts.
  Trace trace(const std::string& name, const std::string& config) const;
  const std::string& summary() const { return summary_; }

 private:
  const Trace& source_;
  const bool abbreviated_;
  const ReplayProgram* program_ = nullptr;
  std::vector<std::uint32_t> alloc_contexts_;  // per successful alloc, in order
  Snapshot snapshot_;
  std::string summary_;
};

// The devices of a trace file a tool works on: `device` when given, else
// every device with events or segments. A file of several devices names
// each one's trace "PATH (device N)". Prints a note on standard error for
// what the tool leaves out: other devices' events under --device, keys and
// actions the reader does not model.
std::vector<Trace> load_devices(const std::string& path, std::optional<int> device,
                                const ReadOptions& options = {});

// Adds --device N to a subcommand.
void add_device_option(CLI::App& cmd, std::optional<int>& device);

// A trace's final state: the recorded segments when it has them, else
// those of a replay with its recorded settings (text and RMM traces).
Trace state_of(const std::string& path, std::optional<int> device = std::nullopt);

}  // namespace reservoir::tools
