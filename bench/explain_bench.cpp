// The answer at an out-of-memory error (reservoir/explain.hpp), as the
// program pays for it: reading the snapshot taken at the error and the
// analysis (diagnosis, the live sweep), on one core, for recordings of
// 10,000 and 100,000 events of PyTorch 2.15 that end in an out-of-memory error, on one core and on
// two; and the same answer under reservoir as PyTorch's allocator (from its
// own state: no pickle read). The targets: within 100 ms at 10,000 events and
// 300 ms at 100,000. No device memory is used: the replays run on a
// simulated device.
// Run: build/bin/explain_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/explain.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// A training-like program on a 16 GiB device: weights, then steps whose
// activations are allocated in order and freed in reverse, with sizes that
// drift from step to step, until about `events` are recorded; then a request
// larger than any free piece, which fails. PyTorch's history as the
// allocator records it, written as PyTorch's pickle.
// The program run on `allocator` (on a 16 GiB simulated device) until about
// `events` are recorded, then its failed request.
void run_program(reservoir::CachingAllocator& allocator, std::size_t events);

// A reservoir allocator (PyTorch 2.15's rules) that ran the program: its own
// history and state at the error, as the allocator's explainer reads them.
struct OwnAllocator {
  explicit OwnAllocator(std::size_t events)
      : device(options()), allocator(device, reservoir::AllocatorConfig::parse("pytorch_version:2.15")) {
    run_program(allocator, events);
  }
  static reservoir::SimDeviceOptions options() {
    reservoir::SimDeviceOptions o;
    o.capacity = 16ull << 30;
    return o;
  }
  reservoir::SimDevice device;
  reservoir::CachingAllocator allocator;
};

std::string recording(std::size_t events) {
  reservoir::SimDeviceOptions o;
  o.capacity = 16ull << 30;
  reservoir::SimDevice device(o);
  reservoir::CachingAllocator allocator(device, reservoir::AllocatorConfig{});
  run_program(allocator, events);
  const reservoir::Trace t = reservoir::to_trace(allocator.snapshot(), "bench", "");
  return reservoir::write_pytorch_snapshot(t);
}

void run_program(reservoir::CachingAllocator& allocator, std::size_t events) {
  reservoir::HistoryOptions h;
  h.max_entries = events + 1000;
  allocator.record_history(h);
  std::mt19937_64 rng(7);
  std::vector<void*> weights;
  for (int i = 0; i < 64; ++i) weights.push_back(allocator.allocate((1 + rng() % 64) * kMiB, 0));
  std::size_t recorded = 0;
  std::vector<void*> kept;
  while (recorded < events) {
    std::vector<void*> acts;
    for (int i = 0; i < 200; ++i) {
      const std::size_t kind = rng() % 10;
      const std::size_t size = kind < 6 ? 512 + rng() % kMiB : kind < 9 ? kMiB + rng() % (24 * kMiB)
                                                                       : 24 * kMiB + rng() % (96 * kMiB);
      acts.push_back(allocator.allocate(size, 0));
    }
    // A few survive the step (cached tensors, logs): they pin segments.
    kept.push_back(acts[rng() % acts.size()]);
    for (auto it = acts.rbegin(); it != acts.rend(); ++it) {
      if (*it != kept.back()) allocator.deallocate(*it);
    }
    recorded += 3 * acts.size();
  }
  try {
    (void)allocator.allocate(allocator.stats().reserved_bytes[0].current + (8ull << 30), 0);
  } catch (const reservoir::OutOfMemoryError&) {
  }
}

const std::string& recording_of(std::size_t events) {
  static std::map<std::size_t, std::string> made;
  auto it = made.find(events);
  if (it == made.end()) it = made.emplace(events, recording(events)).first;
  return it->second;
}

