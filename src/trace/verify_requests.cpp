// verify: the device requests the replay makes, answered from the
// recording, and the runs of releases (empty_cache(), the retry ladder,
// garbage collection) applied where the recording makes them.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "verifier.hpp"

namespace reservoir::detail {

namespace {

std::string_view cause_text(ReleaseCause cause) {
  switch (cause) {
    case ReleaseCause::empty_cache: return "the program's empty_cache()";
    case ReleaseCause::allocator: return "the allocator's own release";
    case ReleaseCause::undecided: break;
  }
  return "a release";
}

}  // namespace

Status Verifier::serve(std::size_t bytes, DevicePtr* addr) {
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

void Verifier::on_release(TraceAction action, DevicePtr addr, std::uint64_t size) {
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

DevicePtr Verifier::take_unused_space(std::size_t bytes) {
  const DevicePtr at = unused_space_;
  unused_space_ += (bytes + kLargeBuffer - 1) / kLargeBuffer * kLargeBuffer;
  return at;
}

Status Verifier::serve_reservation(std::size_t bytes, DevicePtr* va) {
  if (restoring_) {
    if (expect_.restore_reservations.empty()) return Status::invalid_argument;
    *va = expect_.restore_reservations.front();
    expect_.restore_reservations.pop_front();
    return Status::ok;
  }
  if (paged_ && config_.policy == Policy::native_paged) {
    // native_paged reserves address space for its segments (one range they
    // are carved from, a range each when that is used up): a new segment
    // starts where the block the request is served lies.
    const TraceEvent& e = trace_.events[current_];
    if (e.action != TraceAction::alloc) {
      // A request the recording failed: the space goes back unused, so it
      // lies anywhere (above what a process's device memory uses).
      *va = take_unused_space(bytes);
      return Status::ok;
    }
    *va = e.addr;
    ++result_.reservations_checked;
    return Status::ok;
  }
  if (expect_.maps.empty() && expect_.oom_expected) {
    // The request fails, mapping nothing: the space lies anywhere.
    *va = take_unused_space(bytes);
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

Status Verifier::serve_physical(std::size_t bytes) {
  if (restoring_) return Status::ok;
  // reservoir's page policies, on a device of known size: the device
  // refuses what does not fit, as it did while recording. (Refusing until
  // the recorded releases are made, as for PyTorch's ladder, would take
  // native_paged past its rescue, which gives pages back handle by handle
  // and retries, into freeing the segments the rescue keeps.)
  if (paged_ && result_.device_memory) return Status::ok;
  if (expect_.frees_made < expect_.segment_frees.size()) return Status::out_of_memory;
  if (!expect_.maps.empty()) return Status::ok;
  if (expect_.oom_expected) return Status::out_of_memory;
  note(fmt::format("reservoir mapped {} more bytes; the recording maps no memory here", bytes));
  return Status::invalid_argument;
}

void Verifier::on_map(DevicePtr addr, std::uint64_t size) {
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

void Verifier::note(const std::string& problem) {
  if (expect_.problem.empty()) expect_.problem = problem;
}

void Verifier::diverge(std::size_t index, std::string what) {
  if (!result_.divergence.empty()) return;
  const std::string& why = step_assumption_.empty() ? assumption_ : step_assumption_;
  if (!why.empty()) {
    result_.cannot_verify = true;
    what = fmt::format("cannot verify: {}\n  {}", what, why);
  }
  result_.divergence_event = index;
  result_.divergence = std::move(what);
}

void Verifier::cannot_verify(std::size_t index, const std::string& why) {
  if (!result_.divergence.empty()) return;
  result_.cannot_verify = true;
  result_.divergence_event = index;
  result_.divergence = why;
}

// An undecided run of a page policy's taken for the allocator's, and the
// request after it disagrees: verify runs again with it as empty_cache().
void Verifier::undecided_failed() {
  if (pending_run_ != nullptr && pending_undecided_ && paged_) {
    undecided_diverged_ = static_cast<std::size_t>(pending_run_ - runs_.data());
  }
}

bool Verifier::settle(std::size_t index) {
  if (!expect_.problem.empty()) {
    diverge(index, expect_.problem);
    undecided_failed();
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
    undecided_failed();
    return false;
  }
  if (!expect_.segment_allocs.empty()) {
    const auto& a = expect_.segment_allocs.front();
    diverge(index, fmt::format("the recording allocates a segment of {} bytes at {:#x} here; "
                               "reservoir served the request from its cache",
                               a.second, a.first));
    undecided_failed();
    return false;
  }
  if (!expect_.maps.empty()) {
    const auto& m = expect_.maps.front();
    diverge(index, fmt::format("the recording maps {} bytes at {:#x} here; reservoir served "
                               "the request from memory already mapped",
                               m.second, m.first));
    undecided_failed();
    return false;
  }
  if (pending_run_ != nullptr && pending_cause_ == ReleaseCause::allocator) {
    ++(pending_gc_ ? result_.garbage_collections : result_.allocator_releases);
  }
  pending_run_ = nullptr;
  pending_undecided_ = false;
  pending_gc_ = false;
  step_assumption_.clear();
  expect_.segment_frees.clear();
  expect_.frees_made = 0;
  return true;
}

bool Verifier::matches_empty_cache(const CachingAllocator& allocator) const {
  std::vector<SegmentRef> would;
  for (const SegmentInfo& s : allocator.snapshot().segments) {
    // A private pool's unused segments go too once the replay let it go.
    if (s.pool_id != PoolId{0, 0} && released_pools_.count(s.pool_id) == 0) continue;
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

void Verifier::resolve(CachingAllocator& allocator, const ReleaseRun& run, std::size_t index) {
  ReleaseCause cause = run.cause;
  const bool undecided = cause == ReleaseCause::undecided;
  const auto run_index = static_cast<std::size_t>(&run - runs_.data());
  if (undecided) {
    // When they are all empty_cache() would free, the same segments go
    // either way: apply it here. Otherwise they are the ladder's. (The
    // ladder frees oversize blocks first: when the order then differs,
    // verify runs again with this run left to the ladder.)
    //
    // Under reservoir's page policies the same unmaps come from empty_cache()
    // and from the allocator's own release (native_paged's rescue gives back
    // a free segment's pages and keeps the segment; empty_cache() frees it),
    // and only what follows tells them apart: the allocator's is taken
    // first, and where that diverges verify runs again with the run applied
    // as empty_cache() (ladder_runs_ then names the runs so applied).
    const bool flipped = ladder_runs_.contains(run_index);
    const bool as_empty_cache = paged_ ? flipped : !flipped && matches_empty_cache(allocator);
    cause = as_empty_cache ? ReleaseCause::empty_cache : ReleaseCause::allocator;
    pending_undecided_ = !as_empty_cache;
    if (paged_ && !as_empty_cache) taken_for_allocator_.push_back(run_index);
  }
  pending_run_ = &run;
  pending_cause_ = cause;
  if (!undecided) pending_undecided_ = false;
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

void Verifier::collect_garbage(CachingAllocator& allocator) {
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

}  // namespace reservoir::detail
