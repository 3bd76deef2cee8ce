// History and trace trackers under reservoir's own allocator (torch_history.hpp).
#include "torch_history.hpp"

#include <algorithm>
#include <chrono>
#include <limits>

namespace reservoir_torch_hooks {

thread_local const History::Recorded* History::current_call = nullptr;

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void History::set(bool enabled, cca::CreateContextFn recorder, std::size_t max_entries,
                  cca::RecordContext when, bool clear,
                  const std::vector<std::string>& skip_actions) {
  std::lock_guard lock(mutex_);
  recorder_ = enabled ? recorder : nullptr;
  on_ = enabled;
  recording_.store(enabled, std::memory_order_relaxed);
  when_ = when;
  skip_actions_ = skip_actions;
  max_entries_ = max_entries;
  if (clear || !enabled) {
    contexts_.clear();
    releases_.clear();
    annotations_.clear();
    own_entries_.clear();
  }
}

bool History::on() {
  std::lock_guard lock(mutex_);
  return on_;
}

std::optional<History::Recorded> History::record(bool alloc, int device) {
  if (!recording_.load(std::memory_order_relaxed))
    return std::nullopt;  // allocate/free without a lock
  cca::CreateContextFn recorder = nullptr;
  cca::RecordContext when{};
  Recorded out;
  {
    std::lock_guard lock(mutex_);
    if (!on_) return std::nullopt;
    recorder = recorder_;
    when = when_;
    out.compile_context = compile_context_of(device);
    out.user_metadata = metadata_of(device);
  }
  const bool wanted = recorder != nullptr && when != cca::RecordContext::NEVER &&
                      (alloc || when == cca::RecordContext::ALL);
  if (wanted) out.context = recorder();
  return out;
}

void History::note_alloc(const void* ptr, Recorded recorded) {
  std::lock_guard lock(mutex_);
  if (on_) contexts_[reinterpret_cast<std::size_t>(ptr)].allocs.push_back(std::move(recorded));
}

void History::note_free(const void* ptr, Recorded recorded) {
  std::lock_guard lock(mutex_);
  if (on_) contexts_[reinterpret_cast<std::size_t>(ptr)].frees.push_back(std::move(recorded));
}

std::shared_ptr<c10::GatheredContext> History::context_for(const void* ptr) {
  std::lock_guard lock(mutex_);
  auto it = contexts_.find(reinterpret_cast<std::size_t>(ptr));
  return it == contexts_.end() || it->second.allocs.empty() ? nullptr
                                                            : it->second.allocs.back().context;
}

void History::annotate(int device, const std::vector<std::pair<std::string, std::string>>& md) {
  std::lock_guard lock(mutex_);
  if (!on_) return;
  trace_types::AnnotationEntry entry(static_cast<c10::DeviceIndex>(device), 0);
  entry.time_.t_ = static_cast<time_t>(now_us());
  for (const auto& [name, value] : md) entry.recordUserMetadata(name, value);
  annotations_.push_back(std::move(entry));
  while (max_entries_ > 0 && annotations_.size() > max_entries_) annotations_.pop_front();
}

void History::annotate_memory(const void* ptr, int device, std::size_t size, cudaStream_t stream,
                              const std::string& metadata) {
#if RESERVOIR_TORCH_ANNOTATE_MEMORY
  std::lock_guard lock(mutex_);
  if (!on_) return;
  trace_types::TraceEntry te(trace_types::TraceEntry::ANNOTATE,
                             static_cast<c10::DeviceIndex>(device),
                             reinterpret_cast<std::size_t>(ptr), size, stream, {0, 0}, 0, nullptr,
                             compile_context_of(device), metadata);
  te.time_.t_ = static_cast<time_t>(now_us());
  keep_own_entry(std::move(te));
#else
  (void)ptr, (void)device, (void)size, (void)stream, (void)metadata;
#endif
}

void History::push_compile_context(int device, const std::string& context) {
  std::lock_guard lock(mutex_);
  if (on_) compile_contexts_[device].push_back(context);
}

void History::pop_compile_context(int device) {
  std::lock_guard lock(mutex_);
  auto it = compile_contexts_.find(device);
  if (it != compile_contexts_.end() && !it->second.empty()) it->second.pop_back();
}

void History::set_user_metadata(int device, const std::string& metadata) {
  std::lock_guard lock(mutex_);
  user_metadata_[device] = metadata;
}

std::string History::user_metadata(int device) {
  std::lock_guard lock(mutex_);
  return metadata_of(device);
}

void History::add_tracker(cca::AllocatorTraceTracker tracker) {
  std::lock_guard lock(mutex_);
  trackers_.push_back(std::move(tracker));
}

bool History::wants_events() {
  std::lock_guard lock(mutex_);
  return on_ || !trackers_.empty();
}

// Every event of reservoir's as it happens (under reservoir's lock): to
// PyTorch's trace trackers, and for history, the call a segment release
// happened in (empty_cache, or the allocation whose retry released it).
void History::on_event(void* self, int device, const char* action, std::size_t action_size,
                       unsigned long long addr, unsigned long long size, void* stream,
                       long long time_us) {
  auto* me = static_cast<History*>(self);
  const auto kind = trace_action(std::string(action, action_size));
  if (!kind) return;
  using TE = trace_types::TraceEntry;
  std::vector<cca::AllocatorTraceTracker> trackers;
  {
    std::lock_guard lock(me->mutex_);
    if (!me->trackers_.empty()) trackers = me->trackers_;  // no copy per event for history alone
    if (me->on_ && (*kind == TE::SEGMENT_FREE || *kind == TE::SEGMENT_UNMAP)) {
      me->releases_[addr].push_back(
          current_call != nullptr
              ? *current_call
              : Recorded{nullptr, me->compile_context_of(device), me->metadata_of(device)});
    }
  }
  if (trackers.empty()) return;
  TE te = trace_entry(*kind, device, addr, size, stream, nullptr, {}, {});
  te.time_.t_ = static_cast<time_t>(time_us != 0 ? time_us : now_us());
  for (const auto& tracker : trackers) tracker(te);
}

void History::add_device(cca::SnapshotInfo& out, int device, const nlohmann::json& snap,
                         MempoolId only, bool include_traces,
                         std::unordered_map<std::size_t, std::size_t>& alloc_seen,
                         std::unordered_map<std::size_t, std::size_t>& free_seen) {
  std::lock_guard lock(mutex_);
  const std::size_t first_segment = out.segments.size();
  for (const nlohmann::json& seg : snap["segments"]) {
    const MempoolId pool = pool_of(seg);
    if (only != kDefaultPools && pool != only) continue;
    trace_types::SegmentInfo info;
    info.device = static_cast<c10::DeviceIndex>(device);
    info.address = seg["address"].get<std::size_t>();
    info.total_size = seg["total_size"].get<std::size_t>();
    info.requested_size = seg["requested_size"].get<std::size_t>();
    info.allocated_size = seg["allocated_size"].get<std::size_t>();
    info.active_size = seg["active_size"].get<std::size_t>();
    info.stream = trace_stream(seg["stream"].get<std::uintptr_t>());
    info.is_large = seg["is_large"].get<bool>();
    info.is_expandable = seg["is_expandable"].get<bool>();
    info.owner_private_pool_id = pool;
    for (const nlohmann::json& b : seg["blocks"]) {
      trace_types::BlockInfo block;
      block.size = b["size"].get<std::size_t>();
      block.requested_size = b["requested_size"].get<std::size_t>();
      const std::string state = b["state"].get<std::string>();
      block.allocated = state == "active_allocated";
      block.active = state != "inactive";
      if (block.allocated) {
        auto it = contexts_.find(b["address"].get<std::size_t>());
        if (it != contexts_.end() && !it->second.allocs.empty()) {
          block.context_when_allocated = it->second.allocs.back().context;
        }
      }
      info.blocks.push_back(std::move(block));
    }
    out.segments.push_back(std::move(info));
  }
  std::size_t total_active = 0;
  for (std::size_t i = first_segment; i < out.segments.size(); ++i)
    total_active += out.segments[i].active_size;
  if (!include_traces) {
    note_snapshot(device, total_active);
    return;
  }
  auto& trace = out.device_traces[static_cast<std::size_t>(device)];
  using TE = trace_types::TraceEntry;
  const nlohmann::json& history = snap["history"];
  std::unordered_map<std::size_t, Recorded> last_free;
  std::unordered_map<std::size_t, std::shared_ptr<c10::GatheredContext>> last_alloc;
  std::unordered_map<std::size_t, std::size_t> release_seen;
  std::size_t own_entries_added = 0;
  for (std::size_t i = 0; i < history.size(); ++i) {
    const nlohmann::json& e = history[i];
    const std::string action = e["action"].get<std::string>();
    const auto kind = trace_action(action);
    // reservoir notes its own snapshots in the history; PyTorch's _snapshot() does not.
    if (!kind || *kind == TE::SNAPSHOT || skipped(action)) continue;
    const std::size_t addr = e["addr"].get<std::size_t>();
    Recorded recorded;
    recorded.compile_context = "N/A";
    // The k-th alloc (or free) at an address is the k-th call kept for
    // it; a segment made for an allocation has the allocation's, a
    // completed free the request's. (A segment given back has none:
    // which call gave it back, the history does not say.)
    if (*kind == TE::ALLOC || *kind == TE::FREE_REQUESTED) {
      const bool alloc = *kind == TE::ALLOC;
      auto& seen = alloc ? alloc_seen : free_seen;
      auto it = contexts_.find(addr);
      const std::size_t k = seen[addr]++;
      if (it != contexts_.end()) {
        const auto& list = alloc ? it->second.allocs : it->second.frees;
        if (k < list.size()) recorded = list[k];
      }
      if (alloc) {
        last_alloc[addr] = recorded.context;
      } else {
        // Without the free's frames (history keeping allocations'
        // only), the allocation's, as PyTorch's.
        if (recorded.context == nullptr) recorded.context = last_alloc[addr];
        last_free[addr] = recorded;
      }
    } else if (*kind == TE::FREE_COMPLETED) {
      auto it = last_free.find(addr);
      if (it != last_free.end()) recorded = it->second;
    } else if (*kind == TE::SEGMENT_ALLOC || *kind == TE::SEGMENT_MAP) {
      for (std::size_t j = i + 1; j < history.size(); ++j) {
        const std::string next = history[j]["action"].get<std::string>();
        if (next == "alloc") {
          const std::size_t at = history[j]["addr"].get<std::size_t>();
          auto it = contexts_.find(at);
          const std::size_t k = alloc_seen[at];
          if (it != contexts_.end() && k < it->second.allocs.size())
            recorded = it->second.allocs[k];
          break;
        }
        if (next != "segment_alloc" && next != "segment_map") break;
      }
    } else if (*kind == TE::SEGMENT_FREE || *kind == TE::SEGMENT_UNMAP) {
      // The call it happened in (no frames when history keeps
      // allocations' only, as PyTorch's).
      auto it = releases_.find(addr);
      const std::size_t k = release_seen[addr]++;
      if (it != releases_.end() && k < it->second.size()) recorded = it->second[k];
    }
    // context="state" keeps frames on the blocks in use only, as
    // PyTorch's: its trace entries have none.
    if (when_ == cca::RecordContext::STATE) recorded.context = nullptr;
    const auto time_us = e["time_us"].get<std::int64_t>();
    add_own_entries_until(trace, device, time_us, &own_entries_added);
    TE te = trace_entry(*kind, device, addr, e["size"].get<std::size_t>(),
                        e["stream"].get<std::uintptr_t>(), std::move(recorded.context),
                        std::move(recorded.compile_context), std::move(recorded.user_metadata));
    te.time_.t_ = static_cast<time_t>(time_us);
    trace.push_back(std::move(te));
  }
  add_own_entries_until(trace, device, std::numeric_limits<std::int64_t>::max(),
                        &own_entries_added);
  note_snapshot(device, total_active);  // in the traces of later snapshots, as PyTorch's
}

void History::add_annotations(cca::SnapshotInfo& out) {
  std::lock_guard lock(mutex_);
  out.external_annotations.assign(annotations_.begin(), annotations_.end());
}

std::optional<trace_types::TraceEntry::Action> History::trace_action(const std::string& a) {
  using A = trace_types::TraceEntry;
  static const std::map<std::string, A::Action> kActions = {{"alloc", A::ALLOC},
                                                            {"free_requested", A::FREE_REQUESTED},
                                                            {"free_completed", A::FREE_COMPLETED},
                                                            {"segment_alloc", A::SEGMENT_ALLOC},
                                                            {"segment_free", A::SEGMENT_FREE},
                                                            {"segment_map", A::SEGMENT_MAP},
                                                            {"segment_unmap", A::SEGMENT_UNMAP},
                                                            {"snapshot", A::SNAPSHOT},
                                                            {"oom", A::OOM}};
  auto it = kActions.find(a);
  if (it == kActions.end()) return std::nullopt;
  return it->second;
}

void History::keep_own_entry(trace_types::TraceEntry te) {
  own_entries_.push_back(std::move(te));
  while (max_entries_ > 0 && own_entries_.size() > max_entries_) own_entries_.pop_front();
}

void History::add_own_entries_until(std::vector<trace_types::TraceEntry>& trace, int device,
                                    std::int64_t time_us, std::size_t* next) const {
  std::size_t seen = 0;
  for (const auto& te : own_entries_) {
    if (te.device_ != device) continue;
    if (seen++ < *next) continue;
    if (static_cast<std::int64_t>(te.time_.t_) >= time_us) break;  // a tie: after the event
    trace.push_back(te);
    ++*next;
  }
}

void History::note_snapshot(int device, std::size_t total_active) {
  if (!on_ || skipped("snapshot")) return;
  trace_types::TraceEntry te =
      trace_entry(trace_types::TraceEntry::SNAPSHOT, device, 0, total_active, nullptr, nullptr,
                  compile_context_of(device), metadata_of(device));
  te.time_.t_ = static_cast<time_t>(now_us());
  keep_own_entry(std::move(te));
}

bool History::skipped(const std::string& action) const {
  return std::find(skip_actions_.begin(), skip_actions_.end(), action) != skip_actions_.end();
}

std::string History::compile_context_of(int device) const {
  auto it = compile_contexts_.find(device);
  return it == compile_contexts_.end() || it->second.empty() ? std::string("N/A")
                                                             : it->second.back();
}

std::string History::metadata_of(int device) const {
  auto it = user_metadata_.find(device);
  return it == user_metadata_.end() ? std::string() : it->second;
}

}  // namespace reservoir_torch_hooks
