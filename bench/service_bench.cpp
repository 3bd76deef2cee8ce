// An inference service that meets out-of-memory errors for hours: a
// diffusion-like model on a 12 GiB device (4 GiB of weights), 10,000
// requests drawn from a mix of batch sizes and resolutions (activations grow
// with batch x resolution^2, attention with its square; the largest never
// fit), each failed request caught and the next one served, as a web
// service does. Under PyTorch's default (the native policy with PyTorch's
// retry ladder), expandable segments, reservoir's native and
// policy:native_paged, on a simulated device (no memory used):
//   served, failed            requests
//   fragmentation             failures of requests that fit the device alone
//                             (the weights and their own activations: a
//                             fresh process serves them), i.e. failures a
//                             smaller device would not explain
//   peak_reserved_GiB         the most memory reserved
//   device_ms                 device-call time under the H100 latency model
// and, with the live answer on (history of the latest 20,000 events, the
// analysis at each error), over the first 1,000 requests:
//   explain_ms_per_error      the answer's cost at each error
//   verdict_agrees            errors whose answer's first line names the
//                             failure's class (fragmentation, or too little
//                             memory) as the ground truth above does
// Run: build/bin/service_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/explain.hpp"
#include "reservoir/sim_device.hpp"

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;
constexpr std::size_t kDevice = 12 * kGiB;
constexpr std::size_t kWeights = 4 * kGiB;

struct Request {
  std::size_t batch;
  std::size_t resolution;
};

// The mix: most requests small, a few large, some too large to ever fit.
std::vector<Request> requests(std::size_t n) {
  std::mt19937_64 rng(2026);
  const std::vector<std::pair<std::size_t, int>> resolutions = {
      {512, 40}, {640, 15}, {768, 20}, {1024, 17}, {1536, 6}, {2048, 2}};
  const std::vector<std::pair<std::size_t, int>> batches = {{1, 50}, {2, 25}, {4, 20}, {8, 5}};
  auto draw = [&rng](const std::vector<std::pair<std::size_t, int>>& table) {
    int total = 0;
    for (const auto& [v, w] : table) total += w;
    int x = static_cast<int>(rng() % static_cast<std::uint64_t>(total));
    for (const auto& [v, w] : table) {
      if ((x -= w) < 0) return v;
    }
    return table.back().first;
  };
  std::vector<Request> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) out.push_back({draw(batches), draw(resolutions)});
  return out;
}

// One request's forward pass: a down path whose stages keep a skip
// connection, attention at the three highest resolutions, an up path that
// consumes the skips. Sizes in bytes of fp16 tensors. Throws
// OutOfMemoryError as the allocator does; frees what it holds either way.
void serve(reservoir::CachingAllocator& a, const Request& r) {
  std::vector<void*> skips;
  std::vector<void*> held;
  auto take = [&a](std::size_t bytes) { return a.allocate(bytes, 0); };
  auto release = [&a](std::vector<void*>& v) {
    for (auto it = v.rbegin(); it != v.rend(); ++it) a.deallocate(*it);
    v.clear();
  };
  try {
    const std::size_t latent = r.resolution / 8;  // the latent's side
    const std::size_t channels[] = {320, 640, 1280, 1280};
    std::size_t side = latent;
    for (std::size_t stage = 0; stage < 4; ++stage, side /= 2) {
      const std::size_t act = r.batch * channels[stage] * side * side * 2;
      held.push_back(take(act));
      held.push_back(take(act));
      if (stage <= 2) {
        // Self-attention's scores: (side^2)^2 per head, 8 heads.
        held.push_back(take(r.batch * 8 * side * side * side * side * 2));
      }
      skips.push_back(take(act));
      release(held);
    }
    for (std::size_t stage = 4; stage-- > 0;) {
      side *= 2;
      const std::size_t act = r.batch * channels[stage] * side * side * 2;
      held.push_back(take(2 * act));  // the skip concatenated
      held.push_back(take(act));
      a.deallocate(skips.back());
      skips.pop_back();
      release(held);
    }
    held.push_back(take(r.batch * 3 * r.resolution * r.resolution * 2));  // the decoded image
    release(held);
  } catch (...) {
    release(held);
    release(skips);
    throw;
  }
}

std::unique_ptr<reservoir::SimDevice> device() {
  reservoir::SimDeviceOptions o;
  o.capacity = kDevice;
  return std::make_unique<reservoir::SimDevice>(o);
}

