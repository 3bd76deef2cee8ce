// Compiling traces to allocator operations, and replaying them on a SimDevice.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "release_bursts.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {

ReplayProgram compile(const Trace& trace, const CompileOptions& options) {
  ReplayProgram program;
  program.name = trace.name;
  program.pytorch_version = trace.pytorch_since;
  program.device = trace.device;
  program.recorded_events = trace.events.size();
  std::unordered_map<DevicePtr, std::uint32_t> live;
  std::unordered_set<DevicePtr> touched;
  std::unordered_set<DevicePtr> zero_size;
  std::vector<std::pair<DevicePtr, ReplayOp>> initial;
  // Ids are dense: the next one is the number of contexts recorded so far.
  auto new_id = [&program](std::uint32_t context) {
    program.contexts.push_back(context);
    return static_cast<std::uint32_t>(program.contexts.size() - 1);
  };
  program.ops.reserve(trace.events.size() / 2);
  // The program's empty_cache() calls, seen as runs of segment releases.
  const std::unordered_set<std::size_t> empty_cache_at = detail::empty_cache_points(trace);
  std::size_t latest_oom = trace.events.size();
  for (std::size_t i = trace.events.size(); i-- > 0;) {
    if (trace.events[i].action == TraceAction::oom && trace.events[i].size > 0) {
      latest_oom = i;
      break;
    }
  }
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    program.op_events.resize(program.ops.size(), i == 0 ? 0 : i - 1);
    const TraceEvent& e = trace.events[i];
    if (empty_cache_at.count(i) != 0) {
      program.ops.push_back({ReplayOp::Kind::empty_cache, 0, 0, 0});
      continue;
    }
    switch (e.action) {
      case TraceAction::alloc: {
        if (e.size == 0) {  // no allocator work, nor for its free
          zero_size.insert(e.addr);
          break;
        }
        const std::uint32_t id = new_id(e.context);
        live[e.addr] = id;
        touched.insert(e.addr);
        program.ops.push_back({ReplayOp::Kind::alloc, id, e.size, e.stream});
        break;
      }
      case TraceAction::free_requested: {
        if (zero_size.erase(e.addr) != 0) break;
        touched.insert(e.addr);
        std::uint32_t id = 0;
        auto it = live.find(e.addr);
        if (it == live.end()) {
          // Live before recording began: allocate it first. Its context is
          // the free's (PyTorch gives a free the allocation's when it has none).
          id = new_id(e.context);
          initial.emplace_back(e.addr, ReplayOp{ReplayOp::Kind::alloc, id, e.size, e.stream});
        } else {
          id = it->second;
          live.erase(it);
        }
        program.ops.push_back({ReplayOp::Kind::free, id, 0, e.stream});
        break;
      }
      case TraceAction::empty_cache:
        program.ops.push_back({ReplayOp::Kind::empty_cache, 0, 0, 0});
        break;
      case TraceAction::oom: {
        if (!options.failed_requests || e.size == 0) break;
        if (i != latest_oom) {
          // Served nothing: what it left is its ladder's release of the cache.
          program.ops.push_back({ReplayOp::Kind::empty_cache, 0, 0, 0});
          break;
        }
        const std::uint32_t id = new_id(e.context);
        program.failed_request_ops.push_back(program.ops.size());
        program.failed_request_events.push_back(i);
        program.ops.push_back({ReplayOp::Kind::alloc, id, e.size, e.stream});
        program.ops.push_back({ReplayOp::Kind::free, id, 0, e.stream});
        break;
      }
      default: break;  // device-side and bookkeeping events are the allocator's to decide
    }
  }
  program.op_events.resize(program.ops.size(), trace.events.empty() ? 0 : trace.events.size() - 1);
  // Blocks allocated before recording and never touched by it.
  for (const SegmentInfo& s : trace.final_state.segments) {
    for (const BlockInfo& b : s.blocks) {
      if (b.state == BlockState::inactive || touched.count(b.address) != 0) continue;
      const std::uint64_t size = b.requested_size != 0 ? b.requested_size : b.size;
      initial.emplace_back(b.address,
                           ReplayOp{ReplayOp::Kind::alloc, new_id(b.context), size, s.stream});
    }
  }
  std::sort(initial.begin(), initial.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [addr, op] : initial) program.initial.push_back(op);
  program.id_count = static_cast<std::uint32_t>(program.contexts.size());
  return program;
}

