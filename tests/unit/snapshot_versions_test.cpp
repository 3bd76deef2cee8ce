// What each PyTorch 2.x writes into a memory snapshot, read as it writes it:
// every trace action, the keys some versions write and others omit, several
// devices, annotations, the allocator_settings of each version, and errors
// that name the path of a value of the wrong type.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "error_text.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/pickle.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {
namespace {

using testing::error_of;

// A snapshot as JSON (the reader treats our JSON and PyTorch's pickle alike).
std::string snapshot(const std::string& events, const std::string& segments = "[]",
                     const std::string& extra = "") {
  return fmt::format(R"({{"segments": {}, "device_traces": {}{}}})", segments, events, extra);
}

Trace read(const std::string& json) { return read_snapshot_json(json, "s.json"); }
std::string error(const std::string& json) {
  return error_of<TraceError>([&] { (void)read(json); });
}

// The entry 2.1 to 2.15 write for an out-of-memory error: device_free in
// place of addr (newer ones add compile_context and user_metadata).
TEST(SnapshotVersions, AnOomEntryCarriesDeviceFreeAndNoAddr) {
  const Trace t = read(snapshot(R"([[
    {"action": "segment_alloc", "addr": 4194304, "size": 20971520, "stream": 0, "time_us": 10},
    {"action": "alloc", "addr": 4194304, "size": 1000, "stream": 0, "time_us": 11},
    {"action": "oom", "device_free": 4028760064, "size": 4202692608, "stream": 7,
     "time_us": 12, "frames": [], "compile_context": "N/A", "user_metadata": ""}]])"));
  ASSERT_EQ(t.events.size(), 3u);
  EXPECT_EQ(t.events[2].action, TraceAction::oom);
  EXPECT_EQ(t.events[2].addr, 4028760064u);  // the device's free bytes
  EXPECT_EQ(t.events[2].size, 4202692608u);
  EXPECT_EQ(t.events[2].stream, 7u);
  EXPECT_EQ(t.events[2].time_us, 12);
  EXPECT_TRUE(t.unknown_keys.empty());
  // Our own older exports wrote addr; both read the same.
  const Trace old = read(snapshot(R"([[{"action": "oom", "addr": 99, "size": 5, "stream": 0}]])"));
  EXPECT_EQ(old.events[0].addr, 99u);
  // Neither: the free memory is unknown, not an error.
  const Trace none = read(snapshot(R"([[{"action": "oom", "size": 5, "stream": 0}]])"));
  EXPECT_EQ(none.events[0].addr, 0u);
}

TEST(SnapshotVersions, EveryActionIsRead) {
  const Trace t = read(snapshot(R"([[
    {"action": "segment_alloc", "addr": 4096, "size": 2097152, "stream": 0},
    {"action": "alloc", "addr": 4096, "size": 512, "stream": 0},
    {"action": "user_defined", "addr": 0, "size": 0, "stream": 0, "time_us": 5,
     "frames": [{"name": "step 3", "filename": "", "line": 0}]},
    {"action": "free_requested", "addr": 4096, "size": 512, "stream": 0},
    {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0},
    {"action": "segment_free", "addr": 4096, "size": 2097152, "stream": 0},
    {"action": "segment_map", "addr": 8192, "size": 2097152, "stream": 0},
    {"action": "segment_unmap", "addr": 8192, "size": 2097152, "stream": 0},
    {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
    {"action": "oom", "device_free": 0, "size": 1, "stream": 0}]])"));
  std::vector<TraceAction> actions;
  for (const TraceEvent& e : t.events) actions.push_back(e.action);
  EXPECT_EQ(actions, (std::vector<TraceAction>{
                         TraceAction::segment_alloc, TraceAction::alloc,
                         TraceAction::free_requested, TraceAction::free_completed,
                         TraceAction::segment_free, TraceAction::segment_map,
                         TraceAction::segment_unmap, TraceAction::snapshot, TraceAction::oom}));
  // The user annotation is kept where it was recorded: before event 2.
  ASSERT_EQ(t.annotations.size(), 1u);
  EXPECT_EQ(t.annotations[0], (TraceAnnotation{"", "step 3", 5, 2}));
  EXPECT_TRUE(t.skipped_actions.empty());
}