void explain_at_error(benchmark::State& state) {
  const std::string& bytes = recording_of(static_cast<std::size_t>(state.range(0)));
  const std::span<const std::uint8_t> span(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  reservoir::ExplainOptions options;  // no files
  options.threads = static_cast<unsigned>(state.range(1));
  std::size_t events = 0;
  std::size_t lines = 0;
  std::uint64_t replays = 0;
  std::uint64_t settings = 0;
  for (auto _ : state) {
    reservoir::Trace trace = reservoir::read_pytorch_snapshot(span, "bench");
    // As PyTorch 2.15 records it: its settings' keys are swept too.
    trace.pytorch_since = "2.15";
    const reservoir::OomExplanation e = reservoir::explain_oom(trace, span, options);
    events = trace.events.size();
    lines = e.lines.size();
    if (!e.advice) {
      state.SkipWithError(e.lines.front().c_str());
      break;
    }
    replays = e.advice->replays;
    settings = e.advice->candidates.size();
  }
  state.counters["events"] = static_cast<double>(events);
  state.counters["lines"] = static_cast<double>(lines);
  state.counters["settings"] = static_cast<double>(settings);
  state.counters["replays"] = static_cast<double>(replays);
  state.counters["snapshot_MiB"] = static_cast<double>(bytes.size()) / static_cast<double>(kMiB);
}

// The same under reservoir as PyTorch's allocator: the answer from the
// allocator's own state and history (no pickle to read), as its explainer
// makes it at the error.
void explain_own_allocator(benchmark::State& state) {
  static std::map<std::size_t, std::unique_ptr<OwnAllocator>> made;
  const auto events = static_cast<std::size_t>(state.range(0));
  auto& own = made[events];
  if (!own) own = std::make_unique<OwnAllocator>(events);
  reservoir::ExplainOptions options;  // no files
  options.threads = static_cast<unsigned>(state.range(1));
  options.on_reservoir = true;
  std::size_t recorded = 0;
  for (auto _ : state) {
    const reservoir::Trace trace =
        reservoir::to_trace(own->allocator.snapshot(), "this process", own->allocator.config().to_string());
    const reservoir::OomExplanation e = reservoir::explain_oom(trace, {}, options);
    recorded = trace.events.size();
    if (!e.advice) {
      state.SkipWithError(e.lines.front().c_str());
      break;
    }
  }
  state.counters["events"] = static_cast<double>(recorded);
}

// Its parts: reading the snapshot, and the diagnosis (the verified replay to
// the moment) without the sweep.
void read_and_diagnose(benchmark::State& state) {
  const std::string& bytes = recording_of(static_cast<std::size_t>(state.range(0)));
  const std::span<const std::uint8_t> span(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  for (auto _ : state) {
    const reservoir::Trace trace = reservoir::read_pytorch_snapshot(span, "bench");
    if (state.range(1) != 0) benchmark::DoNotOptimize(reservoir::diagnose(trace).reserved_bytes);
    benchmark::DoNotOptimize(trace.events.size());
  }
}

// Beside it: the whole of advise (every default setting, exact) on one core.
void advise_whole_sweep(benchmark::State& state) {
  const std::string& bytes = recording_of(static_cast<std::size_t>(state.range(0)));
  const std::span<const std::uint8_t> span(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  reservoir::AdviseOptions options;
  options.threads = 1;
  std::uint64_t replays = 0;
  for (auto _ : state) {
    reservoir::Trace trace = reservoir::read_pytorch_snapshot(span, "bench");
    trace.pytorch_since = "2.15";
    replays = reservoir::advise(trace, options).replays;
  }
  state.counters["replays"] = static_cast<double>(replays);
}

BENCHMARK(advise_whole_sweep)->Arg(100'000)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);
BENCHMARK(read_and_diagnose)->Args({100'000, 0})->Args({100'000, 1})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(explain_own_allocator)->Args({10'000, 1})->Args({100'000, 1})->Args({10'000, 2})->Args({100'000, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(explain_at_error)->Args({10'000, 1})->Args({100'000, 1})->Args({10'000, 2})->Args({100'000, 2})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
