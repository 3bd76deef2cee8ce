// The allocator's event history: a ring buffer of the latest events, each
// with an interned context (annotation path, native stack).
//
// Not thread-safe: the allocator calls it with its mutex held.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "reservoir/history.hpp"
#include "reservoir/snapshot.hpp"

namespace reservoir::detail {

class EventHistory {
 public:
  // Applies options: disabling drops the events (contexts stay, as live
  // blocks refer to them); a new max_entries keeps the latest events.
  void configure(const HistoryOptions& options);
  bool on() const noexcept { return on_; }

  // Microseconds since the epoch, strictly increasing across every history
  // of the process, so the events of several allocators merge by time.
  static std::int64_t unique_time_us() noexcept;
  // Records an event in the calling thread's context; returns the context's
  // internal id (for the block an alloc hands out).
  std::uint32_t record(TraceAction action, DevicePtr addr, std::uint64_t size, StreamId stream);

  // Turns internal context ids into a snapshot's context table, symbolizing
  // stacks. Ids are exported once each; the empty context is 0.
  class Exporter {
   public:
    Exporter(const EventHistory& history, std::vector<Context>& out) : history_(history), out_(out) {
      by_content_.emplace(context_key(Context{}), 0);
    }
    std::uint32_t operator()(std::uint32_t internal);

   private:
    const EventHistory& history_;
    std::vector<Context>& out_;
    std::unordered_map<std::uint32_t, std::uint32_t> exported_;
    std::unordered_map<std::string, std::uint32_t> by_content_;
  };
  // The recorded events, oldest first, their contexts exported through `ctx`.
  void append_events(std::vector<TraceEvent>& out, Exporter& ctx) const;

 private:
  struct Entry {
    TraceEvent event;
    std::uint32_t context;
  };
  std::uint32_t intern_stack(std::vector<std::uintptr_t>&& pcs);
  std::uint32_t intern_context(std::uint32_t annotation, std::uint32_t stack);

  bool on_ = false;
  bool capture_stacks_ = false;
  std::size_t max_frames_ = 32;
  std::size_t max_entries_ = 1;
  std::vector<Entry> ring_;  // grows to max_entries_, then wraps at next_
  std::size_t next_ = 0;
  // Internal contexts: (annotation id, stack id); [0] is (0, 0).
  std::vector<std::pair<std::uint32_t, std::uint32_t>> contexts_{{0, 0}};
  std::unordered_map<std::uint64_t, std::uint32_t> context_ids_;
  std::pair<std::uint32_t, std::uint32_t> last_{0, 0};  // the latest context interned
  std::uint32_t last_context_ = 0;
  std::vector<std::vector<std::uintptr_t>> stacks_{{}};
  std::unordered_map<std::size_t, std::vector<std::uint32_t>> stack_ids_;  // by hash
};

}  // namespace reservoir::detail
