// Saver: fault injection on every device call pause and resume make; a
// failure leaves the tag as it was (pause) or paused with its backup (resume).
#include "reservoir/saver.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_caching_allocator.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/sim_device.hpp"
#include "saver_fixture.hpp"

namespace reservoir {
namespace {

// ---- fault injection: every device call of pause and resume -------------------------

struct Fixture {
  HostDevice host;
  FaultyDevice dev{host};
  std::unique_ptr<Saver> saver;
  std::vector<void*> ps;
  std::vector<std::size_t> sizes = {3 * kMiB, 30 * kMiB, 5000};

  explicit Fixture(const std::string& config) {
    SaverOptions o = options(config);
    saver = std::make_unique<Saver>(dev, o);
    auto r = saver->region("w", {.cpu_backup = true});
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ps.push_back(saver->allocate(sizes[i]));
      fill(ps.back(), sizes[i], static_cast<unsigned>(i + 40));
    }
  }
  void expect_contents() {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(mismatch(ps[i], sizes[i], static_cast<unsigned>(i + 40)), -1) << "block " << i;
    }
  }
  // Frees everything and destroys the saver: nothing may be left on the device.
  void finish() {
    for (void* p : ps) saver->deallocate(p);
    saver->validate();
    saver.reset();
    EXPECT_EQ(host.used_bytes(), 0u);
  }
};

struct FaultCase {
  CallKind call;
  int nth;
  Status status;
};
void PrintTo(const FaultCase& f, std::ostream* os) {
  *os << to_string(f.call) << " #" << f.nth << " -> " << to_string(f.status);
}

template <typename Param>
std::string fault_name(const ::testing::TestParamInfo<Param>& info) {
  const FaultCase& f = std::get<1>(info.param);
  return fmt::format("{}_{}_{}_{}", policy_name(std::get<0>(info.param)), to_string(f.call), f.nth,
                     to_string(f.status));
}

class PauseFaults : public ::testing::TestWithParam<std::tuple<const char*, FaultCase>> {};

