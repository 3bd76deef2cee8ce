// graph_capture_record_stream_reuse:True: during a capture, a block freed
// after use on another stream is reused within the capture once the
// capture's graph puts the stream's next work after every last use of it
// (its free markers), as PyTorch 2.9's allocator decides; without the
// setting it waits for the capture to end. The capture's graph is laid out
// by hand on a FaultyDevice (over a SimDevice: real addresses), which also
// fails the capture queries for the error paths.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "faulty_device.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir::testing {
namespace {

constexpr DevicePtr kBase = 0x7f0000000000;
constexpr StreamId kCapture = 7;  // the stream torch.cuda.graph captures on
constexpr StreamId kSide = 8;     // a side stream joined into the capture
constexpr PoolId kPool{1, 0};
constexpr std::uint64_t kCaptureId = 41;
// Nodes of the capture's graph: the capture stream's kernel, the side
// stream's kernel (after the fork), and the capture stream's kernel after
// it waited on the side stream (the join).
constexpr GraphNode kFork = 0x100, kOnCapture = 0x200, kOnSide = 0x300, kJoined = 0x400;

class CaptureReuse : public ::testing::Test {
 protected:
  void make(const std::string& config) {
    sim_ = std::make_unique<SimDevice>(SimDeviceOptions{});
    device_ = std::make_unique<FaultyDevice>(*sim_);
    allocator_ = std::make_unique<CachingAllocator>(*device_, AllocatorConfig::parse(config));
    allocator_->set_validate_each_call(true);
    allocator_->attach_trace_tracker([this](const TraceEvent& e) { events_.push_back(e); });
    // fork -> on_capture (capture stream), fork -> on_side (side stream).
    device_->add_node(kFork, {});
    device_->add_node(kOnCapture, {kFork});
    device_->add_node(kOnSide, {kFork});
    device_->set_capture(kCapture, kCaptureId, {kOnCapture});
    device_->set_capture(kSide, kCaptureId, {kOnSide});
    allocator_->begin_allocate_to_pool(kPool,
                                       [](StreamId s) { return s == kCapture || s == kSide; });
  }
  // The capture stream waits on the side stream: its next work comes after both.
  void join() {
    device_->add_node(kJoined, {kOnCapture, kOnSide});
    device_->set_capture(kCapture, kCaptureId, {kJoined});
  }
  DevicePtr alloc(std::size_t size, StreamId stream) {
    return reinterpret_cast<DevicePtr>(allocator_->allocate(size, stream));
  }
  void release(DevicePtr p) { allocator_->deallocate(reinterpret_cast<void*>(p)); }
  std::int64_t stat(const std::string& key) const { return allocator_->stats_map().at(key); }
  // A block on the capture stream used on the side stream, then freed.
  DevicePtr freed_after_side_use() {
    const DevicePtr a = alloc(4096, kCapture);
    allocator_->record_stream(reinterpret_cast<void*>(a), kSide);
    release(a);
    return a;
  }
  int free_completed(DevicePtr at) const {
    int n = 0;
    for (const TraceEvent& e : events_)
      n += e.action == TraceAction::free_completed && e.addr == at;
    return n;
  }

