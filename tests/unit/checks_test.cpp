// The check tiers: the debug assertion macro, and validation mode on the
// allocator and the saver (reservoir/detail/debug_assert.hpp).
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "error_text.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/detail/debug_assert.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/host_device.hpp"
#include "reservoir/saver.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir {

// checks_off.cpp: the macro compiled with RESERVOIR_DEBUG_ASSERTS=0.
int conditions_evaluated_when_off();

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Sets (or, with nullptr, removes) an environment variable for a scope; the
// suite itself may run with RESERVOIR_VALIDATE set.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(DebugAssert, AFailureNamesTheConditionAndWhereAndAborts) {
  static_assert(RESERVOIR_DEBUG_ASSERTS == 1, "this file is compiled with the checks on");
  int evaluated = 0;
  RESERVOIR_DEBUG_ASSERT(++evaluated == 1);
  EXPECT_EQ(evaluated, 1);
  const int one = 1;
  EXPECT_DEATH(RESERVOIR_DEBUG_ASSERT(one == 2),
               "reservoir: internal check failed: one == 2, at .*checks_test\\.cpp:[0-9]+ in TestBody");
}

TEST(DebugAssert, OffTheConditionIsNotEvaluated) {
  EXPECT_EQ(conditions_evaluated_when_off(), 0);
}

TEST(ValidationMode, ValidatesAfterEveryChangingCallReturnedOrThrown) {
  SimDeviceOptions o;
  o.capacity = 64 * kMiB;
  SimDevice device(o);
  const ScopedEnv unset("RESERVOIR_VALIDATE", nullptr);
  CachingAllocator a(device);
  void* p = a.allocate(kMiB);
  a.deallocate(p);
  EXPECT_EQ(a.validations(), 0u);  // off unless asked for

  a.set_validate_each_call(true);
  p = a.allocate(kMiB);                                         // 1
  EXPECT_THROW(a.allocate(std::size_t{1} << 30), OutOfMemoryError);  // 2: failed, validated
  EXPECT_THROW(a.deallocate(static_cast<char*>(p) + 512), InvalidPointerError);  // 3
  (void)a.stats();                                              // reads are not validated
  (void)a.snapshot();
  a.record_stream(p, 7);                                        // 4
  a.deallocate(p);                                              // 5
  a.empty_cache();                                              // 6
  EXPECT_EQ(a.validations(), 6u);
  a.set_validate_each_call(false);
  a.empty_cache();
  EXPECT_EQ(a.validations(), 6u);
}

TEST(ValidationMode, TheEnvironmentTurnsItOnFromConstruction) {
  SimDevice device;
  std::optional<CachingAllocator> on, off;
  {
    const ScopedEnv set("RESERVOIR_VALIDATE", "1");
    on.emplace(device);
  }
  {
    const ScopedEnv set("RESERVOIR_VALIDATE", "0");
    off.emplace(device);
  }
  on->deallocate(on->allocate(512));
  off->deallocate(off->allocate(512));
  EXPECT_EQ(on->validations(), 2u);
  EXPECT_EQ(off->validations(), 0u);
}

TEST(ValidationMode, TheSaverValidatesAfterPauseAndResume) {
  HostDevice host;
  Saver saver(host);
  saver.set_validate_each_call(true);
  void* p = nullptr;
  {
    auto region = saver.region("w", {.cpu_backup = true});
    p = saver.allocate(3 * kMiB);
  }
  const std::uint64_t before = saver.untagged_allocator().validations();
  saver.pause("w");   // Saver::validate covers the untagged allocator too
  saver.resume("w");
  EXPECT_EQ(saver.untagged_allocator().validations(), before + 2);
  EXPECT_THROW(saver.pause("nope"), UsageError);  // failed: validated as well
  EXPECT_EQ(saver.untagged_allocator().validations(), before + 3);
  saver.deallocate(p);
}

}  // namespace
}  // namespace reservoir
