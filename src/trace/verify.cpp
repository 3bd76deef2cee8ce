// verify: replay a PyTorch snapshot exactly as it was recorded and compare
// every device request and every address with the recording.
//
// Starting state: verify_start.cpp. Runs of segment releases and their
// causes: release_bursts.cpp.
//
// Device requests. SimDevice gives each new segment the address of the next
// recorded segment_alloc. While the recording shows segment frees not yet
// made, a request fails as out of memory: PyTorch releases cached segments
// itself only after a failed device allocation (or by garbage collection,
// just before one).
#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "release_bursts.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "verify_start.hpp"

namespace reservoir {
namespace {

using detail::ReleaseCause;
using detail::ReleaseRun;
using detail::starting_state;
using detail::StartingState;

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

std::string_view cause_text(ReleaseCause cause) {
  switch (cause) {
    case ReleaseCause::empty_cache: return "the program's empty_cache()";
    case ReleaseCause::allocator: return "the allocator's own release";
    case ReleaseCause::undecided: break;
  }
  return "a release";
}

class Verifier {
 public:
  Verifier(const Trace& trace, const VerifyOptions& options, bool first_alloc_made_its_segment,
           const VerifyWatch* watch, std::string pytorch_rules,
           const std::set<std::size_t>& ladder_runs)
      : trace_(trace),
        options_(options),
        first_alloc_made_its_segment_(first_alloc_made_its_segment),
        watch_(watch),
        pytorch_rules_(std::move(pytorch_rules)),
        ladder_runs_(ladder_runs) {}

  // The undecided run (index into the release runs) that was applied as
  // empty_cache() and did not agree, if the verification stopped there.
  std::optional<std::size_t> undecided_run_that_diverged() const {
    return undecided_diverged_;
  }

  VerifyResult run() {
    if (!trace_.has_addresses) {
      throw TraceError(
          fmt::format("verify {}: a {} trace has no recorded addresses; it can be "
                      "replayed, not verified",
                      trace_.name, trace_.format));
    }
    config_ = trace_.settings;
    if (config_.pytorch_version.empty()) config_.pytorch_version = pytorch_rules_;
    result_.pytorch_rules = config_.pytorch_version;
    if (!trace_.settings_recorded) {
      assumption_ =
          "the snapshot does not record its allocator settings (PyTorch records them from "
          "2.4 on), so verify assumed PyTorch's defaults; settings made while recording "
          "(max_split_size_mb, roundup_power2_divisions, ...) would explain a difference";
    }
    result_.events = trace_.events.size();
    if (trace_.port != "cuda") {
      cannot_verify(trace_.events.size(), fmt::format(
                           "cannot verify: recorded by torch_npu's allocator ({} device), which "
                           "reservoir does not model; replay, summary and advise read it as "
                           "PyTorch's CUDA allocator would serve the same requests",
                           trace_.port));
      return result_;
    }
    if (trace_.events.empty()) {
      cannot_verify(0, "cannot verify: the snapshot holds no recorded events for this device "
                       "(its state only: memory history was not recording here)");
      return result_;
    }
    if (const std::string cut = history_cut(); !cut.empty()) {
      cannot_verify(trace_.events.size(), cut);
      return result_;
    }
    vm_ = config_.expandable_segments;
    runs_ = detail::release_runs(trace_);
    for (std::size_t k = 0; k < runs_.size(); ++k) run_ending_at_[runs_[k].last] = k;
    find_private_pools();

    StartingState start;
    if (vm_) {
      try {
        start = detail::expandable_starting_state(trace_, config_);
      } catch (const TraceError& e) {
        cannot_verify(0, fmt::format("cannot verify: the expandable segments mapped at the "
                                     "start cannot be rebuilt: {}",
                                     e.what()));
        return result_;
      }
      result_.initial_reservations = start.reservations.size();
      for (const ExpandableReservation& r : start.reservations) {
        expect_.restore_reservations.push_back(r.base);
      }
    } else {
      start = starting_state(trace_, config_, first_alloc_made_its_segment_);
    }
    if (start.made_by_first_alloc.second != 0) {
      expect_.segment_allocs.push_back(start.made_by_first_alloc);
    }
    result_.initial_segments = start.layout.segments.size();
    result_.initial_live_blocks = start.live_blocks;
    result_.unsplit_tails = start.unsplit_tails;
    for (const SegmentInfo& seg : start.layout.segments) {
      expect_.restore.emplace_back(seg.address, seg.total_size);
      if (seg.blocks.size() == 1 && seg.blocks[0].state == BlockState::inactive) {
        ++result_.initial_free_segments;
      }
    }

    SimDeviceOptions options;
    options.capacity = options_.device_memory.value_or(std::size_t{1} << 50);
    SimDevice device(options);
    device.set_address_source(
        [this](std::size_t bytes, DevicePtr* addr) { return serve(bytes, addr); });
    device.set_reservation_source(
        [this](std::size_t bytes, DevicePtr* va) { return serve_reservation(bytes, va); });
    device.set_physical_gate([this](std::size_t bytes) { return serve_physical(bytes); });
    CachingAllocator allocator(device, config_);
    if (exact_limit_) {
      // The process's own limit: the allocator refuses past it, and
      // collects garbage by its threshold, as PyTorch did.
      allocator.set_memory_fraction(*options_.memory_fraction);
      gc_above_ = static_cast<std::uint64_t>(
          config_.garbage_collection_threshold *
          static_cast<double>(static_cast<std::uint64_t>(
              *options_.memory_fraction * static_cast<double>(*options_.device_memory))));
    } else if (config_.garbage_collection_threshold > 0.0) {
      // Block ages count only under a memory fraction; one of the whole
      // (unlimited) device never triggers collection by itself.
      allocator.set_memory_fraction(1.0);
    }
    allocator.attach_trace_tracker([this](const TraceEvent& e) {
      if (e.action == TraceAction::segment_free || e.action == TraceAction::segment_unmap) {
        on_release(e.action, e.addr, e.size);
      } else if (e.action == TraceAction::segment_map) {
        on_map(e.addr, e.size);
      }
    });
    restoring_ = true;
    try {
      allocator.restore(start.layout, start.reservations);
    } catch (const Error& e) {
      if (!vm_) throw;
      cannot_verify(0, fmt::format("cannot verify: the expandable segments mapped at the start "
                                   "cannot be rebuilt (their reservations' bases are inferred: "
                                   "a snapshot does not record them): {}",
                                   e.what()));
      return result_;
    }
    restoring_ = false;
    for (const DevicePtr addr : start.pending_frees) hold_and_free(allocator, addr);
    allocator.reset_accumulated_stats();
    allocator.reset_peak_stats();

    for (std::size_t i = 0; i < trace_.events.size() && result_.divergence.empty(); ++i) {
      if (i == private_stop_) {
        cannot_verify(i, private_reason_);
        break;
      }
      step(allocator, device, i);
      if (!result_.divergence.empty()) break;
      if (auto it = run_ending_at_.find(i); it != run_ending_at_.end()) {
        resolve(allocator, runs_[it->second], i);
      }
      if (watch_ != nullptr && result_.divergence.empty()) (*watch_)(i, allocator);
    }
    if (result_.divergence.empty()) {
      compare_final_state(allocator.snapshot());
    }
    result_.agreed = result_.divergence.empty();
    return result_;
  }