TEST(SnapshotVersions, KeysSomeVersionsOmitMayBeAbsent) {
  // No time_us, no frames (2.1 without context), frames without file or
  // line, compile_context None, forward_frames (autograd's forward stack).
  const Trace t = read(snapshot(R"([[
    {"action": "alloc", "addr": 4096, "size": 512, "stream": 0},
    {"action": "alloc", "addr": 8192, "size": 512, "stream": 0, "time_us": 3,
     "frames": [{"name": "empty_cuda"}, {"name": "forward", "filename": "model.py", "line": 12}],
     "compile_context": null, "user_metadata": "", "forward_frames": []}]])"));
  ASSERT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.events[0].time_us, 0);
  EXPECT_EQ(t.events[0].context, 0u);
  const Context& c = t.context(t.events[1].context);
  ASSERT_EQ(c.frames.size(), 2u);
  EXPECT_EQ(c.frames[0], (Frame{"??", 0, "empty_cuda"}));
  EXPECT_EQ(c.frames[1], (Frame{"model.py", 12, "forward"}));
  EXPECT_TRUE(t.unknown_keys.empty());
}

TEST(SnapshotVersions, UnknownKeysAndActionsAreKeptAndCountedNeverFatal) {
  const Trace t = read(snapshot(
      R"([[
    {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "tensor_id": 1},
    {"action": "alloc", "addr": 8192, "size": 512, "stream": 0, "tensor_id": 2},
    {"action": "segment_defrag", "addr": 0, "size": 0, "stream": 0}]])",
      R"([{"address": 0, "total_size": 2097152, "stream": 0, "segment_type": "small",
           "numa_node": 0, "blocks": [{"size": 2097152, "state": "inactive", "tag": "x"}]}])",
      R"(, "allocator_version": 3)"));
  EXPECT_EQ(t.events.size(), 2u);
  EXPECT_EQ(t.unknown_keys, (std::map<std::string, std::uint64_t>{
                                {"allocator_version", 1},
                                {"device_traces[][].tensor_id", 2},
                                {"segments[].blocks[].tag", 1},
                                {"segments[].numa_node", 1}}));
  EXPECT_EQ(t.skipped_actions, (std::map<std::string, std::uint64_t>{{"segment_defrag", 1}}));
}

TEST(SnapshotVersions, AValueOfTheWrongTypeNamesItsPath) {
  const std::string ok = R"({"action": "alloc", "addr": 4096, "size": 512, "stream": 0})";
  auto events = [&](const std::string& bad) {
    return snapshot(fmt::format("[[{0}, {0}, {0}, {1}]]", ok, bad));
  };
  EXPECT_EQ(error(events(R"({"action": "alloc", "addr": 1, "size": "512", "stream": 0})")),
            "snapshot s.json: device_traces[0][3].size: expected int, got str");
  EXPECT_EQ(error(events(R"({"action": 3, "addr": 1, "size": 512, "stream": 0})")),
            "snapshot s.json: device_traces[0][3].action: expected str, got int");
  EXPECT_EQ(error(events(R"({"action": "oom", "device_free": 1.5, "size": 512, "stream": 0})")),
            "snapshot s.json: device_traces[0][3].device_free: expected int, got float");
  EXPECT_EQ(error(events(R"({"action": "alloc", "addr": 1, "size": 5, "stream": 0, "time_us": "x"})")),
            "snapshot s.json: device_traces[0][3].time_us: expected int, got str");
  EXPECT_EQ(error(events(R"({"action": "alloc", "addr": 1, "size": 5, "stream": 0, "compile_context": 4})")),
            "snapshot s.json: device_traces[0][3].compile_context: expected str, got int");
  EXPECT_EQ(error(events(R"({"action": "alloc", "size": 5, "stream": 0})")),
            "snapshot s.json: device_traces[0][3]: 'addr' is missing");
  EXPECT_EQ(error(snapshot("[[]]", R"([{"address": 0, "total_size": 2097152, "stream": 0,
      "segment_type": "small", "blocks": [{"size": 2097152, "state": "inactive"}],
      "segment_pool_id": [1]}])")),
            "snapshot s.json: segments[0].segment_pool_id: expected two ints");
  EXPECT_EQ(error(snapshot("[[]]", R"([{"address": 0, "total_size": 2097152, "stream": 0,
      "segment_type": "small", "blocks": [{"size": 2097152, "state": "freed"}]}])")),
            "snapshot s.json: segments[0].blocks[0].state: unknown block state 'freed'");
}

