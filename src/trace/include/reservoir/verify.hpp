// Verify: a recorded PyTorch snapshot replayed with its own settings and
// every recorded decision checked (docs/replay.md).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/trace_model.hpp"

namespace reservoir {

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
  // What mapped the pages below: "" for PyTorch's expandable segments, else
  // reservoir's page policy ("policy:native_paged's segments", ...).
  std::string pages_of;
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
  // The device's total memory the replay took: given (VerifyOptions::
  // device_memory), or, for a recording with pages mapped (expandable
  // segments, reservoir's page policies) that ran out of memory, inferred as
  // the most the process's mapped memory and the device's free memory at an
  // oom add up to (how far a map gets before the device refuses it decides
  // what follows); none otherwise (a device without limit).
  std::optional<std::uint64_t> device_memory;
  bool device_memory_inferred = false;
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
  // of taking a recorded run of releases for its work. A fraction needs the
  // total. The total alone replays on a device of that size, used by the
  // process alone: reservoir's page policies map by its free memory.
  std::optional<double> memory_fraction;
  std::optional<std::uint64_t> device_memory;
  // The allocator settings (PYTORCH_CUDA_ALLOC_CONF) the program ran under,
  // for a snapshot that does not record them (PyTorch before 2.3): taken in
  // place of PyTorch's defaults. A snapshot that records settings other
  // than these is refused (UsageError), as neither can be checked then.
  std::optional<AllocatorConfig> settings;
};
VerifyResult verify(const Trace& trace, const VerifyOptions& options,
                    const VerifyWatch& watch = {});

}  // namespace reservoir