 private:
  // ---- the history's end and the recorded state ---------------------------------

  // The state a snapshot records is taken when it is dumped; the history
  // may have stopped before (recording switched off, or its events lost).
  // Then an allocation the history leaves live is free in the state, or one
  // it frees is allocated there. The starting state is rebuilt from the
  // recorded one, so such a recording cannot be checked: says why, or
  // nothing when the two agree.
  std::string history_cut() const {
    std::unordered_map<DevicePtr, std::size_t> last;  // address -> its last alloc/free event
    for (std::size_t i = 0; i < trace_.events.size(); ++i) {
      const TraceEvent& e = trace_.events[i];
      if (e.size == 0) continue;
      if (e.action == TraceAction::alloc || e.action == TraceAction::free_completed) {
        last[e.addr] = i;
      }
    }
    std::unordered_map<DevicePtr, BlockState> state;
    for (const SegmentInfo& s : trace_.final_state.segments) {
      for (const BlockInfo& b : s.blocks) state.emplace(b.address, b.state);
    }
    std::size_t live_freed = 0;
    std::size_t freed_live = 0;
    std::size_t example = trace_.events.size();
    for (const auto& [addr, i] : last) {
      const auto it = state.find(addr);
      const bool allocated = it != state.end() && it->second == BlockState::active_allocated;
      const bool alloc = trace_.events[i].action == TraceAction::alloc;
      const bool live_but_free = alloc && (it == state.end() || it->second == BlockState::inactive);
      const bool freed_but_allocated = !alloc && allocated;
      if (!live_but_free && !freed_but_allocated) continue;
      if (private_segment_of(addr)) continue;  // private pools are not replayed at all
      ++(live_but_free ? live_freed : freed_live);
      if (example == trace_.events.size() || i > example) example = i;
    }
    if (live_freed + freed_live == 0) return {};
    const TraceEvent& e = trace_.events[example];
    return fmt::format(
        "cannot verify: the history stops before the state was taken (recording stopped early, "
        "or its last events were lost): {} allocation{} the history leaves live {} free in the "
        "recorded state and {} it frees {} allocated there; the latest, {} of {} bytes at "
        "{:#x} (event {}), is {} there. The starting state is rebuilt from the recorded one, so "
        "nothing can be checked.",
        live_freed, live_freed == 1 ? "" : "s", live_freed == 1 ? "is" : "are", freed_live,
        freed_live == 1 ? "is" : "are", to_string(e.action), e.size, e.addr, example,
        e.action == TraceAction::alloc ? "free" : "allocated");
  }

