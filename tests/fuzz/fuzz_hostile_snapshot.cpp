// libFuzzer target, structure-aware: the fuzzer's bytes are a recipe for a
// PyTorch snapshot of the shapes hostile files take (no devices, empty
// lists, thousands of device lists, sizes near 2^64 and near 1 EiB, one
// frame or one stack shared many times through the pickle memo, strings
// that are long or not UTF-8), encoded as Python pickles it. Whatever the
// reader accepts is replayed under every policy, verified and written back,
// as the command-line tools do. Each must answer or refuse with TraceError,
// ConfigError or an out-of-memory result: a DeviceError or any other
// exception is an internal error (abort), and libFuzzer's -timeout and
// -rss_limit_mb (Makefile) catch a hang or memory out of proportion to the
// file.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/pickle.hpp"
#include "reservoir/trace.hpp"

namespace {

using reservoir::pickle::Document;
using reservoir::pickle::Kind;
using reservoir::pickle::Value;

// Sizes at the edges of every size computation: rounding, segments, pages,
// the 1 EiB limit, the unbounded replay device, wrapping.
constexpr std::uint64_t kSizes[] = {0,
                                    1,
                                    512,
                                    (1u << 20) + 1,
                                    (20u << 20) + 1,
                                    std::uint64_t{1} << 33,
                                    std::uint64_t{1} << 44,
                                    (std::uint64_t{1} << 44) + 1,
                                    std::uint64_t{1} << 50,
                                    (std::uint64_t{1} << 60) - 1,
                                    std::uint64_t{1} << 60,
                                    std::uint64_t{1} << 62,
                                    ~std::uint64_t{0} - 511,
                                    ~std::uint64_t{0}};
constexpr std::size_t kCounts[] = {0, 1, 2, 7, 1024, 1025, 30000, 150000};
constexpr const char* kActions[] = {"alloc", "free_requested", "free_completed", "segment_alloc",
                                    "segment_free", "segment_map", "segment_unmap", "oom",
                                    "snapshot", "empty_cache", "bogus"};

class Builder {
 public:
  explicit Builder(FuzzedDataProvider& in) : in_(in) {}

  Value* str(const std::string& s) {
    Value* v = doc_.make(Kind::string);
    v->text = s;
    return v;
  }
  Value* integer(std::uint64_t u) {
    Value* v = doc_.make(Kind::integer);
    v->integer = static_cast<std::int64_t>(u);
    v->above_int64 = u > static_cast<std::uint64_t>(INT64_MAX);
    return v;
  }
  Value* list() { return doc_.make(Kind::list); }
  Value* dict() { return doc_.make(Kind::dict); }
  void set(Value* d, const char* key, const Value* value) { d->entries.emplace_back(key_(key), value); }

  // Sizes and the program's steps come from a generator the first eight
  // bytes seed, so that even a short input makes a program of many sizes.
  std::uint64_t next() {
    state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return state_ >> 17;
  }
  std::uint64_t size() {
    const std::uint64_t r = next();
    return r % 2 == 0 ? kSizes[(r >> 1) % std::size(kSizes)] : 1 + (r >> 8) % (std::uint64_t{1} << 31);
  }
  // A hostile choice is one in sixteen: most of what the fuzzer builds
  // reaches the replay, where sizes are the hostile part.
  bool rare() { return in_.ConsumeIntegralInRange(0, 15) == 15; }
  std::size_t count(std::size_t most) {
    return std::min(most, rare() ? in_.PickValueInArray(kCounts)
                                 : std::size_t{in_.ConsumeIntegralInRange<std::uint8_t>(0, 40)});
  }
  std::string text() {
    if (!rare()) return "train.py";
    switch (in_.ConsumeIntegralInRange(0, 3)) {
      case 0: return in_.ConsumeRandomLengthString(64);
      case 1: return std::string((std::size_t{1} << 20) + in_.ConsumeIntegralInRange(0, 1), 'x');
      case 2: return std::string("\xff\xfe", 2);  // not UTF-8
      default: return "train.py";
    }
  }
  // One frames list: fresh frames, or one frame (or the list itself) shared.
  Value* frames() {
    Value* l = list();
    const std::size_t n = count(150000);
    if (n == 0) return l;
    if (in_.ConsumeBool()) {
      Value* f = dict();
      set(f, "filename", str(text()));
      set(f, "name", str("step"));
      set(f, "line", integer(in_.ConsumeIntegral<std::uint16_t>()));
      l->items.assign(n, f);  // one memo reference, n times
    } else {
      for (std::size_t i = 0; i < std::min<std::size_t>(n, 64); ++i) {
        Value* f = dict();
        set(f, "filename", str(text()));
        set(f, "name", str("f" + std::to_string(i)));
        set(f, "line", integer(i));
        l->items.push_back(f);
      }
    }
    return l;
  }

