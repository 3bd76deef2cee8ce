// Replay: a trace compiled to allocator operations, run on a simulated
// device under any configuration, and the smallest capacity it runs in.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/trace_model.hpp"

namespace reservoir {

// A trace compiled to allocator operations on dense ids.
struct ReplayOp {
  // stream_use: record_stream(id's block, stream) (generated programs; a
  // recording has none).
  enum class Kind : std::uint8_t { alloc, free, empty_cache, stream_use } kind;
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
  // With CompileOptions::failed_requests: the index in `ops` of the latest
  // request that ran out of memory in the recording, and of its oom event
  // (none or one).
  std::vector<std::uint64_t> failed_request_ops;
  std::vector<std::uint64_t> failed_request_events;
};
struct CompileOptions {
  // Make the latest request that ran out of memory in the recording (its
  // oom event) an alloc, freed at once: a setting that fits serves it,
  // beside everything alive then. An earlier one got no memory and the
  // program went on without it (a batch-size finder, a service failing one
  // request): it is its retry ladder's release of the cache (an
  // empty_cache op), not an allocation. Off, the program is what the
  // recording served.
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

// The capacity of a replay's device when none is given: more than any GPU
// holds (16 TiB), so nothing a real recording asks runs out of memory, and
// small enough that a page table of it (8 Mi pages of 2 MiB) stays cheap:
// a request beyond it is an out-of-memory result, quickly.
inline constexpr std::uint64_t kUnboundedCapacity = std::uint64_t{1} << 44;

struct ReplayOptions {
  std::optional<std::uint64_t> capacity;  // device capacity; kUnboundedCapacity when empty
  std::optional<double> memory_fraction;  // set_memory_fraction before the replay
  bool validate_each_step = false;        // run the invariant validator after every op
  ReplayObserver* observer = nullptr;     // not owned; also sees min_capacity's probes
  // Keep the reserved bytes after every op (ReplayResult::reserved_after_op).
  bool keep_reserved = false;
  // Another replay's reserved_after_op for the same program under the native
  // policy: the result then says how far this one went above it at the same
  // op (ReplayResult::over_native). Not owned; min_capacity ignores it.
  const std::vector<std::uint64_t>* native_reserved = nullptr;
  // min_capacity stops bisecting once the range is within this fraction of
  // its upper end (0: to the 2 MiB step, exact); refine_min_capacity ends it.
  double min_capacity_tolerance = 0.0;
  // false: min_capacity does not replay at the capacity it is given where the
  // program's requests alone exceed it (the unlimited replay's peak of
  // requested bytes), which cannot fit and tells the search nothing; its
  // result then has no at_capacity.
  bool min_capacity_replay_at_hopeless_capacity = true;
  // Stop at the first request that runs out of memory (the result's other
  // figures then cover the ops up to it): what min_capacity's probes need to
  // know, sooner.
  bool stop_at_first_oom = false;
  // The simulated device gives a segment the lowest freed range it fits
  // (SimDeviceOptions::reuse_freed_addresses), as a real driver can.
  bool reuse_freed_addresses = false;
};

// One device page per stream: the native bound's slack when a config names none.
inline constexpr std::uint64_t kNativeBoundPage = std::uint64_t{2} << 20;

// How far a replay's reserved memory went above the native policy's for the
// same program at the same op (policy:paging's native bound, docs/config.md).
struct OverNative {
  std::uint64_t worst_bytes = 0;  // the most reserved above native's (0: never above)
  std::uint64_t worst_op = 0;     // where
  // The bound: native's reserved plus slack_bytes per stream allocated on so
  // far (the config's paging_slack_mb, else one 2 MiB page per stream).
  std::uint64_t slack_bytes = 0;
  std::uint64_t ops_over_bound = 0;  // ops after which reserved was above the bound
  std::uint64_t worst_over_bound_bytes = 0;
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
  std::vector<std::uint64_t> reserved_after_op;  // with ReplayOptions::keep_reserved
  std::optional<OverNative> over_native;         // with ReplayOptions::native_reserved
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
  ReplayResult unlimited;     // the replay with no limit the search starts from
  // The replay at the capacity asked about (min_capacity's `at`), which the
  // search used as one of its probes.
  std::optional<ReplayResult> at_capacity;
  // The largest capacity known not to fit: `bytes` is exact when it is one
  // step below (a search with a tolerance may stop sooner).
  std::uint64_t below = 0;
};

ReplayResult replay(const ReplayProgram& program, const AllocatorConfig& config,
                    const std::string& config_text, const ReplayOptions& options = {});

// The smallest device capacity, in 2 MiB steps, on which the program runs with
// no out-of-memory error (the retry ladder included), found by bisection
// between the peak of requested bytes and the peak reserved with no limit.
// options.capacity is ignored; options.memory_fraction applies to each probe.
// With `at` (a device's capacity), the replay at it is one of the probes, and
// is returned (at_capacity): fitting or not, it halves the range searched.
MinCapacityResult min_capacity(const ReplayProgram& program, const AllocatorConfig& config,
                               const std::string& config_text, const ReplayOptions& options = {},
                               std::optional<std::uint64_t> at = std::nullopt);

// Ends a search min_capacity stopped within its tolerance: the exact minimum
// between result.below and result.bytes (result updated, its replays added).
void refine_min_capacity(const ReplayProgram& program, const AllocatorConfig& config,
                         const std::string& config_text, const ReplayOptions& options,
                         MinCapacityResult& result);

}  // namespace reservoir