  bool private_segment_of(DevicePtr addr) const {
    for (const SegmentInfo& s : trace_.final_state.segments) {
      if (s.pool_id != PoolId{0, 0} && addr >= s.address && addr < s.address + s.total_size) {
        return true;
      }
    }
    return false;
  }

  // ---- private pools ----------------------------------------------------------

  // Allocations routed to a private pool (CUDA graph capture, MemPool) carry
  // nothing in the recording that says so: verify stops, with the reason, at
  // the first event of a private pool's segment.
  void find_private_pools() {
    for (const SegmentInfo& s : trace_.final_state.segments) {
      if (s.pool_id == PoolId{0, 0}) continue;
      ++result_.private_pool_segments;
      result_.private_pool_bytes += s.total_size;
      std::size_t first = trace_.events.size();
      for (std::size_t i = trace_.events.size(); i-- > 0;) {
        const TraceEvent& e = trace_.events[i];
        if (e.action == TraceAction::segment_alloc && e.addr == s.address) {
          first = i;  // this segment's own device request
          break;
        }
        if ((e.action == TraceAction::alloc || e.action == TraceAction::free_requested) &&
            e.addr >= s.address && e.addr < s.address + s.total_size) {
          first = i;
        }
      }
      if (first < trace_.events.size() && first < private_stop_) {
        private_stop_ = first;
        private_reason_ = fmt::format(
            "cannot verify: this {} at {:#x} is in a segment of private pool ({}, {}) "
            "(CUDA graph capture or torch.cuda.MemPool); a recording does not say which "
            "allocations were routed to a private pool, so they cannot be replayed",
            to_string(trace_.events[first].action), trace_.events[first].addr, s.pool_id.first,
            s.pool_id.second);
      }
    }
  }

  // ---- device requests -----------------------------------------------------

  Status serve(std::size_t bytes, DevicePtr* addr) {
    if (restoring_) {
      if (expect_.restore.empty()) return Status::invalid_argument;
      auto [a, size] = expect_.restore.front();
      expect_.restore.pop_front();
      *addr = a;
      return size == bytes ? Status::ok : Status::invalid_argument;
    }
    if (expect_.frees_made < expect_.segment_frees.size()) return Status::out_of_memory;
    if (!expect_.segment_allocs.empty()) {
      auto [a, size] = expect_.segment_allocs.front();
      if (size != bytes) {
        note(
            fmt::format("reservoir asked the device for a segment of {} bytes ({}); the "
                        "recording's segment_alloc here is {} bytes ({}) at {:#x}",
                        bytes, format_size(bytes), size, format_size(size), a));
        return Status::invalid_argument;
      }
      expect_.segment_allocs.pop_front();
      *addr = a;
      ++result_.segment_allocs_checked;
      return Status::ok;
    }
    if (expect_.oom_expected) return Status::out_of_memory;
    note(
        fmt::format("reservoir asked the device for a new segment of {} bytes ({}); the "
                    "recording made no segment_alloc here",
                    bytes, format_size(bytes)));
    return Status::invalid_argument;
  }

  // A segment freed, or (expandable segments) pages unmapped.
  void on_release(TraceAction action, DevicePtr addr, std::uint64_t size) {
    const bool unmap = action == TraceAction::segment_unmap;
    const char* did = unmap ? "unmapped the pages" : "freed the segment";
    const char* does = unmap ? "unmaps" : "frees";
    const std::size_t k = expect_.frees_made++;
    if (k >= expect_.segment_frees.size()) {
      note(fmt::format("reservoir {} at {:#x} ({} bytes); the recording {} nothing here", did, addr,
                       size, does));
    } else if (expect_.segment_frees[k] != std::make_pair(addr, size)) {
      note(fmt::format("reservoir {} at {:#x} ({} bytes); the recording {} {:#x} ({} bytes)", did,
                       addr, size, does, expect_.segment_frees[k].first,
                       expect_.segment_frees[k].second));
    } else {
      ++(unmap ? result_.segment_unmaps_checked : result_.segment_frees_checked);
    }
  }

  // ---- expandable segments ---------------------------------------------------

  // A new reservation's first mapping is at its start: the next recorded map.
  Status serve_reservation(std::size_t bytes, DevicePtr* va) {
    if (restoring_) {
      if (expect_.restore_reservations.empty()) return Status::invalid_argument;
      *va = expect_.restore_reservations.front();
      expect_.restore_reservations.pop_front();
      return Status::ok;
    }
    if (expect_.maps.empty()) {
      note(
          fmt::format("reservoir reserved address space for a new expandable segment ({} "
                      "bytes); the recording maps no memory here",
                      bytes));
      return Status::invalid_argument;
    }
    // (A base may come back: the driver reuses address space once released.)
    *va = expect_.maps.front().first;
    ++result_.reservations_checked;
    return Status::ok;
  }

