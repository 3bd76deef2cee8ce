// What torch.cuda.memory._record_memory_history keeps under reservoir's own
// allocator, and what its snapshot's traces are made of: PyTorch's context
// recorder's frames for each allocation and free (reservoir keeps the
// events themselves), the call each segment release happened in,
// record_function's annotations, torch.compile's contexts, user metadata,
// the entries this library writes itself (_annotate_memory's, each
// _snapshot()'s own), and the trace trackers that see every event as it
// happens (NCCL's memory registration). Thread-safe: a lock of its own,
// never held while reservoir is called. Internal to the per-release
// libraries.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torch_types.hpp"

namespace reservoir_torch_hooks {

class History {
 public:
  // What history keeps of a call: PyTorch's recorder's context, and the
  // compile context and user metadata in force on its device.
  struct Recorded {
    std::shared_ptr<c10::GatheredContext> context;
    std::string compile_context;
    std::string user_metadata;
  };

  // The call of this thread's that is in reservoir now, while one lives:
  // what its segment releases are written with (null: none kept).
  class InCall {
   public:
    explicit InCall(const std::optional<Recorded>& r) : previous_(current_call) {
      current_call = r ? &*r : nullptr;
    }
    ~InCall() { current_call = previous_; }
    InCall(const InCall&) = delete;
    InCall& operator=(const InCall&) = delete;

   private:
    const Recorded* previous_;
  };

  // _record_memory_history's settings (clear: forget what was kept).
  void set(bool enabled, cca::CreateContextFn recorder, std::size_t max_entries,
           cca::RecordContext when, bool clear, const std::vector<std::string>& skip_actions);
  bool on();
  // Whether history is on, without the lock (a free asks; settled under it by note_free).
  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  // What history keeps of an allocation (alloc) or a free on `device`, when it is on.
  std::optional<Recorded> record(bool alloc, int device);
  // Kept for the k-th allocation (free) at an address, while history is on.
  void note_alloc(const void* ptr, Recorded recorded);
  void note_free(const void* ptr, Recorded recorded);
  // The frames of the last allocation at ptr (null: none kept).
  std::shared_ptr<c10::GatheredContext> context_for(const void* ptr);

  // record_function's annotations, the latest max_entries.
  void annotate(int device, const std::vector<std::pair<std::string, std::string>>& md);
  // An "annotate" entry for the live allocation at ptr, while history is on.
  void annotate_memory(const void* ptr, int device, std::size_t size, cudaStream_t stream,
                       const std::string& metadata);
  void push_compile_context(int device, const std::string& context);
  void pop_compile_context(int device);
  void set_user_metadata(int device, const std::string& metadata);
  std::string user_metadata(int device);

  // Trace trackers, called with every event (on_event).
  void add_tracker(cca::AllocatorTraceTracker tracker);
  // Whether reservoir's events are wanted (history on, or a tracker).
  bool wants_events();
  // reservoir's event callback (its lock held; self: this History).
  static void on_event(void* self, int device, const char* action, std::size_t action_size,
                       unsigned long long addr, unsigned long long size, void* stream,
                       long long time_us);

  // One device's part of torch.cuda.memory._snapshot() from reservoir's
  // state of it: its segments (of pool `only`, unless it is the default
  // pools' id) with each live block's frames, and with traces, its trace.
  void add_device(cca::SnapshotInfo& out, int device, const nlohmann::json& state, MempoolId only,
                  bool include_traces, std::unordered_map<std::size_t, std::size_t>& alloc_seen,
                  std::unordered_map<std::size_t, std::size_t>& free_seen);
  // record_function's annotations, into a snapshot.
  void add_annotations(cca::SnapshotInfo& out);

 private:
  // Per address, in the order of the allocations (and frees) there.
  struct Contexts {
    std::vector<Recorded> allocs;
    std::vector<Recorded> frees;
  };

  static std::optional<trace_types::TraceEntry::Action> trace_action(const std::string& a);
  // Keeps an entry this library wrote, the latest max_entries as PyTorch's
  // ring of entries keeps them. Holds mutex_.
  void keep_own_entry(trace_types::TraceEntry te);
  // The entries of a device this library wrote not yet added, up to a time,
  // into its trace (in time order with reservoir's entries); *next counts
  // those added. Holds mutex_.
  void add_own_entries_until(std::vector<trace_types::TraceEntry>& trace, int device,
                             std::int64_t time_us, std::size_t* next) const;
  // A snapshot taken is an entry of the device's trace while history is on
  // (its size the active bytes it reported), as PyTorch writes it. Holds mutex_.
  void note_snapshot(int device, std::size_t total_active);
  bool skipped(const std::string& action) const;  // holds mutex_
  // The innermost compile context pushed on a device, "N/A" without one (as
  // PyTorch writes it), and the user metadata set on it. Hold mutex_.
  std::string compile_context_of(int device) const;
  std::string metadata_of(int device) const;

  static thread_local const Recorded* current_call;

  std::mutex mutex_;
  cca::CreateContextFn recorder_ = nullptr;
  std::atomic<bool> recording_{false};  // history on, read without the lock
  bool on_ = false;
  cca::RecordContext when_{};
  std::vector<std::string> skip_actions_;
  std::size_t max_entries_ = 0;
  std::unordered_map<std::size_t, Contexts> contexts_;
  // Per segment address, the calls its releases happened in, in order.
  std::unordered_map<std::size_t, std::vector<Recorded>> releases_;
  std::map<int, std::vector<std::string>> compile_contexts_;
  std::map<int, std::string> user_metadata_;
  std::deque<trace_types::AnnotationEntry> annotations_;
  // Entries this library writes itself, merged into the trace by time:
  // torch.cuda.memory._annotate_memory's, and each _snapshot()'s own.
  std::deque<trace_types::TraceEntry> own_entries_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
};

// Microseconds since the epoch: the clock of reservoir's history.
std::int64_t now_us();

}  // namespace reservoir_torch_hooks