// An FSDP rank on device 1: device_traces holds four lists, three empty.
const char* const kFourDevices = R"({
  "segments": [
    {"device": 1, "address": 4194304, "total_size": 2097152, "stream": 0, "segment_type": "small",
     "segment_pool_id": [0, 0], "is_expandable": false,
     "blocks": [{"address": 4194304, "size": 512, "requested_size": 500, "state": "active_allocated"},
                {"address": 4194816, "size": 2096640, "requested_size": 0, "state": "inactive"}]},
    {"device": 3, "address": 8388608, "total_size": 2097152, "stream": 0, "segment_type": "small",
     "blocks": [{"size": 2097152, "state": "inactive"}]}],
  "device_traces": [[],
    [{"action": "segment_alloc", "addr": 4194304, "size": 2097152, "stream": 0, "time_us": 100},
     {"action": "alloc", "addr": 4194304, "size": 500, "stream": 0, "time_us": 101}],
    [], []],
  "external_annotations": [
    {"stage": "START", "name": "forward", "device": 1, "time_us": 100},
    {"stage": "START", "name": "other device", "device": 0, "time_us": 100},
    {"stage": "END", "name": "forward", "device": 1, "time_us": 102}]
})";

TEST(SnapshotVersions, EveryDeviceIsReadOnce) {
  std::vector<Trace> all = read_snapshot_json_devices(kFourDevices, "s.json");
  ASSERT_EQ(all.size(), 4u);
  for (std::size_t d = 0; d < 4; ++d) {
    EXPECT_EQ(all[d].device, static_cast<int>(d));
    EXPECT_EQ(all[d].device_count, 4u);
    EXPECT_EQ(all[d].device_events, (std::vector<std::uint64_t>{0, 2, 0, 0}));
  }
  EXPECT_EQ(all[1].events.size(), 2u);
  ASSERT_EQ(all[1].final_state.segments.size(), 1u);
  EXPECT_EQ(all[1].final_state.segments[0].address, 4194304u);
  EXPECT_EQ(all[1].final_state.segments[0].device, 1);
  EXPECT_EQ(all[3].final_state.segments.size(), 1u);  // segments, no events
  EXPECT_TRUE(all[0].final_state.segments.empty());
  // Annotations of device 1 only, each before the first event after it.
  EXPECT_EQ(all[1].annotations, (std::vector<TraceAnnotation>{{"START", "forward", 100, 0},
                                                              {"END", "forward", 102, 2}}));
  EXPECT_EQ(all[0].annotations.size(), 1u);

  // Every device with events or segments, unless one is asked for.
  std::vector<Trace> used = select_devices(all, std::nullopt);
  ASSERT_EQ(used.size(), 2u);
  EXPECT_EQ(used[0].device, 1);
  EXPECT_EQ(used[1].device, 3);
  std::vector<Trace> two = select_devices(all, 2);
  ASSERT_EQ(two.size(), 1u);
  EXPECT_EQ(two[0].device, 2);
  EXPECT_EQ(error_of<TraceError>([&] { (void)select_devices(all, 4); }),
            "trace s.json: no device 4 (the file holds 4)");
  // One device at a time reads the same as all at once.
  const Trace one = read_snapshot_json(kFourDevices, "s.json", 1);
  EXPECT_EQ(one.events, all[1].events);
  EXPECT_EQ(one.final_state.segments, all[1].final_state.segments);
}