  std::unique_ptr<SimDevice> sim_;
  std::unique_ptr<FaultyDevice> device_;
  std::unique_ptr<CachingAllocator> allocator_;
  std::vector<TraceEvent> events_;
};

TEST_F(CaptureReuse, AFreedBlockIsReusedOnceTheCaptureJoinedItsStreams) {
  make("graph_capture_record_stream_reuse:True");
  const DevicePtr a = freed_after_side_use();
  EXPECT_EQ(a, kBase);
  EXPECT_EQ(stat("allocation.all.current"), 0);
  EXPECT_EQ(stat("active.all.current"), 1);  // waits for its streams
  // Not joined: the side stream's kernel may still read it.
  const DevicePtr b = alloc(4096, kCapture);
  EXPECT_EQ(b, kBase + 4096);
  EXPECT_EQ(free_completed(a), 0);
  join();
  const DevicePtr c = alloc(4096, kCapture);
  EXPECT_EQ(c, kBase);  // a's block, within the capture
  EXPECT_EQ(free_completed(a), 1);
  EXPECT_EQ(stat("active.all.current"), 2);
  EXPECT_EQ(stat("segment.all.current"), 1);
  EXPECT_EQ(sim_->live_events(), 0u);  // the graph orders it: no event
  release(b);
  release(c);
  allocator_->end_allocate_to_pool(kPool);
  allocator_->validate();
}

TEST_F(CaptureReuse, WithoutTheSettingTheBlockWaitsForTheCapturesEnd) {
  make("");
  const DevicePtr a = freed_after_side_use();
  join();
  const DevicePtr c = alloc(4096, kCapture);
  EXPECT_EQ(c, kBase + 4096);
  EXPECT_EQ(free_completed(a), 0);
  EXPECT_EQ(device_->calls(CallKind::capture_frontier), 0);  // never asked
  allocator_->end_allocate_to_pool(kPool);
  // After the capture: an event on the side stream, then the block is free.
  release(alloc(512, 0));
  EXPECT_EQ(sim_->live_events(), 1u);
  EXPECT_EQ(free_completed(a), 0);
  sim_->complete_stream(kSide);
  release(alloc(512, 0));
  EXPECT_EQ(free_completed(a), 1);
  release(c);
}

TEST_F(CaptureReuse, OnlyARequestOnTheBlocksOwnStreamReusesIt) {
  make("graph_capture_record_stream_reuse:True");
  const DevicePtr a = freed_after_side_use();
  join();
  // The side stream's next work also follows both kernels, but a request
  // there does not free the capture stream's block.
  device_->add_node(0x500, {kJoined});
  device_->set_capture(kSide, kCaptureId, {0x500});
  const DevicePtr s = alloc(4096, kSide);
  EXPECT_NE(s, a);
  EXPECT_EQ(free_completed(a), 0);
  EXPECT_EQ(alloc(4096, kCapture), kBase);
  allocator_->end_allocate_to_pool(kPool);
}

TEST_F(CaptureReuse, AStreamOutsideTheCaptureLeavesTheBlockToTheCapturesEnd) {
  make("graph_capture_record_stream_reuse:True");
  const DevicePtr a = alloc(4096, kCapture);
  allocator_->record_stream(reinterpret_cast<void*>(a), 3);  // stream 3 does not capture
  release(a);
  join();
  EXPECT_EQ(alloc(4096, kCapture), kBase + 4096);
  EXPECT_EQ(free_completed(a), 0);
  allocator_->end_allocate_to_pool(kPool);
  release(alloc(512, 0));  // its event, on stream 3
  sim_->complete_stream(3);
  release(alloc(512, 0));
  EXPECT_EQ(free_completed(a), 1);  // by its event, after the capture
}

TEST_F(CaptureReuse, TheCapturesEndGivesMarkedBlocksTheirEvents) {
  make("graph_capture_record_stream_reuse:True");
  const DevicePtr a = freed_after_side_use();  // marked, never reached
  allocator_->end_allocate_to_pool(kPool);
  allocator_->validate();
  release(alloc(512, 0));  // its event, on the side stream
  EXPECT_EQ(free_completed(a), 0);
  sim_->complete_stream(kSide);
  release(alloc(512, 0));
  EXPECT_EQ(free_completed(a), 1);
  EXPECT_EQ(stat("active.all.current"), 0);
}

TEST_F(CaptureReuse, AFailedCaptureQueryOnFreeLeavesTheBlockAllocated) {
  make("graph_capture_record_stream_reuse:True");
  const DevicePtr a = alloc(4096, kCapture);
  allocator_->record_stream(reinterpret_cast<void*>(a), kSide);
  device_->fail_nth(CallKind::capture_frontier, 2, Status::device_error);  // the side stream's
  try {
    release(a);
    FAIL() << "the failed query was not reported";
  } catch (const DeviceError& e) {
    EXPECT_NE(std::string(e.what()).find("asking stream 8 for the capture it takes part in"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(stat("allocation.all.current"), 1);
  EXPECT_EQ(stat("allocated_bytes.all.current"), 4096);
  release(a);  // again, the device answering
  join();
  EXPECT_EQ(alloc(4096, kCapture), a);
  allocator_->end_allocate_to_pool(kPool);
}

TEST_F(CaptureReuse, AFailedGraphWalkOnAllocateChangesNothing) {
  make("graph_capture_record_stream_reuse:True");
  const DevicePtr a = freed_after_side_use();
  join();
  device_->fail_nth(CallKind::node_dependencies, 2, Status::device_error);
  EXPECT_THROW(alloc(4096, kCapture), DeviceError);
  EXPECT_EQ(stat("allocation.all.current"), 0);
  EXPECT_EQ(stat("active.all.current"), 1);
  EXPECT_EQ(free_completed(a), 0);
  EXPECT_EQ(alloc(4096, kCapture), a);  // the walk resumes where it failed
  allocator_->end_allocate_to_pool(kPool);
}

TEST_F(CaptureReuse, AnInvalidatedCaptureIsAnError) {
  make("graph_capture_record_stream_reuse:True");
  freed_after_side_use();
  device_->fail_nth(CallKind::capture_frontier, 1, Status::device_error);
  EXPECT_THROW(alloc(4096, kCapture), DeviceError);
  EXPECT_EQ(stat("allocation.all.current"), 0);
  allocator_->end_allocate_to_pool(kPool);
}

}  // namespace
}  // namespace reservoir::testing