TEST_P(PauseFaults, AFailedPauseLeavesTheTagRunningAndUntouched) {
  const auto& [config, fault] = GetParam();
  Fixture f(config);
  const std::size_t physical = f.saver->tag_info("w").physical_bytes;
  f.dev.fail_nth(fault.call, fault.nth, fault.status);
  try {
    f.saver->pause("w");
    ADD_FAILURE() << "pause succeeded";
  } catch (const DeviceError& e) {
    EXPECT_EQ(e.call(), fault.call);
    EXPECT_EQ(std::string(e.what()).rfind("pause of tag 'w': ", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("the tag is left running, untouched"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(f.saver->is_paused("w"));
  EXPECT_EQ(f.saver->tag_info("w").physical_bytes, physical);
  EXPECT_EQ(f.saver->tag_info("w").backup_bytes, 0u);
  f.saver->validate();
  f.expect_contents();
  // And it can be paused and resumed afterwards.
  f.saver->pause("w");
  f.saver->resume("w");
  f.expect_contents();
  f.finish();
}

INSTANTIATE_TEST_SUITE_P(
    EveryCall, PauseFaults,
    ::testing::Combine(::testing::Values("", "expandable_segments:True", "policy:paging"),
                       ::testing::Values(FaultCase{CallKind::synchronize_device, 1, Status::device_error},
                                         FaultCase{CallKind::copy_to_host, 1, Status::device_error},
                                         FaultCase{CallKind::copy_to_host, 7, Status::device_error},
                                         FaultCase{CallKind::synchronize_stream, 2, Status::device_error},
                                         FaultCase{CallKind::unmap, 1, Status::device_error},
                                         FaultCase{CallKind::unmap, 2, Status::device_error})),
    fault_name<PauseFaults::ParamType>);

TEST(SaverFaults, AFailedReleaseStillPausesAndIsRetriedSoNothingLeaks) {
  for (const char* config : {"", "expandable_segments:True", "policy:paging"}) {
    SCOPED_TRACE(config);
    Fixture f(config);
    f.dev.fail_nth(CallKind::release_physical, 1, Status::device_error);
    f.saver->pause("w");  // unmapped: the memory is out of reach either way
    EXPECT_TRUE(f.saver->is_paused("w"));
    EXPECT_EQ(f.saver->tag_info("w").physical_bytes, 0u);
    f.saver->resume("w");  // retries the release first
    f.expect_contents();
    f.finish();
  }
}

class ResumeFaults : public ::testing::TestWithParam<std::tuple<const char*, FaultCase>> {};

TEST_P(ResumeFaults, AFailedResumeStaysPausedWithItsBackup) {
  const auto& [config, fault] = GetParam();
  Fixture f(config);
  f.saver->pause("w");
  f.saver->deallocate(f.ps[2]);  // a pending free survives the failed resume too
  const TagInfo paused = f.saver->tag_info("w");
  const std::size_t used = f.host.used_bytes();
  f.dev.fail_nth(fault.call, fault.nth, fault.status);
  if (fault.status == Status::out_of_memory) {
    try {
      f.saver->resume("w");
      ADD_FAILURE() << "resume succeeded";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("the tag stays paused with its backup"), std::string::npos)
          << e.what();
    }
  } else {
    try {
      f.saver->resume("w");
      ADD_FAILURE() << "resume succeeded";
    } catch (const DeviceError& e) {
      EXPECT_EQ(e.call(), fault.call);
      EXPECT_NE(std::string(e.what()).find("the tag stays paused with its backup"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_TRUE(f.saver->is_paused("w"));
  const TagInfo after = f.saver->tag_info("w");
  EXPECT_EQ(after.physical_bytes, 0u);
  EXPECT_EQ(after.backup_bytes, paused.backup_bytes);
  EXPECT_EQ(after.pending_frees, 1u);
  EXPECT_EQ(f.host.used_bytes(), used);  // what was created was given back
  f.saver->validate();
  f.saver->resume("w");
  f.sizes.pop_back();
  f.ps.pop_back();
  f.expect_contents();
  EXPECT_EQ(f.saver->tag_info("w").pending_frees, 0u);
  f.finish();
}

INSTANTIATE_TEST_SUITE_P(
    EveryCall, ResumeFaults,
    ::testing::Combine(::testing::Values("", "expandable_segments:True", "policy:paging"),
                       ::testing::Values(FaultCase{CallKind::create_physical, 1, Status::out_of_memory},
                                         FaultCase{CallKind::create_physical, 2, Status::out_of_memory},
                                         FaultCase{CallKind::create_physical, 2, Status::device_error},
                                         FaultCase{CallKind::map, 2, Status::device_error},
                                         FaultCase{CallKind::set_access, 2, Status::device_error},
                                         FaultCase{CallKind::copy_to_device, 1, Status::device_error},
                                         FaultCase{CallKind::copy_to_device, 9, Status::device_error},
                                         FaultCase{CallKind::synchronize_stream, 1, Status::device_error})),
    fault_name<ResumeFaults::ParamType>);

// A tag paused to come back zeroed: a failed zeroing or mapping leaves it
// paused (no backup to keep: none was taken), its memory given back, and the
// next resume zeroes every live allocation.
TEST(SaverFaults, AResumeThatFailsToZeroStaysPausedAndTheNextOneZeroes) {
  for (const FaultCase fault : {FaultCase{CallKind::copy_to_device, 1, Status::device_error},
                                FaultCase{CallKind::synchronize_stream, 1, Status::device_error},
                                FaultCase{CallKind::create_physical, 2, Status::out_of_memory}}) {
    Fixture f("");
    f.saver->pause("w", PauseContents::zero);
    EXPECT_EQ(f.saver->tag_info("w").last_pause_copied, 0u);
    const std::size_t used = f.host.used_bytes();
    f.dev.fail_nth(fault.call, fault.nth, fault.status);
    try {
      f.saver->resume("w");
      ADD_FAILURE() << "resume succeeded";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the tag stays paused"), std::string::npos) << what;
      EXPECT_EQ(what.find("with its backup"), std::string::npos) << what;
      if (fault.call != CallKind::create_physical) {
        EXPECT_NE(what.find("zeroing"), std::string::npos) << what;
      }
    }
    EXPECT_TRUE(f.saver->is_paused("w"));
    EXPECT_EQ(f.host.used_bytes(), used);
    f.saver->validate();
    f.saver->resume("w");
    for (std::size_t i = 0; i < f.sizes.size(); ++i) {
      const auto* b = static_cast<const unsigned char*>(f.ps[i]);
      EXPECT_TRUE(std::all_of(b, b + f.sizes[i], [](unsigned char c) { return c == 0; })) << "block " << i;
    }
    EXPECT_EQ(f.saver->tag_info("w").last_resume_copied, 3 * kMiB + 30 * kMiB + 5000);
    f.finish();
  }
}

TEST(SaverFaults, ResumeRunsOutOfMemoryHalfwayOnARealCapacityAndRollsBack) {
  SimDeviceOptions so;
  so.capacity = 64 * kMiB;
  so.auto_complete_events = true;
  SimDevice sim(so);
  Saver saver(sim, options());
  void* a = nullptr;
  void* b = nullptr;
  {
    auto r = saver.region("w", {.cpu_backup = true});
    a = saver.allocate(20 * kMiB);
    b = saver.allocate(20 * kMiB);
  }
  saver.pause("w");
  EXPECT_EQ(sim.used_bytes(), 0u);
  void* other = saver.allocate(30 * kMiB);  // untagged memory takes the room meanwhile
  // The first 20 MiB segment fits, the second does not: both are given back.
  const std::uint64_t creates = sim.calls(CallKind::create_physical);
  EXPECT_THROW(saver.resume("w"), OutOfMemoryError);
  EXPECT_EQ(sim.calls(CallKind::create_physical), creates + 2);
  EXPECT_TRUE(saver.is_paused("w"));
  EXPECT_EQ(sim.used_bytes(), 30 * kMiB);
  saver.deallocate(other);
  saver.empty_cache();
  saver.resume("w");
  EXPECT_FALSE(saver.is_paused("w"));
  EXPECT_EQ(sim.used_bytes(), 40 * kMiB);
  saver.deallocate(a);
  saver.deallocate(b);
  saver.validate();
}

}  // namespace
}  // namespace reservoir
