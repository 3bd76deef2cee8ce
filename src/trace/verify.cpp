// verify: replay a PyTorch snapshot exactly as it was recorded and compare
// every device request and every address with the recording (the phases:
// verifier.hpp). Here the run over the events, and the entry points.
//
// Device requests. SimDevice gives each new segment the address of the next
// recorded segment_alloc. While the recording shows segment frees not yet
// made, a request fails as out of memory: PyTorch releases cached segments
// itself only after a failed device allocation (or by garbage collection,
// just before one).
#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "verifier.hpp"
#include "verify_start.hpp"

namespace reservoir::detail {

namespace {
// Settings as verify names them to the user.
std::string settings_text(const AllocatorConfig& c) {
  const std::string text = c.to_string();
  return text.empty() ? "PyTorch's defaults" : text;
}
}  // namespace

using detail::starting_state;
using detail::StartingState;

bool Verifier::infer_device_memory(std::uint64_t mapped_at_start) {
  // PyTorch records the device's free memory with each oom (in its address
  // field); the pages mapped then are the recording's maps less its unmaps.
  std::int64_t mapped = static_cast<std::int64_t>(mapped_at_start);
  std::optional<std::uint64_t> most;
  std::size_t at = 0;
  for (std::size_t i = 0; i < trace_.events.size(); ++i) {
    const TraceEvent& e = trace_.events[i];
    if (e.action == TraceAction::segment_map) mapped += static_cast<std::int64_t>(e.size);
    if (e.action == TraceAction::segment_unmap) mapped -= static_cast<std::int64_t>(e.size);
    if (e.action != TraceAction::oom || mapped < 0) continue;
    const std::uint64_t total = static_cast<std::uint64_t>(mapped) + e.addr;
    if (!most || total > *most) {
      most = total;
      at = i;
    }
  }
  if (!most) return false;
  result_.device_memory = most;
  result_.device_memory_inferred = true;
  if (assumption_.empty()) {
    assumption_ = fmt::format(
        "the snapshot does not record the device's memory, which decides how far a map gets "
        "before the device refuses it: verify took {} ({} bytes), the pages mapped and the "
        "free memory recorded at the out-of-memory error of event {} together (memory used "
        "outside the allocator makes it less: give the device's total memory, "
        "--device-memory, to check it exactly)",
        format_size(*most), *most, at);
  }
  return true;
}

VerifyResult Verifier::run() {
  if (!trace_.has_addresses) {
    throw TraceError(
        fmt::format("verify {}: a {} trace has no recorded addresses; it can be "
                    "replayed, not verified",
                    trace_.name, trace_.format));
  }
  config_ = trace_.settings;
  if (options_.settings && !trace_.settings_recorded) {
    // The settings given for a snapshot without its own; the release's
    // rules stay those the snapshot shows.
    const std::string version = config_.pytorch_version;
    config_ = *options_.settings;
    if (config_.pytorch_version.empty()) config_.set_pytorch_version(version);
  }
  if (config_.pytorch_version.empty()) config_.set_pytorch_version(pytorch_rules_);
  // Each release's ladder (a recording of reservoir's live one, which
  // searches the pool after waiting for pending frees, reads the same:
  // the wait's free_completed events come before the allocation).
  config_.retry_searches_pool = false;
  following_pools_ = trace_.event_pools_recorded;
  result_.pytorch_rules = config_.pytorch_version;
  if (!trace_.settings_recorded && options_.settings) {
    assumption_ = fmt::format(
        "the snapshot does not record its allocator settings (PyTorch records them from 2.3 on): "
        "verify took those given ({}); settings other than those while recording would explain "
        "a difference",
        settings_text(*options_.settings));
  } else if (!trace_.settings_recorded) {
    assumption_ =
        "the snapshot does not record its allocator settings (PyTorch records them from "
        "2.3 on), so verify assumed PyTorch's defaults; settings made while recording "
        "(max_split_size_mb, roundup_power2_divisions, ...) would explain a difference: give "
        "them as verify's --settings";
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
    cannot_verify(0, "nothing to check: the snapshot holds no recorded events for this device "
                     "(its state only: memory history was not recording here)");
    return result_;
  }
  // Markers alone (snapshot marks, a lone oom with nothing before it) make
  // no request to compare: nothing was checked, so nothing agrees.
  const bool any_request = std::any_of(trace_.events.begin(), trace_.events.end(), [](const TraceEvent& e) {
    return e.action != TraceAction::snapshot && e.action != TraceAction::oom &&
           e.action != TraceAction::empty_cache;
  });
  if (!any_request) {
    cannot_verify(trace_.events.size(),
                  fmt::format("nothing to check: {} (no allocation, free or segment to replay)",
                              trace_.events.size() == 1
                                  ? std::string("the one recorded event is a marker")
                                  : fmt::format("the {} recorded events are markers only",
                                                trace_.events.size())));
    return result_;
  }
  // reservoir's own page policies replay as they were recorded: their
  // segments' address space is served from where the recording's blocks
  // lie, their page maps and unmaps are compared with the recording's, and
  // the device's free memory (which decides how much a map covers) is that
  // of a device of --device-memory, used by this process alone.
  paged_ = config_.policy == Policy::paging || config_.policy == Policy::native_paged;
  if (paged_) {
    result_.pages_of = fmt::format("policy:{}'s pages", to_string(config_.policy));
    if (const std::string late = paged_late_start(); !late.empty()) {
      cannot_verify(0, late);
      return result_;
    }
    if (!options_.device_memory && !infer_device_memory(0)) {
      assumption_ = fmt::format(
          "recorded under reservoir's policy:{}, whose page maps depend on the device's free "
          "memory, which a snapshot does not record: verify assumed a device without limit "
          "(give the device's total memory, --device-memory, to check it exactly)",
          to_string(config_.policy));
    }
  }
  if (const std::string cut = history_cut(); !cut.empty()) {
    cannot_verify(trace_.events.size(), cut);
    return result_;
  }
  vm_ = config_.expandable_segments || paged_;
  runs_ = detail::release_runs(trace_);
  for (std::size_t k = 0; k < runs_.size(); ++k) run_ending_at_[runs_[k].last] = k;
  find_private_pools();

  StartingState start;
  if (paged_) {
    // (paged_late_start: nothing was held when the recording started.)
  } else if (vm_) {
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
  if (vm_ && !paged_ && !options_.device_memory) {
    std::uint64_t mapped = 0;
    for (const SegmentInfo& seg : start.layout.segments) mapped += seg.total_size;
    infer_device_memory(mapped);
  }
  const bool device_ran_full = std::any_of(runs_.begin(), runs_.end(), [](const ReleaseRun& r) {
    return r.cause != ReleaseCause::empty_cache;
  });
  if (vm_ && !paged_ && !options_.device_memory && !result_.device_memory && device_ran_full &&
      assumption_.empty()) {
    assumption_ =
        "the device ran short (the allocator unmapped cached pages to serve a request), and how "
        "many pages a map gets before the device refuses it depends on the device's memory, "
        "which the snapshot does not record: verify assumed a device without limit (give the "
        "device's total memory, --device-memory, to check it exactly)";
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
  if (options_.device_memory) result_.device_memory = options_.device_memory;
  options.capacity = result_.device_memory.value_or(kUnboundedCapacity);
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
    current_ = i;
    step(allocator, device, i);
    if (!result_.divergence.empty()) break;
    if (auto it = run_ending_at_.find(i); it != run_ending_at_.end()) {
      resolve(allocator, runs_[it->second], i);
    }
    if (watch_ != nullptr && result_.divergence.empty()) (*watch_)(i, allocator);
  }
  if (result_.divergence.empty()) {
    if (bare_releases_.contains(trace_.events.size())) (void)allocator.release_unmapped_segments();
    compare_final_state(allocator.snapshot());
  }
  if (!result_.divergence.empty() && paged_ && config_.policy == Policy::native_paged &&
      (result_.divergence_event >= trace_.events.size() ||
       trace_.events[result_.divergence_event].action == TraceAction::alloc) &&
      !bare_releases_.contains(result_.divergence_event)) {
    bare_release_point_ = result_.divergence_event;
  }
  result_.agreed = result_.divergence.empty();
  return result_;
}

}  // namespace reservoir::detail

namespace reservoir {

using detail::Verifier;

VerifyResult verify(const Trace& trace) { return verify(trace, VerifyOptions{}, VerifyWatch{}); }

VerifyResult verify(const Trace& trace, const VerifyWatch& watch) {
  return verify(trace, VerifyOptions{}, watch);
}

namespace {

// One reading of the start; undecided runs applied as empty_cache() whose
// order of releases disagrees are left to the ladder on a run from the
// start again (the same segments, freed oversize first), as many times as
// there are such runs.
// One reading of the recording: undecided runs are flipped to
// empty_cache() where one diverges while pending (first, or after the bare
// releases when bare_first), and under native_paged, where the replay
// diverges at an allocation, the reading is tried again with the segments
// holding no memory released just before it; a release that gets no
// further is dropped. At most this many such releases are tried.
constexpr std::size_t kBareReadings = 16;

VerifyResult verify_runs(const Trace& trace, const VerifyOptions& options, bool first_alloc,
                         const VerifyWatch* w, const std::string& rules,
                         std::set<std::size_t> ladder_runs, std::vector<std::size_t>* allocator_runs,
                         bool bare_first) {
  // (A watch then sees the events again from the start.)
  std::set<std::size_t> bare_releases;
  std::set<std::size_t> bare_tried;
  // The reading before a bare release was tried, and its undecided run.
  struct Before {
    VerifyResult result;
    std::optional<std::size_t> undecided;
    std::size_t point = 0;
  };
  std::optional<Before> before;
  for (;;) {
    Verifier verifier(trace, options, first_alloc, w, rules, ladder_runs, bare_releases);
    VerifyResult r = verifier.run();
    if (allocator_runs != nullptr && allocator_runs->empty()) {
      *allocator_runs = verifier.undecided_taken_for_the_allocator();  // the first reading's
    }
    if (r.agreed) return r;
    std::optional<std::size_t> undecided = verifier.undecided_run_that_diverged();
    if (!bare_first && undecided && ladder_runs.insert(*undecided).second) continue;
    if (before && r.divergence_event <= before->result.divergence_event) {
      // The release got no further: not it. Back to the reading before.
      bare_releases.erase(before->point);
      r = std::move(before->result);
      undecided = before->undecided;
      before.reset();
    } else {
      before.reset();
      // native_paged: a reading with the bare segments the replay held at
      // the divergence released just before it (a few at most).
      const std::optional<std::size_t> bare = verifier.bare_release_point();
      if (bare && bare_tried.size() < kBareReadings && bare_tried.insert(*bare).second) {
        before = Before{r, undecided, *bare};
        bare_releases.insert(*bare);
        continue;
      }
    }
    if (!bare_first || !undecided || !ladder_runs.insert(*undecided).second) return r;
  }
}

// Under reservoir's page policies a run of unmaps taken for the allocator's
// own release may agree event for event and leave another state (paging
// moved a free handle where the program's empty_cache() had released it
// and a new one was made): where the replay diverges later, the latest such
// runs before it are read as empty_cache() in turn (a few, each a replay
// from the start). Under native_paged the bare segments are also tried
// before the undecided runs. The first reading that agrees holds, else the
// first divergence is reported.
constexpr std::size_t kLaterReadings = 64;

VerifyResult verify_from(const Trace& trace, const VerifyOptions& options, bool first_alloc,
                         const VerifyWatch* w, const std::string& rules) {
  std::vector<std::size_t> taken;
  VerifyResult r = verify_runs(trace, options, first_alloc, w, rules, {}, &taken, false);
  if (r.agreed || taken.empty()) return r;
  const auto agreed = [&](const std::set<std::size_t>& runs, bool bare_first) {
    VerifyResult other = verify_runs(trace, options, first_alloc, nullptr, rules, runs, nullptr, bare_first);
    if (!other.agreed || w == nullptr) return other;
    return verify_runs(trace, options, first_alloc, w, rules, runs, nullptr, bare_first);
  };
  if (trace.settings.policy == Policy::native_paged) {
    if (VerifyResult other = agreed({}, true); other.agreed) return other;
  }
  std::size_t tried = 0;
  for (auto it = taken.rbegin(); it != taken.rend() && tried < kLaterReadings; ++it, ++tried) {
    if (VerifyResult other = agreed({*it}, false); other.agreed) return other;
  }
  return r;
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
  if (options.memory_fraction && !options.device_memory) {
    throw UsageError(
        "verify: a memory fraction needs the device's total memory (the limit is the fraction "
        "of the total: give both)");
  }
  if (options.memory_fraction &&
      !(*options.memory_fraction > 0.0 && *options.memory_fraction <= 1.0)) {
    throw UsageError(fmt::format("verify: invalid memory fraction {}; accepted: above 0.0, up to 1.0",
                                 *options.memory_fraction));
  }
  if (options.device_memory && *options.device_memory == 0) {
    throw UsageError("verify: the device's total memory must be more than 0 bytes");
  }
  if (options.settings && trace.settings_recorded) {
    AllocatorConfig given = *options.settings;
    AllocatorConfig recorded = trace.settings;
    recorded.pytorch_version = "";
    // The same settings as some release reads the text (before 2.10 a '>'
    // covers the interval before it too): those are the recorded ones.
    const auto read_by = [&](const char* release) {
      AllocatorConfig g = given;
      g.set_pytorch_version(release);
      g.pytorch_version = "";
      return g == recorded;
    };
    given.pytorch_version = "";
    if (!read_by("2.9") && !read_by("2.10")) {
      throw UsageError(fmt::format(
          "verify {}: the snapshot records its allocator settings ({}), not those given ({}); "
          "give settings only for a snapshot that does not record them (PyTorch before 2.3)",
          trace.name, detail::settings_text(recorded), detail::settings_text(given)));
    }
  }
  const VerifyWatch* w = watch ? &watch : nullptr;
  const std::string& since = trace.pytorch_since;
  VerifyResult r = verify_as(trace, options, w, since);
  if (r.agreed || !trace.settings.pytorch_version.empty()) return r;
  // Releases whose snapshots look alike but whose rules differ: a recording
  // that disagrees under the rules of the release it shows, or that cannot
  // be verified under them (an address a page policy's device memory might
  // explain), is checked under theirs too, and verified by the first that
  // agrees (a watch then sees that run again, from the start). Before 2.4
  // one division keeps a request's size (2.3's rules; 2.0 to 2.2 show no
  // release at all), yet 2.4 to 2.8 write the settings 2.3 writes; 2.12
  // writes the settings 2.11 writes, but of cached blocks of equal
  // size takes the one made first.
  std::vector<std::string> others;
  if (since.empty()) others.emplace_back("2.3");
  if (since.empty() || compare_versions(since, "2.4") < 0) others.emplace_back("2.4");
  if (!since.empty() && compare_versions(since, "2.12") < 0) others.emplace_back("2.12");
  for (const std::string& rules : others) {
    VerifyResult other = verify_as(trace, options, nullptr, rules);
    if (other.agreed) return w == nullptr ? other : verify_as(trace, options, w, rules);
  }
  return r;
}

}  // namespace reservoir
