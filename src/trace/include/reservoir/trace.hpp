// Allocation traces: what a program asked of its allocator, and what the
// allocator asked of the device, as recorded by PyTorch's memory snapshots
// (torch.cuda.memory._dump_snapshot) or written by hand in our text format.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "reservoir/caching_allocator.hpp"
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
  // Why the recorded settings text was not used as written (a key this
  // reservoir does not know, a backend it does not model); "" when it was.
  std::string settings_note;
  bool has_addresses = false;   // events carry real device addresses (snapshots)
  // False for a snapshot that does not record its allocator settings (PyTorch
  // before 2.4 wrote no allocator_settings): recorded_config is then a guess.
  bool settings_recorded = true;
  int device = 0;                // the device these events and segments are of
  std::size_t device_count = 1;  // devices the file holds traces of
  // The device port that recorded it: "cuda", or "npu" for Ascend's
  // torch_npu, which writes the same format (told by its stack frames).
  std::string port = "cuda";
  std::vector<TraceEvent> events;
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

// The formats a trace file may be in, told apart by their first bytes: a
// pickle opens with PROTO (0x80), JSON with '{', RMM's CSV log with its
// header line ("Thread,"); anything else is read as our text format.
enum class TraceFormat { pytorch_pickle, snapshot_json, rmm_csv, text };
TraceFormat detect_trace_format(std::string_view bytes) noexcept;
// "pytorch-snapshot", "snapshot-json", "rmm-csv", "reservoir-text": the
// names Trace::format carries.
std::string_view to_string(TraceFormat format) noexcept;

// What a reader reads beyond the events: stacks (contexts) cost time and
// memory that replay does not need.
struct ReadOptions {
  bool contexts = true;  // false: every event and block has context 0
  // Called with a byte offset of the input once the reader has moved past
  // it for good (every few MB): read_trace_file hands a mapped file's pages
  // back behind the reader with it, so a large snapshot is never held whole.
  std::function<void(std::size_t offset)> consumed;
};

// Reads a trace, choosing the reader by content: a pickle (PyTorch snapshot),
// JSON (our snapshot export), RMM's CSV log (its header line), or our text
// format ("reservoir-trace" header). `device` picks one device's events and
// segments from a snapshot (Trace::device_count says how many it holds).
// Throws TraceError naming the file and the byte offset, line or field of
// the problem.
Trace read_trace_file(const std::string& path, int device = 0);
// Every device of a trace file, read once (one entry for formats that hold
// one device): entry d is device d, with no events when it recorded none.
std::vector<Trace> read_trace_devices(const std::string& path, const ReadOptions& options = {});
// The devices a tool works on: `device` when set (TraceError when the file
// has no such device), else every device with events or segments (device 0
// when none has any).
std::vector<Trace> select_devices(std::vector<Trace> devices, std::optional<int> device);
// PyTorch snapshot pickle, already in memory.
Trace read_pytorch_snapshot(std::span<const std::uint8_t> data, const std::string& name,
                            int device = 0, const ReadOptions& options = {});
std::vector<Trace> read_pytorch_snapshot_devices(std::span<const std::uint8_t> data,
                                                 const std::string& name,
                                                 const ReadOptions& options = {});
// reservoir's text format (docs/replay.md).
Trace read_text_trace(const std::string& text, const std::string& name);
std::string write_text_trace(const Trace& trace);
// Writes a trace as a PyTorch snapshot pickle (segments from final_state,
// device_traces from events, allocator_settings from recorded_config), which
// read_pytorch_snapshot reads back to the same trace.
std::string write_pytorch_snapshot(const Trace& trace);
// The same dict as JSON (keys and nesting as the pickle's; integers exact).
std::string write_snapshot_json(const Trace& trace);
// A snapshot of the allocator in JSON, read back to the same trace.
Trace read_snapshot_json(const std::string& text, const std::string& name, int device = 0);
std::vector<Trace> read_snapshot_json_devices(const std::string& text, const std::string& name);
// RMM's logging_resource_adaptor CSV (Thread,Time,Action,Pointer,Size,Stream).
Trace read_rmm_csv(const std::string& text, const std::string& name);
// An allocator snapshot (with its history) as a trace, for writing or replay.
Trace to_trace(Snapshot snapshot, std::string name, const std::string& recorded_config);

// Frames of this file name carry annotations in written snapshots.
inline constexpr std::string_view kAnnotationFile = "<annotation>";

// ---- replay ---------------------------------------------------------------

