// The one worker pool of the library: each index of [0, count) handed to
// `body` once, on up to `threads` threads (0: one per core), the calling
// thread among them. The first exception a body throws stops the handing out
// of further indices and is rethrown once every thread has finished; a body
// that catches its own errors lets every index run. `done(finished, count)`,
// where given, is called after each index under a lock, in the order they
// finish (a progress line).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace reservoir::detail {

template <typename Body>
void parallel_for(std::size_t count, unsigned threads, Body&& body,
                  const std::function<void(std::size_t, std::size_t)>& done = {}) {
  if (count == 0) return;
  if (threads == 0) threads = std::thread::hardware_concurrency();
  threads = std::max(1u, static_cast<unsigned>(std::min<std::size_t>(threads, count)));
  std::atomic<std::size_t> next{0};
  std::mutex mutex;
  std::size_t finished = 0;
  std::exception_ptr failure;
  auto work = [&] {
    for (std::size_t i = next++; i < count; i = next++) {
      try {
        body(i);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(mutex);
        if (!failure) failure = std::current_exception();
        next = count;
        return;
      }
      const std::lock_guard<std::mutex> lock(mutex);
      ++finished;
      if (done) done(finished, count);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace reservoir::detail
