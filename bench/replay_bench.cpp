// Replay throughput: recorded events per second on a simulated device; and
// the whole of `advise` (diagnosis and the sweep of every default setting to
// its minimum capacity) on one core and on every core.
// Run: build/bin/replay_bench (uses ../shared/traces when present too)
#include <benchmark/benchmark.h>

#include <filesystem>

#include "reservoir/advise.hpp"
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

// The whole of advise, as the command runs it: reading the file included.
void advise_file(benchmark::State& state, const std::string& path, unsigned threads) {
  reservoir::AdviseOptions options;
  options.threads = threads;
  std::uint64_t replays = 0;
  for (auto _ : state) {
    const reservoir::Trace trace = reservoir::read_trace_file(path);
    const reservoir::Advice advice = reservoir::advise(trace, options);
    replays = advice.replays;
    benchmark::DoNotOptimize(advice.best_reservoir);
  }
  state.counters["settings"] = static_cast<double>(reservoir::default_sweep().size());
  state.counters["replays"] = static_cast<double>(replays);
}

int register_all() {
  const std::filesystem::path root(RESERVOIR_SOURCE_DIR);
  for (const auto& dir : {root / "examples" / "traces", root / ".." / "shared" / "traces",
                          root / ".." / "shared" / "traces" / "oom"}) {
    if (!std::filesystem::exists(dir)) continue;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const auto ext = entry.path().extension();
      if (ext != ".pickle" && ext != ".trace") continue;
      const std::string path = entry.path().string();
      benchmark::RegisterBenchmark(("replay/" + entry.path().filename().string()).c_str(),
                                   [path](benchmark::State& s) { replay_file(s, path); })
          ->Unit(benchmark::kMillisecond);
      for (const unsigned threads : {1u, 0u}) {
        const std::string name = "advise/" + entry.path().filename().string() +
                                 (threads == 1 ? "/one_core" : "/every_core");
        benchmark::RegisterBenchmark(name.c_str(), [path, threads](benchmark::State& s) {
          advise_file(s, path, threads);
        })
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