// A trace compiled to allocator operations on dense ids.
struct ReplayOp {
  enum class Kind : std::uint8_t { alloc, free, empty_cache } kind;
  std::uint32_t id;
  std::uint64_t size;
  StreamId stream;
};
struct ReplayProgram {
  std::string name;
  int device = 0;  // the recording's device (memory_summary names it)
  // The PyTorch release the recording shows (Trace::pytorch_since): a
  // replay under a config that names none takes that release's rules.
  std::string pytorch_version;
  std::vector<ReplayOp> initial;  // blocks live when recording began, in address order
  std::vector<ReplayOp> ops;      // then the recorded requests, in order
  std::vector<std::uint64_t> op_events;  // per op in `ops`: the recorded event it came from
  std::uint32_t id_count = 0;
  std::uint64_t recorded_events = 0;
  // Per id: the context of its recorded alloc event (the trace's contexts;
  // 0 when none or when the block was live before recording began).
  std::vector<std::uint32_t> contexts;
  // With CompileOptions::failed_requests: the index in `ops` of each request
  // that ran out of memory in the recording, and of its oom event.
  std::vector<std::uint64_t> failed_request_ops;
  std::vector<std::uint64_t> failed_request_events;
};
struct CompileOptions {
  // Make each request that ran out of memory in the recording (its oom
  // event) an alloc, freed at once: a setting that fits serves it, beside
  // everything alive then. Off, the program is what the recording served.
  bool failed_requests = false;
};
// Blocks live at the start are those freed before any alloc at their address,
// plus those still allocated at the end that no event touches.
ReplayProgram compile(const Trace& trace, const CompileOptions& options = {});

// Sees a replay as it runs: reports, summaries and progress build on it.
class ReplayObserver {
 public:
  virtual ~ReplayObserver() = default;
  virtual void on_start(CachingAllocator& /*allocator*/, const ReplayProgram& /*program*/) {}
  // After each op (the initial ones first, then program.ops); `ptr` is what
  // an alloc returned (null when it ran out of memory), else null.
  virtual void on_op(std::uint64_t /*index*/, const ReplayOp& /*op*/, const void* /*ptr*/) {}
  virtual void on_finish(CachingAllocator& /*allocator*/) {}
};

// Captures the allocator's segments just before global op `before` of a
// replay (after op before-1; the state at the start when before is 0), with
// the request id of each live block.
class ReplayStateCapture : public ReplayObserver {
 public:
  explicit ReplayStateCapture(std::uint64_t before) : before_(before) {}
  void on_start(CachingAllocator& allocator, const ReplayProgram& program) override;
  void on_op(std::uint64_t index, const ReplayOp& op, const void* ptr) override;

  bool taken = false;
  Snapshot snapshot;
  std::unordered_map<DevicePtr, std::uint32_t> id_at;  // live block address -> request id

 private:
  void take();
  std::uint64_t before_;
  CachingAllocator* allocator_ = nullptr;
  std::vector<DevicePtr> ptrs_;
};

struct ReplayOptions {
  std::optional<std::uint64_t> capacity;  // device capacity; unlimited when empty
  std::optional<double> memory_fraction;  // set_memory_fraction before the replay
  bool validate_each_step = false;        // run the invariant validator after every op
  ReplayObserver* observer = nullptr;     // not owned; also sees min_capacity's probes
};

struct ReplayResult {
  std::string trace;
  std::string config;
  std::uint64_t events = 0;  // recorded events the program came from
  std::uint64_t ops = 0;     // allocator calls made
  std::uint64_t peak_requested_bytes = 0;
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;
  std::uint64_t peak_reserved_op = 0;  // index of the op at which reserved peaked
  std::uint64_t final_reserved_bytes = 0;
  std::int64_t device_allocs = 0;
  std::int64_t device_frees = 0;
  std::int64_t num_alloc_retries = 0;
  std::int64_t num_ooms = 0;
  std::string first_oom;             // message of the first out-of-memory error
  double device_call_seconds = 0.0;  // latency-model estimate
  double wall_seconds = 0.0;
  std::uint64_t allocations = 0;   // alloc calls made (including ones that ran out of memory)
  std::uint64_t device_calls = 0;  // memory-management calls: kMemoryCallKinds
};

// Device calls that obtain or return memory or address space: what
// "device calls" counts in replay results.
inline constexpr CallKind kMemoryCallKinds[] = {
    CallKind::allocate_segment, CallKind::free_segment,     CallKind::reserve,
    CallKind::unreserve,        CallKind::create_physical,  CallKind::release_physical,
    CallKind::map,              CallKind::unmap,            CallKind::set_access};

struct MinCapacityResult {
  std::uint64_t bytes = 0;    // smallest capacity (a multiple of 2 MiB) with no out-of-memory
  std::uint64_t replays = 0;  // replays the search ran
};

