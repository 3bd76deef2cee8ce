// History: the ring buffer of events, annotations and native stacks.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <thread>

#include "allocator_fixture.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/history.hpp"

namespace reservoir::testing {
namespace {

using History = AllocatorTest;
using A = TraceAction;

struct Ev {
  A action;
  DevicePtr addr;
  std::uint64_t size;
  StreamId stream;
  bool operator==(const Ev&) const = default;
};

std::vector<Ev> events(const Snapshot& s) {
  std::vector<Ev> out;
  for (const TraceEvent& e : s.history) out.push_back({e.action, e.addr, e.size, e.stream});
  return out;
}

std::ostream& operator<<(std::ostream& os, const Ev& e) {
  return os << to_string(e.action) << "@" << std::hex << e.addr << std::dec << ":" << e.size
            << "/s" << e.stream;
}

TEST_F(History, OffByDefault) {
  allocator_->deallocate(allocator_->allocate(1000));
  const Snapshot s = allocator_->snapshot();
  EXPECT_TRUE(s.history.empty());
  ASSERT_EQ(s.contexts.size(), 1u);
  EXPECT_TRUE(s.contexts[0].empty());
}

TEST_F(History, RecordsEveryEventInOrder) {
  allocator_->record_history({});
  const DevicePtr a = alloc(1000, 3);
  const DevicePtr b = alloc(30 * kMiB);
  release(a);
  allocator_->empty_cache();
  const Snapshot s = allocator_->snapshot();
  const std::vector<Ev> want = {
      {A::segment_alloc, kBase, 2 * kMiB, 3},
      {A::alloc, kBase, 1000, 3},
      {A::segment_alloc, kBase + 2 * kMiB, 30 * kMiB, 0},
      {A::alloc, kBase + 2 * kMiB, 30 * kMiB, 0},
      {A::free_requested, kBase, 1000, 3},
      {A::free_completed, kBase, 1000, 3},
      {A::segment_free, kBase, 2 * kMiB, 3},
      {A::snapshot, 0, 0, 0},
  };
  EXPECT_EQ(events(s), want);
  EXPECT_EQ(b, kBase + 2 * kMiB);
  std::int64_t last = 0;
  for (const TraceEvent& e : s.history) {
    EXPECT_GE(e.time_us, last);
    last = e.time_us;
    EXPECT_EQ(e.context, 0u);  // no annotation, no stacks
  }
  EXPECT_GT(last, std::int64_t{1'600'000'000} * 1'000'000);  // microseconds since the epoch
}

TEST_F(History, RingKeepsTheLatestEntries) {
  allocator_->record_history({.max_entries = 3});
  std::vector<DevicePtr> ptrs;
  for (std::size_t i = 1; i <= 4; ++i) ptrs.push_back(alloc(i * 512));
  // 1 segment_alloc + 4 allocs so far; the ring holds the last three.
  Snapshot s = allocator_->snapshot();  // records a snapshot event first
  EXPECT_EQ(events(s), (std::vector<Ev>{{A::alloc, ptrs[2], 1536, 0},
                                        {A::alloc, ptrs[3], 2048, 0},
                                        {A::snapshot, 0, 0, 0}}));
  // Growing the ring keeps the latest events, oldest first.
  allocator_->record_history({.max_entries = 5});
  release(ptrs[0]);
  s = allocator_->snapshot();
  EXPECT_EQ(events(s), (std::vector<Ev>{{A::alloc, ptrs[3], 2048, 0},
                                        {A::snapshot, 0, 0, 0},
                                        {A::free_requested, ptrs[0], 512, 0},
                                        {A::free_completed, ptrs[0], 512, 0},
                                        {A::snapshot, 0, 0, 0}}));
  // Shrinking keeps the newest.
  allocator_->record_history({.max_entries = 2});
  s = allocator_->snapshot();
  EXPECT_EQ(events(s), (std::vector<Ev>{{A::snapshot, 0, 0, 0}, {A::snapshot, 0, 0, 0}}));
}

TEST_F(History, SwitchedAtRunTime) {
  allocator_->record_history({});
  const DevicePtr a = alloc(512);
  allocator_->record_history({.enabled = false});
  release(a);
  EXPECT_TRUE(allocator_->snapshot().history.empty());
  allocator_->record_history({});
  const DevicePtr b = alloc(512);
  EXPECT_EQ(events(allocator_->snapshot()),
            (std::vector<Ev>{{A::alloc, b, 512, 0}, {A::snapshot, 0, 0, 0}}));
}

TEST_F(History, RejectsBadOptions) {
  EXPECT_THROW(allocator_->record_history({.max_entries = 0}), UsageError);
  EXPECT_THROW(allocator_->record_history({.max_frames = 65}), UsageError);
  // Turning off a history that was never on is fine.
  allocator_->record_history({.enabled = false});
}

TEST_F(History, AnnotationsNameEventsAndLiveBlocks) {
  allocator_->record_history({});
  DevicePtr a = 0;
  DevicePtr b = 0;
  {
    ScopedAnnotation train("train");
    {
      ScopedAnnotation fwd("forward");
      EXPECT_EQ(current_annotations(), (std::vector<std::string>{"train", "forward"}));
      a = alloc(4096);
    }
    b = alloc(8192);
  }
  const DevicePtr c = alloc(512);
  const Snapshot s = allocator_->snapshot();
  auto annotations_of = [&](DevicePtr p) {
    for (const TraceEvent& e : s.history) {
      if (e.action == A::alloc && e.addr == p) return s.contexts.at(e.context).annotations;
    }
    ADD_FAILURE() << "no alloc event at " << p;
    return std::vector<std::string>{};
  };
  EXPECT_EQ(annotations_of(a), (std::vector<std::string>{"train", "forward"}));
  EXPECT_EQ(annotations_of(b), (std::vector<std::string>{"train"}));
  EXPECT_TRUE(annotations_of(c).empty());
  // The segment_alloc happened inside "train/forward" too.
  EXPECT_EQ(s.contexts.at(s.history.front().context).annotations,
            (std::vector<std::string>{"train", "forward"}));
  // Blocks carry the context of their allocation; each context is exported once.
  ASSERT_EQ(s.segments.size(), 1u);
  const auto& blocks = s.segments[0].blocks;
  ASSERT_GE(blocks.size(), 3u);
  EXPECT_EQ(s.contexts.at(blocks[0].context).annotations,
            (std::vector<std::string>{"train", "forward"}));
  EXPECT_EQ(s.contexts.at(blocks[1].context).annotations, (std::vector<std::string>{"train"}));
  EXPECT_EQ(blocks[2].context, 0u);
  EXPECT_EQ(blocks.back().state, BlockState::inactive);
  EXPECT_EQ(blocks.back().context, 0u);
  EXPECT_EQ(s.contexts.size(), 3u);  // empty, train/forward, train
}

TEST(Annotations, BelongToTheThreadAndNest) {
  EXPECT_THROW(pop_annotation(), UsageError);
  push_annotation("outer");
  std::vector<std::string> seen_elsewhere{"unset"};
  std::thread([&] {
    seen_elsewhere = current_annotations();
    ScopedAnnotation a("worker");
    push_annotation("inner");
    seen_elsewhere.push_back(fmt::format("{}", fmt::join(current_annotations(), "/")));
    pop_annotation();
  }).join();
  EXPECT_EQ(seen_elsewhere, (std::vector<std::string>{"worker/inner"}));
  push_annotation("outer");  // the same name nested: a distinct path
  EXPECT_EQ(current_annotations(), (std::vector<std::string>{"outer", "outer"}));
  pop_annotation();
  pop_annotation();
  EXPECT_TRUE(current_annotations().empty());
}

[[gnu::noinline]] DevicePtr allocate_from_a_named_function(CachingAllocator& allocator) {
  void* p = allocator.allocate(777);
  asm volatile("" ::: "memory");  // keep this frame (no tail call)
  return reinterpret_cast<DevicePtr>(p);
}

TEST_F(History, StacksAreSymbolizedWhenExported) {
  allocator_->record_history({.stacks = true, .max_frames = 16});
  const DevicePtr p = allocate_from_a_named_function(*allocator_);
  const Snapshot s = allocator_->snapshot();
  const TraceEvent* alloc_event = nullptr;
  for (const TraceEvent& e : s.history) {
    if (e.action == A::alloc) alloc_event = &e;
  }
  ASSERT_NE(alloc_event, nullptr);
  EXPECT_EQ(alloc_event->addr, p);
  const Context& c = s.contexts.at(alloc_event->context);
  ASSERT_FALSE(c.frames.empty());
  EXPECT_LE(c.frames.size(), 16u);
  // The allocator's own frames are cut: the first frame is the caller.
  EXPECT_NE(c.frames[0].name.find("allocate_from_a_named_function"), std::string::npos)
      << c.frames[0].name;
  EXPECT_NE(c.frames[0].filename.find("history_test.cpp"), std::string::npos)
      << c.frames[0].filename;
  EXPECT_GT(c.frames[0].line, 0);
  // The live block points at the same context.
  EXPECT_EQ(s.segments.at(0).blocks.at(0).context, alloc_event->context);
}

}  // namespace
}  // namespace reservoir::testing