  Status serve_physical(std::size_t bytes) {
    if (restoring_) return Status::ok;
    if (expect_.frees_made < expect_.segment_frees.size()) return Status::out_of_memory;
    if (!expect_.maps.empty()) return Status::ok;
    if (expect_.oom_expected) return Status::out_of_memory;
    note(fmt::format("reservoir mapped {} more bytes; the recording maps no memory here", bytes));
    return Status::invalid_argument;
  }

  void on_map(DevicePtr addr, std::uint64_t size) {
    if (restoring_) return;
    if (expect_.maps.empty()) {
      note(fmt::format("reservoir mapped {} bytes at {:#x}; the recording maps nothing here", size,
                       addr));
      return;
    }
    const SegmentRef want = expect_.maps.front();
    expect_.maps.pop_front();
    if (want != std::make_pair(addr, size)) {
      note(fmt::format("reservoir mapped {} bytes at {:#x}; the recording maps {} bytes at {:#x}",
                       size, addr, want.second, want.first));
    } else {
      ++result_.segment_maps_checked;
    }
  }

  void note(const std::string& problem) {
    if (expect_.problem.empty()) expect_.problem = problem;
  }

  void diverge(std::size_t index, std::string what) {
    if (!result_.divergence.empty()) return;
    const std::string& why = step_assumption_.empty() ? assumption_ : step_assumption_;
    if (!why.empty()) {
      result_.cannot_verify = true;
      what = fmt::format("cannot verify: {}\n  {}", what, why);
    }
    result_.divergence_event = index;
    result_.divergence = std::move(what);
  }

  void cannot_verify(std::size_t index, const std::string& why) {
    if (!result_.divergence.empty()) return;
    result_.cannot_verify = true;
    result_.divergence_event = index;
    result_.divergence = why;
  }

  // Checks that a step made exactly the recorded device requests.
  bool settle(std::size_t index) {
    if (!expect_.problem.empty()) {
      diverge(index, expect_.problem);
      return false;
    }
    if (expect_.frees_made < expect_.segment_frees.size()) {
      const auto& f = expect_.segment_frees[expect_.frees_made];
      std::string what =
          fmt::format("the recording {} at {:#x} ({} bytes) here; reservoir did not",
                      vm_ ? "unmaps the pages" : "frees the segment", f.first, f.second);
      if (pending_run_ != nullptr) {
        what +=
            fmt::format(" (taken for {}: {})", cause_text(pending_cause_), pending_run_->evidence);
      }
      diverge(index, what);
      return false;
    }
    if (!expect_.segment_allocs.empty()) {
      const auto& a = expect_.segment_allocs.front();
      diverge(index, fmt::format("the recording allocates a segment of {} bytes at {:#x} here; "
                                 "reservoir served the request from its cache",
                                 a.second, a.first));
      return false;
    }
    if (!expect_.maps.empty()) {
      const auto& m = expect_.maps.front();
      diverge(index, fmt::format("the recording maps {} bytes at {:#x} here; reservoir served "
                                 "the request from memory already mapped",
                                 m.second, m.first));
      return false;
    }
    if (pending_run_ != nullptr && pending_cause_ == ReleaseCause::allocator) {
      ++(pending_gc_ ? result_.garbage_collections : result_.allocator_releases);
    }
    pending_run_ = nullptr;
    pending_gc_ = false;
    step_assumption_.clear();
    expect_.segment_frees.clear();
    expect_.frees_made = 0;
    return true;
  }

  // ---- runs of releases ------------------------------------------------------

  // Would empty_cache() free exactly the segments this run frees? (Every
  // segment of the default pools with no allocated block, once the events of
  // pending frees are synchronized.)
  bool matches_empty_cache(const CachingAllocator& allocator) const {
    std::vector<SegmentRef> would;
    for (const SegmentInfo& s : allocator.snapshot().segments) {
      if (s.pool_id != PoolId{0, 0}) continue;
      if (s.is_expandable) {
        // The whole pages inside each free block (a mapped range starts on a page).
        // Blocks pending free are free once empty_cache() synchronizes: a
        // run of them and free blocks is one block then.
        const std::uint64_t page = s.is_large ? config_.large_segment_size : kSmallBuffer;
        for (std::size_t j = 0; j < s.blocks.size();) {
          if (s.blocks[j].state == BlockState::active_allocated) {
            ++j;
            continue;
          }
          const DevicePtr lo = s.blocks[j].address;
          DevicePtr hi = lo;
          for (; j < s.blocks.size() && s.blocks[j].state != BlockState::active_allocated; ++j) {
            hi = s.blocks[j].address + s.blocks[j].size;
          }
          const std::uint64_t first = (lo - s.address + page - 1) / page;
          const std::uint64_t end = (hi - s.address) / page;
          if (first < end) would.emplace_back(s.address + first * page, (end - first) * page);
        }
        continue;
      }
      const bool unused = std::none_of(s.blocks.begin(), s.blocks.end(), [](const BlockInfo& b) {
        return b.state == BlockState::active_allocated;
      });
      if (unused) would.emplace_back(s.address, s.total_size);
    }
    std::vector<SegmentRef> recorded = expect_.segment_frees;
    std::sort(would.begin(), would.end());
    std::sort(recorded.begin(), recorded.end());
    return would == recorded;
  }