ReplayResult replay(const ReplayProgram& program, const AllocatorConfig& config,
                    const std::string& config_text, const ReplayOptions& options = {});

// The smallest device capacity, in 2 MiB steps, on which the program runs with
// no out-of-memory error (the retry ladder included), found by bisection
// between the peak of requested bytes and the peak reserved with no limit.
// options.capacity is ignored; options.memory_fraction applies to each probe.
MinCapacityResult min_capacity(const ReplayProgram& program, const AllocatorConfig& config,
                               const std::string& config_text, const ReplayOptions& options = {});

// ---- verify -----------------------------------------------------------------

struct VerifyResult {
  bool agreed = false;
  // Set when verify stopped not on a disagreement but on something the
  // recording does not say enough about to check (a private pool's
  // allocations, settings the snapshot does not record, garbage collection
  // under an unrecorded memory fraction): `divergence` then says what and why,
  // at divergence_event.
  bool cannot_verify = false;
  std::uint64_t events = 0;
  std::uint64_t allocs_checked = 0;
  std::uint64_t segment_allocs_checked = 0;
  std::uint64_t segment_frees_checked = 0;
  std::uint64_t segment_maps_checked = 0;    // expandable segments: pages mapped
  std::uint64_t segment_unmaps_checked = 0;  // ... and unmapped
  std::uint64_t reservations_checked = 0;    // ... and new address-space reservations
  std::uint64_t ooms_checked = 0;          // oom events reservoir also ran out of memory at
  std::uint64_t empty_cache_calls = 0;     // release runs shown to be the program's empty_cache()
  // Release runs before a device request that no frames explain and that
  // freed every unused segment, as empty_cache() and the retry ladder's last
  // rung both do: applied as empty_cache() (the same segments go either way).
  std::uint64_t undecided_releases = 0;
  std::uint64_t allocator_releases = 0;    // release runs made by the retry ladder
  std::uint64_t garbage_collections = 0;   // release runs made by garbage collection
  std::uint64_t zero_size_skipped = 0;     // zero-byte alloc/free events (no allocator work)
  std::uint64_t private_pool_segments = 0; // final segments of private pools, left out
  std::uint64_t private_pool_bytes = 0;     // ... and their total size
  std::uint64_t initial_segments = 0;       // segments (expandable: mapped ranges) at the start
  std::uint64_t initial_reservations = 0;   // expandable segments' reservations at the start
  std::uint64_t initial_free_segments = 0;  // of them: wholly free (cached) at the start
  std::uint64_t initial_live_blocks = 0;
  std::uint64_t unsplit_tails = 0;  // live-at-start blocks found to carry an unsplit tail
  bool final_state_checked = false;
  std::uint64_t divergence_event = 0;  // index into the recorded events
  std::string divergence;              // what differed, and the state that explains it
  // The PyTorch release whose rules were verified (AllocatorConfig::
  // pytorch_version): the recording's own when it shows one from 2.12 on;
  // for one that shows 2.4 to 2.11 (which 2.12 writes alike), "2.12" when
  // only that release's rules agree; "" otherwise.
  std::string pytorch_rules;
};

// Replays a PyTorch snapshot with the settings it was recorded with, giving
// each new segment the recorded address, and checks every alloc address,
// segment_alloc size and segment_free against the recording, then the final
// segment layout. Runs of segment frees are applied as the program's
// empty_cache() or left to the allocator's retry ladder or garbage
// collection as docs/replay.md describes. Throws TraceError when the trace
// cannot be verified at all (no addresses, unreadable settings).
VerifyResult verify(const Trace& trace);
// The same, calling `watch` after each recorded event verify has checked and
// agreed with (index into trace.events, and the allocator in that state).
// Where verify reads the recording again from the start (another reading of
// a run of releases, or of the release's rules), the watch sees the events
// again: the last call for an event is the one that holds.
using VerifyWatch = std::function<void(std::size_t event, const CachingAllocator& allocator)>;
VerifyResult verify(const Trace& trace, const VerifyWatch& watch);

// What a snapshot does not record about the process it came from.
struct VerifyOptions {
  // torch.cuda.set_per_process_memory_fraction(F), set before the recording
  // began, and the device's total memory (torch.cuda.mem_get_info()[1]):
  // with both, the allocator's own limit (F x total) is applied, and
  // garbage_collection_threshold collects exactly as PyTorch does, instead
  // of taking a recorded run of releases for its work. Both or neither.
  std::optional<double> memory_fraction;
  std::optional<std::uint64_t> device_memory;
};
VerifyResult verify(const Trace& trace, const VerifyOptions& options,
                    const VerifyWatch& watch = {});

}  // namespace reservoir
