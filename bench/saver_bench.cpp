// Pause and resume on HostDevice (real memory: memfd pages released and
// recreated, contents copied with memcpy) beside a plain copy into pinned
// host memory of the same bytes, in one run. The GPU figures come from
// gpu_bench, which registers the same cases on CUDA.
#include <benchmark/benchmark.h>

#include "reservoir/host_device.hpp"
#include "saver_cases.hpp"

int main(int argc, char** argv) {
  static reservoir::HostDevice device(reservoir::HostDeviceOptions{std::size_t{16} << 30, std::size_t{2} << 20});
  static reservoir::HostPinnedMemory pinned;
  reservoir::bench::register_saver_benchmarks(
      {[]() -> reservoir::Device& { return device; },
       []() -> reservoir::PinnedMemorySource& { return pinned; }},
      {256, 1024});
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
