// policy:native_paged: the native policy's decisions, each segment's memory
// mapped in pages as its blocks are handed out. Its guarantee, checked as a
// property over generated programs: reserved memory never above the native
// policy's for the same program at the same call, with the same blocks in
// segments of the same sizes. Then what the pages buy under pressure, exact
// figures on small cases, and every device failure on the release side.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "address_arena.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/generated.hpp"
#include "reservoir/replay.hpp"
#include "reservoir/sim_device.hpp"
#include "per_call_validation.hpp"

namespace reservoir::testing {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::int64_t reserved(const CachingAllocator& a) { return a.stats().reserved_bytes[0].current; }

// A device where memory is never plentiful for a segment of 20 MiB (its free
// memory / 256 is below 2 MiB): pages are mapped block by block.
SimDevice tight_device(std::size_t capacity = 64 * kMiB) {
  SimDeviceOptions o;
  o.capacity = capacity;
  o.auto_complete_events = true;
  return SimDevice(o);
}

// A 20 MiB segment on a tight device: x (pages 0 and 1) freed, y (pages 2
// and 3) live; 8 MiB mapped where native holds 20.
struct OneOfTwoFreed {
  SimDevice device = tight_device();
  CachingAllocator a{device, AllocatorConfig::parse("policy:native_paged")};
  void* y = nullptr;
  OneOfTwoFreed() {
    void* x = a.allocate(4 * kMiB);
    y = a.allocate(4 * kMiB);
    a.deallocate(x);
  }
  ~OneOfTwoFreed() { a.deallocate(y); }
  OneOfTwoFreed(const OneOfTwoFreed&) = delete;
  OneOfTwoFreed& operator=(const OneOfTwoFreed&) = delete;
};

OverNative over_native(const ReplayProgram& prog, const std::string& settings) {
  ReplayOptions keep;
  keep.keep_reserved = true;
  const std::vector<std::uint64_t> native =
      replay(prog, AllocatorConfig::parse(settings), settings, keep).reserved_after_op;
  ReplayOptions compare;
  compare.native_reserved = &native;
  const std::string config = settings.empty() ? "policy:native_paged" : settings + ",policy:native_paged";
  const ReplayResult r = replay(prog, AllocatorConfig::parse(config), config, compare);
  EXPECT_EQ(r.num_ooms, 0) << prog.name;
  return r.over_native.value();
}

TEST(NativePaged, ReleasingUnmappedSegmentsGivesBackOnlySegmentsWithNothingMapped) {
  SimDevice device = tight_device();
  CachingAllocator a{device, AllocatorConfig::parse("policy:native_paged")};
  void* first = a.allocate(40 * kMiB);
  a.deallocate(first);  // cached, its pages mapped
  EXPECT_EQ(a.release_unmapped_segments(), 0u);
  EXPECT_EQ(a.snapshot().segments.size(), 1u);
  // 50 MiB more than the device has beside it: the free pages of the first
  // segment go back (the segment stays, nothing mapped) and the second maps.
  void* second = a.allocate(50 * kMiB);
  ASSERT_EQ(a.snapshot().segments.size(), 2u);
  EXPECT_EQ(reserved(a), 50 * static_cast<std::int64_t>(kMiB));
  const std::uint64_t unreserves = device.calls(CallKind::unreserve);
  const std::size_t used = device.used_bytes();
  EXPECT_EQ(a.release_unmapped_segments(), 1u);
  const Snapshot after = a.snapshot();
  ASSERT_EQ(after.segments.size(), 1u);
  EXPECT_EQ(after.segments[0].address, reinterpret_cast<DevicePtr>(second));
  EXPECT_EQ(reserved(a), 50 * static_cast<std::int64_t>(kMiB));  // no memory moved
  EXPECT_EQ(device.used_bytes(), used);
  EXPECT_EQ(device.calls(CallKind::unreserve), unreserves);  // arena space: no device call
  EXPECT_EQ(a.release_unmapped_segments(), 0u);
  a.deallocate(second);
  // Under the native policy no segment is without memory: nothing goes.
  SimDevice plain = tight_device();
  CachingAllocator n{plain, AllocatorConfig{}};
  n.deallocate(n.allocate(40 * kMiB));
  EXPECT_EQ(n.release_unmapped_segments(), 0u);
  EXPECT_EQ(n.snapshot().segments.size(), 1u);
}

TEST(NativePaged, NeverReservesMoreThanNativeAtAnyCallOfAnyProgram) {
  // The property, on programs of every family (docs/replay.md), under the
  // default settings and two others: not one call above native, not a byte.
  for (const auto& [settings, programs] : {std::tuple<std::string, int>{"", 1500},
                                           {"roundup_power2_divisions:4", 300},
                                           {"max_split_size_mb:64", 300}}) {
    for (int seed = 0; seed < scaled_for_validation(programs); ++seed) {
      const ReplayProgram prog = generated_program(static_cast<std::uint64_t>(seed));
      const OverNative o = over_native(prog, settings);
      ASSERT_EQ(o.worst_bytes, 0u) << prog.name << " [" << settings << "] at call " << o.worst_op;
      ASSERT_EQ(o.ops_over_bound, 0u) << prog.name;
    }
  }
}

// The bound on a device that gives a segment the lowest freed range (as a
// real driver can): from PyTorch 2.12, ties among cached blocks of one size
// go to the oldest segment, so addresses decide nothing and the bound holds
// exactly; before, the lowest address wins, the native policy's layout
// follows the driver's order and native_paged's (its arena, ascending) can
// differ either way: measured, not promised.
TEST(NativePaged, WhereTheDriverReusesAddressesTheBoundHoldsFromPyTorch212) {
  auto over = [](const ReplayProgram& prog, const std::string& settings) {
    ReplayOptions keep;
    keep.keep_reserved = true;
    keep.reuse_freed_addresses = true;
    const std::vector<std::uint64_t> native =
        replay(prog, AllocatorConfig::parse(settings), settings, keep).reserved_after_op;
    ReplayOptions compare;
    compare.native_reserved = &native;
    compare.reuse_freed_addresses = true;
    const std::string config = settings + ",policy:native_paged";
    return replay(prog, AllocatorConfig::parse(config), config, compare).over_native.value();
  };
  int above_before_212 = 0;
  std::uint64_t worst_before_212 = 0;
  const int programs = scaled_for_validation(600);
  for (int seed = 0; seed < programs; ++seed) {
    const ReplayProgram prog = generated_program(static_cast<std::uint64_t>(seed));
    const OverNative now = over(prog, "pytorch_version:2.15");
    ASSERT_EQ(now.worst_bytes, 0u) << prog.name << " at call " << now.worst_op;
    const OverNative before = over(prog, "pytorch_version:2.11");
    above_before_212 += before.worst_bytes > 0 ? 1 : 0;
    worst_before_212 = std::max(worst_before_212, before.worst_bytes);
  }
  RecordProperty("programs_above_native_before_2_12", above_before_212);
  RecordProperty("worst_mib_before_2_12", static_cast<int>(worst_before_212 >> 20));
}

// A segment as the snapshot shows it, apart from where it lies.
using Shape = std::tuple<StreamId, bool, std::size_t, std::vector<std::tuple<std::size_t, std::size_t, int>>>;
std::vector<Shape> shapes(const CachingAllocator& a) {
  std::vector<Shape> out;
  for (const SegmentInfo& s : a.snapshot().segments) {
    std::vector<std::tuple<std::size_t, std::size_t, int>> blocks;
    for (const BlockInfo& b : s.blocks) {
      blocks.emplace_back(b.address - s.address, b.size, static_cast<int>(b.state));
    }
    out.emplace_back(s.stream, s.is_large, s.total_size, std::move(blocks));
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(NativePaged, MakesEveryDecisionTheNativePolicyMakes) {
  // Side by side on devices without a limit: the same statistics after
  // every call, and every segment of the same size with the same blocks at
  // the same offsets (only where segments lie, and what backs them, differ).
  for (int seed = 0; seed < scaled_for_validation(200); ++seed) {
    const ReplayProgram prog = generated_program(static_cast<std::uint64_t>(seed) + 5000);
    SimDeviceOptions o;
    o.capacity = std::size_t{1} << 40;
    o.auto_complete_events = true;
    SimDevice native_device(o);
    SimDevice paged_device(o);
    CachingAllocator native(native_device, AllocatorConfig::parse(""));
    CachingAllocator paged(paged_device, AllocatorConfig::parse("policy:native_paged"));
    std::vector<std::pair<void*, void*>> ptrs(prog.id_count, {nullptr, nullptr});
    for (std::size_t i = 0; i < prog.ops.size(); ++i) {
      const ReplayOp& op = prog.ops[i];
      auto& [n, p] = ptrs[op.id];
      switch (op.kind) {
        case ReplayOp::Kind::alloc:
          n = native.allocate(op.size, op.stream);
          p = paged.allocate(op.size, op.stream);
          break;
        case ReplayOp::Kind::free:
          native.deallocate(n);
          paged.deallocate(p);
          break;
        case ReplayOp::Kind::stream_use:
          native.record_stream(n, op.stream);
          paged.record_stream(p, op.stream);
          break;
        case ReplayOp::Kind::empty_cache:
          native.empty_cache();
          paged.empty_cache();
          break;
      }
      const DeviceStats a = native.stats();
      const DeviceStats b = paged.stats();
      ASSERT_EQ(a.segment[0].current, b.segment[0].current) << prog.name << " call " << i;
      ASSERT_EQ(a.allocated_bytes[0].current, b.allocated_bytes[0].current) << prog.name;
      ASSERT_EQ(a.active_bytes[0].current, b.active_bytes[0].current) << prog.name;
      ASSERT_EQ(a.inactive_split_bytes[0].current, b.inactive_split_bytes[0].current) << prog.name;
      ASSERT_LE(b.reserved_bytes[0].current, a.reserved_bytes[0].current) << prog.name;
    }
    ASSERT_EQ(shapes(native), shapes(paged)) << prog.name;
    paged.validate();
  }
}

TEST(NativePaged, UnderPressureEveryStepKeepsItsInvariants) {
  // Generated programs at capacities just above their peaks: pages given
  // back, handles shed, segments freed by the retry ladder; every step
  // validated (allocated blocks have memory behind every page, the page
  // tables match the handles, reserved memory is the pages mapped).
  ReplayOptions checked;
  checked.validate_each_step = true;
  const AllocatorConfig config = AllocatorConfig::parse("policy:native_paged");
  int ran_out = 0;
  std::uint64_t released = 0;
  const auto seeds = static_cast<std::uint64_t>(scaled_for_validation(60));
  for (std::uint64_t seed = 0; seed < seeds; ++seed) {
    const ReplayProgram prog = generated_program(seed);
    const std::uint64_t peak = replay(prog, config, "").peak_requested_bytes;
    for (std::uint64_t k : {1, 2, 4, 8, 16, 40}) {
      checked.capacity = (peak / (2 * kMiB) + k) * (2 * kMiB);
      const ReplayResult r = replay(prog, config, "tight", checked);
      ran_out += r.num_ooms > 0 ? 1 : 0;
      released += static_cast<std::uint64_t>(r.device_frees);
    }
  }
  EXPECT_GT(ran_out, 0);   // tight enough to fail somewhere
  EXPECT_GT(released, 0u);  // and to give pages back
}

TEST(NativePaged, MapsABlocksPagesOnlyWhereMemoryIsTight) {
  // 3 MiB: native allocates a 20 MiB segment. With memory to spare, the
  // segment is mapped whole (one handle); on a tight device, the 2 pages
  // the block covers.
  SimDevice roomy;
  CachingAllocator a(roomy, AllocatorConfig::parse("policy:native_paged"));
  void* p = a.allocate(3 * kMiB);
  EXPECT_EQ(reserved(a), std::int64_t{20} << 20);
  EXPECT_EQ(roomy.calls(CallKind::create_physical), 1u);
  SimDevice tight = tight_device();
  CachingAllocator b(tight, AllocatorConfig::parse("policy:native_paged"));
  void* q = b.allocate(3 * kMiB);
  EXPECT_EQ(reserved(b), std::int64_t{4} << 20);
  EXPECT_EQ(b.snapshot().segments.at(0).total_size, 20 * kMiB);  // native's segment
  a.deallocate(p);
  b.deallocate(q);
  a.validate();
  b.validate();
}

TEST(NativePaged, FitsWhereNativeRunsOutOfMemory) {
  // 40 MiB device. A and B (8 MiB each) share a 20 MiB segment; A is freed;
  // then 28 MiB. Native needs 20 + 28 MiB: its segment is in use, so the
  // retry ladder frees nothing and the request fails. native_paged holds
  // A's and B's pages (16 MiB); short of 4 MiB, it gives A's back and fits:
  // 8 + 28 MiB.
  SimDevice native_device = tight_device(40 * kMiB);
  CachingAllocator native(native_device, AllocatorConfig::parse(""));
  void* a = native.allocate(8 * kMiB);
  void* b = native.allocate(8 * kMiB);
  native.deallocate(a);
  EXPECT_THROW((void)native.allocate(28 * kMiB), OutOfMemoryError);

  SimDevice device = tight_device(40 * kMiB);
  CachingAllocator paged(device, AllocatorConfig::parse("policy:native_paged"));
  void* pa = paged.allocate(8 * kMiB);
  void* pb = paged.allocate(8 * kMiB);
  EXPECT_EQ(reserved(paged), std::int64_t{16} << 20);
  paged.deallocate(pa);
  void* big = paged.allocate(28 * kMiB);
  EXPECT_EQ(reserved(paged), std::int64_t{36} << 20);
  EXPECT_EQ(paged.stats().num_ooms, 0);
  EXPECT_EQ(paged.stats().segment[0].current, 2);  // native's two segments
  paged.validate();
  paged.deallocate(big);
  paged.deallocate(pb);
  native.deallocate(b);
}

// A 6 MiB device, full: a 20 MiB segment of the large pool (on `stream`)
// holds 2.5 MiB at 0 and 2 MiB at 2.5 MiB, three pages mapped; the last
// page's upper 1.5 MiB is free. A request for a new small segment finds no
// page to map.
struct FullWithAFreeTail {
  SimDevice device = tight_device(6 * kMiB);
  CachingAllocator a;
  void* l1 = nullptr;
  void* l2 = nullptr;
  explicit FullWithAFreeTail(const std::string& settings, StreamId stream = 0)
      : a(device, AllocatorConfig::parse(settings)) {
    l1 = a.allocate(5 * kMiB / 2, stream);
    l2 = a.allocate(2 * kMiB, stream);
  }
  ~FullWithAFreeTail() {
    a.deallocate(l2);
    a.deallocate(l1);
  }
  FullWithAFreeTail(const FullWithAFreeTail&) = delete;
  FullWithAFreeTail& operator=(const FullWithAFreeTail&) = delete;
};

TEST(NativePaged, WhereNativesChoiceFindsNoMemoryAFreeBlockOnMappedPagesServes) {
  FullWithAFreeTail t("policy:native_paged");
  ASSERT_EQ(reserved(t.a), std::int64_t{6} << 20);
  void* s = t.a.allocate(std::size_t{512} * 1024);  // native: a new small segment, no page for it
  EXPECT_EQ(s, static_cast<char*>(t.l1) + 9 * kMiB / 2);  // just above l2, on its page
  EXPECT_EQ(reserved(t.a), std::int64_t{6} << 20);
  const DeviceStats st = t.a.stats();
  EXPECT_EQ(st.num_ooms, 0);
  EXPECT_EQ(st.segment[0].current, 1);  // the small segment tried was given back
  EXPECT_EQ(st.allocated_bytes[2].current, std::int64_t{5} << 20);  // in the large pool
  EXPECT_EQ(st.allocated_bytes[1].current, 0);
  EXPECT_EQ(t.device.live_physical(), 2u);
  t.a.validate();
  t.a.deallocate(s);
  t.a.validate();
  // Freed, it merges back into the large segment's free rest.
  const Snapshot snap = t.a.snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 3u);
  EXPECT_EQ(snap.segments[0].blocks[2].size, 31 * kMiB / 2);
}

TEST(NativePaged, WithoutTheRescueTheNativeChoiceRunsOutOfMemory) {
  FullWithAFreeTail t("policy:native_paged,native_paged_rescue:False");
  EXPECT_THROW((void)t.a.allocate(std::size_t{512} * 1024), OutOfMemoryError);
  EXPECT_EQ(reserved(t.a), std::int64_t{6} << 20);
  EXPECT_EQ(t.a.stats().num_ooms, 1);
  EXPECT_EQ(t.a.stats().segment[0].current, 1);
  t.a.validate();
}

TEST(NativePaged, TheRescueLendsAnotherStreamsFreeBlockAfterSynchronizingIt) {
  // The large segment is stream 1's; the request is stream 0's. The block
  // stays stream 1's, with stream 0 as a use of it (as by record_stream):
  // freed, it waits for stream 0's work before stream 1 may reuse it.
  FullWithAFreeTail t("policy:native_paged", 1);
  const std::uint64_t syncs = t.device.calls(CallKind::synchronize_stream);
  const std::uint64_t records = t.device.calls(CallKind::record_event);
  void* s = t.a.allocate(std::size_t{512} * 1024, 0);
  EXPECT_EQ(s, static_cast<char*>(t.l1) + 9 * kMiB / 2);
  EXPECT_EQ(t.device.calls(CallKind::synchronize_stream), syncs + 1);
  const Snapshot snap = t.a.snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].stream, 1);
  ASSERT_EQ(snap.segments[0].blocks.size(), 4u);
  EXPECT_EQ(snap.segments[0].blocks[2].size, 512u * 1024);
  EXPECT_EQ(snap.segments[0].blocks[2].state, BlockState::active_allocated);
  t.a.deallocate(s);
  EXPECT_EQ(t.device.calls(CallKind::record_event), records + 1);  // on stream 0
  EXPECT_EQ(t.a.snapshot().segments[0].blocks[2].state, BlockState::active_pending_free);
  t.a.empty_cache();  // its event has completed: the block is cached, merged
  EXPECT_EQ(t.a.snapshot().segments[0].blocks.size(), 3u);
  EXPECT_EQ(t.a.stats().allocated_bytes[0].current, std::int64_t{9} << 19);
  t.a.validate();
}

