// FaultInjector: counts device calls by kind and fails the ones a test asks
// for: the nth call of a kind from now, or a seeded fraction of a kind's
// calls. SimDevice injects with one, and so does the tests' FaultyDevice,
// which wraps any device (HostDevice: faults on real memory).
//
// Thread safety: none; the owning device's mutex guards it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>

#include "reservoir/device.hpp"

namespace reservoir::detail {

class FaultInjector {
 public:
  FaultInjector() {
    for (std::size_t i = 0; i < kCallKindCount; ++i) faults_[i].rng.seed(i + 1);
  }

  // Fail the nth (1-based) call of `kind` counted from now with `status`.
  void fail_nth(CallKind kind, std::uint64_t n, Status status) {
    Fault& f = faults_[index(kind)];
    f.nth = n;
    f.nth_status = status;
  }
  // Fail each call of `kind` with probability `fraction` (seeded, repeatable).
  void fail_fraction(CallKind kind, double fraction, std::uint64_t seed, Status status) {
    Fault& f = faults_[index(kind)];
    f.fraction = fraction;
    f.fraction_status = status;
    f.rng.seed(seed);
  }
  void clear() {
    for (Fault& f : faults_) {
      f.nth = 0;
      f.fraction = 0.0;
    }
  }

  // Counts a call of `kind`; returns the status it must fail with, or ok.
  Status enter(CallKind kind) {
    const std::size_t i = index(kind);
    ++calls_[i];
    Fault& f = faults_[i];
    if (f.nth != 0 && --f.nth == 0) {
      ++failures_[i];
      return f.nth_status;
    }
    if (f.fraction > 0.0) {
      std::uniform_real_distribution<double> u(0.0, 1.0);
      if (u(f.rng) < f.fraction) {
        ++failures_[i];
        return f.fraction_status;
      }
    }
    return Status::ok;
  }

  std::uint64_t calls(CallKind kind) const noexcept { return calls_[index(kind)]; }
  std::uint64_t failures(CallKind kind) const noexcept { return failures_[index(kind)]; }
  void reset_counters() noexcept {
    calls_ = {};
    failures_ = {};
  }

 private:
  struct Fault {
    std::uint64_t nth = 0;  // 0: none
    Status nth_status = Status::ok;
    double fraction = 0.0;
    Status fraction_status = Status::ok;
    std::mt19937_64 rng;
  };
  static std::size_t index(CallKind kind) noexcept { return static_cast<std::size_t>(kind); }

  std::array<Fault, kCallKindCount> faults_{};
  std::array<std::uint64_t, kCallKindCount> calls_{};
  std::array<std::uint64_t, kCallKindCount> failures_{};
};

}  // namespace reservoir::detail