  void resolve(CachingAllocator& allocator, const ReleaseRun& run, std::size_t index) {
    ReleaseCause cause = run.cause;
    const bool undecided = cause == ReleaseCause::undecided;
    const auto run_index = static_cast<std::size_t>(&run - runs_.data());
    if (undecided) {
      // When they are all empty_cache() would free, the same segments go
      // either way: apply it here. Otherwise they are the ladder's. (The
      // ladder frees oversize blocks first: when the order then differs,
      // verify runs again with this run left to the ladder.)
      cause = !ladder_runs_.contains(run_index) && matches_empty_cache(allocator)
                  ? ReleaseCause::empty_cache
                  : ReleaseCause::allocator;
    }
    pending_run_ = &run;
    pending_cause_ = cause;
    if (cause == ReleaseCause::empty_cache) {
      try {
        allocator.empty_cache();
      } catch (const DeviceError& err) {
        diverge(index, expect_.problem.empty() ? std::string(err.what()) : expect_.problem);
        return;
      }
      if (settle(index)) {
        ++(undecided ? result_.undecided_releases : result_.empty_cache_calls);
      } else if (undecided) {
        undecided_diverged_ = run_index;
      }
      return;
    }
    // The allocation that follows makes them: its retry ladder (the device
    // refuses it until they are made), or garbage collection first when the
    // settings ask for it. Under a known memory limit the allocator decides
    // by itself; the run is garbage collection's when reserved memory is
    // above the threshold (it collects first).
    if (!exact_limit_) {
      pending_gc_ = config_.garbage_collection_threshold > 0.0;
    } else {
      pending_gc_ = config_.garbage_collection_threshold > 0.0 &&
                    static_cast<std::uint64_t>(
                        allocator.stats().reserved_bytes[0].current) > gc_above_;
    }
  }

  // Garbage collection runs only under a memory fraction, which a snapshot
  // does not record: apply it with the recorded run's size as its target.
  void collect_garbage(CachingAllocator& allocator) {
    std::uint64_t large = 0;
    for (const auto& [addr, size] : expect_.segment_frees) {
      if (size != kSmallBuffer) large += size;
    }
    step_assumption_ =
        "the settings enable garbage collection, which runs only under a memory fraction "
        "the snapshot does not record: verify took the releases before this allocation for "
        "garbage collection with their total as its target (give the fraction and the "
        "device's memory, --memory-fraction and --device-memory, to check it exactly)";
    allocator.collect_garbage(large);
  }

  // ---- events ------------------------------------------------------------------

  void step(CachingAllocator& allocator, SimDevice& device, std::size_t i) {
    const TraceEvent& e = trace_.events[i];
    switch (e.action) {
      case TraceAction::segment_alloc:
      case TraceAction::segment_free:
        if (vm_) {
          settings_changed(i);
        } else if (e.action == TraceAction::segment_alloc) {
          expect_.segment_allocs.emplace_back(e.addr, e.size);
        } else {
          expect_.segment_frees.emplace_back(e.addr, e.size);
        }
        return;
      case TraceAction::segment_map:
      case TraceAction::segment_unmap:
        if (!vm_) {
          settings_changed(i);
        } else if (e.action == TraceAction::segment_map) {
          expect_.maps.emplace_back(e.addr, e.size);
        } else {
          expect_.segment_frees.emplace_back(e.addr, e.size);
        }
        return;
      case TraceAction::alloc: alloc(allocator, i); return;
      case TraceAction::oom: oom(allocator, i); return;
      case TraceAction::free_requested: {
        if (zero_size_.erase(e.addr) != 0) {
          ++result_.zero_size_skipped;
          return;
        }
        const bool completes_now = i + 1 < trace_.events.size() &&
                                   trace_.events[i + 1].action == TraceAction::free_completed &&
                                   trace_.events[i + 1].addr == e.addr;
        try {
          if (completes_now) {
            allocator.deallocate(reinterpret_cast<void*>(e.addr));
          } else {
            hold_and_free(allocator, e.addr);
          }
        } catch (const InvalidPointerError& err) {
          diverge(i, fmt::format("free of {:#x}: {}", e.addr, err.what()));
        }
        return;
      }
      case TraceAction::free_completed: {
        // PyTorch records free_completed as it returns the block to the cache.
        auto it = held_.find(e.addr);
        if (it != held_.end()) {
          device.complete_stream(it->second);
          held_.erase(it);
          try {
            allocator.process_completed_frees();
          } catch (const DeviceError& err) {
            diverge(i, err.what());
          }
        }
        return;
      }
      default: return;  // snapshot markers
    }
  }