TEST(SnapshotVersions, AnEntryNamingNoDeviceBelongsToEveryDevice) {
  // Segments and annotations without a device key (or with None), as older
  // writers leave them, are each device's; the list is walked once for all.
  const char* const two_devices = R"({
    "segments": [
      {"address": 2097152, "total_size": 2097152, "stream": 0, "segment_type": "small",
       "blocks": [{"size": 2097152, "state": "inactive"}]},
      {"device": null, "address": 8388608, "total_size": 20971520, "stream": 0,
       "segment_type": "large", "blocks": [{"size": 20971520, "state": "inactive"}]},
      {"device": 1, "address": 4194304, "total_size": 2097152, "stream": 0, "segment_type": "small",
       "blocks": [{"size": 2097152, "state": "inactive"}]}],
    "device_traces": [[], []],
    "external_annotations": [{"stage": "START", "name": "step", "time_us": 5}]
  })";
  const std::vector<Trace> all = read_snapshot_json_devices(two_devices, "s.json");
  ASSERT_EQ(all.size(), 2u);
  ASSERT_EQ(all[0].final_state.segments.size(), 2u);
  EXPECT_EQ(all[0].final_state.segments[0].address, 2097152u);
  EXPECT_EQ(all[0].final_state.segments[0].device, 0);
  EXPECT_EQ(all[0].final_state.segments[1].address, 8388608u);
  ASSERT_EQ(all[1].final_state.segments.size(), 3u);  // in address order
  EXPECT_EQ(all[1].final_state.segments[1].address, 4194304u);
  EXPECT_EQ(all[1].final_state.segments[1].device, 1);
  EXPECT_EQ(all[1].final_state.segments[2].device, 1);
  for (const Trace& t : all) {
    EXPECT_EQ(t.annotations, (std::vector<TraceAnnotation>{{"START", "step", 5, 0}}));
  }
  for (int d = 0; d < 2; ++d) {
    const Trace one = read_snapshot_json(two_devices, "s.json", d);
    EXPECT_EQ(one.final_state.segments, all[static_cast<std::size_t>(d)].final_state.segments);
  }
}

// allocator_settings as each version writes it: none before 2.3; 2.3 to
// 2.8 eight keys; 2.9 on graph_capture_record_stream_reuse besides.
TEST(SnapshotVersions, TheAllocatorSettingsOfEachVersion) {
  const Trace v21 = read(snapshot("[[]]"));
  EXPECT_FALSE(v21.settings_recorded);
  EXPECT_EQ(v21.recorded_config, "");

  const std::string roundup_zero =
      R"({"1": 0, "2": 0, "4": 0, "8": 0, "16": 0, "32": 0, "64": 0, "128": 0, "256": 0,
          "512": 0, "1024": 0, "2048": 0, "4096": 0, "8192": 0, "16384": 0, "32768": 0})";
  const Trace v24 = read(snapshot("[[]]", "[]", fmt::format(R"(, "allocator_settings": {{
      "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,garbage_collection_threshold:0.6",
      "max_split_size": 134217728, "garbage_collection_threshold": 0.6,
      "expandable_segments": false, "pinned_num_register_threads": 1,
      "release_lock_on_cudamalloc": false, "pinned_use_cuda_host_register": false,
      "roundup_power2_divisions": {}}})",
                                                            roundup_zero)));
  EXPECT_TRUE(v24.settings_recorded);
  EXPECT_EQ(v24.recorded_config, "max_split_size_mb:128,garbage_collection_threshold:0.6");
  EXPECT_EQ(v24.recorded_settings_text, "max_split_size_mb:128,garbage_collection_threshold:0.6");

  const Trace v29 = read(snapshot("[[]]", "[]", fmt::format(R"(, "allocator_settings": {{
      "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
      "expandable_segments": true, "pinned_num_register_threads": 1,
      "release_lock_on_cudamalloc": false, "pinned_use_cuda_host_register": false,
      "graph_capture_record_stream_reuse": false, "roundup_power2_divisions": {}}})",
                                                            roundup_zero)));
  EXPECT_EQ(v29.recorded_config, "expandable_segments:True");
  EXPECT_TRUE(v29.unknown_keys.empty());
  EXPECT_EQ(v29.pytorch_since, "2.9");  // graph_capture_record_stream_reuse
  EXPECT_EQ(v24.pytorch_since, "2.3");  // 2.3 is the first to record them
  EXPECT_EQ(v21.pytorch_since, "");
  EXPECT_EQ(v24.settings.max_split_size, 128u << 20);
  EXPECT_EQ(v24.settings.garbage_collection_threshold, 0.6);
}

