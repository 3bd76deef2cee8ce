// Advice from one recording: the diagnosis at the moment that matters and a
// sweep of allocator settings, each replayed to its minimum capacity.
#include "reservoir/advise.hpp"
#include "reservoir/detail/parallel.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kWorstSegments = 5;
constexpr std::size_t kPinsPerSegment = 8;

// The event after which the recorded reserved memory is highest (the first
// such), from the segment events: the starting level is a constant offset.
// The event after which reserved memory was highest, counted from the
// recording's start; `rose` tells whether it ever rose above the start.
std::size_t reserved_peak_event(const Trace& trace, bool& rose) {
  std::int64_t level = 0;
  std::int64_t best = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    const TraceEvent& e = trace.events[i];
    const auto size = static_cast<std::int64_t>(e.size);
    if (e.action == TraceAction::segment_alloc || e.action == TraceAction::segment_map) {
      level += size;
    } else if (e.action == TraceAction::segment_free || e.action == TraceAction::segment_unmap) {
      level -= size;
    }
    if (level > best) {
      best = level;
      at = i;
    }
  }
  rose = best > 0;
  return at;
}

const AllocatorConfig& recorded_settings(const Trace& trace) { return trace.settings; }

std::string pool_name(bool large) { return large ? "large" : "small"; }

