// Pause and resume benchmarks for any device, beside a plain copy of the same
// bytes into (and out of) pinned host memory through the same device, so the
// ratio of the two is measured in one run. saver_bench registers them on
// HostDevice, gpu_bench on a GPU.
//
// Arguments: {MiB in the tag, policy (0 native, 1 expandable, 2 paging)}.
// Times are manual: only the pause (or the resume, or the copy) is timed.
// Pause without backup writes the memory first (untimed), so the pause
// releases pages that exist.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "reservoir/device.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "reservoir/saver.hpp"

namespace reservoir::bench {

struct SaverBenchEnv {
  std::function<Device&()> device;
  std::function<PinnedMemorySource&()> pinned;
};

inline const char* policy_config(std::int64_t p) {
  return p == 0 ? "" : p == 1 ? "expandable_segments:True" : "policy:paging";
}

// A saver holding one allocation of `bytes` under tag "t", its contents set.
struct Tagged {
  Tagged(const SaverBenchEnv& env, std::size_t bytes, std::int64_t policy, bool backup)
      : device(env.device()), bytes(bytes) {
    SaverOptions o;
    o.config = AllocatorConfig::parse(policy_config(policy));
    o.pinned_source = &env.pinned();
    saver = std::make_unique<Saver>(device, o);
    {
      auto r = saver->region("t", {.cpu_backup = backup});
      ptr = saver->allocate(bytes);
    }
    for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<unsigned char>(i * 13);
    touch();
    saver->pause("t");  // a first cycle fills the pinned cache, as in steady use
    saver->resume("t");
    touch();
  }
  // Writes every byte of the allocation (on HostDevice this is also what
  // gives fresh physical memory its pages).
  void touch() {
    for (std::size_t at = 0; at < bytes; at += pattern.size()) {
      const std::size_t n = std::min(pattern.size(), bytes - at);
      if (device.copy_to_device(reinterpret_cast<DevicePtr>(ptr) + at, pattern.data(), n, 0) !=
          Status::ok) {
        throw Error("benchmark: writing the tag's contents failed");
      }
    }
    (void)device.synchronize_device();
  }
  ~Tagged() { saver->deallocate(ptr); }
  Device& device;
  std::size_t bytes;
  std::unique_ptr<Saver> saver;
  void* ptr = nullptr;
  std::vector<unsigned char> pattern = std::vector<unsigned char>(std::size_t{1} << 20);
};

inline double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Every iteration's time, for the median of one run: a run of a large tag
// takes seconds to set up, so a GPU run times several cycles of one setup
// rather than repeating the setup (Google Benchmark's repetitions).
struct Timings {
  std::vector<double> s;
  void add(benchmark::State& state, double t) {
    state.SetIterationTime(t);
    s.push_back(t);
  }
  void report(benchmark::State& state, std::size_t bytes) {
    if (s.empty()) return;
    std::sort(s.begin(), s.end());
    const double median =
        s.size() % 2 == 1 ? s[s.size() / 2] : (s[s.size() / 2 - 1] + s[s.size() / 2]) / 2;
    state.counters["median_ms"] = median * 1e3;
    state.counters["median_GiB_per_s"] = static_cast<double>(bytes) / median / (1 << 30);
  }
};

// The plain pinned copy: one copy of the tag's bytes into a pinned buffer
// (kToHost) or back, on stream 0, waited for.
template <bool kToHost>
void pinned_copy(benchmark::State& state, const SaverBenchEnv& env) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 20;
  Tagged t(env, bytes, state.range(1), false);
  HostCachingAllocator cache(env.pinned(), t.device);
  void* host = cache.allocate(bytes);
  std::memset(host, 1, bytes);
  const auto dev = reinterpret_cast<DevicePtr>(t.ptr);
  Timings times;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = kToHost ? t.device.copy_to_host(host, dev, bytes, 0)
                             : t.device.copy_to_device(dev, host, bytes, 0);
    if (s != Status::ok || t.device.synchronize_stream(0) != Status::ok) {
      state.SkipWithError("copy failed");
      break;
    }
    times.add(state, seconds(t0));
  }
  times.report(state, bytes);
  cache.deallocate(host);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// Pause (kPause) or resume of the tag, with or without backup.
template <bool kPause, bool kBackup>
void pause_resume(benchmark::State& state, const SaverBenchEnv& env) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 20;
  Tagged t(env, bytes, state.range(1), kBackup);
  Timings times;
  for (auto _ : state) {
    if (!kPause) t.saver->pause("t");
    if (kPause && !kBackup) t.touch();  // resumed memory is fresh: give it its pages
    const auto t0 = std::chrono::steady_clock::now();
    kPause ? t.saver->pause("t") : t.saver->resume("t");
    times.add(state, seconds(t0));
    if (kPause) t.saver->resume("t");
  }
  times.report(state, bytes);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
  state.counters["released_bytes"] =
      static_cast<double>(t.saver->tag_info("t").last_released_bytes);
}

// Which cases run: copies and pause/resume with backup of `backup_mib`
// (under every policy, or the native one alone), pause/resume without backup
// of `no_backup_mib` under every policy; `iterations` fixes each run's
// iterations (0: Google Benchmark decides).
struct SaverBenchPlan {
  std::vector<std::int64_t> backup_mib;
  std::vector<std::int64_t> no_backup_mib;
  bool backup_every_policy = true;
  std::int64_t iterations = 0;
};

inline void register_saver_benchmarks(const SaverBenchEnv& env, const SaverBenchPlan& plan) {
  auto add = [&](const char* name, void (*fn)(benchmark::State&, const SaverBenchEnv&),
                 const std::vector<std::int64_t>& mib, int policies) {
    auto* b = benchmark::RegisterBenchmark(name, [env, fn](benchmark::State& s) { fn(s, env); });
    for (std::int64_t m : mib) {
      for (std::int64_t p = 0; p < policies; ++p) b->Args({m, p});
    }
    b->UseManualTime()->Unit(benchmark::kMillisecond);
    if (plan.iterations > 0) b->Iterations(plan.iterations);
  };
  const int backup_policies = plan.backup_every_policy ? 3 : 1;
  add("Copy_DeviceToPinned", pinned_copy<true>, plan.backup_mib, 1);
  add("Copy_PinnedToDevice", pinned_copy<false>, plan.backup_mib, 1);
  add("Pause_Backup", pause_resume<true, true>, plan.backup_mib, backup_policies);
  add("Resume_Backup", pause_resume<false, true>, plan.backup_mib, backup_policies);
  add("Pause_NoBackup", pause_resume<true, false>, plan.no_backup_mib, 3);
  add("Resume_NoBackup", pause_resume<false, false>, plan.no_backup_mib, 3);
}

// Every case at every size, under every policy.
inline void register_saver_benchmarks(const SaverBenchEnv& env, std::vector<std::int64_t> mib) {
  register_saver_benchmarks(env, SaverBenchPlan{mib, mib, true, 0});
}

}  // namespace reservoir::bench
