// Replay throughput: recorded events per second on a simulated device.
// Run: build/bin/replay_bench (uses ../shared/traces when present too)
#include <benchmark/benchmark.h>

#include <filesystem>

#include "reservoir/trace.hpp"

namespace {

void replay_file(benchmark::State& state, const std::string& path) {
  const reservoir::ReplayProgram program = reservoir::compile(reservoir::read_trace_file(path));
  const reservoir::AllocatorConfig config;
  for (auto _ : state) {
    auto r = reservoir::replay(program, config, "");
    benchmark::DoNotOptimize(r.peak_reserved_bytes);
  }
  state.counters["events_per_second"] = benchmark::Counter(
      static_cast<double>(program.recorded_events), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ops_per_second"] =
      benchmark::Counter(static_cast<double>(program.initial.size() + program.ops.size()),
                         benchmark::Counter::kIsIterationInvariantRate);
}

int register_all() {
  const std::filesystem::path root(RESERVOIR_SOURCE_DIR);
  for (const auto& dir : {root / "examples" / "traces", root / ".." / "shared" / "traces"}) {
    if (!std::filesystem::exists(dir)) continue;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const auto ext = entry.path().extension();
      if (ext != ".pickle" && ext != ".trace") continue;
      const std::string path = entry.path().string();
      benchmark::RegisterBenchmark(("replay/" + entry.path().filename().string()).c_str(),
                                   [path](benchmark::State& s) { replay_file(s, path); })
          ->Unit(benchmark::kMillisecond);
    }
  }
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
