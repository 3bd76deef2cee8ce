// A reader-writer lock for paths taken on every allocation: a tag's state
// (held shared by each allocation and free inside a tag, exclusively by
// pause and resume) and the saver's index of tag address ranges.
//
// Written here because std::shared_mutex (pthread_rwlock) costs about 70
// instructions per shared lock and unlock, a tenth of an allocation's whole
// cost; this one costs two atomic operations. Writers are rare and win:
// once one waits, new readers wait behind it. A waiter spins briefly, then
// yields, then sleeps, since a writer (a pause copying gigabytes) may hold
// it for seconds.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "reservoir/detail/thread_safety.hpp"

namespace reservoir::detail {

class RESERVOIR_CAPABILITY("mutex") SharedSpinMutex {
 public:
  void lock() noexcept RESERVOIR_ACQUIRE() {
    Backoff wait;
    while ((state_.fetch_or(kWriter, std::memory_order_acquire) & kWriter) != 0) wait();
    while ((state_.load(std::memory_order_acquire) & kReaders) != 0) wait();
  }
  void unlock() noexcept RESERVOIR_RELEASE() {
    state_.fetch_and(~kWriter, std::memory_order_release);
  }
  void lock_shared() noexcept RESERVOIR_ACQUIRE_SHARED() {
    Backoff wait;
    while ((state_.fetch_add(1, std::memory_order_acquire) & kWriter) != 0) {
      state_.fetch_sub(1, std::memory_order_relaxed);
      while ((state_.load(std::memory_order_relaxed) & kWriter) != 0) wait();
    }
  }
  void unlock_shared() noexcept RESERVOIR_RELEASE_SHARED() {
    state_.fetch_sub(1, std::memory_order_release);
  }

 private:
  static constexpr std::uint32_t kWriter = std::uint32_t{1} << 31;
  static constexpr std::uint32_t kReaders = kWriter - 1;

  class Backoff {
   public:
    void operator()() noexcept {
      ++rounds_;
      if (rounds_ < 128) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else if (rounds_ < 1024) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }

   private:
    unsigned rounds_ = 0;
  };

  std::atomic<std::uint32_t> state_{0};
};

}  // namespace reservoir::detail
