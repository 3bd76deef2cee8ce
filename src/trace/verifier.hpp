// The verifier (verify.cpp's entry points run it): replays a snapshot with
// its recorded settings on a simulated device that answers every device
// request from the recording, and stops at the first disagreement.
//
// Its phases, a file each: the run over the events and the entry points
// (verify.cpp); device requests and runs of releases (verify_requests.cpp);
// each recorded event (verify_events.cpp); the recorded state, private pools
// and where the history stops (verify_state.cpp). Starting state:
// verify_start.cpp; runs of releases and their causes: release_bursts.cpp.
#pragma once

#include <deque>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "release_bursts.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"

namespace reservoir::detail {

using SegmentRef = std::pair<DevicePtr, std::uint64_t>;  // address, size

struct Expectations {
  std::deque<SegmentRef> restore;              // starting segments
  std::deque<SegmentRef> segment_allocs;       // recorded, not yet made
  std::deque<SegmentRef> maps;                 // expandable segments: recorded maps not yet made
  std::deque<DevicePtr> restore_reservations;  // bases of those live at the start
  std::vector<SegmentRef> segment_frees;       // recorded for this step
  std::size_t frees_made = 0;
  bool oom_expected = false;
  std::string problem;  // first disagreement seen inside a device call
};

class Verifier {
 public:
  Verifier(const Trace& trace, const VerifyOptions& options, bool first_alloc_made_its_segment,
           const VerifyWatch* watch, std::string pytorch_rules,
           const std::set<std::size_t>& ladder_runs, const std::set<std::size_t>& bare_releases)
      : trace_(trace),
        options_(options),
        first_alloc_made_its_segment_(first_alloc_made_its_segment),
        watch_(watch),
        pytorch_rules_(std::move(pytorch_rules)),
        ladder_runs_(ladder_runs),
        bare_releases_(bare_releases) {}

  // native_paged: where the replay diverged (an alloc's index, or the
  // number of events for the final state), for a reading that gives back
  // the address space of segments with no memory mapped just before it
  // (the program's empty_cache() there released only such segments, which
  // a recording does not show).
  std::optional<std::size_t> bare_release_point() const { return bare_release_point_; }

  // The undecided run (index into the release runs) that was applied as
  // empty_cache() and did not agree, if the verification stopped there.
  std::optional<std::size_t> undecided_run_that_diverged() const {
    return undecided_diverged_;
  }
  // Under reservoir's page policies: the undecided runs taken for the
  // allocator's own release, in the order replayed (a run taken wrongly
  // can agree event for event and diverge only later).
  const std::vector<std::size_t>& undecided_taken_for_the_allocator() const {
    return taken_for_allocator_;
  }

  VerifyResult run();

 private:
  // ---- the history's end and the recorded state ---------------------------------

  // The state a snapshot records is taken when it is dumped; the history
  // may have stopped before (recording switched off, or its events lost).
  // Then an allocation the history leaves live is free in the state, or one
  // it frees is allocated there. The starting state is rebuilt from the
  // recorded one, so such a recording cannot be checked: says why, or
  // nothing when the two agree.
  std::string history_cut() const;
  // Why a page policy's recording cannot be replayed from an empty
  // allocator (it started with memory held), or "".
  std::string paged_late_start() const;
  // Takes the device's memory from the recorded out-of-memory errors (see
  // VerifyResult::device_memory); false when it records none.
  bool infer_device_memory(std::uint64_t mapped_at_start);

  bool private_segment_of(DevicePtr addr) const;

  // ---- private pools ----------------------------------------------------------

  // Allocations routed to a private pool (CUDA graph capture, MemPool):
  // where the recording says which (PyTorch 2.15's pool_id on each event),
  // verify follows them (following_pools_), routing each to its pool; where
  // it does not, it stops, with the reason, at the first event of a private
  // pool's segment.
  void find_private_pools();
  // The private pool event i was recorded in; nullptr for the default pools.
  const PoolId* pool_of(std::size_t i) const;
  // An allocation of event i, routed to its pool when it has one. A pool is
  // made by its first allocation and held (as the graph or MemPool holding
  // it does) until the recording frees one of its segments.
  void* allocate_routed(CachingAllocator& allocator, std::size_t i);
  void release_held_pool(CachingAllocator& allocator, std::size_t i);

  // ---- device requests -----------------------------------------------------

  Status serve(std::size_t bytes, DevicePtr* addr);

  // A segment freed, or (expandable segments) pages unmapped.
  void on_release(TraceAction action, DevicePtr addr, std::uint64_t size);

  // ---- expandable segments ---------------------------------------------------

