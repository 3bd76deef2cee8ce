// Reading PyTorch memory snapshots (torch.cuda.memory._dump_snapshot pickles).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <unordered_map>
#include <limits>

#include "reservoir/errors.hpp"
#include "reservoir/pickle.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {

using pickle::Kind;
using pickle::Value;

namespace {

class Reader {
 public:
  explicit Reader(std::string name) : name_(std::move(name)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw TraceError(fmt::format("snapshot {}: {}: {}", name_, path, what));
  }

  const Value& field(const Value& dict, std::string_view key, const std::string& path) const {
    if (dict.kind != Kind::dict)
      fail(path, fmt::format("expected a dict, found {}", to_string(dict.kind)));
    const Value* v = dict.find(key);
    if (v == nullptr) fail(path, fmt::format("'{}' is missing", key));
    return *v;
  }

  std::int64_t integer(const Value& dict, std::string_view key, const std::string& path) const {
    const Value& v = field(dict, key, path);
    if (v.kind == Kind::boolean) return v.boolean ? 1 : 0;
    if (v.kind != Kind::integer) {
      fail(path, fmt::format("'{}' should be an int, found {}", key, to_string(v.kind)));
    }
    return v.integer;
  }

  std::uint64_t unsigned_int(const Value& dict, std::string_view key,
                             const std::string& path) const {
    const std::int64_t i = integer(dict, key, path);
    if (field(dict, key, path).above_int64) return static_cast<std::uint64_t>(i);
    if (i < 0) fail(path, fmt::format("'{}' is negative ({})", key, i));
    return static_cast<std::uint64_t>(i);
  }

  const std::string& text(const Value& dict, std::string_view key, const std::string& path) const {
    const Value& v = field(dict, key, path);
    if (v.kind != Kind::string) {
      fail(path, fmt::format("'{}' should be a str, found {}", key, to_string(v.kind)));
    }
    return v.text;
  }

  const std::vector<const Value*>& list(const Value& v, const std::string& path) const {
    if (v.kind != Kind::list && v.kind != Kind::tuple) {
      fail(path, fmt::format("expected a list, found {}", to_string(v.kind)));
    }
    return v.items;
  }

  std::string config_from_settings(const Value& settings) const {
    const std::string path = "allocator_settings";
    if (settings.kind != Kind::dict) fail(path, "expected a dict");
    std::vector<std::string> parts;
    if (const Value* v = settings.find("max_split_size");
        v && v->kind == Kind::integer && v->integer > 0) {
      parts.push_back(fmt::format("max_split_size_mb:{}", v->integer >> 20));
    }
    if (const Value* v = settings.find("garbage_collection_threshold");
        v && v->kind == Kind::floating && v->floating > 0.0) {
      parts.push_back(fmt::format("garbage_collection_threshold:{}", v->floating));
    }
    if (const Value* v = settings.find("expandable_segments");
        v && v->kind == Kind::boolean && v->boolean) {
      parts.push_back("expandable_segments:True");
    }
    if (const Value* v = settings.find("roundup_power2_divisions")) {
      if (v->kind == Kind::dict) {
        bool any = false;
        std::vector<std::string> entries;
        for (const auto& [k, d] : v->entries) {
          if (k->kind != Kind::string || d->kind != Kind::integer) {
            fail(path + ".roundup_power2_divisions", "expected str keys and int values");
          }
          any |= d->integer != 0;
          entries.push_back(fmt::format("{}:{}", k->text, d->integer));
        }
        if (any)
          parts.push_back(fmt::format("roundup_power2_divisions:[{}]", fmt::join(entries, ",")));
      } else if (v->kind == Kind::integer && v->integer > 1) {
        parts.push_back(fmt::format("roundup_power2_divisions:{}", v->integer));
      }
    }
    return fmt::format("{}", fmt::join(parts, ","));
  }

