// Advice from one recording: why a job ran out of memory (or where its
// reserved memory peaked), and which allocator setting makes it fit, found by
// replaying the recording under each candidate setting on a simulated device.
// `reservoir advise` prints it; docs/tools.md documents the figures.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "reservoir/trace.hpp"

namespace reservoir {

// Free memory of one pool and stream inside segments that also hold live
// blocks: memory the allocator cannot give back, usable only by requests
// that fit in its pieces.
struct FreeGroup {
  bool large = true;
  StreamId stream = 0;
  std::uint64_t bytes = 0;
  std::uint64_t blocks = 0;
  std::uint64_t largest = 0;
};

// A live block of a segment that holds unusable free memory.
struct PinningBlock {
  DevicePtr address = 0;
  std::uint64_t size = 0;
  std::uint32_t context = 0;  // index into the trace's contexts; 0 when unknown
};

struct PinnedSegment {
  DevicePtr address = 0;
  std::uint64_t total = 0;
  std::uint64_t free_bytes = 0;
  std::uint64_t largest_free = 0;
  StreamId stream = 0;
  bool large = true;
  std::vector<PinningBlock> live;  // largest first
};

// The request that ran out of memory, and why nothing could serve it.
struct FailedRequest {
  std::uint64_t size = 0;          // as requested
  std::uint64_t rounded = 0;       // as the recorded settings round it
  std::uint64_t segment_size = 0;  // the device allocation a new segment would need
  StreamId stream = 0;
  bool large = true;
  std::uint32_t context = 0;
  std::uint64_t largest_same_stream = 0;   // largest free block of its pool and stream
  std::uint64_t largest_other_stream = 0;  // ... of its pool on other streams
  std::uint64_t ladder_released = 0;       // cached memory the retry ladder gave back first
  std::vector<std::string> reasons;        // each a sentence, in the order they apply
};

struct Diagnosis {
  // The PyTorch release whose rules verify agreed with the recording by
  // (VerifyResult::pytorch_rules; "" when it did not agree): the replays of
  // advice follow them.
  std::string pytorch_rules;
  // "oom": at the recording's first out-of-memory error; "peak_reserved":
  // where reserved memory peaked (the recording has no oom event).
  std::string moment;
  std::uint64_t event = 0;  // index into the recorded events
  // The recording ends at its error (no allocation after the failed one):
  // it shows the program only up to the failed request, and every capacity
  // found covers that part only (scope_text()).
  bool ends_at_error = false;
  // The peak is where the recording started: reserved memory never rose
  // above what was already reserved then (segments cached before it).
  bool at_recording_start = false;
  // "verified": the state of an exact replay of the recording (verify's);
  // "replayed": of a replay under the recorded settings (verify could not
  // reach the moment: text traces, private pools, divergences).
  std::string source;
  std::string source_note;  // why the replay was used, when it was
  // What the program was doing then, in its own words: the record_function
  // ranges open at the moment (external_annotations, outermost first) and
  // the last user annotation before it ("" when none).
  std::vector<std::string> during;
  std::string last_mark;
  // The last range that ended before the moment, and how long before (in
  // microseconds; empty when the recording has no times).
  std::string last_ended;
  std::optional<std::int64_t> last_ended_us_before;
  std::uint64_t allocated_bytes = 0;
  std::uint64_t reserved_bytes = 0;
  // reserved - allocated, by cause: free pieces of split segments, whole
  // cached segments, blocks waiting on other streams' work (record_stream).
  std::uint64_t split_free_bytes = 0;
  std::vector<FreeGroup> split_free;  // per pool and stream, most bytes first
  std::uint64_t cached_segment_bytes = 0;
  std::uint64_t cached_segments = 0;
  std::uint64_t pending_free_bytes = 0;
  std::uint64_t pending_free_blocks = 0;
  std::optional<std::uint64_t> device_free_bytes;  // recorded with the oom
  // Device memory neither this allocator's nor free: capacity - reserved -
  // device free, when a capacity was given and the oom recorded the free memory.
  std::optional<std::uint64_t> outside_bytes;
  // When the device had room for the new segment the failed request needed,
  // what refused it was the process's own limit
  // (torch.cuda.set_per_process_memory_fraction): at least what the
  // allocator held, and below that plus the segment. Set with both bounds.
  std::optional<std::uint64_t> limit_at_least;
  std::optional<std::uint64_t> limit_below;
  std::optional<FailedRequest> request;  // with moment "oom"
  std::vector<PinnedSegment> worst_segments;  // most unusable free memory first
  Snapshot segments;                          // the allocator's segments at the moment
};

// One allocator setting, replayed.
struct Candidate {
  std::string config;         // PYTORCH_CUDA_ALLOC_CONF syntax; "" for the defaults
  bool reservoir_only = false;  // a reservoir policy stock PyTorch does not have
  bool recorded = false;        // the settings the recording was made with
  // The replays run under this memory fraction (garbage collection runs only
  // under one): the program must call set_per_process_memory_fraction too.
  std::optional<double> memory_fraction;
  std::uint64_t min_capacity_bytes = 0;
  // To the 2 MiB step; false: within AdviseOptions::tolerance above it.
  bool min_capacity_exact = true;
  double min_capacity_over_requested = 0.0;
  std::uint64_t peak_reserved_bytes = 0;  // with no capacity limit
  // Of the replay at the capacity when one is known, else with no limit.
  double device_calls_per_1000_allocs = 0.0;
  double device_call_seconds = 0.0;
  std::optional<std::int64_t> ooms_at_capacity;
  std::uint64_t replays = 0;
};

struct Advice {
  std::string trace;
  std::string recorded_config;
  // The oldest PyTorch release the recording shows ("" when none), and the
  // variable advice for it is written in (pytorch_env_var).
  std::string pytorch_since;
  std::string pytorch_env = "PYTORCH_CUDA_ALLOC_CONF";
  // pytorch_since is AdviseOptions::torch_version, not what the recording shows.
  bool torch_version_given = false;
  // The recording names the release it ran under (Trace::pytorch_release_known).
  bool pytorch_release_known = false;
  std::uint64_t peak_requested_bytes = 0;
  // The memory the allocator may have: --capacity, else what the oom event
  // shows it had (reserved + device free); empty when neither is known.
  std::optional<std::uint64_t> capacity_bytes;
  std::string capacity_source;  // "given", "oom event", or ""
  Diagnosis diagnosis;
  std::vector<Candidate> candidates;
  // Indexes into candidates: the best of stock PyTorch's settings (none when
  // only reservoir policies were swept), and the best of all, on reservoir.
  std::optional<std::size_t> best_pytorch;
  std::size_t best_reservoir = 0;
  // With a capacity: whether the best PyTorch setting (else the best of all)
  // fits, and, when even
  // peak requested memory exceeds it, by how much the program must shrink.
  std::optional<bool> fits;
  std::optional<std::uint64_t> shrink_bytes;
  std::uint64_t replays = 0;
  double seconds = 0.0;
};

struct AdviseOptions {
  std::optional<std::uint64_t> capacity;
  // The PyTorch release the settings are written for ("2.5"); empty: the
  // oldest the recording shows (Trace::pytorch_since).
  std::string torch_version;
  // Settings to sweep; empty: default_sweep() plus the recorded settings.
  std::vector<std::string> configs;
  unsigned threads = 0;  // 0: every core
  // Each minimum capacity within this fraction above the exact one (0:
  // exact); the recorded settings' and the best ones' are made exact after.
  double tolerance = 0.0;
  // false (the answer at an error, which shows no such count): a setting whose
  // requests alone exceed the capacity is not replayed at it, so its
  // ooms_at_capacity is empty and its device calls are those with no limit.
  bool count_ooms_at_capacity = true;
  // Called after each candidate is done (from worker threads, serialized).
  std::function<void(std::size_t done, std::size_t total)> progress;
};

// The settings swept by default: PyTorch's defaults; max_split_size_mb from
// 20 MiB to 2 GiB; roundup_power2_divisions 1 to 16 and a bucketed form;
// garbage_collection_threshold with max_split_size_mb; expandable segments;
// combinations; and reservoir's policy:paging. With `pytorch_since` (the
// oldest release the recording shows, Trace::pytorch_since), only settings
// whose keys that release knows, and for newer ones their own keys
// (max_non_split_rounding_mb from 2.4, large_segment_size_mb from 2.11);
// empty: a recording that shows no release (2.0 to 2.3).
std::vector<std::string> default_sweep(std::string_view pytorch_since = "2.3");

// A stream as people know it: "the default stream" for PyTorch's default
// (legacy) stream, else "stream 0x7f...".
std::string stream_name(std::uint64_t stream);

// The environment variable the recording's PyTorch reads its settings from:
// PYTORCH_ALLOC_CONF from 2.9 on, PYTORCH_CUDA_ALLOC_CONF before.
std::string_view pytorch_env_var(std::string_view pytorch_since);

// What a recording that ends at its error can say (Diagnosis::ends_at_error),
// in one paragraph: the capacities cover the recorded part, and how to check
// the rest. Every view of advice built on such a recording says it.
std::string scope_text();

// The state at the moment that matters, read from the recording.
Diagnosis diagnose(const Trace& trace, std::optional<std::uint64_t> capacity = std::nullopt);

// Diagnosis and sweep. Throws TraceError for a trace with nothing to replay
// and ConfigError for a bad setting in options.configs.
Advice advise(const Trace& trace, const AdviseOptions& options = {});

// ---- a job of many ranks ------------------------------------------------------

// One rank's recording (one device of one file), as the job sees it.
struct RankAdvice {
  std::string path;
  std::string name;  // "rank 3" (from the file name), else the file name; "(device N)" added
  int device = 0;
  bool ok = false;
  std::string error;  // why the file could not be read or advised on, when !ok
  bool ran_out = false;                       // it holds an oom entry
  std::optional<std::uint64_t> oom_request;   // the request that failed
  std::string moment;                         // the diagnosis's
  bool ends_at_error = false;                 // the diagnosis's
  std::uint64_t peak_requested_bytes = 0;
  std::uint64_t allocated_bytes = 0;          // at the moment
  std::uint64_t reserved_bytes = 0;
  std::uint64_t unusable_bytes = 0;           // reserved - allocated at the moment
  std::uint64_t largest_allocation = 0;       // the largest block live at the moment
  std::optional<std::uint64_t> capacity_bytes;
  std::vector<std::string> during;            // the diagnosis's
  std::vector<Candidate> candidates;          // as the rank's own advice sweeps them
  std::string pytorch_since;
  bool pytorch_release_known = false;         // Advice::pytorch_release_known
};

// One setting across the job: the capacity its hungriest rank needs.
struct JobCandidate {
  std::string config;
  bool reservoir_only = false;
  std::optional<double> memory_fraction;
  std::uint64_t worst_min_capacity_bytes = 0;  // the largest over the ranks
  std::string worst_rank;                      // the rank that needs it
};

struct JobAdvice {
  std::vector<RankAdvice> ranks;  // in the order of the files (then devices)
  std::vector<JobCandidate> candidates;
  std::optional<std::size_t> best_pytorch;  // least worst-rank capacity, stock PyTorch
  std::size_t best_reservoir = 0;
  // The memory one rank's allocator may have: --capacity, else the least
  // that any rank's oom entry shows; whether the best setting fits every rank.
  std::optional<std::uint64_t> capacity_bytes;
  std::optional<bool> fits;
  std::string pytorch_env = "PYTORCH_CUDA_ALLOC_CONF";
  std::string pytorch_since;
  bool pytorch_release_known = false;  // every rank names the same release it ran under
  std::size_t unreadable = 0;
  double seconds = 0.0;
};

struct JobOptions {
  std::optional<std::uint64_t> capacity;
  std::string torch_version;  // as AdviseOptions::torch_version
  std::vector<std::string> configs;  // as AdviseOptions::configs
  std::optional<int> device;         // only this device of each file
  unsigned threads = 0;              // files analysed at once (0: every core)
  // Called after each file is done (serialized): files done, files in all.
  std::function<void(std::size_t done, std::size_t total)> progress;
  // Called in the worker that advised a rank, while its trace and advice are
  // still in memory (for a per-rank page); at most `threads` are held at
  // once, and calls run concurrently: what it shares, it synchronizes.
  std::function<void(const Trace&, const Advice&, const RankAdvice&)> on_rank;
};

// Advises on every rank's recording, files in parallel (each file's sweep on
// one core), and on one setting for them all. A file that cannot be read is
// a rank with ok == false and its reason; the others are still advised.
JobAdvice advise_job(const std::vector<std::string>& paths, const JobOptions& options = {});

// The files of a job named by paths, folders (their .pickle and .json files)
// and glob patterns, in natural order (rank2 before rank10). Throws
// UsageError for a pattern or folder that names no file.
// In a folder, the files the live answer wrote for one process's errors
// (HOST[-rankR]-YYYYmmdd-HHMMSS[-N].pickle, a process that caught its errors
// and went on) are one rank's errors: only the latest is advised on, and
// `errors_of`, when given, gets each such rank's latest file and the earlier
// ones set aside.
struct RankErrors {
  std::string latest;
  std::vector<std::string> earlier;  // oldest first
};
std::vector<std::string> job_files(const std::vector<std::string>& args,
                                   std::vector<RankErrors>* errors_of = nullptr);

// The line that selects the candidate: PYTORCH_CUDA_ALLOC_CONF=<config> (or
// the advice to leave it unset) for stock PyTorch; RESERVOIR_ALLOC_CONF=<config>
// for reservoir's allocator (which reads it first) and its own policies.
std::string env_line(const Candidate& candidate, bool on_reservoir = false,
                     std::string_view pytorch_env = "PYTORCH_CUDA_ALLOC_CONF");

}  // namespace reservoir
