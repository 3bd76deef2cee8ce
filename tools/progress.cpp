#include "progress.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace reservoir::tools {

Progress::Progress() {
  const char* env = std::getenv("RESERVOIR_PROGRESS");
  enabled_ = isatty(STDERR_FILENO) == 1 && !(env != nullptr && std::strcmp(env, "0") == 0);
}

void Progress::task(std::string label) {
  label_ = std::move(label);
  replays_ = 0;
  done_ = total_ = 0;
  draw(true);
}

void Progress::clear() {
  if (!drawn_) return;
  std::fputs("\r\x1b[K", stderr);
  std::fflush(stderr);
  drawn_ = false;
}

void Progress::on_start(CachingAllocator&, const ReplayProgram& program) {
  ++replays_;
  done_ = 0;
  total_ = program.initial.size() + program.ops.size();
  draw(false);
}

void Progress::on_op(std::uint64_t index, const ReplayOp&, const void*) {
  done_ = index + 1;
  if ((done_ & 4095) == 0) draw(false);
}

void Progress::draw(bool force) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  std::string line = label_;
  if (total_ > 0) {
    line += fmt::format("  {:3.0f}% of {} ops", 100.0 * static_cast<double>(done_) / static_cast<double>(total_),
                        total_);
  }
  if (replays_ > 1) line += fmt::format(" (replay {})", replays_);
  fmt::print(stderr, "\r\x1b[K{}", line);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace reservoir::tools
