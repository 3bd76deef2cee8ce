// policy:paging's native bound (paging_slack_mb, docs/config.md): reserved
// memory within what the native policy would reserve for the same program at
// the same point, plus the slack per stream. Checked over seeded programs of
// several families (training steps, inference with varying batch and
// sequence, huge allocations among small ones, several streams, empty_cache
// anywhere) run under both policies on a device without a capacity limit,
// the bound looked at after every step; a failing program shrinks to a
// minimal one. The model of the native policy the bound rests on is checked
// exactly: its reserved memory is the native policy's at every step.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "native_shadow.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/generated.hpp"
#include "reservoir/replay.hpp"
#include "reservoir/sim_device.hpp"
#include "per_call_validation.hpp"

namespace reservoir::testing {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

using Program = ReplayProgram;

// Runs a program under the native policy and under `config` (what replay's
// --vs-native does): how far the config's reserved memory went above
// native's at the same call, and how often above native plus the slack
// (the config's paging_slack_mb, else 2 MiB) per stream allocated on so far.
OverNative over_native(const Program& prog, const std::string& config) {
  ReplayOptions keep;
  keep.keep_reserved = true;
  const std::vector<std::uint64_t> native =
      replay(prog, AllocatorConfig::parse(""), "", keep).reserved_after_op;
  ReplayOptions compare;
  compare.native_reserved = &native;
  return replay(prog, AllocatorConfig::parse(config), config, compare).over_native.value();
}

bool fails(const Program& prog, const std::string& config) {
  return over_native(prog, config).ops_over_bound > 0;
}

// Drops allocation `id` (its free and stream uses too).
Program without_alloc(const Program& prog, std::uint32_t id) {
  Program out = prog;
  out.ops.clear();
  for (const ReplayOp& op : prog.ops) {
    if (op.kind != ReplayOp::Kind::empty_cache && op.id == id) continue;
    out.ops.push_back(op);
  }
  out.op_events.resize(out.ops.size());
  return out;
}

// A minimal failing program: allocations (with their frees and uses), then
// frees, uses and empty_cache steps, removed one at a time while it still fails.
Program shrink(Program prog, const std::string& config) {
  bool smaller = true;
  while (smaller) {
    smaller = false;
    std::vector<std::uint32_t> allocs;
    for (const ReplayOp& op : prog.ops) {
      if (op.kind == ReplayOp::Kind::alloc) allocs.push_back(op.id);
    }
    for (auto it = allocs.rbegin(); it != allocs.rend(); ++it) {
      Program candidate = without_alloc(prog, *it);
      if (fails(candidate, config)) {
        prog = std::move(candidate);
        smaller = true;
      }
    }
    for (std::size_t i = prog.ops.size(); i-- > 0;) {
      if (prog.ops[i].kind == ReplayOp::Kind::alloc) continue;
      Program candidate = prog;
      candidate.ops.erase(candidate.ops.begin() + static_cast<std::ptrdiff_t>(i));
      candidate.op_events.resize(candidate.ops.size());
      if (fails(candidate, config)) {
        prog = std::move(candidate);
        smaller = true;
      }
    }
  }
  return prog;
}

std::string describe(const Program& prog) {
  std::string out = "{";
  for (const ReplayOp& op : prog.ops) {
    switch (op.kind) {
      case ReplayOp::Kind::alloc: out += fmt::format("A{}({}, {}), ", op.id, op.size, op.stream); break;
      case ReplayOp::Kind::free: out += fmt::format("F({}), ", op.id); break;
      case ReplayOp::Kind::stream_use: out += fmt::format("U({}, {}), ", op.id, op.stream); break;
      case ReplayOp::Kind::empty_cache: out += "E(), "; break;
    }
  }
  return out + "}";
}

constexpr int kPrograms = 1500;

TEST(PagingBound, TheNativeModelReservesWhatTheNativePolicyDoesAtEveryStep) {
  // Both ways a request reaches the model: logged after it was served (a
  // cached block), or begun before (a miss, retried by the ladder once).
  for (int seed = 0; seed < 300; ++seed) {
    const Program prog = generated_program(static_cast<std::uint64_t>(seed) + 7000);
    SimDeviceOptions options;
    options.capacity = std::size_t{1} << 40;
    options.auto_complete_events = true;
    SimDevice device(options);
    const AllocatorConfig config = AllocatorConfig::parse(
        seed % 3 == 0 ? "roundup_power2_divisions:4" : (seed % 3 == 1 ? "max_split_size_mb:64" : ""));
    CachingAllocator native(device, config);
    detail::NativeShadow model(config);
    std::uint64_t r = static_cast<std::uint64_t>(seed);
    auto chance = [&r](int percent) {
      r = r * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<int>((r >> 33) % 100) < percent;
    };
    std::vector<void*> ptrs(prog.id_count, nullptr);
    std::set<StreamId> streams;
    for (std::size_t i = 0; i < prog.ops.size(); ++i) {
      const ReplayOp& op = prog.ops[i];
      void*& ptr = ptrs[op.id];
      if (op.kind == ReplayOp::Kind::alloc) {
        streams.insert(op.stream);
        if (chance(30)) {
          model.begin_request(op.size, op.stream);
          if (chance(20)) model.begin_request(op.size, op.stream);  // the ladder's retry
        }
        ptr = native.allocate(op.size, op.stream);
        model.allocated(reinterpret_cast<DevicePtr>(ptr), op.size, op.stream);
      } else if (op.kind == ReplayOp::Kind::free) {
        ASSERT_NE(ptr, nullptr);
        native.deallocate(ptr);
        model.freed(reinterpret_cast<DevicePtr>(ptr));
        ptr = nullptr;
      } else if (op.kind == ReplayOp::Kind::stream_use) {
        ASSERT_NE(ptr, nullptr);
        native.record_stream(ptr, op.stream);
        model.stream_used(reinterpret_cast<DevicePtr>(ptr), op.stream);
      } else {
        native.empty_cache();
        model.cache_emptied();
      }
      ASSERT_EQ(model.reserved(),
                static_cast<std::size_t>(native.stats().reserved_bytes[0].current))
          << "seed " << seed << " op " << i;
    }
    EXPECT_EQ(model.streams(), streams.size());
  }
}

TEST(PagingBound, MappingAheadStopsAtTheBound) {
  // A 200 MiB request: paging maps room for half another like it (300 MiB);
  // with the bound, no more than the native policy's 200 MiB plus 2 MiB.
  SimDevice unbounded_device;
  CachingAllocator unbounded(unbounded_device, AllocatorConfig::parse("policy:paging"));
  void* p = unbounded.allocate(200 * kMiB);
  EXPECT_EQ(unbounded.stats().reserved_bytes[0].current, std::int64_t{300} << 20);
  SimDevice bounded_device;
  CachingAllocator bounded(bounded_device,
                           AllocatorConfig::parse("policy:paging,paging_slack_mb:2"));
  void* q = bounded.allocate(200 * kMiB);
  EXPECT_EQ(bounded.stats().reserved_bytes[0].current, std::int64_t{202} << 20);
  unbounded.deallocate(p);
  bounded.deallocate(q);
  bounded.validate();
}

TEST(PagingBound, CutsTheProgramsWherePagingPassesNative) {
  // Where the bound does not hold yet is measured, not hidden: the count of
  // programs with a call above native plus 2 MiB per stream, with and
  // without the bound (docs/config.md lists what is left).
  int with_bound = 0;
  int without = 0;
  std::uint64_t worst = 0;
  std::size_t ops = 0;
  const int programs = scaled_for_validation(kPrograms);
  for (int seed = 0; seed < programs; ++seed) {
    const Program prog = generated_program(static_cast<std::uint64_t>(seed));
    ops += prog.ops.size();
    const OverNative bounded = over_native(prog, "policy:paging,paging_slack_mb:2");
    with_bound += bounded.ops_over_bound > 0 ? 1 : 0;
    worst = std::max(worst, bounded.worst_bytes);
    without += over_native(prog, "policy:paging").ops_over_bound > 0 ? 1 : 0;
  }
  EXPECT_GT(ops, static_cast<std::size_t>(programs) * 66);  // the programs are not trivial
  EXPECT_GT(without, programs * 9 / 10);
  EXPECT_LT(with_bound, without * 7 / 10);
  RecordProperty("programs_above_native_with_bound", with_bound);
  RecordProperty("programs_above_native_without", without);
  RecordProperty("worst_excess_mib", static_cast<int>(worst >> 20));
}

TEST(PagingBound, UnderPressureTheBlockBeingServedStaysWhole) {
  // Near the capacity, a request may be served by a stitched block; the
  // bound's release of free handles after growing must not take that block
  // apart (it did: freed under the caller, a crash). Every step checked.
  ReplayOptions checked;
  checked.validate_each_step = true;
  const AllocatorConfig config = AllocatorConfig::parse("policy:paging,paging_slack_mb:2");
  int ran_out = 0;
  const auto seeds = static_cast<std::uint64_t>(scaled_for_validation(40));
  for (std::uint64_t seed = 0; seed < seeds; ++seed) {
    const Program prog = generated_program(seed);
    const std::uint64_t peak = replay(prog, config, "").peak_requested_bytes;
    for (std::uint64_t k = 0; k < 8; ++k) {
      checked.capacity = (peak / kNativeBoundPage + 1 + k) * kNativeBoundPage;
      ran_out += replay(prog, config, "bounded", checked).num_ooms > 0 ? 1 : 0;
    }
  }
  EXPECT_GT(ran_out, 0);  // the capacities were tight enough to matter
}

TEST(PagingBound, GivingStitchedPagesBackDoesNotMergeTheBlockBeingServed) {
  // Shrunk from generated program #1886 at 1,750 MiB: the 20 MB request
  // (stream 0) is mapped beside a block whose pages a cached stitched block
  // (stream 2) has borrowed. Releasing free handles above the bound used to
  // give those pages back first, which merged the lender with the block just
  // mapped, and then released the block's own handle: a served block with
  // no memory behind it.
  ReplayProgram p;
  p.name = "generated #1886, shrunk";
  auto alloc = [&p](std::uint32_t id, std::uint64_t size, StreamId stream) {
    p.ops.push_back({ReplayOp::Kind::alloc, id, size, stream});
    p.id_count = std::max(p.id_count, id + 1);
  };
  auto free = [&p](std::uint32_t id) { p.ops.push_back({ReplayOp::Kind::free, id, 0, 0}); };
  alloc(0, 233336075, 0);
  alloc(1, 2293760, 0);
  free(1);
  alloc(2, 45777986, 0);
  free(2);
  free(0);
  alloc(3, 7719476, 1);
  alloc(4, 62436, 0);
  alloc(5, 169044603, 1);
  alloc(6, 190437597, 0);
  alloc(7, 83379299, 0);
  free(6);
  alloc(8, 112731149, 2);
  alloc(9, 308021697, 3);
  alloc(10, 116172573, 2);
  alloc(11, 197721953, 2);
  alloc(12, 248439363, 2);
  p.ops.push_back({ReplayOp::Kind::empty_cache, 0, 0, 0});
  alloc(13, 281198838, 2);
  free(13);
  alloc(14, 20166653, 0);
  p.op_events.resize(p.ops.size());
  p.contexts.resize(p.id_count);
  ReplayOptions checked;
  checked.validate_each_step = true;
  checked.capacity = std::uint64_t{1750} << 20;
  const ReplayResult r =
      replay(p, AllocatorConfig::parse("policy:paging,paging_slack_mb:2"), "bounded", checked);
  // Every step validated to the end. Since stitching lends whole handles
  // only (CUDA maps a handle from its start), the last request, which
  // borrowed pages of handles still in use, now runs out of memory where the
  // native policy's segments fit it: paging's handles shared by the pages
  // mapped together cannot give back part of themselves.
  const ReplayResult native = replay(p, AllocatorConfig::parse(""), "native", checked);
  EXPECT_EQ(r.ops, p.ops.size());
  EXPECT_EQ(r.num_ooms, 1);
  EXPECT_EQ(native.num_ooms, 0);
}

TEST(PagingBound, AFailureShrinksToAFewSteps) {
  const std::string config = "policy:paging";
  std::optional<Program> found;
  for (int seed = 0; seed < kPrograms && !found; ++seed) {
    Program prog = generated_program(static_cast<std::uint64_t>(seed));
    if (fails(prog, config)) found = std::move(prog);
  }
  ASSERT_TRUE(found.has_value());
  const Program minimal = shrink(*found, config);
  EXPECT_TRUE(fails(minimal, config));
  EXPECT_LE(minimal.ops.size(), 8u) << describe(minimal);
}

}  // namespace
}  // namespace reservoir::testing