ReplayResult replay(const ReplayProgram& program, const AllocatorConfig& config,
                    const std::string& config_text, const ReplayOptions& options) {
  SimDeviceOptions device_options;
  device_options.capacity = options.capacity.value_or(kUnboundedCapacity);
  device_options.reuse_freed_addresses = options.reuse_freed_addresses;
  device_options.auto_complete_events = true;
  SimDevice device(device_options);
  AllocatorConfig rules = config;
  if (rules.pytorch_version.empty()) rules.set_pytorch_version(program.pytorch_version);
  rules.retry_searches_pool = false;  // each release's ladder, as recorded
  CachingAllocator allocator(device, rules, program.device);
  if (options.memory_fraction) allocator.set_memory_fraction(*options.memory_fraction);

  ReplayResult result;
  result.trace = program.name;
  result.config = config_text;
  result.events = program.recorded_events;

  std::uint64_t op_index = 0;
  std::uint64_t reserved = 0;
  allocator.attach_trace_tracker([&](const TraceEvent& e) {
    if (e.action == TraceAction::segment_alloc || e.action == TraceAction::segment_map) {
      reserved += e.size;
      if (reserved > result.peak_reserved_bytes) {
        result.peak_reserved_bytes = reserved;
        result.peak_reserved_op = op_index;
      }
    } else if (e.action == TraceAction::segment_free || e.action == TraceAction::segment_unmap) {
      reserved -= e.size;
    }
  });

  std::vector<void*> pointers(program.id_count, nullptr);
  ReplayObserver* const observer = options.observer;
  std::unordered_set<StreamId> streams;
  const std::vector<std::uint64_t>* const native = options.native_reserved;
  if (native != nullptr) {
    result.over_native.emplace();
    result.over_native->slack_bytes =
        config.paging_slack != kNoPagingBound ? config.paging_slack : kNativeBoundPage;
  }
  if (options.keep_reserved) {
    result.reserved_after_op.reserve(program.initial.size() + program.ops.size());
  }
  if (observer != nullptr) observer->on_start(allocator, program);
  const auto start = std::chrono::steady_clock::now();
  // Requests refused, counted here too: one of 1 EiB or more is refused
  // ahead of the allocator's statistics, as PyTorch refuses it.
  std::int64_t refused = 0;
  struct StopAtFirstOom {};  // thrown past the op loops: nothing on the path of an op that succeeds
  auto run = [&](const ReplayOp& op) {
    switch (op.kind) {
      case ReplayOp::Kind::alloc:
        ++result.allocations;
        try {
          pointers[op.id] = allocator.allocate(op.size, op.stream);
        } catch (const OutOfMemoryError& e) {
          ++refused;
          if (result.first_oom.empty()) {
            result.first_oom = fmt::format("op {}: {}", op_index, e.what());
          }
          if (options.stop_at_first_oom) throw StopAtFirstOom{};
        }
        break;
      case ReplayOp::Kind::free:
        if (pointers[op.id] != nullptr) allocator.deallocate(pointers[op.id]);
        pointers[op.id] = nullptr;
        break;
      case ReplayOp::Kind::empty_cache: allocator.empty_cache(); break;
      case ReplayOp::Kind::stream_use:
        if (pointers[op.id] != nullptr) allocator.record_stream(pointers[op.id], op.stream);
        break;
    }
    if (options.keep_reserved) result.reserved_after_op.push_back(reserved);
    if (native != nullptr && op_index < native->size()) {
      if (op.kind == ReplayOp::Kind::alloc) streams.insert(op.stream);
      OverNative& o = *result.over_native;
      const std::uint64_t n = (*native)[op_index];
      if (reserved > n && reserved - n > o.worst_bytes) {
        o.worst_bytes = reserved - n;
        o.worst_op = op_index;
      }
      const std::uint64_t bound = n + o.slack_bytes * std::max<std::size_t>(streams.size(), 1);
      if (reserved > bound) {
        ++o.ops_over_bound;
        o.worst_over_bound_bytes = std::max(o.worst_over_bound_bytes, reserved - bound);
      }
    }
    if (options.validate_each_step) allocator.validate();
    if (observer != nullptr) {
      observer->on_op(op_index, op, op.kind == ReplayOp::Kind::alloc ? pointers[op.id] : nullptr);
    }
    ++op_index;
  };
  try {
    for (const ReplayOp& op : program.initial) run(op);
    for (const ReplayOp& op : program.ops) run(op);
  } catch (const StopAtFirstOom&) {
    ++op_index;  // the op that ran out of memory was done
  }
  result.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const DeviceStats s = allocator.stats();
  result.ops = op_index;
  result.peak_requested_bytes = static_cast<std::uint64_t>(s.requested_bytes[0].peak);
  result.peak_allocated_bytes = static_cast<std::uint64_t>(s.allocated_bytes[0].peak);
  result.final_reserved_bytes = static_cast<std::uint64_t>(s.reserved_bytes[0].current);
  result.device_allocs = s.num_device_alloc;
  result.device_frees = s.num_device_free;
  result.num_alloc_retries = s.num_alloc_retries;
  result.num_ooms = std::max(s.num_ooms, refused);
  result.device_call_seconds = device.estimated_ns() / 1e9;
  for (CallKind kind : kMemoryCallKinds) result.device_calls += device.calls(kind);
  if (observer != nullptr) observer->on_finish(allocator);
  return result;
}

void ReplayStateCapture::on_start(CachingAllocator& allocator, const ReplayProgram& program) {
  allocator_ = &allocator;
  ptrs_.assign(program.id_count, 0);
  taken = false;
  if (before_ == 0) take();
}

void ReplayStateCapture::on_op(std::uint64_t index, const ReplayOp& op, const void* ptr) {
  if (op.kind == ReplayOp::Kind::alloc && ptr != nullptr) {
    ptrs_[op.id] = reinterpret_cast<DevicePtr>(ptr);
  } else if (op.kind == ReplayOp::Kind::free) {
    ptrs_[op.id] = 0;
  }
  if (index + 1 == before_) take();
}