// The op of a replay's first out-of-memory error ("op N: ..."), or the
// program's length when it had none.
std::size_t first_oom_op(const ReplayResult& r, const ReplayProgram& prog) {
  if (r.num_ooms == 0) return prog.ops.size();
  EXPECT_TRUE(r.first_oom.starts_with("op ")) << r.first_oom;
  return static_cast<std::size_t>(std::stoull(r.first_oom.substr(3)));
}

TEST(NativePaged, TheRescueServesOnlyWhereTheNativeChoiceWouldRunOutOfMemory) {
  // Generated programs at capacities just above their peaks, with and
  // without the rescue, every step validated: up to the first call the
  // native choice cannot serve, both take the same decisions (the same
  // reserved memory after every call); there the rescue serves the request
  // or runs out of memory too. Under three settings.
  int rescued = 0;
  for (const auto& [settings, programs] : {std::tuple<std::string, int>{"", 1400},
                                           {"roundup_power2_divisions:4", 300},
                                           {"max_split_size_mb:64", 300}}) {
    const std::string with = settings.empty() ? "policy:native_paged" : settings + ",policy:native_paged";
    const AllocatorConfig rescue = AllocatorConfig::parse(with);
    const AllocatorConfig plain = AllocatorConfig::parse(with + ",native_paged_rescue:False");
    const int count = scaled_for_validation(programs);
    for (int seed = 0; seed < count; ++seed) {
      const ReplayProgram prog = generated_program(static_cast<std::uint64_t>(seed) + 9000);
      const std::uint64_t peak = replay(prog, plain, "").peak_requested_bytes;
      ReplayOptions o;
      o.validate_each_step = true;
      o.keep_reserved = true;
      o.capacity = (peak / (2 * kMiB) + 1 + static_cast<std::uint64_t>(seed % 4)) * (2 * kMiB);
      const ReplayResult a = replay(prog, plain, "plain", o);
      const ReplayResult b = replay(prog, rescue, "rescue", o);
      const std::size_t first_oom = first_oom_op(a, prog);
      ASSERT_EQ(a.reserved_after_op.size(), b.reserved_after_op.size());
      for (std::size_t i = 0; i < first_oom; ++i) {
        ASSERT_EQ(a.reserved_after_op[i], b.reserved_after_op[i])
            << prog.name << " [" << settings << "] call " << i;
      }
      const std::size_t rescued_to = first_oom_op(b, prog);
      ASSERT_GE(rescued_to, first_oom) << prog.name << " [" << settings << "]";
      rescued += rescued_to > first_oom ? 1 : 0;
    }
  }
  EXPECT_GT(rescued, 0);  // the capacities were tight enough for rescues
  RecordProperty("programs_rescued", rescued);
}