  // Freed now, returned to the cache at its free_completed: held until then
  // by an event on a stream of its own.
  void hold_and_free(CachingAllocator& allocator, DevicePtr addr) {
    const StreamId hold = kHoldStreamBase + next_hold_++;
    allocator.record_stream(reinterpret_cast<void*>(addr), hold);
    held_[addr] = hold;
    allocator.deallocate(reinterpret_cast<void*>(addr));
  }

  // A classic segment event with expandable settings, or the other way round.
  void settings_changed(std::size_t i) {
    cannot_verify(
        i, fmt::format("cannot verify: a {} event, but the recorded settings {} "
                       "expandable segments (were they changed while recording?)",
                       to_string(trace_.events[i].action), vm_ ? "enable" : "do not enable"));
  }

  void alloc(CachingAllocator& allocator, std::size_t i) {
    const TraceEvent& e = trace_.events[i];
    if (e.size == 0) {
      // PyTorch answers a zero-byte request without its allocator; nothing to replay.
      zero_size_.insert(e.addr);
      ++result_.zero_size_skipped;
      return;
    }
    void* got = nullptr;
    try {
      if (pending_gc_ && !exact_limit_) collect_garbage(allocator);
      got = allocator.allocate(e.size, e.stream);
    } catch (const OutOfMemoryError&) {
      diverge(i, expect_.problem.empty()
                     ? fmt::format("alloc of {} bytes: reservoir ran out of memory; the "
                                   "recording returned {:#x}",
                                   e.size, e.addr)
                     : expect_.problem);
      return;
    } catch (const DeviceError& err) {
      diverge(i, expect_.problem.empty() ? std::string(err.what()) : expect_.problem);
      return;
    }
    if (!settle(i)) return;
    const auto ptr = reinterpret_cast<DevicePtr>(got);
    if (ptr != e.addr) {
      diverge(i, explain_alloc(allocator, e, ptr));
      return;
    }
    ++result_.allocs_checked;
  }

  void oom(CachingAllocator& allocator, std::size_t i) {
    const TraceEvent& e = trace_.events[i];
    expect_.oom_expected = true;
    try {
      if (pending_gc_ && !exact_limit_) collect_garbage(allocator);
      void* got = allocator.allocate(e.size, e.stream);
      expect_.oom_expected = false;
      diverge(i, fmt::format("the recording ran out of memory allocating {} bytes; reservoir "
                             "returned {:#x}",
                             e.size, reinterpret_cast<DevicePtr>(got)));
      return;
    } catch (const OutOfMemoryError&) {
    } catch (const DeviceError&) {
    }
    expect_.oom_expected = false;
    if (settle(i)) ++result_.ooms_checked;
  }

  std::string explain_alloc(const CachingAllocator& allocator, const TraceEvent& e,
                            DevicePtr got) const {
    const std::size_t size = CachingAllocator::round_size(e.size, config_);
    const bool small = size <= kSmallSize;
    std::string out = fmt::format(
        "alloc of {} bytes (rounded to {}, {} pool, stream {}): expected {:#x}, got {:#x}", e.size,
        size, small ? "small" : "large", e.stream, e.addr, got);
    const Snapshot snap = allocator.snapshot();
    std::vector<std::pair<std::uint64_t, DevicePtr>> fits;
    for (const SegmentInfo& s : snap.segments) {
      for (const BlockInfo& b : s.blocks) {
        if (e.addr >= b.address && e.addr < b.address + b.size) {
          out += fmt::format(
              "\n  reservoir's block holding the expected address: {:#x}, {} bytes, "
              "{} (segment {:#x}, {} bytes, {})",
              b.address, b.size, to_string(b.state), s.address, s.total_size,
              s.is_large ? "large" : "small");
        }
        if (b.state == BlockState::inactive && s.is_large == !small && s.stream == e.stream &&
            b.size >= size) {
          fits.emplace_back(b.size, b.address);
        }
      }
    }
    std::sort(fits.begin(), fits.end());
    out +=
        fmt::format("\n  free blocks of the pool that fit, best first ({} in all):", fits.size());
    for (std::size_t k = 0; k < fits.size() && k < 5; ++k) {
      out += fmt::format("\n    {:#x}: {} bytes", fits[k].second, fits[k].first);
    }
    return out;
  }