void ReplayStateCapture::take() {
  snapshot = allocator_->snapshot();
  id_at.clear();
  for (std::uint32_t id = 0; id < ptrs_.size(); ++id) {
    if (ptrs_[id] != 0) id_at[ptrs_[id]] = id;
  }
  taken = true;
}

namespace {

// The smallest multiple of `step` in (lo, hi] for which fits() holds, given
// fits(hi); assumes fits is monotone, which bisection needs.
std::uint64_t bisect(std::uint64_t& lo, std::uint64_t hi, std::uint64_t step,
                     const std::function<bool(std::uint64_t)>& fits, double tolerance = 0.0) {
  while (hi - lo > step && static_cast<double>(hi - lo) > tolerance * static_cast<double>(hi)) {
    const std::uint64_t mid = lo + (hi - lo) / step / 2 * step;
    if (fits(mid)) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return hi;
}

}  // namespace

MinCapacityResult min_capacity(const ReplayProgram& program, const AllocatorConfig& config,
                               const std::string& config_text, const ReplayOptions& options,
                               std::optional<std::uint64_t> at) {
  constexpr std::uint64_t kStep = std::uint64_t{2} << 20;  // the device granularity
  MinCapacityResult out;
  ReplayOptions probe = options;
  probe.validate_each_step = false;
  probe.keep_reserved = false;
  probe.native_reserved = nullptr;
  std::string last_oom;
  // The bisection's probes need only whether the trace fits.
  ReplayOptions bisecting = probe;
  bisecting.stop_at_first_oom = true;  // the first out-of-memory error of the last probe that had one
  auto fits = [&](std::uint64_t capacity) {
    bisecting.capacity = capacity;
    ++out.replays;
    ReplayResult r = replay(program, config, config_text, bisecting);
    if (r.num_ooms != 0) last_oom = std::move(r.first_oom);
    return r.num_ooms == 0;
  };
  // An upper bound: the peak reserved with no limit, or twice it if the
  // retry ladder somehow needs more, doubling until the trace fits.
  ReplayOptions unlimited = probe;
  unlimited.capacity.reset();
  out.unlimited = replay(program, config, config_text, unlimited);
  const ReplayResult& free_run = out.unlimited;
  ++out.replays;
  // Capacities below the peak of requested bytes cannot fit: start below it.
  const std::uint64_t below = free_run.peak_requested_bytes / kStep * kStep;
  std::uint64_t lo = below >= kStep ? below - kStep : 0;
  std::uint64_t hi = (free_run.peak_reserved_bytes + kStep - 1) / kStep * kStep;
  hi = std::max(hi, kStep);
  bool hi_known = false;  // hi is known to fit
  if (at && !options.min_capacity_replay_at_hopeless_capacity && free_run.peak_requested_bytes > *at) {
    at.reset();  // cannot fit: what is live at the peak alone is more
  }
  if (at) {
    // The device's capacity as a probe (allocations are whole 2 MiB pages:
    // what fits at it fits at it rounded down).
    probe.capacity = *at;
    ++out.replays;
    out.at_capacity = replay(program, config, config_text, probe);
    const std::uint64_t floor = *at / kStep * kStep;
    if (out.at_capacity->num_ooms == 0 && floor >= kStep) {
      hi = floor;
      hi_known = true;
    } else if (out.at_capacity->num_ooms != 0) {
      last_oom = out.at_capacity->first_oom;
      lo = std::max(lo, floor);
      hi = std::max(hi, lo + kStep);
    }
  }
  constexpr std::uint64_t kLimit = kUnboundedCapacity;
  while (!hi_known && !fits(hi)) {
    if (hi >= kLimit) {
      throw TraceError(fmt::format(
          "{}: no capacity up to {} (more than any GPU holds) runs without running out of "
          "memory; {}",
          program.name, format_size(kLimit), last_oom));
    }
    hi *= 2;
  }
  if (free_run.peak_requested_bytes == 0) return out;  // nothing to hold
  out.bytes = lo + kStep >= hi ? hi : bisect(lo, hi, kStep, fits, options.min_capacity_tolerance);
  out.below = lo;
  return out;
}

void refine_min_capacity(const ReplayProgram& program, const AllocatorConfig& config,
                         const std::string& config_text, const ReplayOptions& options,
                         MinCapacityResult& result) {
  constexpr std::uint64_t kStep = std::uint64_t{2} << 20;
  if (result.bytes <= result.below + kStep) return;
  ReplayOptions probe = options;
  probe.validate_each_step = false;
  probe.keep_reserved = false;
  probe.native_reserved = nullptr;
  probe.stop_at_first_oom = true;
  auto fits = [&](std::uint64_t capacity) {
    probe.capacity = capacity;
    ++result.replays;
    return replay(program, config, config_text, probe).num_ooms == 0;
  };
  result.bytes = bisect(result.below, result.bytes, kStep, fits);
}

}  // namespace reservoir