// The settings text holds keys the dict does not record: they are applied,
// and tell the release. A text no config accepts is set aside, with a note.
TEST(SnapshotVersions, TheSettingsTextAndTheDictTogether) {
  const Trace v211 = read(snapshot("[[]]", "[]", R"(, "allocator_settings": {
      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,large_segment_size_mb:12",
      "max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": true,
      "graph_capture_record_stream_reuse": false, "future_knob": 3})"));
  EXPECT_EQ(v211.settings.large_segment_size, 12u << 20);
  EXPECT_TRUE(v211.settings.expandable_segments);
  EXPECT_EQ(v211.pytorch_since, "2.11");
  EXPECT_EQ(v211.recorded_config, "large_segment_size_mb:12,expandable_segments:True");
  EXPECT_EQ(v211.unknown_keys,
            (std::map<std::string, std::uint64_t>{{"allocator_settings.future_knob", 1}}));
  EXPECT_EQ(v211.settings_note, "");

  const Trace async = read(snapshot("[[]]", "[]", R"(, "allocator_settings": {
      "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "max_split_size": 268435456,
      "garbage_collection_threshold": 0.0, "expandable_segments": false})"));
  EXPECT_EQ(async.recorded_config, "max_split_size_mb:256");
  EXPECT_EQ(async.settings_note.rfind("the recorded settings text \"backend:cudaMallocAsync\" "
                                      "was not used (allocator config",
                                      0),
            0u)
      << async.settings_note;
  // The dict's values win over the text's, as they are what was in effect.
  const Trace changed = read(snapshot("[[]]", "[]", R"(, "allocator_settings": {
      "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "max_split_size": 134217728})"));
  EXPECT_EQ(changed.settings.max_split_size, 128u << 20);
  EXPECT_EQ(error(snapshot("[[]]", "[]", R"(, "allocator_settings": {"max_split_size": "big"})")),
            "snapshot s.json: allocator_settings.max_split_size: expected int, got str");
}

// Trace entries as PyTorch's pickler writes them (keys and action names
// memoized, so that after the first entry each is read without making its
// values) read the same as through the checked way, and an entry of a wrong
// type among them is still an error naming its path.
TEST(SnapshotVersions, EntriesReadFastAndCheckedAlike) {
  using pickle::Kind;
  using pickle::Value;
  pickle::Document doc;
  auto str = [&](const std::string& t) {
    Value* v = doc.make(Kind::string);
    v->text = t;
    return v;
  };
  auto integer = [&](std::int64_t i) {
    Value* v = doc.make(Kind::integer);
    v->integer = i;
    return v;
  };
  Value* k_action = str("action");
  Value* k_addr = str("addr");
  Value* k_size = str("size");
  Value* k_stream = str("stream");
  Value* k_time = str("time_us");
  Value* k_frames = str("frames");
  Value* k_free = str("device_free");
  Value* alloc = str("alloc");
  Value* oom = str("oom");
  Value* frames = doc.make(Kind::list);
  Value* frame = doc.make(Kind::dict);
  frame->entries = {{str("name"), str("forward")}, {str("filename"), str("model.py")},
                    {str("line"), integer(7)}};
  frames->items.push_back(frame);
  Value* events = doc.make(Kind::list);
  for (int i = 0; i < 6; ++i) {
    Value* e = doc.make(Kind::dict);
    e->entries = {{k_action, alloc}, {k_addr, integer(4096 + 512 * i)}, {k_size, integer(500)},
                  {k_stream, integer(0)}, {k_time, integer(100 + i)}, {k_frames, frames}};
    events->items.push_back(e);
  }
  Value* o = doc.make(Kind::dict);
  o->entries = {{k_action, oom}, {k_free, integer(1 << 30)}, {k_size, integer(1 << 20)},
                {k_stream, integer(0)}, {k_time, integer(200)}, {k_frames, frames}};
  events->items.push_back(o);
  Value* traces = doc.make(Kind::list);
  traces->items.push_back(events);
  Value* root = doc.make(Kind::dict);
  root->entries = {{str("segments"), doc.make(Kind::list)}, {str("device_traces"), traces}};
  const std::string bytes = pickle::encode(*root);
  auto read_bytes = [](const std::string& b) {
    return read_pytorch_snapshot(std::span(reinterpret_cast<const std::uint8_t*>(b.data()), b.size()),
                                 "s.pickle");
  };
  const Trace t = read_bytes(bytes);
  ASSERT_EQ(t.events.size(), 7u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(t.events[static_cast<std::size_t>(i)],
              (TraceEvent{TraceAction::alloc, static_cast<DevicePtr>(4096 + 512 * i), 500, 0, 100 + i, 1}));
  }
  EXPECT_EQ(t.events[6], (TraceEvent{TraceAction::oom, 1u << 30, 1u << 20, 0, 200, 1}));
  ASSERT_EQ(t.final_state.contexts.size(), 2u);
  EXPECT_EQ(t.final_state.contexts[1].frames, (std::vector<Frame>{{"model.py", 7, "forward"}}));

  // Without stacks (replay shows none): the same events, every context 0.
  const std::vector<Trace> bare = read_pytorch_snapshot_devices(
      std::span(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()), "s.pickle",
      ReadOptions{.contexts = false, .consumed = {}});
  ASSERT_EQ(bare.size(), 1u);
  ASSERT_EQ(bare[0].events.size(), 7u);
  for (std::size_t i = 0; i < 7; ++i) {
    TraceEvent want = t.events[i];
    want.context = 0;
    EXPECT_EQ(bare[0].events[i], want);
  }
  EXPECT_EQ(bare[0].final_state.contexts.size(), 1u);

  // The fifth entry's size as a str: the reader's error names it.
  const_cast<Value*>(events->items[4])->entries[2].second = str("500");
  EXPECT_EQ(error_of<TraceError>([&] { (void)read_bytes(pickle::encode(*root)); }),
            "snapshot s.pickle: device_traces[0][4].size: expected int, got str");
}

