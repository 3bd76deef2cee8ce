// What the simulated cuBLAS and cuBLASLt share: the handles they hand out
// (made, found and destroyed under a lock; a destroyed or foreign handle is
// not found, as the libraries say "not initialized" of one), and the answer
// to a call that computes.
#pragma once

#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>

#include "sim.hpp"

namespace reservoir::simcuda {

// A call that computes is a kernel here: taken without computing when
// kernels are allowed (0, success), else refused, naming it (15,
// CUBLAS_STATUS_NOT_SUPPORTED), as a launch is.
inline int skipped_or_refused(const char* name) {
  if (Sim::get().allow_kernels()) return 0;
  (void)Sim::get().refuse(name);
  return 15;
}

template <typename T>
class Handles {
 public:
  // Null when host memory runs out.
  T* make() {
    std::unique_ptr<T> owned(new (std::nothrow) T);
    if (owned == nullptr) return nullptr;
    T* raw = owned.get();
    std::lock_guard<std::mutex> lock(mutex_);
    live_.emplace(raw, std::move(owned));
    return raw;
  }
  T* find(const void* handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(handle);
    return it == live_.end() ? nullptr : it->second.get();
  }
  bool destroy(const void* handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_.erase(handle) != 0;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const void*, std::unique_ptr<T>> live_;
};

}  // namespace reservoir::simcuda
