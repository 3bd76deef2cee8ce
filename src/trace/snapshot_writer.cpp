// Writing traces as PyTorch snapshots: pickle (memory_viz) or JSON.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <unordered_map>

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
  // Strings are shared: the pickle stores each distinct one once.
  Value* str(std::string_view s) {
    auto it = strings_.find(s);
    if (it != strings_.end()) return it->second;
    Value* v = doc_.make(Kind::string);
    v->text = s;
    strings_.emplace(v->text, v);
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
  Value* make(Kind kind) { return doc_.make(kind); }

 private:
  Document doc_;
  std::unordered_map<std::string_view, Value*> strings_;  // views into doc_'s values
};

// The snapshot as a value tree: the dict torch.cuda.memory._snapshot() gives.
class SnapshotBuilder {
 public:
  // contexts_by_reference: contexts in a top-level "contexts" table, events
  // and blocks naming theirs by "context" index (JSON, which cannot share
  // values as a pickle does); otherwise PyTorch's "frames" lists.
  SnapshotBuilder(const Trace& trace, bool contexts_by_reference)
      : trace_(trace), by_reference_(contexts_by_reference) {}

  const Value* build() {
    Value* root = b_.dict();
    Value* segments = b_.list();
    for (const SegmentInfo& s : trace_.final_state.segments) segments->items.push_back(segment(s));
    b_.set(root, "segments", segments);
    Value* events = b_.list();
    for (const TraceEvent& e : trace_.events) {
      if (e.action == TraceAction::empty_cache) continue;  // not a PyTorch trace action
      Value* ev = b_.dict();
      b_.set(ev, "action", b_.str(to_string(e.action)));
      // PyTorch writes an oom entry's device free memory in place of addr.
      b_.set(ev, e.action == TraceAction::oom ? "device_free" : "addr", b_.uinteger(e.addr));
      b_.set(ev, "size", b_.uinteger(e.size));
      b_.set(ev, "stream", b_.uinteger(e.stream));
      b_.set(ev, "time_us", b_.integer(e.time_us));
      set_context(ev, e.context);
      events->items.push_back(ev);
    }
    // PyTorch's list of every device's events: those of devices before this
    // one are empty (the file speaks of one device).
    Value* traces = b_.list();
    for (int i = 0; i < trace_.device; ++i) traces->items.push_back(b_.list());
    traces->items.push_back(events);
    b_.set(root, "device_traces", traces);
    b_.set(root, "allocator_settings", settings());
    if (by_reference_) {
      Value* contexts = b_.list();
      for (const Context& c : trace_.final_state.contexts) {
        Value* entry = b_.dict();
        Value* annotations = b_.list();
        for (const std::string& a : c.annotations) annotations->items.push_back(b_.str(a));
        b_.set(entry, "annotations", annotations);
        Value* frames = b_.list();
        for (const Frame& f : c.frames) frames->items.push_back(frame(f.filename, f.line, f.name));
        b_.set(entry, "frames", frames);
        contexts->items.push_back(entry);
      }
      b_.set(root, "contexts", contexts);
    }
    return root;
  }

 private:
  // A context as PyTorch frames: the call stack (innermost first), then the
  // annotations (innermost first) as frames of file "<annotation>", which
  // memory_viz shows in the stack and our reader turns back into annotations.
  Value* frames(std::uint32_t context) {
    if (context == 0) return b_.list();
    // One list per context, shared by the events and blocks that have it.
    if (Value* shared = frames_[context]) return shared;
    Value* list = b_.list();
    frames_[context] = list;
    const Context& c = trace_.context(context);
    for (const Frame& f : c.frames) list->items.push_back(frame(f.filename, f.line, f.name));
    for (auto it = c.annotations.rbegin(); it != c.annotations.rend(); ++it) {
      list->items.push_back(frame(kAnnotationFile, 0, *it));
    }
    return list;
  }

  Value* frame(std::string_view file, int line, std::string_view name) {
    Value* f = b_.dict();
    b_.set(f, "filename", b_.str(file));
    b_.set(f, "line", b_.integer(line));
    b_.set(f, "name", b_.str(name));
    return f;
  }

  void set_context(Value* owner, std::uint32_t context) {
    if (by_reference_) {
      b_.set(owner, "context", b_.integer(context));
    } else {
      b_.set(owner, "frames", frames(context));
    }
  }

