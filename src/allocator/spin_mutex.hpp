#pragma once

#include <atomic>
#include <thread>

#include "reservoir/detail/debug_assert.hpp"

namespace reservoir::detail {

// The allocator's lock: critical sections are tens of nanoseconds, so a
// waiter spins briefly (then yields) instead of sleeping in the kernel, which
// a contended std::mutex does at several microseconds a round trip.
class SpinMutex {
 public:
  void lock() noexcept {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      for (int spins = 0; locked_.load(std::memory_order_relaxed); ++spins) {
        if (spins < 128) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        } else {
          std::this_thread::yield();
        }
      }
    }
  }
  bool try_lock() noexcept {
    return !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept {
    RESERVOIR_DEBUG_ASSERT(locked_.load(std::memory_order_relaxed));
    locked_.store(false, std::memory_order_release);
  }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace reservoir::detail