// Sorts out reserved-but-unallocated memory, the segments that hold the most
// of it, and (at an oom) why no block could serve the request.
void analyze(Diagnosis& d, const AllocatorConfig& config,
             const std::unordered_map<DevicePtr, std::uint32_t>& context_at,
             std::optional<std::uint64_t> capacity) {
  std::vector<FreeGroup> groups;
  auto group = [&groups](bool large, StreamId stream) -> FreeGroup& {
    for (FreeGroup& g : groups) {
      if (g.large == large && g.stream == stream) return g;
    }
    groups.push_back(FreeGroup{large, stream, 0, 0, 0});
    return groups.back();
  };
  std::vector<PinnedSegment> pinned;
  for (const SegmentInfo& s : d.segments.segments) {
    std::uint64_t live = 0;
    std::uint64_t free = 0;
    std::uint64_t largest = 0;
    for (const BlockInfo& b : s.blocks) {
      if (b.state == BlockState::active_allocated) {
        live += b.size;
      } else if (b.state == BlockState::active_pending_free) {
        d.pending_free_bytes += b.size;
        ++d.pending_free_blocks;
      } else {
        free += b.size;
        largest = std::max<std::uint64_t>(largest, b.size);
      }
    }
    // A native_paged segment holds only its pages with memory behind them:
    // its free blocks count for what of them is backed (their whole size
    // still decides what they can serve, pages being mapped on demand).
    const std::uint64_t held = d.segments.backed(s);
    if (held < s.total_size) {
      const std::uint64_t busy = s.total_size - free;
      free = held > busy ? held - busy : 0;
      largest = std::min(largest, free);
    }
    d.reserved_bytes += held;
    d.allocated_bytes += live;
    const bool whole_free = s.blocks.size() == 1 && s.blocks[0].state == BlockState::inactive;
    if (whole_free) {
      d.cached_segment_bytes += held;
      ++d.cached_segments;
      continue;
    }
    if (free == 0) continue;
    d.split_free_bytes += free;
    FreeGroup& g = group(s.is_large, s.stream);
    g.bytes += free;
    g.largest = std::max(g.largest, largest);
    for (const BlockInfo& b : s.blocks) g.blocks += b.state == BlockState::inactive ? 1 : 0;
    PinnedSegment p{s.address, held, free, largest, s.stream, s.is_large, {}};
    for (const BlockInfo& b : s.blocks) {
      if (b.state != BlockState::active_allocated) continue;
      auto it = context_at.find(b.address);
      p.live.push_back({b.address, b.size, it == context_at.end() ? 0 : it->second});
    }
    std::stable_sort(p.live.begin(), p.live.end(),
                     [](const PinningBlock& a, const PinningBlock& b) { return a.size > b.size; });
    if (p.live.size() > kPinsPerSegment) p.live.resize(kPinsPerSegment);
    pinned.push_back(std::move(p));
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const FreeGroup& a, const FreeGroup& b) { return a.bytes > b.bytes; });
  d.split_free = std::move(groups);
  std::stable_sort(pinned.begin(), pinned.end(), [](const PinnedSegment& a, const PinnedSegment& b) {
    return a.free_bytes > b.free_bytes;
  });
  if (pinned.size() > kWorstSegments) pinned.resize(kWorstSegments);
  d.worst_segments = std::move(pinned);
  if (capacity && d.device_free_bytes && *capacity >= d.reserved_bytes + *d.device_free_bytes) {
    d.outside_bytes = *capacity - d.reserved_bytes - *d.device_free_bytes;
  }

  if (!d.request) return;
  FailedRequest& r = *d.request;
  r.rounded = CachingAllocator::round_size(r.size, config);
  r.large = r.rounded > kSmallSize;
  r.segment_size = CachingAllocator::allocation_size(r.rounded, config);
  if (d.device_free_bytes && *d.device_free_bytes >= r.segment_size) {
    d.limit_at_least = d.reserved_bytes;
    d.limit_below = d.reserved_bytes + r.segment_size;
  }
  std::uint64_t largest_same_any = 0;  // ignoring the max_split_size rules
  for (const SegmentInfo& s : d.segments.segments) {
    if (s.is_large != r.large) continue;
    for (const BlockInfo& b : s.blocks) {
      if (b.state != BlockState::inactive) continue;
      if (s.stream == r.stream) {
        largest_same_any = std::max<std::uint64_t>(largest_same_any, b.size);
      } else {
        r.largest_other_stream = std::max<std::uint64_t>(r.largest_other_stream, b.size);
      }
    }
  }
  r.largest_same_stream = largest_same_any;
  const std::string where = fmt::format("the {} pool of {}", pool_name(r.large), stream_name(r.stream));
  const std::string need =
      r.rounded == r.size ? format_size(r.rounded)
                          : fmt::format("{} (rounded from {})", format_size(r.rounded), format_size(r.size));
  if (largest_same_any < r.rounded) {
    r.reasons.push_back(
        largest_same_any == 0
            ? fmt::format("No block of {} was free; the request needs {}.", where, need)
            : fmt::format("No free block of {} was large enough: the largest was {}, the request "
                          "needs {}.",
                          where, format_size(largest_same_any), need));
  } else if (r.rounded < config.max_split_size && largest_same_any >= config.max_split_size) {
    r.reasons.push_back(fmt::format(
        "The free blocks of {} large enough ({} the largest) are of max_split_size_mb ({}) or "
        "more, which serve only requests of that size or more.",
        where, format_size(largest_same_any), format_size(config.max_split_size)));
  } else if (r.rounded >= config.max_split_size &&
             largest_same_any >= r.rounded + config.max_non_split_rounding_size) {
    r.reasons.push_back(fmt::format(
        "The free blocks of {} large enough ({} the largest) exceed the request by "
        "max_non_split_rounding_mb ({}) or more, and are not split for it.",
        where, format_size(largest_same_any), format_size(config.max_non_split_rounding_size)));
  }
  if (r.largest_other_stream >= r.rounded) {
    r.reasons.push_back(fmt::format(
        "A free block of {} on another stream could hold it, but a block serves only the "
        "stream it was allocated on.",
        format_size(r.largest_other_stream)));
  }
  const std::uint64_t unusable = d.reserved_bytes - d.allocated_bytes;
  if (d.split_free_bytes >= r.rounded) {
    r.reasons.push_back(fmt::format(
        "{} was free inside split segments ({:.1f}x the request), in pieces of at most {}: "
        "fragmentation.",
        format_size(d.split_free_bytes),
        static_cast<double>(d.split_free_bytes) / static_cast<double>(r.rounded),
        format_size(d.split_free.empty() ? 0 : std::max_element(d.split_free.begin(), d.split_free.end(),
                                                                [](const FreeGroup& a, const FreeGroup& b) {
                                                                  return a.largest < b.largest;
                                                                })->largest)));
  } else if (unusable >= r.rounded) {
    r.reasons.push_back(fmt::format("{} was reserved but unallocated, more than the request.",
                                    format_size(unusable)));
  }
  if (r.ladder_released > 0) {
    r.reasons.push_back(fmt::format(
        "The retry ladder first gave {} of cached segments back to the device; still not enough.",
        format_size(r.ladder_released)));
  } else if (d.cached_segments == 0) {
    r.reasons.push_back("No whole segment was cached for the retry ladder to give back.");
  }
  if (d.limit_below) {
    r.reasons.push_back(fmt::format(
        "A new segment needed {} and the device had {} free: what refused it was this process's "
        "own memory limit (torch.cuda.set_per_process_memory_fraction), at least {} (what the "
        "allocator held) and below {} (that plus the segment).",
        format_size(r.segment_size), format_size(*d.device_free_bytes), format_size(*d.limit_at_least),
        format_size(*d.limit_below)));
  } else if (d.device_free_bytes) {
    std::string outside;
    if (d.outside_bytes && *d.outside_bytes > 0) {
      outside = fmt::format(", with {} of the device held outside this allocator",
                            format_size(*d.outside_bytes));
    }
    r.reasons.push_back(fmt::format("A new segment needed {}; the device had {} free{}.",
                                    format_size(r.segment_size), format_size(*d.device_free_bytes),
                                    outside));
  }
}