  TraceAction action(const std::string& a, const std::string& path, bool* skip) const {
    *skip = false;
    if (a == "alloc") return TraceAction::alloc;
    if (a == "free_requested") return TraceAction::free_requested;
    if (a == "free_completed") return TraceAction::free_completed;
    if (a == "segment_alloc") return TraceAction::segment_alloc;
    if (a == "segment_free") return TraceAction::segment_free;
    if (a == "segment_map") return TraceAction::segment_map;
    if (a == "segment_unmap") return TraceAction::segment_unmap;
    if (a == "snapshot") return TraceAction::snapshot;
    if (a == "oom") return TraceAction::oom;
    if (a == "user_defined") {
      *skip = true;  // annotations carry no allocator work
      return TraceAction::snapshot;
    }
    fail(path, fmt::format("unknown action '{}'", a));
  }

  // The context of an event or block from its "frames" (absent or empty: 0).
  std::uint32_t context(const Value& owner, const std::string& path, Trace& trace) {
    if (owner.find("context") != nullptr) {  // our JSON: an index into "contexts"
      const std::uint64_t id = unsigned_int(owner, "context", path);
      if (id >= trace.final_state.contexts.size()) {
        fail(path, fmt::format("'context' {} is not in 'contexts' (which has {})", id,
                               trace.final_state.contexts.size()));
      }
      return static_cast<std::uint32_t>(id);
    }
    const Value* frames = owner.find("frames");
    if (frames == nullptr) return 0;
    const auto& items = list(*frames, path + ".frames");
    if (items.empty()) return 0;
    Context c;
    for (std::size_t i = 0; i < items.size(); ++i) {
      const std::string fpath = fmt::format("{}.frames[{}]", path, i);
      Frame frame = this->frame(*items[i], fpath);
      if (frame.filename == kAnnotationFile) {
        c.annotations.push_back(std::move(frame.name));
      } else if (!c.annotations.empty()) {
        fail(fpath, "a stack frame follows an annotation frame (annotations come last)");
      } else {
        c.frames.push_back(std::move(frame));
      }
    }
    std::reverse(c.annotations.begin(), c.annotations.end());  // outermost first
    std::string key = context_key(c);
    auto [it, inserted] = context_ids_.try_emplace(std::move(key), 0);
    if (inserted) {
      it->second = static_cast<std::uint32_t>(trace.final_state.contexts.size());
      trace.final_state.contexts.push_back(std::move(c));
    }
    return it->second;
  }

  // Our JSON's table of contexts; [0] must be the empty one.
  void read_contexts(const Value& table, Trace& trace) {
    const auto& items = list(table, "contexts");
    if (items.empty()) fail("contexts", "the table is empty (entry 0 is the empty context)");
    trace.final_state.contexts.clear();
    for (std::size_t i = 0; i < items.size(); ++i) {
      const std::string path = fmt::format("contexts[{}]", i);
      Context c;
      for (const Value* a : list(field(*items[i], "annotations", path), path + ".annotations")) {
        if (a->kind != Kind::string) fail(path + ".annotations", "expected strings");
        c.annotations.push_back(a->text);
      }
      const auto& frames = list(field(*items[i], "frames", path), path + ".frames");
      for (std::size_t k = 0; k < frames.size(); ++k) {
        c.frames.push_back(frame(*frames[k], fmt::format("{}.frames[{}]", path, k)));
      }
      if (i == 0 && !c.empty()) fail(path, "entry 0 must be the empty context");
      trace.final_state.contexts.push_back(std::move(c));
    }
  }

  Frame frame(const Value& f, const std::string& fpath) const {
    Frame frame;
    frame.filename = text(f, "filename", fpath);
    frame.name = text(f, "name", fpath);
    const std::int64_t line = integer(f, "line", fpath);
    if (line < std::numeric_limits<int>::min() || line > std::numeric_limits<int>::max()) {
      fail(fpath, fmt::format("'line' is out of range ({})", line));
    }
    frame.line = static_cast<int>(line);
    return frame;
  }

