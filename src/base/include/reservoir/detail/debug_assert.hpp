// Checks in tiers, as mimalloc has them:
//   1. RESERVOIR_DEBUG_ASSERT(cond): cheap internal conditions (a block's size
//      after a split, a counter that cannot go negative), checked in debug
//      builds and compiled out otherwise (the condition is not evaluated).
//      A failure is a bug in reservoir: it prints the condition and where it
//      failed and aborts. RESERVOIR_DEBUG_ASSERTS=1 turns them on in any build.
//   2. Validation mode (CachingAllocator/Saver::set_validate_each_call, or
//      RESERVOIR_VALIDATE=1): the full validator after every public call
//      that changes state; a breach is an InvariantError.
//   3. Clang's thread-safety analysis (thread_safety.hpp), at compile time.
#pragma once

#if !defined(RESERVOIR_DEBUG_ASSERTS)
#if defined(NDEBUG)
#define RESERVOIR_DEBUG_ASSERTS 0
#else
#define RESERVOIR_DEBUG_ASSERTS 1
#endif
#endif

namespace reservoir::detail {
[[noreturn]] void debug_assert_failed(const char* condition, const char* file, int line,
                                      const char* function) noexcept;
}  // namespace reservoir::detail

#if RESERVOIR_DEBUG_ASSERTS
#define RESERVOIR_DEBUG_ASSERT(cond)                                                       \
  ((cond) ? static_cast<void>(0)                                                           \
          : ::reservoir::detail::debug_assert_failed(#cond, __FILE__, __LINE__, __func__))
#else
// Not evaluated, but still compiled: a condition that stops compiling is seen.
#define RESERVOIR_DEBUG_ASSERT(cond) static_cast<void>(sizeof((cond) ? 1 : 0))
#endif