// diagnose(), replaying `compiled` (the trace compiled with its failed
// requests) when verify cannot reach the moment; compiles it when null.
Diagnosis diagnose_with(const Trace& trace, std::optional<std::uint64_t> capacity,
                        const ReplayProgram* compiled) {
  const AllocatorConfig config = recorded_settings(trace);
  Diagnosis d;
  // The latest error: a program that catches its errors and goes on (a
  // batch-size finder, a service) records one per failure, and the one a
  // snapshot is taken for, in the program or in its handler, is its last.
  std::size_t oom_at = trace.events.size();
  for (std::size_t i = trace.events.size(); i-- > 0;) {
    if (trace.events[i].action == TraceAction::oom && trace.events[i].size > 0) {
      oom_at = i;
      break;
    }
  }
  const bool at_oom = oom_at < trace.events.size();
  d.moment = at_oom ? "oom" : "peak_reserved";
  d.ends_at_error = at_oom && std::none_of(trace.events.begin() + static_cast<std::ptrdiff_t>(oom_at) + 1,
                                           trace.events.end(), [](const TraceEvent& e) {
                                             return e.action == TraceAction::alloc && e.size > 0;
                                           });
  bool rose = true;
  d.event = at_oom ? oom_at : reserved_peak_event(trace, rose);
  d.at_recording_start = !at_oom && !rose;
  if (!at_oom) {
    // The state after the allocation that the peak's segment was made for.
    for (std::size_t i = d.event; i < trace.events.size(); ++i) {
      if (trace.events[i].action == TraceAction::alloc) {
        d.event = i;
        break;
      }
    }
  }
  if (at_oom) {
    const TraceEvent& e = trace.events[oom_at];
    FailedRequest r;
    r.size = e.size;
    r.stream = e.stream;
    r.context = e.context;
    // The releases just before it are the retry ladder's for this request.
    for (std::size_t k = oom_at; k-- > 0;) {
      const TraceEvent& p = trace.events[k];
      if (p.action == TraceAction::segment_free || p.action == TraceAction::segment_unmap) {
        r.ladder_released += p.size;
      } else if (p.action != TraceAction::free_completed) {
        break;
      }
    }
    d.request = r;
    d.device_free_bytes = e.addr;  // PyTorch records the device's free memory there
  }

  // The program's own annotations open at the moment.
  for (const TraceAnnotation& a : trace.annotations) {
    if (a.event > d.event) break;
    if (a.stage == "START") {
      d.during.push_back(a.name);
    } else if (a.stage == "END") {
      const auto it = std::find(d.during.rbegin(), d.during.rend(), a.name);
      if (it != d.during.rend()) d.during.erase(std::next(it).base());
      d.last_ended = a.name;
      d.last_ended_us_before.reset();
      if (a.time_us != 0 && d.event < trace.events.size() && trace.events[d.event].time_us != 0) {
        d.last_ended_us_before = trace.events[d.event].time_us - a.time_us;
      }
    } else if (a.stage.empty()) {
      d.last_mark = a.name;
    }
  }

  // A recording taken at the error (the answer in the program, or a snapshot
  // dumped in its handler) ends with it: its segments are the allocator's
  // own state at the failed request, where a replay that cannot follow the
  // recording (a policy verify does not model, memory held from before the
  // recording began) would only estimate it.
  const bool taken_at_error =
      at_oom && trace.has_addresses && !trace.final_state.segments.empty() &&
      std::all_of(trace.events.begin() + static_cast<std::ptrdiff_t>(oom_at) + 1, trace.events.end(),
                  [](const TraceEvent& e) { return e.action == TraceAction::snapshot; });
  std::unordered_map<DevicePtr, std::uint32_t> context_at;
  bool captured = false;
  if (trace.events.empty()) {
    d.segments = trace.final_state;
    d.source = "recorded";
    captured = true;
  } else if (trace.has_addresses) {
    const VerifyResult v = verify(trace, [&](std::size_t i, const CachingAllocator& allocator) {
      if (i == d.event) {
        d.segments = allocator.snapshot();
        captured = true;
      }
    });
    if (v.agreed) d.pytorch_rules = v.pytorch_rules;
    if (captured && taken_at_error && !(v.agreed && v.final_state_checked)) {
      // The replay reached the error but was not shown to hold the recorded
      // state there: the recorded state (taken below) is the allocator's own.
      captured = false;
      d.segments = Snapshot{};
      d.source_note = "verify did not show the replay to hold the state recorded at the error";
    } else if (captured) {
      d.source = "verified";
    } else {
      d.source_note = v.divergence.empty()
                          ? "verify did not reach the moment"
                          : fmt::format("verify stopped at event {}: {}", v.divergence_event, v.divergence);
    }
  } else {
    d.source_note = fmt::format("a {} trace has no recorded addresses", trace.format);
  }
  if (!captured && taken_at_error) {
    d.segments = trace.final_state;
    d.source = "recorded";
    captured = true;
  }
  if (captured && (d.source == "verified" || d.source == "recorded")) {
    // Each block's context: its recorded alloc, else the final state's.
    for (const SegmentInfo& s : trace.final_state.segments) {
      for (const BlockInfo& b : s.blocks) {
        if (b.state != BlockState::inactive) context_at[b.address] = b.context;
      }
    }
    for (std::size_t i = 0; i <= d.event && i < trace.events.size(); ++i) {
      const TraceEvent& e = trace.events[i];
      if (e.action == TraceAction::alloc) context_at[e.addr] = e.context;
    }
  } else if (!captured) {
    // Replay under the recorded settings, as the sweep does.
    std::optional<ReplayProgram> own;
    if (compiled == nullptr) own = compile(trace, CompileOptions{true});
    const ReplayProgram& program = compiled != nullptr ? *compiled : *own;
    std::uint64_t before = 0;
    if (at_oom && !program.failed_request_ops.empty()) {
      before = program.initial.size() + program.failed_request_ops.back();
    } else {
      const ReplayResult first = replay(program, config, trace.recorded_config);
      before = first.peak_reserved_op + 1;
      // (A program with no segment at all peaks at op 0, which may be none.)
      const std::uint64_t at = first.peak_reserved_op - program.initial.size();
      if (first.peak_reserved_op >= program.initial.size() && at < program.op_events.size()) {
        d.event = program.op_events[at];
      }
    }
    ReplayStateCapture capture(before);
    ReplayOptions options;
    options.observer = &capture;
    (void)replay(program, config, trace.recorded_config, options);
    d.segments = std::move(capture.snapshot);
    for (const auto& [addr, id] : capture.id_at) {
      context_at[addr] = id < program.contexts.size() ? program.contexts[id] : 0;
    }
    d.source = "replayed";
  }
  analyze(d, config, context_at, capacity);
  return d;
}

}  // namespace