  Trace read(const Value& root, int device) {
    Trace trace;
    trace.name = name_;
    trace.format = to_string(TraceFormat::pytorch_pickle);
    trace.has_addresses = true;
    if (root.kind != Kind::dict)
      fail("top level", fmt::format("expected a dict, found {}", to_string(root.kind)));
    if (const Value* settings = root.find("allocator_settings")) {
      trace.recorded_config = config_from_settings(*settings);
    } else {
      trace.settings_recorded = false;
    }
    if (const Value* contexts = root.find("contexts")) read_contexts(*contexts, trace);
    const auto& traces = list(field(root, "device_traces", "top level"), "device_traces");
    if (device < 0 || static_cast<std::size_t>(device) >= traces.size()) {
      fail("device_traces",
           fmt::format("no device {} (the snapshot has {})", device, traces.size()));
    }
    trace.device = device;
    trace.device_count = traces.size();
    const std::string dpath = fmt::format("device_traces[{}]", device);
    const auto& events = list(*traces[static_cast<std::size_t>(device)], dpath);
    trace.events.reserve(events.size());
    for (std::size_t i = 0; i < events.size(); ++i) {
      const std::string path = fmt::format("{}[{}]", dpath, i);
      const Value& e = *events[i];
      bool skip = false;
      const TraceAction a = action(text(e, "action", path), path, &skip);
      if (skip) continue;
      TraceEvent ev;
      ev.action = a;
      ev.addr = unsigned_int(e, "addr", path);
      ev.size = unsigned_int(e, "size", path);
      ev.stream = unsigned_int(e, "stream", path);
      if (e.find("time_us") != nullptr) ev.time_us = integer(e, "time_us", path);
      ev.context = context(e, path, trace);
      trace.events.push_back(ev);
    }
    const auto& segments = list(field(root, "segments", "top level"), "segments");
    for (std::size_t i = 0; i < segments.size(); ++i) {
      const std::string path = fmt::format("segments[{}]", i);
      const Value& s = *segments[i];
      if (const Value* d = s.find("device");
          d && d->kind == Kind::integer && d->integer != device) {
        continue;
      }
      SegmentInfo seg;
      seg.device = device;
      seg.address = unsigned_int(s, "address", path);
      seg.total_size = unsigned_int(s, "total_size", path);
      seg.stream = unsigned_int(s, "stream", path);
      const std::string& type = text(s, "segment_type", path);
      if (type != "large" && type != "small")
        fail(path, fmt::format("segment_type '{}' is neither large nor small", type));
      seg.is_large = type == "large";
      if (const Value* x = s.find("is_expandable"); x && x->kind == Kind::boolean)
        seg.is_expandable = x->boolean;
      const auto& blocks = list(field(s, "blocks", path), path + ".blocks");
      DevicePtr cursor = seg.address;
      for (std::size_t j = 0; j < blocks.size(); ++j) {
        const std::string bpath = fmt::format("{}.blocks[{}]", path, j);
        const Value& b = *blocks[j];
        BlockInfo block;
        block.address = b.find("address") ? unsigned_int(b, "address", bpath) : cursor;
        block.size = unsigned_int(b, "size", bpath);
        block.requested_size =
            b.find("requested_size") ? unsigned_int(b, "requested_size", bpath) : 0;
        const std::string& state = text(b, "state", bpath);
        if (state == "active_allocated") {
          block.state = BlockState::active_allocated;
        } else if (state == "active_pending_free") {
          block.state = BlockState::active_pending_free;
        } else if (state == "inactive") {
          block.state = BlockState::inactive;
        } else {
          fail(bpath, fmt::format("unknown block state '{}'", state));
        }
        block.context = context(b, bpath, trace);
        cursor = block.address + block.size;
        seg.blocks.push_back(block);
        if (block.state == BlockState::active_allocated) seg.allocated_size += block.size;
        if (block.state != BlockState::inactive) {
          seg.active_size += block.size;
          seg.requested_size += block.requested_size;
        }
      }
      // Recorded totals, where present, win over the recount.
      if (s.find("allocated_size")) seg.allocated_size = unsigned_int(s, "allocated_size", path);
      if (s.find("active_size")) seg.active_size = unsigned_int(s, "active_size", path);
      if (s.find("requested_size")) seg.requested_size = unsigned_int(s, "requested_size", path);
      if (const Value* pool = s.find("segment_pool_id")) {
        const auto& ids = list(*pool, path + ".segment_pool_id");
        if (ids.size() != 2 || ids[0]->kind != Kind::integer || ids[1]->kind != Kind::integer) {
          fail(path + ".segment_pool_id", "expected two ints");
        }
        seg.pool_id = {static_cast<std::uint64_t>(ids[0]->integer),
                       static_cast<std::uint64_t>(ids[1]->integer)};
      }
      trace.final_state.segments.push_back(std::move(seg));
    }
    std::sort(trace.final_state.segments.begin(), trace.final_state.segments.end(),
              [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
    return trace;
  }

 private:
  std::string name_;
  std::unordered_map<std::string, std::uint32_t> context_ids_;
};

// JSON values as pickle values, so one reader checks both.
const Value* from_json(const nlohmann::json& j, pickle::Document& doc, const std::string& name,
                       int depth = 0) {
  using nlohmann::json;
  if (depth > 64) throw TraceError(fmt::format("snapshot {}: JSON nested deeper than 64", name));
  Value* v = nullptr;
  switch (j.type()) {
    case json::value_t::null: v = doc.make(Kind::none); break;
    case json::value_t::boolean:
      v = doc.make(Kind::boolean);
      v->boolean = j.get<bool>();
      break;
    case json::value_t::number_integer:
      v = doc.make(Kind::integer);
      v->integer = j.get<std::int64_t>();
      break;
    case json::value_t::number_unsigned: {
      v = doc.make(Kind::integer);
      const auto u = j.get<std::uint64_t>();
      v->integer = static_cast<std::int64_t>(u);
      v->above_int64 = u >= (std::uint64_t{1} << 63);
      break;
    }
    case json::value_t::number_float:
      v = doc.make(Kind::floating);
      v->floating = j.get<double>();
      break;
    case json::value_t::string:
      v = doc.make(Kind::string);
      v->text = j.get<std::string>();
      break;
    case json::value_t::array:
      v = doc.make(Kind::list);
      for (const auto& item : j) v->items.push_back(from_json(item, doc, name, depth + 1));
      break;
    case json::value_t::object:
      v = doc.make(Kind::dict);
      for (const auto& [key, item] : j.items()) {
        Value* k = doc.make(Kind::string);
        k->text = key;
        v->entries.emplace_back(k, from_json(item, doc, name, depth + 1));
      }
      break;
    default: v = doc.make(Kind::none); break;  // binary and discarded: not produced by parse
  }
  return v;
}

}  // namespace

Trace read_pytorch_snapshot(std::span<const std::uint8_t> data, const std::string& name,
                            int device) {
  pickle::Document doc = [&] {
    try {
      return pickle::decode(data);
    } catch (const TraceError& e) {
      throw TraceError(fmt::format("snapshot {}: {}", name, e.what()));
    }
  }();
  return Reader(name).read(doc.root(), device);
}

Trace read_snapshot_json(const std::string& text, const std::string& name, int device) {
  nlohmann::json j;
  try {
    // Depth is bounded by the parser's recursion; snapshots nest 6 levels.
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is the 1-based offset of the problem.
    throw TraceError(fmt::format("snapshot {}: byte {}: invalid JSON: {}", name,
                                 e.byte == 0 ? 0 : e.byte - 1, e.what()));
  } catch (const nlohmann::json::exception& e) {
    // Valid syntax the parser still refuses (a number beyond a double).
    throw TraceError(fmt::format("snapshot {}: invalid JSON: {}", name, e.what()));
  }
  pickle::Document doc;
  doc.set_root(from_json(j, doc, name));
  Trace trace = Reader(name).read(doc.root(), device);
  trace.format = to_string(TraceFormat::snapshot_json);
  return trace;
}

}  // namespace reservoir
