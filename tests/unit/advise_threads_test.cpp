// advise's sweep on every core against one core (run under ThreadSanitizer
// too): the same minimum capacities, device calls and recommendation, and a
// progress report per setting.
#include <gtest/gtest.h>

#include <vector>

#include "reservoir/advise.hpp"
#include "trace_fixture.hpp"

namespace reservoir {
namespace {

TEST(Advise, ParallelAndSerialSweepsAgree) {
  Trace t = record(5, 400);
  t.recorded_config = "";
  AdviseOptions serial;
  serial.threads = 1;
  AdviseOptions parallel;
  parallel.threads = 4;
  std::vector<std::size_t> reported;  // serialized by advise
  parallel.progress = [&](std::size_t done, std::size_t total) {
    reported.push_back(done);
    EXPECT_EQ(total, default_sweep().size());
  };
  const Advice x = advise(t, serial);
  const Advice y = advise(t, parallel);
  ASSERT_EQ(reported.size(), y.candidates.size());
  for (std::size_t i = 0; i < reported.size(); ++i) EXPECT_EQ(reported[i], i + 1);
  EXPECT_EQ(x.peak_requested_bytes, y.peak_requested_bytes);
  ASSERT_EQ(x.candidates.size(), y.candidates.size());
  for (std::size_t i = 0; i < x.candidates.size(); ++i) {
    EXPECT_EQ(x.candidates[i].min_capacity_bytes, y.candidates[i].min_capacity_bytes);
    EXPECT_EQ(x.candidates[i].device_calls_per_1000_allocs, y.candidates[i].device_calls_per_1000_allocs);
  }
  EXPECT_EQ(x.best_pytorch, y.best_pytorch);
  EXPECT_EQ(x.best_reservoir, y.best_reservoir);
}

}  // namespace
}  // namespace reservoir