// Pickle opcodes as Python's pickler writes a snapshot: each string once
// (fetched from the memo after), each allocation's stack a list written in
// place (its frees fetch it), each frame a dict written once.
class SnapshotWriter {
 public:
  SnapshotWriter() { out_ = "\x80\x04"; }
  void op(char o) { out_.push_back(o); }
  std::uint32_t memoize() { return op('\x94'), memo_++; }
  void get(std::uint32_t m) {
    op('j');
    for (int b = 0; b < 4; ++b) op(static_cast<char>((m >> (8 * b)) & 0xff));
  }
  void str(const std::string& s) {
    if (auto it = strings_.find(s); it != strings_.end()) return get(it->second);
    op('\x8c'), op(static_cast<char>(s.size()));
    out_ += s;
    strings_[s] = memoize();
  }
  void integer(std::uint64_t v) {  // LONG1, 8 bytes (values below 2^63)
    op('\x8a'), op(8);
    for (int b = 0; b < 8; ++b) op(static_cast<char>((v >> (8 * b)) & 0xff));
  }
  // A stack of frames (function names): a list written in place.
  std::uint32_t stack(const std::vector<std::string>& names) {
    op(']');
    const std::uint32_t list = memoize();
    op('(');
    for (const std::string& n : names) {
      if (auto it = frames_.find(n); it != frames_.end()) {
        get(it->second);
        continue;
      }
      op('}');
      frames_[n] = memoize();
      op('(');
      str("name"), str(n), str("filename"), str("model.py"), str("line"), integer(7);
      op('u');
    }
    op('e');
    return list;
  }
  // One trace entry; `frames` < 0: a new stack of `names`, else fetched.
  std::uint32_t entry(const std::string& action, std::uint64_t addr, std::uint64_t size,
                      std::int64_t frames, const std::vector<std::string>& names = {}) {
    op('}'), memoize(), op('(');
    str("action"), str(action);
    if (action == "oom") {
      str("device_free"), integer(addr);
    } else {
      str("addr"), integer(addr);
    }
    str("size"), integer(size);
    str("stream"), integer(0);
    str("time_us"), integer(1000 + entries_++);
    str("frames");
    std::uint32_t list = 0;
    if (frames < 0) {
      list = stack(names);
    } else {
      get(static_cast<std::uint32_t>(frames));
      list = static_cast<std::uint32_t>(frames);
    }
    op('u');
    return list;
  }
  void user_defined(const std::string& name) {
    op('}'), memoize(), op('(');
    str("action"), str("user_defined"), str("name"), str(name), op('u');
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
  std::uint32_t memo_ = 0;
  std::uint64_t entries_ = 0;
  std::map<std::string, std::uint32_t> strings_;
  std::map<std::string, std::uint32_t> frames_;
};

std::span<const std::uint8_t> span_of(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

// Entries as PyTorch writes them, most taken by the decoder's hook (no value
// made) and some read the checked way (the first of each key, a new frame,
// a user_defined entry), in one list: the events, their stacks and the
// annotation are the same read from memory, from the file (mapped, its
// events moved as read) and device by device.
TEST(SnapshotVersions, AsPyTorchWritesThemEntriesReadInOrder) {
  SnapshotWriter w;
  w.op('}'), w.memoize(), w.op('(');
  w.str("segments"), w.op(']'), w.memoize();
  w.str("device_traces"), w.op(']'), w.memoize(), w.op('(');
  w.op(']'), w.memoize(), w.op('(');  // device 0
  // Read the checked way: the first of each key and action name.
  const std::uint32_t a = w.entry("alloc", 0x1000, 512, -1, {"forward", "main"});
  w.entry("free_requested", 0x1000, 512, a);
  w.entry("free_completed", 0x1000, 512, a);
  // Taken: the same stack in place again, then fetched.
  const std::uint32_t b = w.entry("alloc", 0x1200, 512, -1, {"forward", "main"});
  w.entry("alloc", 0x1400, 512, b);
  w.user_defined("step");  // checked
  w.entry("free_requested", 0x1200, 512, b);  // taken
  w.entry("free_completed", 0x1200, 512, b);
  w.entry("alloc", 0x1600, 1024, -1, {"backward", "main"});  // checked: a new frame
  w.entry("oom", 1u << 20, 1u << 30, -1, {"backward", "main"});  // checked: device_free
  w.entry("alloc", 0x1800, 1024, -1, {"backward", "main"});  // taken
  w.op('e');
  w.op(']'), w.memoize(), w.op('(');  // device 1
  const std::uint32_t d = w.entry("alloc", 0x9000, 2048, -1, {"main"});
  w.entry("free_requested", 0x9000, 2048, d);
  w.op('e');
  w.op('e'), w.op('u'), w.op('.');
  const std::string bytes = w.out();

  auto check_device0 = [](const Trace& t) {
    using A = TraceAction;
    EXPECT_EQ(t.events, (std::vector<TraceEvent>{{A::alloc, 0x1000, 512, 0, 1000, 1},
                                                 {A::free_requested, 0x1000, 512, 0, 1001, 1},
                                                 {A::free_completed, 0x1000, 512, 0, 1002, 1},
                                                 {A::alloc, 0x1200, 512, 0, 1003, 1},
                                                 {A::alloc, 0x1400, 512, 0, 1004, 1},
                                                 {A::free_requested, 0x1200, 512, 0, 1005, 1},
                                                 {A::free_completed, 0x1200, 512, 0, 1006, 1},
                                                 {A::alloc, 0x1600, 1024, 0, 1007, 2},
                                                 {A::oom, 1u << 20, 1u << 30, 0, 1008, 2},
                                                 {A::alloc, 0x1800, 1024, 0, 1009, 2}}));
    ASSERT_EQ(t.final_state.contexts.size(), 3u);
    EXPECT_EQ(t.final_state.contexts[1].frames,
              (std::vector<Frame>{{"model.py", 7, "forward"}, {"model.py", 7, "main"}}));
    EXPECT_EQ(t.final_state.contexts[2].frames,
              (std::vector<Frame>{{"model.py", 7, "backward"}, {"model.py", 7, "main"}}));
    ASSERT_EQ(t.annotations.size(), 1u);
    EXPECT_EQ(t.annotations[0], (TraceAnnotation{"", "step", 0, 5}));
    EXPECT_EQ(t.device_events, (std::vector<std::uint64_t>{11, 2}));
  };
  check_device0(read_pytorch_snapshot(span_of(bytes), "s.pickle"));
  const std::vector<Trace> all = read_pytorch_snapshot_devices(span_of(bytes), "s.pickle");
  ASSERT_EQ(all.size(), 2u);
  check_device0(all[0]);
  EXPECT_EQ(all[1].events, (std::vector<TraceEvent>{{TraceAction::alloc, 0x9000, 2048, 0, 1010, 1},
                                                    {TraceAction::free_requested, 0x9000, 2048, 0, 1011, 1}}));

  const std::string path = ::testing::TempDir() + "/as_pytorch_writes.pickle";
  {
    std::ofstream(path, std::ios::binary) << bytes;
  }
  check_device0(read_trace_file(path));
  const std::vector<Trace> from_file = read_trace_devices(path);
  ASSERT_EQ(from_file.size(), 2u);
  check_device0(from_file[0]);
  EXPECT_EQ(from_file[1].events, all[1].events);
  EXPECT_EQ(read_trace_file(path, 1).events, all[1].events);
  std::remove(path.c_str());
}

// One list of entries as two devices' (device_traces = [L, L], the second
// from the memo): each device reads every entry, none is lost by the first.
TEST(SnapshotVersions, AListOfEntriesHeldTwiceIsReadTwice) {
  SnapshotWriter w;
  w.op('}'), w.memoize(), w.op('(');
  w.str("segments"), w.op(']'), w.memoize();
  w.str("device_traces"), w.op(']'), w.memoize(), w.op('(');
  w.op(']');
  const std::uint32_t list = w.memoize();
  w.op('(');
  const std::uint32_t a = w.entry("alloc", 0x1000, 512, -1, {"f"});
  for (int i = 0; i < 3; ++i) w.entry("alloc", 0x2000 + 0x200 * i, 512, a);
  w.op('e');
  w.get(list);
  w.op('e'), w.op('u'), w.op('.');
  const std::vector<Trace> all = read_pytorch_snapshot_devices(span_of(w.out()), "s.pickle");
  ASSERT_EQ(all.size(), 2u);
  ASSERT_EQ(all[0].events.size(), 4u);
  EXPECT_EQ(all[1].events, all[0].events);
  EXPECT_EQ(all[1].events[3], (TraceEvent{TraceAction::alloc, 0x2400, 512, 0, 1003, 1}));
}

// An entry of the wrong type after runs of taken entries: the error names
// its place in the list.
TEST(SnapshotVersions, AnErrorAfterTakenEntriesNamesItsIndex) {
  SnapshotWriter w;
  w.op('}'), w.memoize(), w.op('(');
  w.str("segments"), w.op(']'), w.memoize();
  w.str("device_traces"), w.op(']'), w.memoize(), w.op('(');
  w.op(']'), w.memoize(), w.op('(');
  const std::uint32_t a = w.entry("alloc", 0x1000, 512, -1, {"f"});
  for (int i = 0; i < 4; ++i) w.entry("alloc", 0x2000 + 0x200 * i, 512, a);
  // Entry 5: size as a str.
  w.op('}'), w.memoize(), w.op('(');
  w.str("action"), w.str("alloc"), w.str("addr"), w.integer(0x3000), w.str("size"), w.str("512");
  w.str("stream"), w.integer(0), w.op('u');
  w.op('e');
  w.op('e'), w.op('u'), w.op('.');
  EXPECT_EQ(error_of<TraceError>([&] { (void)read_pytorch_snapshot(span_of(w.out()), "s.pickle"); }),
            "snapshot s.pickle: device_traces[0][5].size: expected int, got str");
}


// PyTorch 2.0 gives a block no "frames" but a "history": the
// allocations it held, each with its address, requested size ("real_size")
// and stack. A live block's stack is that of its allocation at its address;
// a bad entry is named.
TEST(SnapshotVersions, ABlocksHistoryGivesItsStackIn20) {
  const std::string frames_a = R"([{"filename": "train.py", "line": 52, "name": "program"}])";
  const std::string frames_b = R"([{"filename": "train.py", "line": 60, "name": "step"}])";
  const std::string segments = fmt::format(R"([
    {{"device": 0, "address": 2097152, "total_size": 2097152, "stream": 0, "segment_type": "small",
      "allocated_size": 1536, "active_size": 1536, "requested_size": 1400,
      "blocks": [
        {{"size": 512, "requested_size": 500, "state": "active_allocated",
          "history": [{{"addr": 2097152, "real_size": 300, "frames": {0}}},
                      {{"addr": 2097152, "real_size": 500, "frames": {1}}}]}},
        {{"size": 1024, "requested_size": 900, "state": "active_allocated",
          "history": [{{"addr": 2097664, "real_size": 900, "frames": {0}}}]}},
        {{"size": 2095616, "requested_size": 0, "state": "inactive",
          "history": [{{"addr": 2098688, "real_size": 64, "frames": {1}}}]}}]}}])",
                                           frames_a, frames_b);
  const Trace t = read(snapshot("[[]]", segments));
  EXPECT_EQ(t.unknown_keys.count("segments[].blocks[].history"), 0u);
  const auto& blocks = t.final_state.segments.at(0).blocks;
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_EQ(t.context(blocks[0].context).frames, (std::vector<Frame>{{"train.py", 60, "step"}}));
  EXPECT_EQ(t.context(blocks[1].context).frames, (std::vector<Frame>{{"train.py", 52, "program"}}));
  EXPECT_EQ(blocks[2].context, 0u);  // a free block holds no allocation

  std::string bad = segments;
  bad.replace(bad.find(R"("real_size": 900)"), 16, R"("real_size": "900")");
  EXPECT_NE(error(snapshot("[[]]", bad)).find("segments[0].blocks[1].history[0]"), std::string::npos)
      << error(snapshot("[[]]", bad));
}

}  // namespace
}  // namespace reservoir