  // Every device request and every alloc and free in the history was
  // checked, so a segment present in one final state and not the other, or
  // a block allocated in one and free in the other, was made by work the
  // history does not hold: it stopped before the state was taken. Says
  // which, or nothing when the two agree on that.
  static std::string outside_history(const Snapshot& ours,
                                     const std::vector<const SegmentInfo*>& theirs) {
    std::map<DevicePtr, const SegmentInfo*> a;
    std::map<DevicePtr, const SegmentInfo*> b;
    for (const SegmentInfo& s : ours.segments) a.emplace(s.address, &s);
    for (const SegmentInfo* s : theirs) b.emplace(s->address, s);
    for (const auto& [addr, s] : b) {
      auto it = a.find(addr);
      if (it == a.end() || it->second->total_size != s->total_size) {
        return fmt::format("the recorded state holds a segment at {:#x} ({}) that no recorded "
                           "event made",
                           addr, format_size(s->total_size));
      }
    }
    for (const auto& [addr, s] : a) {
      if (b.find(addr) == b.end()) {
        return fmt::format("the recorded state lacks the segment at {:#x} ({}) that the history "
                           "leaves in place, with no segment_free for it",
                           addr, format_size(s->total_size));
      }
    }
    for (const auto& [addr, s] : b) {
      std::set<DevicePtr> live_a;
      std::set<DevicePtr> live_b;
      for (const BlockInfo& k : a.at(addr)->blocks) {
        if (k.state != BlockState::inactive) live_a.insert(k.address);
      }
      for (const BlockInfo& k : s->blocks) {
        if (k.state != BlockState::inactive) live_b.insert(k.address);
      }
      for (const DevicePtr p : live_b) {
        if (live_a.count(p) == 0) {
          return fmt::format("the recorded state holds an allocation at {:#x} (segment {:#x}) "
                             "that the history frees or never makes",
                             p, addr);
        }
      }
      for (const DevicePtr p : live_a) {
        if (live_b.count(p) == 0) {
          return fmt::format("the history leaves an allocation at {:#x} (segment {:#x}) that "
                             "the recorded state does not hold, with no free for it",
                             p, addr);
        }
      }
    }
    return {};
  }

  void compare_final_state(const Snapshot& ours) {
    std::vector<const SegmentInfo*> theirs;
    for (const SegmentInfo& s : trace_.final_state.segments) {
      if (s.pool_id == PoolId{0, 0}) theirs.push_back(&s);
    }
    if (const std::string why = outside_history(ours, theirs); !why.empty()) {
      cannot_verify(trace_.events.size(),
                    fmt::format("cannot verify the final state: {}; the history stops before "
                                "the state was taken (recording stopped early, or events "
                                "outside it), so there is nothing to compare it with. Every "
                                "recorded event agreed.",
                                why));
      return;
    }
    result_.final_state_checked = true;
    const std::size_t n = std::max(ours.segments.size(), theirs.size());
    for (std::size_t k = 0; k < n; ++k) {
      if (k >= ours.segments.size() || k >= theirs.size()) {
        diverge(trace_.events.size(),
                fmt::format("final state: reservoir holds {} segments, the recording {}",
                            ours.segments.size(), theirs.size()));
        return;
      }
      const SegmentInfo& a = ours.segments[k];
      const SegmentInfo& b = *theirs[k];
      if (a.address != b.address || a.total_size != b.total_size) {
        diverge(trace_.events.size(),
                fmt::format("final state: segment {} is {:#x} ({} bytes) in reservoir and {:#x} "
                            "({} bytes) in the recording",
                            k, a.address, a.total_size, b.address, b.total_size));
        return;
      }
      const std::size_t m = std::max(a.blocks.size(), b.blocks.size());
      for (std::size_t j = 0; j < m; ++j) {
        const bool same = j < a.blocks.size() && j < b.blocks.size() &&
                          a.blocks[j].address == b.blocks[j].address &&
                          a.blocks[j].size == b.blocks[j].size &&
                          (a.blocks[j].state == BlockState::inactive) ==
                              (b.blocks[j].state == BlockState::inactive);
        if (!same) {
          auto describe = [](const SegmentInfo& s, std::size_t j) {
            if (j >= s.blocks.size()) return std::string("no block");
            return fmt::format("{:#x} ({} bytes, {})", s.blocks[j].address, s.blocks[j].size,
                               to_string(s.blocks[j].state));
          };
          diverge(trace_.events.size(),
                  fmt::format("final state: segment {:#x}, block {}: reservoir has {}, the "
                              "recording {}",
                              a.address, j, describe(a, j), describe(b, j)));
          return;
        }
      }
    }
  }

  static constexpr StreamId kHoldStreamBase = StreamId{0xfeed} << 48;