TEST(NativePaged, EmptyCacheGivesBackFreePagesOfSegmentsInUse) {
  OneOfTwoFreed t;
  EXPECT_EQ(reserved(t.a), std::int64_t{8} << 20);
  t.a.empty_cache();  // native keeps the whole segment (y is in it)
  EXPECT_EQ(reserved(t.a), std::int64_t{4} << 20);
  EXPECT_EQ(t.a.stats().segment[0].current, 1);
  t.a.deallocate(t.y);
  t.y = t.a.allocate(512);  // a small block: a segment of the small pool
  t.a.empty_cache();
  EXPECT_EQ(reserved(t.a), std::int64_t{2} << 20);
  EXPECT_EQ(t.a.stats().segment[0].current, 1);
  EXPECT_EQ(t.device.live_physical(), 1u);
  EXPECT_EQ(t.device.live_reservations(), 1u);
  t.a.validate();
}

TEST(NativePaged, ABlockInALargerFreeHandleGetsPagesOfItsOwn) {
  // 8 MiB, freed; then 2 MiB at the same offset (native's best fit). Served
  // inside the 8 MiB handle it would hold 8 MiB; on a tight device the
  // handle goes back and the block gets one page.
  SimDevice device = tight_device();
  CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
  void* big = a.allocate(8 * kMiB);
  a.deallocate(big);
  void* small = a.allocate(2 * kMiB);
  EXPECT_EQ(small, big);
  EXPECT_EQ(reserved(a), std::int64_t{2} << 20);
  EXPECT_EQ(device.calls(CallKind::release_physical), 1u);
  a.validate();
  // With memory to spare it is served as it is: no device call.
  SimDevice roomy;
  CachingAllocator b(roomy, AllocatorConfig::parse("policy:native_paged"));
  b.deallocate(b.allocate(8 * kMiB));
  const std::uint64_t maps = roomy.calls(CallKind::map);
  void* again = b.allocate(2 * kMiB);
  EXPECT_EQ(roomy.calls(CallKind::map), maps);
  EXPECT_EQ(reserved(b), std::int64_t{20} << 20);
  b.deallocate(again);
  a.deallocate(small);
}

