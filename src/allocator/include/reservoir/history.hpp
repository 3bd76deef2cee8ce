// Allocation history and annotations.
//
// History (CachingAllocator::record_history) keeps the latest events of an
// allocator in a ring buffer, each with the time and the context it happened
// in: the calling thread's annotation stack and, optionally, its native call
// stack (captured as return addresses; symbolized only when a snapshot is
// taken). snapshot() returns the events with their contexts, and the blocks
// alive with the context of their allocation.
//
// Annotations name phases of a program ("forward", "layer3"). They belong to
// the thread, nest, and cost a few tens of nanoseconds per push and pop, so
// they can be left on; every allocator of the process sees them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace reservoir {

struct HistoryOptions {
  bool enabled = true;
  // Events kept; older ones are overwritten. At least 1.
  std::size_t max_entries = 1'000'000;
  // Capture the native call stack of every event (a few microseconds each).
  bool stacks = false;
  // Innermost frames kept per stack (at most 64).
  std::size_t max_frames = 32;
};

// Enters an annotation on the calling thread (nested inside the current one).
void push_annotation(std::string_view name);
// Leaves the innermost annotation. Throws UsageError when the thread has none.
void pop_annotation();
// The calling thread's annotations, outermost first.
std::vector<std::string> current_annotations();

// An annotation for the lifetime of a scope.
class ScopedAnnotation {
 public:
  explicit ScopedAnnotation(std::string_view name) { push_annotation(name); }
  ~ScopedAnnotation() { pop_annotation_noexcept(); }
  ScopedAnnotation(const ScopedAnnotation&) = delete;
  ScopedAnnotation& operator=(const ScopedAnnotation&) = delete;

 private:
  static void pop_annotation_noexcept() noexcept;
};

namespace detail {
// The calling thread's innermost annotation as an interned id (0: none).
std::uint32_t current_annotation_id() noexcept;
// The annotation path of an interned id, outermost first.
std::vector<std::string> annotation_path(std::uint32_t id);
}  // namespace detail

}  // namespace reservoir