  const Trace& trace_;
  const VerifyOptions options_;
  const bool exact_limit_ = options_.memory_fraction.has_value();
  std::uint64_t gc_above_ = 0;  // under an exact limit: reserved bytes garbage collection keeps
  const bool first_alloc_made_its_segment_;
  const VerifyWatch* watch_;
  std::string pytorch_rules_;  // pytorch_version when the settings name none
  const std::set<std::size_t>& ladder_runs_;  // undecided runs to leave to the ladder
  std::optional<std::size_t> undecided_diverged_;
  AllocatorConfig config_;
  VerifyResult result_;
  Expectations expect_;
  bool restoring_ = false;
  bool vm_ = false;  // recorded with expandable segments
  std::unordered_map<DevicePtr, StreamId> held_;
  std::unordered_set<DevicePtr> zero_size_;
  std::uint64_t next_hold_ = 0;
  std::vector<ReleaseRun> runs_;
  std::unordered_map<std::size_t, std::size_t> run_ending_at_;  // last event -> run
  const ReleaseRun* pending_run_ = nullptr;  // releases the next request is to make
  ReleaseCause pending_cause_ = ReleaseCause::undecided;
  bool pending_gc_ = false;
  std::size_t private_stop_ = static_cast<std::size_t>(-1);
  std::string private_reason_;
  std::string assumption_;       // what verify assumed for the whole recording
  std::string step_assumption_;  // ... and for the request in hand
};

}  // namespace

VerifyResult verify(const Trace& trace) { return verify(trace, VerifyOptions{}, VerifyWatch{}); }

VerifyResult verify(const Trace& trace, const VerifyWatch& watch) {
  return verify(trace, VerifyOptions{}, watch);
}

namespace {

// One reading of the start; undecided runs applied as empty_cache() whose
// order of releases disagrees are left to the ladder on a run from the
// start again (the same segments, freed oversize first), as many times as
// there are such runs.
VerifyResult verify_from(const Trace& trace, const VerifyOptions& options, bool first_alloc,
                         const VerifyWatch* w, const std::string& rules) {
  // (A watch then sees the events again from the start.)
  std::set<std::size_t> ladder_runs;
  for (;;) {
    Verifier verifier(trace, options, first_alloc, w, rules, ladder_runs);
    VerifyResult r = verifier.run();
    const std::optional<std::size_t> undecided = verifier.undecided_run_that_diverged();
    if (r.agreed || !undecided || !ladder_runs.insert(*undecided).second) return r;
  }
}

VerifyResult verify_as(const Trace& trace, const VerifyOptions& options, const VerifyWatch* w,
                       const std::string& rules) {
  VerifyResult r = verify_from(trace, options, false, w, rules);
  // A recording may start between an allocation's segment_alloc and its
  // alloc (a ring buffer's cut): the segment then looks present at the start.
  // If that reading fails at once, take the segment as the alloc's.
  if (!r.agreed && r.divergence_event == 0 && !trace.events.empty() &&
      trace.events[0].action == TraceAction::alloc) {
    VerifyResult other = verify_from(trace, options, true, w, rules);
    if (other.agreed || other.divergence_event > 0) return other;
  }
  return r;
}

}  // namespace

VerifyResult verify(const Trace& trace, const VerifyOptions& options, const VerifyWatch& watch) {
  if (options.memory_fraction.has_value() != options.device_memory.has_value()) {
    throw UsageError(
        "verify: a memory fraction needs the device's total memory, and the other way round "
        "(the limit is the fraction of the total: give both)");
  }
  if (options.memory_fraction &&
      !(*options.memory_fraction > 0.0 && *options.memory_fraction <= 1.0)) {
    throw UsageError(fmt::format("verify: invalid memory fraction {}; accepted: above 0.0, up to 1.0",
                                 *options.memory_fraction));
  }
  if (options.device_memory && *options.device_memory == 0) {
    throw UsageError("verify: the device's total memory must be more than 0 bytes");
  }
  const VerifyWatch* w = watch ? &watch : nullptr;
  const std::string& since = trace.pytorch_since;
  VerifyResult r = verify_as(trace, options, w, since);
  // 2.12 writes the settings 2.4 to 2.11 write, but takes cached blocks of
  // equal size oldest segment first: a recording that shows 2.4 to 2.11
  // and disagrees is checked by 2.12's rules too, and verified by them when
  // they agree (a watch then sees that run again, from the start).
  const bool could_be_2_12 = !since.empty() && compare_versions(since, "2.12") < 0 &&
                             trace.settings.pytorch_version.empty();
  if (!r.agreed && !r.cannot_verify && could_be_2_12) {
    VerifyResult newer = verify_as(trace, options, nullptr, "2.12");
    if (newer.agreed) return w == nullptr ? newer : verify_as(trace, options, w, "2.12");
  }
  return r;
}

}  // namespace reservoir
