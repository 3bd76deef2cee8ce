// The trace model: what a program asked of its allocator, and what the
// allocator asked of the device, as recorded by PyTorch's memory snapshots
// (torch.cuda.memory._dump_snapshot), RMM's log or our text format. The
// formats are in trace_formats.hpp, replay in replay.hpp, verify in verify.hpp.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "reservoir/config.hpp"
#include "reservoir/history.hpp"
#include "reservoir/snapshot.hpp"

namespace reservoir {

// A mark the program put into its recording: PyTorch's external_annotations
// (record_function ranges, START and END) and user_defined trace events
// (torch.cuda.memory._record_memory_history's annotations; stage empty).
struct TraceAnnotation {
  std::string stage;         // "START", "END", or "" for a point
  std::string name;
  std::int64_t time_us = 0;  // 0 when not recorded
  std::size_t event = 0;     // the index in Trace::events of the first event after it
  bool operator==(const TraceAnnotation&) const = default;
};

struct Trace {
  std::string name;             // file name, for messages
  std::string format;           // to_string(TraceFormat) of the format read
  std::string recorded_config;  // allocator settings the trace was recorded with (canonical text)
  AllocatorConfig settings;     // ... parsed once, by the reader
  // The oldest PyTorch release that writes what this snapshot holds (its
  // allocator_settings' keys, the keys of its settings text): "2.9" means
  // 2.9 or newer; "" when nothing tells.
  std::string pytorch_since;
  // The recording names the release it ran under (a reservoir allocator's
  // settings hold pytorch_version): pytorch_since is that release itself.
  bool pytorch_release_known = false;
  // Why the recorded settings text was not used as written (a key this
  // reservoir does not know, a backend it does not model); "" when it was.
  std::string settings_note;
  bool has_addresses = false;   // events carry real device addresses (snapshots)
  // False for a snapshot that does not record its allocator settings (PyTorch
  // before 2.3 wrote no allocator_settings): recorded_config is then a guess.
  bool settings_recorded = true;
  int device = 0;                // the device these events and segments are of
  std::size_t device_count = 1;  // devices the file holds traces of
  // The device port that recorded it: "cuda", or "npu" for Ascend's
  // torch_npu, which writes the same format (told by its stack frames).
  std::string port = "cuda";
  std::vector<TraceEvent> events;
  // PyTorch 2.15 and later record the pool of each event (pool_id): true
  // when these events carry it. The events of private pools (a CUDA graph's,
  // a MemPool's) by index; default-pool events are not listed.
  bool event_pools_recorded = false;
  std::unordered_map<std::size_t, PoolId> event_pools;
  // Events each device of the file holds (snapshots; one entry otherwise).
  std::vector<std::uint64_t> device_events;
  // The allocator settings text the program ran with, as recorded
  // (allocator_settings' PYTORCH_CUDA_ALLOC_CONF; empty when none).
  std::string recorded_settings_text;
  // The program's annotations, in recorded order (this device's).
  std::vector<TraceAnnotation> annotations;
  // What the reader met but no tool models, kept to be reported: keys it
  // does not know ("device_traces[].pool_ids" -> count) and actions it
  // skipped (a newer PyTorch's; name -> count).
  std::map<std::string, std::uint64_t> unknown_keys;
  std::map<std::string, std::uint64_t> skipped_actions;
  // Segments at the end of recording (snapshots), and the contexts that
  // events and blocks refer to (final_state.contexts; [0] is the empty one).
  Snapshot final_state;
  const Context& context(std::uint32_t id) const { return final_state.contexts.at(id); }
};

// Sets the settings a trace was recorded with from config text (parsed
// once, here). Throws ConfigError for text no config accepts.
void set_recorded_config(Trace& trace, const std::string& text);

// An allocator snapshot (with its history) as a trace, for writing or replay.
Trace to_trace(Snapshot snapshot, std::string name, const std::string& recorded_config);

// Frames of this file name carry annotations in written snapshots.
inline constexpr std::string_view kAnnotationFile = "<annotation>";

}  // namespace reservoir