  void event(Value* events, const char* action, std::uint64_t addr, std::uint64_t bytes,
             const Value* stack) {
    Value* e = dict();
    set(e, "action", str(action));
    set(e, "addr", integer(addr));
    set(e, "size", integer(bytes));
    set(e, "stream", integer(stream_));
    set(e, "frames", stack);
    events->items.push_back(e);
  }

  std::string build() {
    state_ = in_.ConsumeIntegral<std::uint64_t>();
    stream_ = in_.ConsumeIntegralInRange(0, 2);
    Value* root = dict();
    Value* segments = list();
    Value* traces = list();
    // The bytes exhausted, every choice falls to a well-formed snapshot of
    // one device: the hostile shapes are what the fuzzer's bytes ask for.
    if (!rare()) set(root, "segments", segments);
    set(root, "device_traces", traces);
    const std::size_t devices = rare() ? count(40000) : 1;
    Value* shared_stack = frames();
    std::uint64_t addr = std::uint64_t{1} << 40;
    for (std::size_t d = 0; d < devices; ++d) {
      Value* events = list();
      traces->items.push_back(events);
      if (d > 1) continue;  // the rest empty
      // Mostly a program (allocations, and frees of earlier ones), so that
      // the replay is reached; now and then any action at all.
      const std::size_t n = rare() ? count(2000) : 1 + next() % 40;
      std::vector<std::pair<std::uint64_t, std::uint64_t>> live;  // addr, size
      for (std::size_t i = 0; i < n; ++i) {
        const auto what = static_cast<int>(next() % 8);
        const Value* stack = next() % 2 == 0 ? shared_stack : frames();
        if (what < 5 || live.empty()) {
          addr += next() % 65536 * 512 + (std::uint64_t{1} << 21);
          const std::uint64_t bytes = size();
          event(events, what == 7 ? in_.PickValueInArray(kActions) : "alloc", addr, bytes, stack);
          live.emplace_back(addr, bytes);
        } else {
          const std::size_t k = next() % live.size();
          event(events, "free_requested", live[k].first, live[k].second, stack);
          event(events, "free_completed", live[k].first, live[k].second, stack);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
    }
    return reservoir::pickle::encode(*root);
  }

 private:
  const Value* key_(const char* k) { return str(k); }
  FuzzedDataProvider& in_;
  Document doc_;
  int stream_ = 0;
  std::uint64_t state_ = 0;
};

// Every policy on an 80 GiB device (a GPU's: what fits maps in a bounded
// number of pages, so each run stays short), and the native one also on the
// unbounded device replay uses without --capacity.
void replay_everything(const reservoir::Trace& t) {
  const reservoir::ReplayProgram program = reservoir::compile(t);
  reservoir::ReplayOptions gpu;
  gpu.capacity = std::uint64_t{80} << 30;
  for (const char* config : {"", "expandable_segments:True", "policy:paging",
                             "policy:native_paged", "roundup_power2_divisions:4"}) {
    (void)reservoir::replay(program, reservoir::AllocatorConfig::parse(config), config, gpu);
  }
  (void)reservoir::replay(program, reservoir::AllocatorConfig::parse(""), "", {});
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  std::string bytes;
  try {
    bytes = Builder(in).build();
  } catch (const reservoir::TraceError&) {
    return 0;  // the encoder refuses (no such pickle)
  }
  const std::span<const std::uint8_t> input(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                            bytes.size());
  std::vector<reservoir::Trace> devices;
  try {
    devices = reservoir::trace_format(reservoir::TraceFormat::pytorch_pickle).read(input, "fuzz", {});
  } catch (const reservoir::TraceError&) {
    return 0;  // refused, saying why: what a tool exits 2 with
  }
  if (devices.empty()) std::abort();  // a tool would have nothing to work on, and no word
  std::vector<reservoir::Trace> used = reservoir::select_devices(std::move(devices), std::nullopt);
  if (used.size() > 2) used.resize(2);  // what each device's replay meets, the first two show
  for (const reservoir::Trace& t : used) {
    try {
      replay_everything(t);
      (void)reservoir::verify(t);
      if (t.events.size() <= 200) {
        (void)reservoir::trace_format(reservoir::TraceFormat::pytorch_pickle).write(t);
      }
    } catch (const reservoir::TraceError&) {
    } catch (const reservoir::ConfigError&) {
    } catch (const reservoir::OutOfMemoryError&) {
    }
    // Anything else (DeviceError: "allocating a segment of 0 bytes", an
    // internal assertion) propagates: libFuzzer reports it as a crash.
  }
  return 0;
}