// Ground truth: does the request fit the device alone (the weights and its
// own activations, in a fresh process under the same settings)?
bool fits_alone(const std::string& settings, const Request& r) {
  static std::map<std::tuple<std::string, std::size_t, std::size_t>, bool> known;
  const auto key = std::make_tuple(settings, r.batch, r.resolution);
  if (auto it = known.find(key); it != known.end()) return it->second;
  auto d = device();
  reservoir::CachingAllocator a(*d, reservoir::AllocatorConfig::parse(settings));
  void* w = a.allocate(kWeights, 0);
  bool ok = true;
  try {
    serve(a, r);
  } catch (const reservoir::OutOfMemoryError&) {
    ok = false;
  }
  a.deallocate(w);
  return known[key] = ok;
}

struct Outcome {
  std::size_t served = 0;
  std::size_t failed = 0;
  std::size_t fragmentation = 0;
  std::size_t peak_reserved = 0;
  double device_ns = 0;
  double explain_ns = 0;
  std::size_t verdict_agrees = 0;
};

Outcome run_service(const std::string& settings, std::size_t n, bool explained) {
  static const std::vector<Request> all = requests(10'000);
  auto d = device();
  reservoir::CachingAllocator a(*d, reservoir::AllocatorConfig::parse(settings));
  if (explained) {
    reservoir::explain_oom_errors(a, reservoir::ExplainOptions{}, 20'000);
  }
  void* w = a.allocate(kWeights, 0);
  Outcome out;
  for (std::size_t i = 0; i < n; ++i) {
    const auto start = std::chrono::steady_clock::now();
    try {
      serve(a, all[i]);
      ++out.served;
    } catch (const reservoir::OutOfMemoryError& e) {
      ++out.failed;
      const bool frag = fits_alone(settings, all[i]);
      out.fragmentation += frag ? 1 : 0;
      if (explained) {
        out.explain_ns += std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
        const std::string what = e.what();
        const std::size_t at = what.find("\nreservoir: out of memory on a ");
        if (at != std::string::npos) {
          const std::string first = what.substr(at + 1, what.find('\n', at + 1) - at - 1);
          const bool says_frag = first.find(": fragmentation") != std::string::npos;
          const bool says_little = first.find(": too little memory") != std::string::npos;
          out.verdict_agrees += (frag && says_frag) || (!frag && says_little) ? 1 : 0;
        }
      }
    }
    out.peak_reserved = std::max<std::size_t>(
        out.peak_reserved, static_cast<std::size_t>(a.stats().reserved_bytes[0].current));
  }
  a.deallocate(w);
  out.device_ns = d->estimated_ns();
  return out;
}

void report(benchmark::State& state, const Outcome& o, std::size_t n) {
  state.counters["served"] = static_cast<double>(o.served);
  state.counters["failed"] = static_cast<double>(o.failed);
  state.counters["fragmentation"] = static_cast<double>(o.fragmentation);
  state.counters["peak_reserved_GiB"] = static_cast<double>(o.peak_reserved) / static_cast<double>(kGiB);
  state.counters["device_ms"] = o.device_ns / 1e6;
  state.counters["us_per_request"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate |
                                                     benchmark::Counter::kInvert);
  if (o.explain_ns > 0) {
    state.counters["explain_ms_per_error"] = o.explain_ns / 1e6 / static_cast<double>(o.failed);
    state.counters["verdict_agrees"] = static_cast<double>(o.verdict_agrees);
  }
}

const char* const kSettings[] = {"retry_searches_pool:False", "expandable_segments:True", "",
                                 "policy:native_paged"};

void service(benchmark::State& state) {
  const std::string settings = kSettings[state.range(0)];
  Outcome o;
  for (auto _ : state) o = run_service(settings, 10'000, false);
  report(state, o, 10'000);
}

void service_explained(benchmark::State& state) {
  const std::string settings = kSettings[state.range(0)];
  Outcome o;
  for (auto _ : state) o = run_service(settings, 1'000, true);
  report(state, o, 1'000);
}

// 0: PyTorch's default, 1: expandable segments, 2: reservoir's native,
// 3: policy:native_paged.
BENCHMARK(service)->DenseRange(0, 3)->Unit(benchmark::kMillisecond)->Iterations(1);
BENCHMARK(service_explained)->DenseRange(0, 3)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
