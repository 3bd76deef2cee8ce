// Progress of long replays on a terminal: one line on stderr, redrawn at
// most ten times a second, erased when done. Silent when stderr is not a
// terminal (pipes, files, CI logs) or when RESERVOIR_PROGRESS=0.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "reservoir/trace.hpp"

namespace reservoir::tools {

class Progress : public ReplayObserver {
 public:
  Progress();
  ~Progress() override { clear(); }
  bool enabled() const noexcept { return enabled_; }
  // What is running now, e.g. "[2/6] trace.pickle, expandable_segments:True".
  void task(std::string label);
  void clear();

  void on_start(CachingAllocator& allocator, const ReplayProgram& program) override;
  void on_op(std::uint64_t index, const ReplayOp& op, const void* ptr) override;

 private:
  void draw(bool force);
  bool enabled_ = false;
  bool drawn_ = false;
  std::string label_;
  std::uint64_t replays_ = 0;  // replays started for this task
  std::uint64_t done_ = 0;
  std::uint64_t total_ = 0;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace reservoir::tools