TEST(NativePaged, MapsOnlyThePagesUnderWhatWasAskedFor) {
  // roundup_power2_divisions:4 rounds 16 MiB + 1 up to 20 MiB: native holds
  // 20 MiB; the caller may touch 16 MiB + 1, on 9 pages.
  SimDevice device = tight_device();
  CachingAllocator a(device,
                     AllocatorConfig::parse("policy:native_paged,roundup_power2_divisions:4"));
  void* p = a.allocate(16 * kMiB + 1);
  EXPECT_EQ(a.stats().allocated_bytes[0].current, std::int64_t{20} << 20);
  EXPECT_EQ(reserved(a), std::int64_t{18} << 20);
  a.validate();
  a.deallocate(p);
  // Served again for 20 MiB, the last page is mapped then.
  void* q = a.allocate(20 * kMiB);
  EXPECT_EQ(q, p);
  EXPECT_EQ(reserved(a), std::int64_t{20} << 20);
  a.validate();
  a.deallocate(q);
}

TEST(NativePaged, ANeighbourOnALargeBlocksLastPageKeepsThatPageAlone) {
  // 40 MiB, freed; 15.5 MiB carved from its front (pages 0 to 7, the last
  // in part), then 3 MiB right after it (pages 7 to 9). The first block's
  // partly covered last page has a handle of its own, so once it is freed
  // its other seven pages go back, though the second block lives on page 7.
  SimDevice device = tight_device();
  CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
  a.deallocate(a.allocate(40 * kMiB));
  constexpr std::size_t kHalfMiB = kMiB / 2;
  void* first = a.allocate(15 * kMiB + kHalfMiB);
  void* second = a.allocate(3 * kMiB);
  EXPECT_EQ(static_cast<std::size_t>(static_cast<char*>(second) - static_cast<char*>(first)),
            15 * kMiB + kHalfMiB);
  EXPECT_EQ(reserved(a), std::int64_t{20} << 20);
  a.deallocate(first);
  a.empty_cache();
  EXPECT_EQ(reserved(a), std::int64_t{6} << 20);  // pages 7 to 9
  a.validate();
  a.deallocate(second);
}

