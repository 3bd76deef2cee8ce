// Clang's thread-safety analysis (-Wthread-safety): which mutex guards which
// member, and which functions expect it held, are declared and checked at
// compile time instead of written in comments. Other compilers ignore the
// annotations.
//
// libstdc++'s mutexes and locks carry no annotations, so the allocator and
// the saver use these thin wrappers: Mutex, SharedMutex and the scoped locks
// LockGuard, UniqueLock and SharedLock.
#pragma once

#include <mutex>
#include <shared_mutex>

#if defined(__clang__)
#define RESERVOIR_TSA(x) __attribute__((x))
#else
#define RESERVOIR_TSA(x)
#endif

#define RESERVOIR_CAPABILITY(name) RESERVOIR_TSA(capability(name))
#define RESERVOIR_SCOPED_CAPABILITY RESERVOIR_TSA(scoped_lockable)
#define RESERVOIR_GUARDED_BY(m) RESERVOIR_TSA(guarded_by(m))
#define RESERVOIR_PT_GUARDED_BY(m) RESERVOIR_TSA(pt_guarded_by(m))
#define RESERVOIR_REQUIRES(...) RESERVOIR_TSA(requires_capability(__VA_ARGS__))
#define RESERVOIR_REQUIRES_SHARED(...) RESERVOIR_TSA(requires_shared_capability(__VA_ARGS__))
#define RESERVOIR_ACQUIRE(...) RESERVOIR_TSA(acquire_capability(__VA_ARGS__))
#define RESERVOIR_ACQUIRE_SHARED(...) RESERVOIR_TSA(acquire_shared_capability(__VA_ARGS__))
#define RESERVOIR_RELEASE(...) RESERVOIR_TSA(release_capability(__VA_ARGS__))
#define RESERVOIR_RELEASE_SHARED(...) RESERVOIR_TSA(release_shared_capability(__VA_ARGS__))
#define RESERVOIR_RELEASE_GENERIC(...) RESERVOIR_TSA(release_generic_capability(__VA_ARGS__))
#define RESERVOIR_TRY_ACQUIRE(...) RESERVOIR_TSA(try_acquire_capability(__VA_ARGS__))
#define RESERVOIR_EXCLUDES(...) RESERVOIR_TSA(locks_excluded(__VA_ARGS__))
#define RESERVOIR_ASSERT_CAPABILITY(x) RESERVOIR_TSA(assert_capability(x))
#define RESERVOIR_NO_THREAD_SAFETY_ANALYSIS RESERVOIR_TSA(no_thread_safety_analysis)
#define RESERVOIR_RETURN_CAPABILITY(x) RESERVOIR_TSA(lock_returned(x))

namespace reservoir::detail {

class RESERVOIR_CAPABILITY("mutex") Mutex {
 public:
  void lock() RESERVOIR_ACQUIRE() { m_.lock(); }
  bool try_lock() RESERVOIR_TRY_ACQUIRE(true) { return m_.try_lock(); }
  void unlock() RESERVOIR_RELEASE() { m_.unlock(); }

 private:
  std::mutex m_;
};

class RESERVOIR_CAPABILITY("mutex") SharedMutex {
 public:
  void lock() RESERVOIR_ACQUIRE() { m_.lock(); }
  bool try_lock() RESERVOIR_TRY_ACQUIRE(true) { return m_.try_lock(); }
  void unlock() RESERVOIR_RELEASE() { m_.unlock(); }
  void lock_shared() RESERVOIR_ACQUIRE_SHARED() { m_.lock_shared(); }
  bool try_lock_shared() RESERVOIR_TSA(try_acquire_shared_capability(true)) {
    return m_.try_lock_shared();
  }
  void unlock_shared() RESERVOIR_RELEASE_SHARED() { m_.unlock_shared(); }

 private:
  std::shared_mutex m_;
};

// std::lock_guard, annotated.
template <typename M>
class RESERVOIR_SCOPED_CAPABILITY LockGuard {
 public:
  explicit LockGuard(M& m) RESERVOIR_ACQUIRE(m) : m_(m) { m_.lock(); }
  ~LockGuard() RESERVOIR_RELEASE() { m_.unlock(); }
  LockGuard(const LockGuard&) = delete;
  LockGuard& operator=(const LockGuard&) = delete;

 private:
  M& m_;
};

// std::unique_lock, annotated: held from construction, may be released and
// taken again (around callbacks that re-enter).
template <typename M>
class RESERVOIR_SCOPED_CAPABILITY UniqueLock {
 public:
  explicit UniqueLock(M& m) RESERVOIR_ACQUIRE(m) : m_(m) { m_.lock(); }
  ~UniqueLock() RESERVOIR_RELEASE() {
    if (held_) m_.unlock();
  }
  void lock() RESERVOIR_ACQUIRE() {
    m_.lock();
    held_ = true;
  }
  void unlock() RESERVOIR_RELEASE() {
    held_ = false;
    m_.unlock();
  }
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;

 private:
  M& m_;
  bool held_ = true;
};

// std::shared_lock, annotated.
template <typename M>
class RESERVOIR_SCOPED_CAPABILITY SharedLock {
 public:
  explicit SharedLock(M& m) RESERVOIR_ACQUIRE_SHARED(m) : m_(m) { m_.lock_shared(); }
  ~SharedLock() RESERVOIR_RELEASE() { m_.unlock_shared(); }
  SharedLock(const SharedLock&) = delete;
  SharedLock& operator=(const SharedLock&) = delete;

 private:
  M& m_;
};

}  // namespace reservoir::detail