  Value* segment(const SegmentInfo& s) {
    Value* seg = b_.dict();
    b_.set(seg, "device", b_.integer(s.device));
    b_.set(seg, "address", b_.uinteger(s.address));
    b_.set(seg, "total_size", b_.uinteger(s.total_size));
    b_.set(seg, "allocated_size", b_.uinteger(s.allocated_size));
    b_.set(seg, "active_size", b_.uinteger(s.active_size));
    b_.set(seg, "requested_size", b_.uinteger(s.requested_size));
    b_.set(seg, "stream", b_.uinteger(s.stream));
    b_.set(seg, "segment_type", b_.str(s.is_large ? "large" : "small"));
    Value* pool = b_.make(Kind::tuple);
    pool->items = {b_.uinteger(s.pool_id.first), b_.uinteger(s.pool_id.second)};
    b_.set(seg, "segment_pool_id", pool);
    b_.set(seg, "is_expandable", b_.boolean(s.is_expandable));
    if (const auto it = trace_.final_state.backed_bytes.find(s.address);
        it != trace_.final_state.backed_bytes.end()) {
      b_.set(seg, "reservoir_backed_size", b_.uinteger(it->second));  // (native_paged's)
    }
    b_.set(seg, "frames", b_.list());
    Value* blocks = b_.list();
    for (const BlockInfo& bi : s.blocks) {
      Value* block = b_.dict();
      b_.set(block, "address", b_.uinteger(bi.address));
      b_.set(block, "size", b_.uinteger(bi.size));
      b_.set(block, "requested_size", b_.uinteger(bi.requested_size));
      b_.set(block, "state", b_.str(to_string(bi.state)));
      set_context(block, bi.context);
      blocks->items.push_back(block);
    }
    b_.set(seg, "blocks", blocks);
    return seg;
  }

  Value* settings() {
    const AllocatorConfig& config = trace_.settings;
    Value* settings = b_.dict();
    b_.set(settings, "PYTORCH_CUDA_ALLOC_CONF", b_.str(trace_.recorded_config));
    b_.set(settings, "max_split_size",
           b_.integer(config.max_split_size == std::numeric_limits<std::size_t>::max()
                          ? -1
                          : static_cast<std::int64_t>(config.max_split_size)));
    b_.set(settings, "garbage_collection_threshold",
           b_.floating(config.garbage_collection_threshold));
    b_.set(settings, "expandable_segments", b_.boolean(config.expandable_segments));
    Value* divisions = b_.dict();
    for (std::size_t i = 0; i < kRoundupIntervals; ++i) {
      divisions->entries.emplace_back(
          b_.str(fmt::format("{}", std::size_t{1} << i)),
          b_.integer(static_cast<std::int64_t>(config.roundup_power2_divisions[i])));
    }
    b_.set(settings, "roundup_power2_divisions", divisions);
    return settings;
  }

  const Trace& trace_;
  const bool by_reference_;
  Builder b_;
  std::unordered_map<std::uint32_t, Value*> frames_;
};

nlohmann::ordered_json to_json(const Value& v) {
  switch (v.kind) {
    case Kind::none: return nullptr;
    case Kind::boolean: return v.boolean;
    case Kind::integer:
      if (v.above_int64) return static_cast<std::uint64_t>(v.integer);
      return v.integer;
    case Kind::floating: return v.floating;
    case Kind::string:
    case Kind::bytes: return v.text;
    case Kind::list:
    case Kind::tuple: {
      auto out = nlohmann::ordered_json::array();
      for (const Value* item : v.items) out.push_back(to_json(*item));
      return out;
    }
    case Kind::taken: return nullptr;  // not in what the writer builds
    case Kind::dict: {
      auto out = nlohmann::ordered_json::object();
      for (const auto& [k, item] : v.entries) out[k->text] = to_json(*item);
      return out;
    }
  }
  return nullptr;
}

}  // namespace

std::string write_pytorch_snapshot(const Trace& trace) {
  SnapshotBuilder builder(trace, false);
  return pickle::encode(*builder.build());
}

std::string write_snapshot_json(const Trace& trace) {
  SnapshotBuilder builder(trace, true);
  return to_json(*builder.build()).dump(1) + "\n";
}

Trace to_trace(Snapshot snapshot, std::string name, const std::string& recorded_config) {
  Trace trace;
  trace.name = std::move(name);
  trace.format = to_string(TraceFormat::pytorch_pickle);
  set_recorded_config(trace, recorded_config);
  trace.has_addresses = true;
  trace.events = std::move(snapshot.history);
  snapshot.history.clear();
  trace.final_state = std::move(snapshot);
  // A reservoir allocator's settings name the release whose rules it runs.
  if (!trace.settings.pytorch_version.empty()) {
    trace.pytorch_since = trace.settings.pytorch_version;
    trace.pytorch_release_known = true;
  }
  return trace;
}

}  // namespace reservoir