TEST(NativePaged, AFailedUnmapLeavesThePagesMappedAndCounted) {
  OneOfTwoFreed t;
  t.device.fail_nth(CallKind::unmap, 1, Status::device_error);
  try {
    t.a.empty_cache();
    FAIL() << "no error";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("unmap"), std::string::npos) << e.what();
  }
  t.a.validate();
  EXPECT_EQ(reserved(t.a), std::int64_t{8} << 20);
  t.a.empty_cache();  // again: it goes now
  EXPECT_EQ(reserved(t.a), std::int64_t{4} << 20);
  t.a.validate();
}

TEST(NativePaged, AFailedReleaseOrUnreserveIsRetriedSoNothingLeaks) {
  SimDevice device = tight_device();
  {
    CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
    a.deallocate(a.allocate(4 * kMiB));
    device.fail_nth(CallKind::release_physical, 1, Status::device_error);
    device.fail_nth(CallKind::unreserve, 1, Status::device_error);
    // The handle the device kept is still its memory: empty_cache says it did
    // not empty, and the statistics keep it as reserved (no segment holds it).
    try {
      a.empty_cache();
      FAIL() << "no error";
    } catch (const DeviceError& e) {
      EXPECT_EQ(e.call(), CallKind::release_physical);
      EXPECT_NE(std::string(e.what()).find("would not release 1 handle (4194304 bytes)"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(reserved(a), std::int64_t{4} << 20);
    EXPECT_EQ(static_cast<std::size_t>(reserved(a)), device.used_bytes());
    EXPECT_EQ(a.stats().segment[0].current, 0);
    a.validate();
    EXPECT_EQ(device.live_physical(), 1u);
    EXPECT_EQ(device.live_reservations(), 1u);
    a.empty_cache();  // retried
    EXPECT_EQ(reserved(a), 0);
    EXPECT_EQ(device.live_physical(), 0u);
    EXPECT_EQ(device.live_reservations(), 0u);
    a.validate();
  }
  EXPECT_EQ(device.live_physical(), 0u);
}

// After a failed release, at every step, under each virtual-memory policy:
// what the statistics call reserved is what the device holds.
TEST(FailedRelease, TheStatisticsSayWhatTheDeviceHolds) {
  for (const char* settings : {"expandable_segments:True", "policy:native_paged", "policy:paging"}) {
    SCOPED_TRACE(settings);
    SimDevice device = tight_device(256 * kMiB);
    {
      CachingAllocator a(device, AllocatorConfig::parse(settings));
      auto holds = [&] {
        EXPECT_EQ(static_cast<std::size_t>(reserved(a)), device.used_bytes());
        a.validate();
      };
      std::vector<void*> live(5);
      for (void*& p : live) p = a.allocate(20 * kMiB);
      holds();
      for (void* p : live) a.deallocate(p);
      device.fail_nth(CallKind::release_physical, 2, Status::device_error);
      EXPECT_THROW(a.empty_cache(), DeviceError);
      holds();
      EXPECT_GT(reserved(a), 0);
      // Allocating again (the ladder's retries) and freeing keep it so.
      void* p = a.allocate(60 * kMiB);
      holds();
      a.deallocate(p);
      a.empty_cache();  // the handle goes now
      holds();
      EXPECT_EQ(reserved(a), 0);
    }
    EXPECT_EQ(device.used_bytes(), 0u);
  }
}

TEST(NativePaged, AFailedSynchronizeBeforeUnmappingChangesNothing) {
  OneOfTwoFreed t;
  // Fail the stream synchronization that unmapping free pages asks for.
  t.device.fail_nth(CallKind::synchronize_stream, 1, Status::device_error);
  EXPECT_THROW(t.a.empty_cache(), DeviceError);
  EXPECT_EQ(reserved(t.a), std::int64_t{8} << 20);
  t.a.validate();
  t.a.empty_cache();
  EXPECT_EQ(reserved(t.a), std::int64_t{4} << 20);
}

TEST(AddressArena, TakesAboveEveryRangeHeldAndMergesWhatComesBack) {
  detail::AddressArena arena;
  const DevicePtr base = DevicePtr{1} << 40;
  arena.reset(base, 20 * kMiB);
  EXPECT_EQ(arena.take(4 * kMiB), base);
  EXPECT_EQ(arena.take(2 * kMiB), base + 4 * kMiB);
  EXPECT_EQ(arena.take(4 * kMiB), base + 6 * kMiB);
  EXPECT_TRUE(arena.give(base + 4 * kMiB, 2 * kMiB));
  // Not the hole: above every range held, as a device allocating one
  // segment after another gives them.
  EXPECT_EQ(arena.take(2 * kMiB), base + 10 * kMiB);
  EXPECT_EQ(arena.taken(), 10 * kMiB);
  // No room above the highest range held: none, though the hole is large.
  EXPECT_EQ(arena.take(10 * kMiB), 0u);
  // Not ranges it handed out: refused, nothing changed.
  EXPECT_FALSE(arena.give(base + 4 * kMiB, 2 * kMiB));  // free already
  EXPECT_FALSE(arena.give(base + 3 * kMiB, 2 * kMiB));  // half free
  EXPECT_FALSE(arena.give(base - 2 * kMiB, 2 * kMiB));  // outside
  EXPECT_FALSE(arena.give(base + 18 * kMiB, 4 * kMiB));  // past the end
  EXPECT_EQ(arena.taken(), 10 * kMiB);
  // Given back, neighbours merge: one range again.
  EXPECT_TRUE(arena.give(base, 4 * kMiB));
  EXPECT_TRUE(arena.give(base + 10 * kMiB, 2 * kMiB));
  EXPECT_TRUE(arena.give(base + 6 * kMiB, 4 * kMiB));
  EXPECT_EQ(arena.taken(), 0u);
  ASSERT_EQ(arena.free_ranges().size(), 1u);
  EXPECT_EQ(arena.free_ranges().begin()->first, base);
  EXPECT_EQ(arena.free_ranges().begin()->second, 20 * kMiB);
  EXPECT_EQ(arena.take(20 * kMiB), base);
}

TEST(NativePaged, SegmentsAreCarvedFromOneReservation) {
  // Three segments: one reservation, then create, map and set access each
  // (three calls where native makes one); each above the one before.
  // empty_cache() gives everything back, the reservation too.
  SimDevice device;
  CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
  std::vector<void*> blocks;
  for (std::size_t mib : {30, 40, 50}) blocks.push_back(a.allocate(mib * kMiB));
  EXPECT_EQ(device.calls(CallKind::reserve), 1u);
  EXPECT_EQ(device.live_reservations(), 1u);
  for (CallKind kind : {CallKind::create_physical, CallKind::map, CallKind::set_access}) {
    EXPECT_EQ(device.calls(kind), 3u) << to_string(kind);
  }
  EXPECT_LT(blocks[0], blocks[1]);
  EXPECT_LT(blocks[1], blocks[2]);
  a.validate();
  for (void* p : blocks) a.deallocate(p);
  a.empty_cache();
  EXPECT_EQ(device.calls(CallKind::unmap), 3u);
  EXPECT_EQ(device.calls(CallKind::release_physical), 3u);
  EXPECT_EQ(device.calls(CallKind::unreserve), 1u);
  EXPECT_EQ(device.live_reservations(), 0u);
  a.validate();
  void* again = a.allocate(30 * kMiB);  // a new reservation
  EXPECT_EQ(device.calls(CallKind::reserve), 2u);
  a.deallocate(again);
}

TEST(NativePaged, ASegmentWithNoRoomAboveTheOthersReservesItsOwn) {
  // 128 MiB device: a 512 MiB arena. Each round makes a 40 MiB segment
  // above the one held, then frees that one: twelve fit ([0, 480) MiB);
  // the thirteenth reserves its own; with it alone held, the idle arena
  // goes back at empty_cache and the next segment reserves a new one.
  SimDevice device = tight_device(128 * kMiB);
  CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
  void* held = a.allocate(40 * kMiB);
  const auto first = reinterpret_cast<DevicePtr>(held);
  std::vector<std::uint64_t> reserves;
  for (int round = 1; round <= 14; ++round) {
    void* next = a.allocate(40 * kMiB);
    a.deallocate(held);
    a.empty_cache();
    a.validate();
    held = next;
    reserves.push_back(device.calls(CallKind::reserve));
    if (round < 12) {
      EXPECT_EQ(reinterpret_cast<DevicePtr>(next), first + static_cast<std::size_t>(round) * 40 * kMiB) << round;
    }
  }
  const std::vector<std::uint64_t> expected = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 3, 3};
  EXPECT_EQ(reserves, expected);
  EXPECT_EQ(device.live_reservations(), 1u);
  a.deallocate(held);
  a.empty_cache();
  EXPECT_EQ(device.live_reservations(), 0u);
}

TEST(NativePaged, WhereTheDeviceWillNotReserveAnArenaEachSegmentReservesItsOwn) {
  // No address space that large, or a size the device will not take.
  for (const Status refusal : {Status::out_of_memory, Status::invalid_argument}) {
    SCOPED_TRACE(to_string(refusal));
    SimDevice device;
    device.fail_nth(CallKind::reserve, 1, refusal);  // the arena's
    CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
    void* p = a.allocate(30 * kMiB);
    void* q = a.allocate(40 * kMiB);
    EXPECT_EQ(device.calls(CallKind::reserve), 3u);
    EXPECT_EQ(device.live_reservations(), 2u);
    a.validate();
    a.deallocate(p);
    a.deallocate(q);
    a.empty_cache();
    EXPECT_EQ(device.live_reservations(), 0u);
    EXPECT_EQ(device.calls(CallKind::unreserve), 2u);
  }
}

TEST(NativePaged, TheArenaOfADeviceBeyondPetabytesStaysWithinFourPebibytes) {
  // 2^62 bytes of capacity: four times that does not fit a size_t.
  SimDeviceOptions o;
  o.capacity = std::size_t{1} << 62;
  SimDevice device(o);
  std::vector<std::size_t> asked;
  device.set_reservation_source([&](std::size_t bytes, DevicePtr* out) {
    asked.push_back(bytes);
    *out = DevicePtr{1} << 60;
    return Status::ok;
  });
  CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
  void* p = a.allocate(30 * kMiB);
  EXPECT_EQ(asked, std::vector<std::size_t>{std::size_t{1} << 52});
  EXPECT_EQ(reinterpret_cast<DevicePtr>(p), DevicePtr{1} << 60);
  a.deallocate(p);
}

TEST(NativePaged, AsksTheDeviceWhatIsFreeOnceEverySixteenSegments) {
  // Whether memory is plentiful (a new segment mapped whole) is judged on
  // the last reading of the device's free memory less what was mapped
  // since; the device is asked again after sixteen answers. Another job
  // that takes memory meanwhile is seen at the next reading. 3 MiB on a
  // stream of its own each time: a new 20 MiB segment each time.
  SimDeviceOptions o;
  o.capacity = std::size_t{8} << 30;
  SimDevice device(o);
  CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
  std::vector<void*> blocks;
  blocks.push_back(a.allocate(3 * kMiB, 1));  // 8 GiB free: 20 MiB x 256 is plentiful
  EXPECT_EQ(device.calls(CallKind::memory_info), 2u);  // the capacity, then what is free
  EXPECT_EQ(reserved(a), std::int64_t{20} << 20);
  CachingAllocator other(device, AllocatorConfig::parse(""));
  void* theirs = other.allocate(std::size_t{6} << 30);  // 2 GiB left: no longer plentiful
  for (StreamId s = 2; s <= 16; ++s) blocks.push_back(a.allocate(3 * kMiB, s));
  EXPECT_EQ(device.calls(CallKind::memory_info), 2u);  // answered from the reading
  EXPECT_EQ(reserved(a), std::int64_t{16} * 20 << 20);  // whole segments
  blocks.push_back(a.allocate(3 * kMiB, 17));
  EXPECT_EQ(device.calls(CallKind::memory_info), 3u);  // asked again: the block's pages alone
  EXPECT_EQ(reserved(a), (std::int64_t{16} * 20 + 4) << 20);
  a.validate();
  for (void* p : blocks) a.deallocate(p);
  other.deallocate(theirs);
}

TEST(NativePaged, ExcludesExpandableSegmentsAndPagingsKeys) {
  EXPECT_THROW(
      {
        SimDevice device;
        CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged,expandable_segments:True"));
      },
      UsageError);
  EXPECT_THROW((void)AllocatorConfig::parse("policy:native_paged,paging_slack_mb:2"), ConfigError);
}

}  // namespace
}  // namespace reservoir::testing

namespace reservoir::testing {
namespace {

// A request far beyond the device's free memory under expandable segments
// (one handle a page) is refused without creating thousands of handles one
// by one: the ladder ends as it would, out of memory, in a few device calls.
TEST(ExpandableSegments, AnImpossibleRequestCreatesNoHandles) {
  SimDevice device = tight_device(std::size_t{64} << 30);
  CachingAllocator a(device, AllocatorConfig::parse("expandable_segments:True"));
  // 1 TiB on a 64 GiB device: the segment's 72 GiB are 3,687 pages of 20
  // MiB (the large pool's), none of which could all be had.
  EXPECT_THROW((void)a.allocate(std::size_t{1} << 40), OutOfMemoryError);
  EXPECT_EQ(device.calls(CallKind::create_physical), 0u);
  EXPECT_EQ(device.used_bytes(), 0u);
  EXPECT_EQ(a.stats().num_ooms, 1u);
  // What fits still maps, page by page, as PyTorch's does.
  void* p = a.allocate(512 * kMiB);
  EXPECT_EQ(device.calls(CallKind::create_physical), 26u);
  a.deallocate(p);
  a.validate();
}

}  // namespace
}  // namespace reservoir::testing
