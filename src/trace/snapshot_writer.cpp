// Writing traces as PyTorch snapshot pickles.
#include <fmt/format.h>

#include "reservoir/pickle.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {
namespace {

using pickle::Document;
using pickle::Kind;
using pickle::Value;

class Builder {
 public:
  Value* dict() { return doc_.make(Kind::dict); }
  Value* list() { return doc_.make(Kind::list); }
  Value* str(std::string_view s) {
    Value* v = doc_.make(Kind::string);
    v->text = s;
    return v;
  }
  Value* integer(std::int64_t i) {
    Value* v = doc_.make(Kind::integer);
    v->integer = i;
    return v;
  }
  Value* uinteger(std::uint64_t u) {
    Value* v = integer(static_cast<std::int64_t>(u));
    v->above_int64 = u >= (std::uint64_t{1} << 63);
    return v;
  }
  Value* boolean(bool b) {
    Value* v = doc_.make(Kind::boolean);
    v->boolean = b;
    return v;
  }
  Value* floating(double d) {
    Value* v = doc_.make(Kind::floating);
    v->floating = d;
    return v;
  }
  void set(Value* d, std::string_view key, Value* v) { d->entries.emplace_back(str(key), v); }

 private:
  Document doc_;
};

}  // namespace

std::string write_pytorch_snapshot(const Trace& trace) {
  Builder b;
  Value* root = b.dict();
  Value* segments = b.list();
  for (const SegmentInfo& s : trace.final_state.segments) {
    Value* seg = b.dict();
    b.set(seg, "device", b.integer(s.device));
    b.set(seg, "address", b.uinteger(s.address));
    b.set(seg, "total_size", b.uinteger(s.total_size));
    b.set(seg, "allocated_size", b.uinteger(s.allocated_size));
    b.set(seg, "active_size", b.uinteger(s.active_size));
    b.set(seg, "requested_size", b.uinteger(s.requested_size));
    b.set(seg, "stream", b.uinteger(s.stream));
    b.set(seg, "segment_type", b.str(s.is_large ? "large" : "small"));
    Value* pool = b.dict();  // replaced by a tuple below
    pool->kind = Kind::tuple;
    pool->items = {b.uinteger(s.pool_id.first), b.uinteger(s.pool_id.second)};
    b.set(seg, "segment_pool_id", pool);
    b.set(seg, "is_expandable", b.boolean(s.is_expandable));
    b.set(seg, "frames", b.list());
    Value* blocks = b.list();
    for (const BlockInfo& bi : s.blocks) {
      Value* block = b.dict();
      b.set(block, "address", b.uinteger(bi.address));
      b.set(block, "size", b.uinteger(bi.size));
      b.set(block, "requested_size", b.uinteger(bi.requested_size));
      b.set(block, "state", b.str(to_string(bi.state)));
      b.set(block, "frames", b.list());
      blocks->items.push_back(block);
    }
    b.set(seg, "blocks", blocks);
    segments->items.push_back(seg);
  }
  b.set(root, "segments", segments);
  Value* events = b.list();
  for (const TraceEvent& e : trace.events) {
    if (e.action == TraceAction::empty_cache) continue;  // not a PyTorch trace action
    Value* ev = b.dict();
    b.set(ev, "action", b.str(to_string(e.action)));
    b.set(ev, "addr", b.uinteger(e.addr));
    b.set(ev, "size", b.uinteger(e.size));
    b.set(ev, "stream", b.uinteger(e.stream));
    b.set(ev, "time_us", b.integer(0));
    b.set(ev, "frames", b.list());
    events->items.push_back(ev);
  }
  Value* traces = b.list();
  traces->items.push_back(events);
  b.set(root, "device_traces", traces);
  const AllocatorConfig config = AllocatorConfig::parse(trace.recorded_config);
  Value* settings = b.dict();
  b.set(settings, "PYTORCH_CUDA_ALLOC_CONF", b.str(trace.recorded_config));
  b.set(settings, "max_split_size",
        b.integer(config.max_split_size == std::numeric_limits<std::size_t>::max()
                      ? -1
                      : static_cast<std::int64_t>(config.max_split_size)));
  b.set(settings, "garbage_collection_threshold", b.floating(config.garbage_collection_threshold));
  b.set(settings, "expandable_segments", b.boolean(config.expandable_segments));
  Value* divisions = b.dict();
  for (std::size_t i = 0; i < kRoundupIntervals; ++i) {
    divisions->entries.emplace_back(
        b.str(fmt::format("{}", std::size_t{1} << i)),
        b.integer(static_cast<std::int64_t>(config.roundup_power2_divisions[i])));
  }
  b.set(settings, "roundup_power2_divisions", divisions);
  b.set(root, "allocator_settings", settings);
  return pickle::encode(*root);
}

}  // namespace reservoir
