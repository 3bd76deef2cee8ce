// Replay throughput: recorded events per second on a simulated device; and
// the whole of `advise` (diagnosis and the sweep of every default setting to
// its minimum capacity) on one core and on every core.
// And a job of many ranks (advise_job): 64 rank files against one, side by
// side; the target is 64 / cores x one file's time x 1.2 (the counter
// "over_target" is the measured time divided by it).
// Run: build/bin/replay_bench (uses ../shared/traces when present too);
//      build/bin/replay_bench --benchmark_filter=advise_job
#include <thread>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

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

// 64 copies of one recording as rank files, made once.
const std::vector<std::string>& rank_files() {
  static const std::vector<std::string> files = [] {
    const std::filesystem::path source =
        std::filesystem::path(RESERVOIR_SOURCE_DIR) / "examples" / "traces" / "gpt_training.pickle";
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / "reservoir_bench_ranks";
    std::filesystem::create_directories(dir);
    std::vector<std::string> out;
    for (int r = 0; r < 64; ++r) {
      const auto path = dir / ("rank" + std::to_string(r) + ".pickle");
      std::filesystem::copy_file(source, path, std::filesystem::copy_options::overwrite_existing);
      out.push_back(path.string());
    }
    return out;
  }();
  return files;
}

double one_rank_seconds = 0.0;

void advise_one_rank(benchmark::State& state) {
  const std::vector<std::string> one{rank_files().front()};
  reservoir::JobOptions options;
  options.threads = 1;
  double total = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(reservoir::advise_job(one, options).candidates.size());
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  one_rank_seconds = total / static_cast<double>(state.iterations());
}

void advise_64_ranks(benchmark::State& state) {
  reservoir::JobOptions options;  // every core
  double total = 0.0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(reservoir::advise_job(rank_files(), options).candidates.size());
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  const double seconds = total / static_cast<double>(state.iterations());
  state.counters["cores"] = cores;
  if (one_rank_seconds > 0.0) {
    state.counters["over_target"] = seconds / (64.0 / cores * one_rank_seconds * 1.2);
  }
}

int register_all() {
  benchmark::RegisterBenchmark("advise_job/one_rank", advise_one_rank)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("advise_job/64_ranks", advise_64_ranks)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
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