Diagnosis diagnose(const Trace& trace, std::optional<std::uint64_t> capacity) {
  return diagnose_with(trace, capacity, nullptr);
}

namespace {
// A PyTorch 2.x release as people write it: 2.5, 2.11.0, 2.5.1+cu121.
bool valid_version(std::string_view v) {
  v = v.substr(0, v.find('+'));
  if (v.size() < 3 || v.substr(0, 2) != "2.") return false;
  bool digit = false;
  for (const char c : v.substr(2)) {
    if (c == '.') {
      if (!digit) return false;
      digit = false;
    } else if (c >= '0' && c <= '9') {
      digit = true;
    } else {
      return false;
    }
  }
  return digit;
}
}  // namespace

std::string stream_name(std::uint64_t stream) {
  return stream == 0 ? std::string("the default stream") : fmt::format("stream {:#x}", stream);
}

std::string_view pytorch_env_var(std::string_view pytorch_since) {
  return !pytorch_since.empty() && compare_versions(pytorch_since, "2.9") >= 0
             ? "PYTORCH_ALLOC_CONF"
             : "PYTORCH_CUDA_ALLOC_CONF";
}

std::vector<std::string> default_sweep(std::string_view pytorch_since) {
  const std::string_view release = pytorch_since.empty() ? "2.3" : pytorch_since;
  auto knows = [&](std::string_view key) {
    const SettingInfo* s = find_setting(key);
    return s != nullptr && (s->since.empty() || compare_versions(s->since, release) <= 0);
  };
  std::vector<std::string> out{""};
  // The smallest value each release's parser takes: above 20 before the
  // unified allocator config of 2.9 ("must be > 20"), 20 and above from it.
  const int smallest_split_mb = compare_versions(release, "2.9") >= 0 ? 20 : 21;
  for (const int mb : {smallest_split_mb, 32, 64, 128, 256, 512, 1024, 2048}) {
    out.push_back(fmt::format("max_split_size_mb:{}", mb));
  }
  for (const int d : {1, 2, 4, 8, 16}) out.push_back(fmt::format("roundup_power2_divisions:{}", d));
  out.emplace_back("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
  out.emplace_back("garbage_collection_threshold:0.6,max_split_size_mb:128");
  out.emplace_back("garbage_collection_threshold:0.8,max_split_size_mb:512");
  out.emplace_back("max_split_size_mb:128,roundup_power2_divisions:4");
  out.emplace_back("max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
  out.emplace_back("expandable_segments:True");
  out.emplace_back("expandable_segments:True,roundup_power2_divisions:4");
  if (knows("max_non_split_rounding_mb")) {
    out.emplace_back("max_split_size_mb:256,max_non_split_rounding_mb:512");
  }
  if (knows("large_segment_size_mb")) {
    out.emplace_back("large_segment_size_mb:40");
    out.emplace_back("expandable_segments:True,large_segment_size_mb:12");
  }
  out.emplace_back("policy:paging");
  out.emplace_back("policy:native_paged");
  return out;
}

std::string scope_text() {
  return "These capacities cover the recording, which ends at the failed request: the rest of that "
         "step (for a training step, the backward pass and the optimizer) was never recorded. To "
         "check it, rerun with the setting and RESERVOIR_EXPLAIN_OOM=1, or record a whole step.";
}

std::string env_line(const Candidate& candidate, bool on_reservoir, std::string_view pytorch_env) {
  if (on_reservoir || candidate.reservoir_only) return "RESERVOIR_ALLOC_CONF=" + candidate.config;
  if (candidate.config.empty()) return fmt::format("{} unset (PyTorch's defaults)", pytorch_env);
  return fmt::format("{}={}", pytorch_env, candidate.config);
}

Advice advise(const Trace& trace, const AdviseOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  Advice advice;
  advice.trace = trace.name;
  advice.recorded_config = trace.recorded_config;
  advice.pytorch_since = trace.pytorch_since;
  advice.pytorch_release_known = trace.pytorch_release_known;
  if (!options.torch_version.empty()) {
    if (!valid_version(options.torch_version)) {
      throw UsageError(fmt::format("--torch-version '{}': expected a release such as 2.5 or 2.11.0",
                                   options.torch_version));
    }
    advice.torch_version_given = true;
    advice.pytorch_since = options.torch_version;
  }
  advice.pytorch_env = std::string(pytorch_env_var(advice.pytorch_since));
  const AllocatorConfig recorded = recorded_settings(trace);
  ReplayProgram program = compile(trace, CompileOptions{true});
  if (program.initial.empty() && program.ops.empty()) {
    throw TraceError(fmt::format("advise {}: the trace holds no allocations to replay", trace.name));
  }
  advice.diagnosis = diagnose_with(trace, options.capacity, &program);
  const Diagnosis& d = advice.diagnosis;
  // A recording that shows 2.4 to 2.11 may be 2.12's: verify says which.
  if (!d.pytorch_rules.empty()) program.pytorch_version = d.pytorch_rules;
  if (options.capacity) {
    advice.capacity_bytes = options.capacity;
    advice.capacity_source = "given";
  } else if (d.limit_at_least) {
    // The program ran under its own limit: what fits is judged against the
    // least it can have been.
    advice.capacity_bytes = d.limit_at_least;
    advice.capacity_source = "the process's memory limit, at least (set_per_process_memory_fraction)";
  } else if (d.device_free_bytes) {
    advice.capacity_bytes = d.reserved_bytes + *d.device_free_bytes;
    advice.capacity_source = "oom event";
  }

  // The settings, parsed before any replay; the recorded ones among them.
  std::vector<std::string> texts =
      options.configs.empty() ? default_sweep(advice.pytorch_since) : options.configs;
  std::vector<AllocatorConfig> configs;
  configs.reserve(texts.size() + 1);
  for (const std::string& t : texts) configs.push_back(AllocatorConfig::parse(t));
  bool have_recorded = false;
  for (std::size_t i = 0; i < configs.size(); ++i) have_recorded |= configs[i] == recorded;
  if (!have_recorded && options.configs.empty()) {
    texts.push_back(trace.recorded_config);
    configs.push_back(recorded);
  }
  advice.candidates.resize(texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) {
    Candidate& c = advice.candidates[i];
    c.config = texts[i];
    c.reservoir_only = configs[i].policy == Policy::paging || configs[i].policy == Policy::native_paged;
    c.recorded = configs[i] == recorded;
    if (configs[i].garbage_collection_threshold > 0.0) c.memory_fraction = 1.0;
  }

  // Each setting replayed to its minimum capacity, then at the capacity, on
  // every core. Replays share nothing but the program.
  std::vector<std::uint64_t> peak_requested(texts.size(), 0);
  std::vector<MinCapacityResult> searches(texts.size());
  detail::parallel_for(texts.size(), options.threads, [&](std::size_t i) {
    Candidate& c = advice.candidates[i];
    ReplayOptions o;
    o.memory_fraction = c.memory_fraction;
    o.min_capacity_tolerance = options.tolerance;
    o.min_capacity_replay_at_hopeless_capacity = options.count_ooms_at_capacity;
    // The replays with no limit and at the capacity are probes of the search.
    searches[i] = min_capacity(program, configs[i], texts[i], o, advice.capacity_bytes);
    const MinCapacityResult& m = searches[i];
    const ReplayResult& unlimited = m.unlimited;
    const ReplayResult& measured = m.at_capacity ? *m.at_capacity : unlimited;
    c.min_capacity_bytes = m.bytes;
    c.min_capacity_exact = m.bytes <= m.below + (std::uint64_t{2} << 20);
    c.replays = m.replays;
    c.peak_reserved_bytes = unlimited.peak_reserved_bytes;
    peak_requested[i] = unlimited.peak_requested_bytes;
    c.min_capacity_over_requested =
        unlimited.peak_requested_bytes
            ? static_cast<double>(m.bytes) / static_cast<double>(unlimited.peak_requested_bytes)
            : 1.0;
    c.device_calls_per_1000_allocs =
        measured.allocations ? 1000.0 * static_cast<double>(measured.device_calls) /
                                   static_cast<double>(measured.allocations)
                             : 0.0;
    c.device_call_seconds = measured.device_call_seconds;
    if (advice.capacity_bytes && m.at_capacity) c.ooms_at_capacity = measured.num_ooms;
  }, options.progress);

  advice.peak_requested_bytes = *std::max_element(peak_requested.begin(), peak_requested.end());
  // Smallest minimum capacity; ties to fewer device calls, then list order.
  auto better = [](const Candidate& a, const Candidate& b) {
    if (a.min_capacity_bytes != b.min_capacity_bytes) return a.min_capacity_bytes < b.min_capacity_bytes;
    return a.device_calls_per_1000_allocs < b.device_calls_per_1000_allocs;
  };
  auto choose = [&] {
    advice.best_pytorch.reset();
    advice.best_reservoir = 0;
    for (std::size_t i = 0; i < advice.candidates.size(); ++i) {
      const Candidate& c = advice.candidates[i];
      if (!c.reservoir_only &&
          (!advice.best_pytorch || better(c, advice.candidates[*advice.best_pytorch]))) {
        advice.best_pytorch = i;
      }
      if (i == 0 || better(c, advice.candidates[advice.best_reservoir])) advice.best_reservoir = i;
    }
  };
  choose();
  if (options.tolerance > 0.0) {
    // The searches stopped within the tolerance: the figures the answer
    // gives (the recorded settings', the best ones') are made exact.
    std::vector<std::size_t> named{advice.best_reservoir};
    if (advice.best_pytorch) named.push_back(*advice.best_pytorch);
    for (std::size_t i = 0; i < advice.candidates.size(); ++i) {
      if (advice.candidates[i].recorded) named.push_back(i);
    }
    auto refine = [&](std::size_t i) {
      Candidate& c = advice.candidates[i];
      ReplayOptions o;
      o.memory_fraction = c.memory_fraction;
      refine_min_capacity(program, configs[i], texts[i], o, searches[i]);
      c.min_capacity_bytes = searches[i].bytes;
      c.replays = searches[i].replays;
      c.min_capacity_exact = true;
      if (peak_requested[i] != 0) {
        c.min_capacity_over_requested =
            static_cast<double>(c.min_capacity_bytes) / static_cast<double>(peak_requested[i]);
      }
    };
    // Each on its own core: the searches share nothing but the program.
    auto refine_all = [&](std::vector<std::size_t> which) {
      std::sort(which.begin(), which.end());
      which.erase(std::unique(which.begin(), which.end()), which.end());
      std::erase_if(which, [&](std::size_t i) { return advice.candidates[i].min_capacity_exact; });
      detail::parallel_for(which.size(), options.threads, [&](std::size_t k) { refine(which[k]); });
    };
    refine_all(named);
    choose();
    // Where the recorded settings come out best, a setting whose search
    // stopped above them but may fit below them (what it is known not to
    // fit in is less) is searched to the end: the answer never says that no
    // setting does better than the program's own when an exact search finds
    // one. (Where another setting is best, it is named with its exact
    // figure, which does better; one that beats it within the tolerance is
    // left to the page's figures, to keep the answer quick.) The most
    // promising first (the least figure within the tolerance), two at a time
    // (on two cores where there are; a fixed number, so that the setting
    // named does not depend on the machine's cores), until one does better
    // or none is left.
    constexpr std::size_t at_once = 2;
    for (;;) {
      std::vector<std::size_t> open;
      for (std::size_t i = 0; i < advice.candidates.size(); ++i) {
        const Candidate& c = advice.candidates[i];
        const Candidate& rival = advice.candidates[c.reservoir_only || !advice.best_pytorch
                                                       ? advice.best_reservoir
                                                       : *advice.best_pytorch];
        if (rival.recorded && !c.min_capacity_exact &&
            searches[i].below + (std::uint64_t{2} << 20) < rival.min_capacity_bytes) {
          open.push_back(i);
        }
      }
      if (open.empty()) break;
      std::stable_sort(open.begin(), open.end(), [&](std::size_t a, std::size_t b) {
        return advice.candidates[a].min_capacity_bytes < advice.candidates[b].min_capacity_bytes;
      });
      if (open.size() > at_once) open.resize(at_once);
      refine_all(std::move(open));
      choose();
    }
  }
  for (const Candidate& c : advice.candidates) advice.replays += c.replays;
  if (advice.capacity_bytes) {
    const Candidate& best = advice.candidates[advice.best_pytorch.value_or(advice.best_reservoir)];
    advice.fits = best.min_capacity_bytes <= *advice.capacity_bytes;
    if (advice.peak_requested_bytes > *advice.capacity_bytes) {
      advice.shrink_bytes = advice.peak_requested_bytes - *advice.capacity_bytes;
    }
  }
  advice.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return advice;
}

}  // namespace reservoir