  // A new reservation's first mapping is at its start: the next recorded map.
  Status serve_reservation(std::size_t bytes, DevicePtr* va);

  Status serve_physical(std::size_t bytes);

  void on_map(DevicePtr addr, std::uint64_t size);

  void note(const std::string& problem);

  void diverge(std::size_t index, std::string what);

  void cannot_verify(std::size_t index, const std::string& why);

  // Checks that a step made exactly the recorded device requests.
  bool settle(std::size_t index);
  void undecided_failed();
  // Address space for a request the recording failed (it maps nothing).
  DevicePtr take_unused_space(std::size_t bytes);

  // ---- runs of releases ------------------------------------------------------

  // Would empty_cache() free exactly the segments this run frees? (Every
  // segment of the default pools with no allocated block, once the events of
  // pending frees are synchronized.)
  bool matches_empty_cache(const CachingAllocator& allocator) const;

  void resolve(CachingAllocator& allocator, const ReleaseRun& run, std::size_t index);

  // Garbage collection runs only under a memory fraction, which a snapshot
  // does not record: apply it with the recorded run's size as its target.
  void collect_garbage(CachingAllocator& allocator);

  // ---- events ------------------------------------------------------------------

  void step(CachingAllocator& allocator, SimDevice& device, std::size_t i);

  // Freed now, returned to the cache at its free_completed: held until then
  // by an event on a stream of its own.
  void hold_and_free(CachingAllocator& allocator, DevicePtr addr);
  bool completed_by_the_ladder(std::size_t i) const;

  // A classic segment event with expandable settings, or the other way round.
  void settings_changed(std::size_t i);

  void alloc(CachingAllocator& allocator, std::size_t i);

  void oom(CachingAllocator& allocator, std::size_t i);

  std::string explain_alloc(const CachingAllocator& allocator, const TraceEvent& e,
                            DevicePtr got) const;

  // Every device request and every alloc and free in the history was
  // checked, so a segment present in one final state and not the other, or
  // a block allocated in one and free in the other, was made by work the
  // history does not hold: it stopped before the state was taken. Says
  // which, or nothing when the two agree on that.
  static std::string outside_history(const Snapshot& ours,
                                     const std::vector<const SegmentInfo*>& theirs);

  void compare_final_state(const Snapshot& ours);

  static constexpr StreamId kHoldStreamBase = StreamId{0xfeed} << 48;

  const Trace& trace_;
  const VerifyOptions options_;
  const bool exact_limit_ = options_.memory_fraction.has_value();
  const bool first_alloc_made_its_segment_;
  std::uint64_t gc_above_ = 0;  // under an exact limit: reserved bytes garbage collection keeps
  const VerifyWatch* watch_;
  std::string pytorch_rules_;  // pytorch_version when the settings name none
  const std::set<std::size_t>& ladder_runs_;  // undecided runs to leave to the ladder
  const std::set<std::size_t>& bare_releases_;  // events to release bare segments before
  std::optional<std::size_t> bare_release_point_;
  std::optional<std::size_t> undecided_diverged_;
  std::vector<std::size_t> taken_for_allocator_;
  AllocatorConfig config_;
  VerifyResult result_;
  Expectations expect_;
  std::size_t current_ = 0;  // the event being replayed
  DevicePtr unused_space_ = 0x7ff000000000;  // address space for requests that fail
  bool restoring_ = false;
  bool vm_ = false;  // recorded with pages mapped (expandable segments, a page policy)
  bool paged_ = false;  // ... under reservoir's page policies (native_paged, paging)
  std::unordered_map<DevicePtr, StreamId> held_;
  std::unordered_set<DevicePtr> zero_size_;
  std::uint64_t next_hold_ = 0;
  std::vector<ReleaseRun> runs_;
  std::unordered_map<std::size_t, std::size_t> run_ending_at_;  // last event -> run
  const ReleaseRun* pending_run_ = nullptr;  // releases the next request is to make
  ReleaseCause pending_cause_ = ReleaseCause::undecided;
  bool pending_undecided_ = false;  // ... an undecided run taken for the allocator's
  bool pending_gc_ = false;
  std::size_t private_stop_ = static_cast<std::size_t>(-1);
  std::string private_reason_;
  bool following_pools_ = false;
  std::set<PoolId> held_pools_;      // private pools the replay holds in use
  std::set<PoolId> released_pools_;  // ... and those it let go (empty_cache frees them)
  std::string assumption_;       // what verify assumed for the whole recording
  std::string step_assumption_;  // ... and for the request in hand
};

}  // namespace reservoir::detail
