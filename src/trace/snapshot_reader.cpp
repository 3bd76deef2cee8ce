// Reading PyTorch memory snapshots (torch.cuda.memory._dump_snapshot pickles).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <charconv>
#include <iterator>
#include <new>
#include <utility>
#include <limits>
#include <optional>
#include <unordered_map>

#include "reservoir/config.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/pickle.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {

using pickle::Kind;
using pickle::Value;

namespace {

// The keys PyTorch writes (some versions, some entries), which the reader
// knows; any other key is kept as a count in Trace::unknown_keys.
constexpr std::string_view kEventKeys[] = {
    "action",   "addr",     "device_free",    "size",          "stream", "time_us",
    "frames",   "context",  "compile_context", "user_metadata", "forward_frames",
    "pool_id",  "device",   "name"};
constexpr std::string_view kSegmentKeys[] = {
    "device",         "address",   "total_size",    "allocated_size", "active_size",
    "requested_size", "stream",    "segment_type",  "segment_pool_id", "is_expandable",
    "frames",         "blocks",    "context",       "compile_context", "user_metadata",
    "forward_frames", "reservoir_backed_size"};
// "history" (2.0): the allocations a block held, each with its
// address, requested size ("real_size") and stack, in place of "frames".
constexpr std::string_view kBlockKeys[] = {
    "address", "size", "requested_size", "state", "frames", "context", "compile_context",
    "user_metadata", "forward_frames", "history"};
// host_segments and host_traces (2.12 or later): the pinned host
// allocator's segments and history, which no tool models.
constexpr std::string_view kTopKeys[] = {"segments", "device_traces", "allocator_settings",
                                         "external_annotations", "contexts", "host_segments",
                                         "host_traces"};

template <std::size_t N>
bool known(std::string_view key, const std::string_view (&keys)[N]) {
  return std::find(std::begin(keys), std::end(keys), key) != std::end(keys);
}

constexpr std::size_t kUnplaced = static_cast<std::size_t>(-1);

std::optional<TraceAction> action_of(std::string_view a);

// The decoder's hook: takes each trace entry whose keys and types are the
// ones PyTorch writes; anything else (an unknown key or action, a wrong
// type, a user_defined entry) it leaves to the reader's checks, which name
// the path. It keeps the events it took, in the order taken, in blocks
// that the reader hands back as it moves them into the trace: with the
// decoder keeping no value per entry and the file's pages handed back
// behind the decoder, reading holds little more than the events read.
class FlatEvents {
 public:
  std::int64_t take(std::span<const pickle::FlatItem> items) {
    struct {
      TraceEvent event;
      const Value* frames = nullptr;
    } f;
    const Value* action = nullptr;
    bool has_addr = false;
    bool has_size = false;
    bool has_stream = false;
    std::optional<std::uint64_t> device_free;
    for (const pickle::FlatItem& it : items) {
      auto unsigned_value = [&](std::uint64_t& out) {
        if (it.kind != Kind::integer || (it.integer < 0 && !it.above_int64)) return false;
        out = static_cast<std::uint64_t>(it.integer);
        return true;
      };
      switch (key_of(it.key)) {
        case Key::action:
          if (it.kind != Kind::string) return -1;
          action = it.ref;
          break;
        case Key::addr:
          if (!unsigned_value(f.event.addr)) return -1;
          has_addr = true;
          break;
        case Key::size:
          if (!unsigned_value(f.event.size)) return -1;
          has_size = true;
          break;
        case Key::stream:
          if (!unsigned_value(f.event.stream)) return -1;
          has_stream = true;
          break;
        case Key::device_free: {
          std::uint64_t v = 0;
          if (!unsigned_value(v)) return -1;
          device_free = v;
          break;
        }
        case Key::time_us:
          if (it.kind == Kind::integer) {
            f.event.time_us = it.integer;
          } else if (it.kind != Kind::none) {
            return -1;
          }
          break;
        case Key::frames:
          if (it.kind == Kind::list || it.kind == Kind::tuple) {
            f.frames = it.ref;
          } else if (it.kind != Kind::none) {
            return -1;
          }
          break;
        case Key::compile_context:
          if (it.kind != Kind::string && it.kind != Kind::none) return -1;
          break;
        case Key::user_metadata:
          if (it.kind != Kind::string && it.kind != Kind::none && it.kind != Kind::dict) return -1;
          break;
        case Key::forward_frames:
          if (it.kind != Kind::list && it.kind != Kind::none) return -1;
          break;
        case Key::pool_id:
          // The default pool's (0, 0) is taken here; a private pool's event,
          // or anything else, is left to the reader, which keeps its pool.
          if (it.kind == Kind::none) break;
          if ((it.kind != Kind::tuple && it.kind != Kind::list) || it.ref == nullptr ||
              it.ref->items.size() != 2 || it.ref->items[0]->kind != Kind::integer ||
              it.ref->items[1]->kind != Kind::integer || it.ref->items[0]->integer != 0 ||
              it.ref->items[1]->integer != 0) {
            return -1;
          }
          saw_pool_ids_ = true;
          break;
        case Key::other: return -1;
      }
    }
    if (action == nullptr || !has_size || !has_stream) return -1;
    const std::optional<TraceAction> a = action_value(action);
    if (!a) return -1;
    if (*a == TraceAction::oom) {
      if (device_free) {
        f.event.addr = *device_free;
      } else if (!has_addr) {
        f.event.addr = 0;
      }
    } else if (!has_addr || device_free) {
      return -1;
    }
    f.event.action = *a;
    f.event.context = f.frames != nullptr ? list_id(f.frames) + 1 : 0;
    if (size_ % kBlock == 0) {
      blocks_.emplace_back();
      moved_.push_back(0);
    }
    blocks_.back().at(size_ % kBlock) = f.event;
    return static_cast<std::int64_t>(size_++);
  }

  std::size_t size() const { return size_; }
  // Whether an event taken carried a pool id (PyTorch 2.15 and later).
  bool saw_pool_ids() const { return saw_pool_ids_; }
  // Event i as taken; its context is its frames list's id + 1 (0: none).
  const TraceEvent& at(std::size_t i) const {
    return blocks_[i / kBlock].at(i % kBlock);
  }
  const Value* frames_list(std::uint32_t id) const { return lists_[id]; }
  std::size_t frames_lists() const { return lists_.size(); }

  // Appends events [first, first + count) to `out`. With `hand_back`, the
  // caller promises that no event it moves is asked for again: each block
  // is freed once all its events have moved.
  void move_run(std::size_t first, std::size_t count, std::vector<TraceEvent>& out, bool hand_back) {
    out.reserve(out.size() + count);
    for (std::size_t i = first; i < first + count;) {
      const std::size_t b = i / kBlock;
      const std::size_t n = std::min(first + count, (b + 1) * kBlock) - i;
      const TraceEvent* block = &at(i);
      out.insert(out.end(), block, block + n);
      i += n;
      if (!hand_back) continue;
      moved_[b] += n;
      const std::size_t held = b + 1 < blocks_.size() ? kBlock : size_ - b * kBlock;
      if (moved_[b] == held) blocks_[b].release();
    }
  }

 private:
  static constexpr std::size_t kBlock = std::size_t{1} << 16;

  // kBlock events in pages of their own, given back to the system when
  // released (the heap would keep them resident for the rest of the run).
  class Block {
   public:
    Block() {
      void* p = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      events_ = static_cast<TraceEvent*>(p);
    }
    Block(Block&& other) noexcept : events_(std::exchange(other.events_, nullptr)) {}
    Block& operator=(Block&&) = delete;
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    ~Block() { release(); }
    TraceEvent& at(std::size_t i) {
      if (events_ == nullptr) throw TraceError("snapshot reader: a trace entry was read again after it was moved");
      return events_[i];
    }
    const TraceEvent& at(std::size_t i) const { return const_cast<Block*>(this)->at(i); }
    void release() {
      if (events_ != nullptr) ::munmap(events_, kBytes);
      events_ = nullptr;
    }

   private:
    static constexpr std::size_t kBytes = kBlock * sizeof(TraceEvent);
    TraceEvent* events_ = nullptr;
  };

  // Each distinct frames list's id (the decoder keeps each content once).
  std::uint32_t list_id(const Value* list) {
    if (list == last_list_) return last_id_;
    auto [it, inserted] = list_ids_.try_emplace(list, static_cast<std::uint32_t>(lists_.size()));
    if (inserted) lists_.push_back(list);
    last_list_ = list;
    last_id_ = it->second;
    return it->second;
  }

  std::vector<Block> blocks_;
  bool saw_pool_ids_ = false;
  std::vector<std::size_t> moved_;  // per block: events moved out with hand_back
  std::size_t size_ = 0;
  std::vector<const Value*> lists_;
  std::unordered_map<const Value*, std::uint32_t> list_ids_;
  const Value* last_list_ = nullptr;
  std::uint32_t last_id_ = 0;

  enum class Key : std::uint8_t {
    action, addr, size, stream, device_free, time_us, frames, compile_context, user_metadata,
    forward_frames, pool_id, other
  };

  // Keys and action names are memoized strings: each distinct value is
  // compared by its text once, then known by its address.
  Key key_of(const Value* key) {
    for (const auto& [v, k] : keys_) {
      if (v == key) return k;
    }
    static constexpr std::pair<std::string_view, Key> kNames[] = {
        {"action", Key::action},           {"addr", Key::addr},
        {"size", Key::size},               {"stream", Key::stream},
        {"device_free", Key::device_free}, {"time_us", Key::time_us},
        {"frames", Key::frames},           {"compile_context", Key::compile_context},
        {"user_metadata", Key::user_metadata}, {"forward_frames", Key::forward_frames},
        {"pool_id", Key::pool_id}};
    Key k = Key::other;
    for (const auto& [name, id] : kNames) {
      if (key->text == name) k = id;
    }
    if (keys_.size() < 64) keys_.emplace_back(key, k);
    return k;
  }

  std::optional<TraceAction> action_value(const Value* name) {
    for (const auto& [v, a] : actions_) {
      if (v == name) return a;
    }
    const std::optional<TraceAction> a = action_of(name->text);
    if (actions_.size() < 64) actions_.emplace_back(name, a);
    return a;
  }

  std::vector<std::pair<const Value*, Key>> keys_;
  std::vector<std::pair<const Value*, std::optional<TraceAction>>> actions_;
};

class Reader {
 public:
  explicit Reader(std::string name, FlatEvents* flat = nullptr, bool with_contexts = true,
                  bool hand_back = false)
      : name_(std::move(name)), flat_(flat), with_contexts_(with_contexts), hand_back_(hand_back) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw TraceError(fmt::format("snapshot {}: {}: {}", name_, path, what));
  }

  const Value& field(const Value& dict, std::string_view key, const std::string& path) const {
    if (dict.kind != Kind::dict)
      fail(path, fmt::format("expected a dict, got {}", to_string(dict.kind)));
    const Value* v = dict.find(key);
    if (v == nullptr) fail(path, fmt::format("'{}' is missing", key));
    return *v;
  }

  std::int64_t as_integer(const Value& v, const std::string& path) const {
    if (v.kind == Kind::boolean) return v.boolean ? 1 : 0;
    if (v.kind != Kind::integer) fail(path, fmt::format("expected int, got {}", to_string(v.kind)));
    return v.integer;
  }

  std::uint64_t as_unsigned(const Value& v, const std::string& path) const {
    const std::int64_t i = as_integer(v, path);
    if (v.above_int64) return static_cast<std::uint64_t>(i);
    if (i < 0) fail(path, fmt::format("expected a non-negative int, got {}", i));
    return static_cast<std::uint64_t>(i);
  }

  // (The key's path is formatted only where the value is refused: these run
  // for every field of every event.)
  std::int64_t integer(const Value& dict, std::string_view key, const std::string& path) const {
    const Value& v = field(dict, key, path);
    if (v.kind == Kind::integer) return v.integer;
    return as_integer(v, fmt::format("{}.{}", path, key));
  }

  std::uint64_t unsigned_int(const Value& dict, std::string_view key,
                             const std::string& path) const {
    const Value& v = field(dict, key, path);
    if (v.kind == Kind::integer && (v.above_int64 || v.integer >= 0)) return static_cast<std::uint64_t>(v.integer);
    return as_unsigned(v, fmt::format("{}.{}", path, key));
  }

  const std::string& text(const Value& dict, std::string_view key, const std::string& path) const {
    const Value& v = field(dict, key, path);
    if (v.kind != Kind::string) {
      fail(fmt::format("{}.{}", path, key), fmt::format("expected str, got {}", to_string(v.kind)));
    }
    return v.text;
  }

  // An optional str key: absent or None is empty.
  std::string_view optional_text(const Value& dict, std::string_view key,
                                 const std::string& path) const {
    const Value* v = dict.find(key);
    if (v == nullptr || v->kind == Kind::none) return {};
    if (v->kind != Kind::string) {
      fail(fmt::format("{}.{}", path, key), fmt::format("expected str, got {}", to_string(v->kind)));
    }
    return v->text;
  }

  // A list's items. A list of trace entries the decoder's hook took (a
  // device's events) is read by read_events alone: elsewhere it is an error.
  const std::vector<const Value*>& list(const Value& v, const std::string& path) const {
    const auto& items = list_items(v, path);
    if (!v.taken_runs.empty()) fail(path, "expected a list of other values, got trace entries");
    return items;
  }

  // The length of a list that may hold trace entries.
  std::size_t events_size(const Value& v, const std::string& path) const {
    std::size_t n = list_items(v, path).size();
    for (const auto& run : v.taken_runs) n += run.count;
    return n;
  }

  // A list's items, where it may also hold runs of trace entries.
  const std::vector<const Value*>& list_items(const Value& v, const std::string& path) const {
    if (v.kind != Kind::list && v.kind != Kind::tuple) {
      fail(path, fmt::format("expected a list, got {}", to_string(v.kind)));
    }
    return v.items;
  }

  // Keys of `dict` that the reader does not know, counted under `pattern`.
  template <std::size_t N>
  void note_unknown(const Value& dict, const std::string_view (&keys)[N], std::string_view pattern,
                    Trace& trace) const {
    for (const auto& [k, v] : dict.entries) {
      if (k->kind != Kind::string) {
        ++trace.unknown_keys[fmt::format("{}<{} key>", pattern, to_string(k->kind))];
      } else if (!known(k->text, keys)) {
        ++trace.unknown_keys[fmt::format("{}{}", pattern, k->text)];
      }
    }
  }

  // The settings a snapshot records: the text the program set
  // (PYTORCH_CUDA_ALLOC_CONF, as PyTorch names that entry in every version),
  // then the effective values of the keys the dict holds, each read through
  // the settings table. Parsed once, here.
  void read_settings(const Value& settings, Trace& trace) const {
    const std::string path = "allocator_settings";
    if (settings.kind != Kind::dict)
      fail(path, fmt::format("expected a dict, got {}", to_string(settings.kind)));
    std::string since = "2.3";  // the first release that records allocator_settings (pytorch/pytorch#119404)
    auto at_least = [&](std::string_view v) {
      if (!v.empty() && compare_versions(v, since) > 0) since = std::string(v);
    };
    std::string text;
    std::string release;  // the one the settings name, if any
    for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
      if (std::string_view t = optional_text(settings, name, path); !t.empty()) text = t;
    }
    trace.recorded_settings_text = text;
    // The text first: it holds keys the dict does not (max_non_split_rounding_mb, ...).
    std::vector<std::string> parts;
    try {
      const AllocatorConfig parsed = AllocatorConfig::parse(text);
      const std::string written = parsed.to_string();
      if (!written.empty()) parts.push_back(written);
      // A reservoir allocator's file names the release it ran under.
      if (!parsed.pytorch_version.empty()) {
        release = parsed.pytorch_version;
      }
      for (const std::string& item : split_items(text)) {
        if (const SettingInfo* s = find_setting(item.substr(0, item.find(':')))) at_least(s->since);
      }
    } catch (const ConfigError& e) {
      trace.settings_note = fmt::format(
          "the recorded settings text \"{}\" was not used ({}); the values the snapshot records "
          "were",
          text, e.what());
    }
    // Then the effective values the dict records, for each key the table maps.
    for (const auto& [k, v] : settings.entries) {
      if (k->kind != Kind::string) continue;
      if (k->text == "PYTORCH_CUDA_ALLOC_CONF" || k->text == "PYTORCH_ALLOC_CONF") continue;
      const SettingInfo* row = nullptr;
      for (const SettingInfo& s : reservoir::settings()) {
        if (s.snapshot_key == k->text) row = &s;
      }
      if (row == nullptr) {
        ++trace.unknown_keys["allocator_settings." + k->text];
        continue;
      }
      at_least(row->since);
      const std::string vpath = fmt::format("{}.{}", path, k->text);
      if (k->text == "max_split_size") {  // bytes; -1 (or SIZE_MAX) when unlimited
        if (v->kind != Kind::integer) fail(vpath, fmt::format("expected int, got {}", to_string(v->kind)));
        if (v->integer > 0 && !v->above_int64) {
          parts.push_back(fmt::format("max_split_size_mb:{}", v->integer >> 20));
        }
      } else if (k->text == "roundup_power2_divisions") {
        parts.push_back(divisions_text(*v, vpath));
      } else if (v->kind == Kind::boolean) {
        parts.push_back(fmt::format("{}:{}", row->key, v->boolean ? "True" : "False"));
      } else if (v->kind == Kind::floating) {
        if (v->floating > 0.0) parts.push_back(fmt::format("{}:{}", row->key, v->floating));
      } else if (v->kind == Kind::integer && row->key.ends_with("_mb")) {
        // Bytes; -1 (or SIZE_MAX) when unlimited.
        if (v->integer >= 0 && !v->above_int64) {
          parts.push_back(fmt::format("{}:{}", row->key, v->integer >> 20));
        }
      } else if (v->kind == Kind::integer) {
        parts.push_back(fmt::format("{}:{}", row->key, v->integer));
      } else {
        fail(vpath, fmt::format("expected a bool, int or float, got {}", to_string(v->kind)));
      }
    }
    std::erase(parts, std::string());
    try {
      trace.settings = AllocatorConfig::parse(fmt::format("{}", fmt::join(parts, ",")));
    } catch (const ConfigError& e) {
      fail(path, e.what());
    }
    trace.recorded_config = trace.settings.to_string();
    trace.pytorch_since = release.empty() ? since : release;
    trace.pytorch_release_known = !release.empty();
  }

  // A settings text's entries, split at the commas outside brackets.
  static std::vector<std::string> split_items(const std::string& text) {
    std::vector<std::string> items;
    std::string current;
    int depth = 0;
    for (const char c : text) {
      if (c == '[') ++depth;
      if (c == ']') --depth;
      if (c == ',' && depth == 0) {
        items.push_back(current);
        current.clear();
      } else if (c != ' ') {
        current.push_back(c);
      }
    }
    items.push_back(current);
    return items;
  }

  // roundup_power2_divisions as the dict records it ({"1": d, "2": d, ...}
  // by MiB interval; an int in older writers), as config text ("" when off).
  std::string divisions_text(const Value& v, const std::string& vpath) const {
    if (v.kind == Kind::integer) {
      return v.integer > 1 ? fmt::format("roundup_power2_divisions:{}", v.integer) : "";
    }
    if (v.kind != Kind::dict) fail(vpath, fmt::format("expected a dict, got {}", to_string(v.kind)));
    bool any = false;
    std::vector<std::string> entries;
    for (const auto& [k, d] : v.entries) {
      if (k->kind != Kind::string || d->kind != Kind::integer) {
        fail(vpath, "expected str keys and int values");
      }
      any |= d->integer != 0;
      entries.push_back(fmt::format("{}:{}", k->text, d->integer));
    }
    return any ? fmt::format("roundup_power2_divisions:[{}]", fmt::join(entries, ",")) : "";
  }

  // The context of an event or block from its "frames" (absent or empty: 0).
  // PyTorch shares one frames list among the entries of one stack, and the
  // pickle memo keeps it one value: each distinct list is read once.
  std::uint32_t context(const Value& owner, const std::string& path, Trace& trace) {
    if (owner.find("context") != nullptr) {  // our JSON: an index into "contexts"
      const std::uint64_t id = unsigned_int(owner, "context", path);
      if (id >= trace.final_state.contexts.size()) {
        fail(path, fmt::format("'context' {} is not in 'contexts' (which has {})", id,
                               trace.final_state.contexts.size()));
      }
      return static_cast<std::uint32_t>(id);
    }
    return frames_context(owner.find("frames"), path, trace);
  }

  // The stack of a live block as 2.0 records it: its "history"
  // entry for the allocation at its address (of the requested size, where
  // the block records one; the last such), else 0.
  std::uint32_t history_context(const Value& b, const BlockInfo& block, const std::string& path,
                                Trace& trace) {
    const Value* history = b.find("history");
    if (history == nullptr || history->kind == Kind::none) return 0;
    const auto& entries = list(*history, path + ".history");
    std::uint32_t found = 0;
    for (std::size_t k = 0; k < entries.size(); ++k) {
      const std::string hpath = fmt::format("{}.history[{}]", path, k);
      const Value& h = *entries[k];
      if (h.kind != Kind::dict) fail(hpath, fmt::format("expected a dict, got {}", to_string(h.kind)));
      const std::uint64_t addr = unsigned_int(h, "addr", hpath);
      const std::uint64_t size = unsigned_int(h, "real_size", hpath);
      if (addr == block.address && (block.requested_size == 0 || size == block.requested_size)) {
        found = frames_context(h.find("frames"), hpath, trace);
      }
    }
    return found;
  }

  // The context of a frames list (null or None: 0).
  std::uint32_t frames_context(const Value* frames, const std::string& path, Trace& trace) {
    if (!with_contexts_ || frames == nullptr || frames->kind == Kind::none) return 0;
    // An empty stack (a recording without stacks: each entry has its own
    // empty list) has no context, and is not remembered.
    if ((frames->kind == Kind::list || frames->kind == Kind::tuple) && frames->items.empty() &&
        frames->taken_runs.empty()) {
      return 0;
    }
    if (auto it = by_list_.find(frames); it != by_list_.end()) return it->second;
    const auto& items = list(*frames, path + ".frames");
    if (items.size() > kMostFrames) {
      fail(path + ".frames",
           fmt::format("{} frames in one stack; a stack PyTorch records is far shorter (at most "
                       "{} are read)",
                       items.size(), kMostFrames));
    }
    std::uint32_t id = 0;
    if (!items.empty()) {
      Context c;
      for (std::size_t i = 0; i < items.size(); ++i) {
        const std::string fpath = fmt::format("{}.frames[{}]", path, i);
        Frame frame = cached_frame(*items[i], fpath);
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
        count_context(c, path + ".frames");
        it->second = static_cast<std::uint32_t>(trace.final_state.contexts.size());
        trace.final_state.contexts.push_back(std::move(c));
      }
      id = it->second;
    }
    by_list_.emplace(frames, id);
    return id;
  }

  // Bounds what the stacks may cost: a pickle shares values through its memo,
  // so a few bytes can name a stack or a string again and again; each stack
  // kept is copied out. Within kContextBase plus kContextPerByte times the
  // input, far beyond what PyTorch's own snapshots take.
  static constexpr std::size_t kMostFrames = 100'000;
  static constexpr std::size_t kLongestText = std::size_t{1} << 20;
  static constexpr std::size_t kContextBase = std::size_t{256} << 20;
  static constexpr std::size_t kContextPerByte = 32;
  // The readers of one file's devices share one budget.
  struct ContextBudget {
    std::size_t limit = 0;
    std::size_t used = 0;
    explicit ContextBudget(std::size_t input_bytes)
        : limit(kContextBase + kContextPerByte * input_bytes) {}
  };
  void share_budget(ContextBudget* budget) { budget_ = budget; }
  static std::size_t bytes_of(const Frame& f) {
    return sizeof(Frame) + f.filename.size() + f.name.size();
  }
  void count_context(const Context& c, const std::string& path) {
    std::size_t bytes = sizeof(Context);
    for (const Frame& f : c.frames) bytes += bytes_of(f);
    for (const std::string& a : c.annotations) bytes += sizeof(std::string) + a.size();
    count(bytes, path);
  }
  void count(std::size_t bytes, const std::string& path) {
    if (budget_ == nullptr) return;
    budget_->used += bytes;
    if (budget_->used > budget_->limit) {
      fail(path,
           fmt::format("the stacks read so far take {} bytes, more than {} for a file of this "
                       "size: the file repeats shared stacks or strings far beyond any "
                       "snapshot PyTorch writes",
                       budget_->used, budget_->limit));
    }
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

  // A frame read once per distinct frame value (PyTorch shares each frame's
  // dict among the stacks that hold it).
  Frame cached_frame(const Value& f, const std::string& fpath) {
    if (auto it = frames_read_.find(&f); it != frames_read_.end()) return it->second;
    Frame out = frame(f, fpath);
    count(bytes_of(out), fpath);
    frames_read_.emplace(&f, out);
    return out;
  }

  // A frame: PyTorch writes name, filename and line; a frame without file
  // or line information (native frames of some builds) is "??", line 0.
  Frame frame(const Value& f, const std::string& fpath) const {
    if (f.kind != Kind::dict) fail(fpath, fmt::format("expected a dict, got {}", to_string(f.kind)));
    Frame frame;
    frame.filename = std::string(optional_text(f, "filename", fpath));
    if (frame.filename.empty() && f.find("filename") == nullptr) frame.filename = "??";
    frame.name = std::string(optional_text(f, "name", fpath));
    if (frame.filename.size() > kLongestText || frame.name.size() > kLongestText) {
      fail(fpath, fmt::format("a name of {} bytes; PyTorch's file and function names are far "
                              "shorter (at most {} are read)",
                              std::max(frame.filename.size(), frame.name.size()), kLongestText));
    }
    if (const Value* l = f.find("line"); l != nullptr && l->kind != Kind::none) {
      const std::int64_t line = as_integer(*l, fpath + ".line");
      if (line < std::numeric_limits<int>::min() || line > std::numeric_limits<int>::max()) {
        fail(fpath + ".line", fmt::format("out of range ({})", line));
      }
      frame.line = static_cast<int>(line);
    }
    return frame;
  }

  // One entry of external_annotations ({stage, name, device, time_us}).
  void read_external_annotation(const Value& a, const std::string& path, Trace& trace) const {
    TraceAnnotation note;
    note.event = kUnplaced;
    note.stage = std::string(optional_text(a, "stage", path));
    note.name = std::string(optional_text(a, "name", path));
    if (const Value* t = a.find("time_us"); t != nullptr && t->kind != Kind::none) {
      note.time_us = as_integer(*t, path + ".time_us");
    }
    trace.annotations.push_back(std::move(note));
  }

  // The context of an event the hook took (its context holds its frames
  // list's id + 1), each list read once.
  std::uint32_t taken_context(std::uint32_t list, const std::string& dpath, std::size_t i,
                              Trace& trace) {
    if (list == 0 || !with_contexts_) return 0;
    if (list_contexts_.empty()) list_contexts_.assign(flat_->frames_lists(), kNoContext);
    std::uint32_t& id = list_contexts_[list - 1];
    if (id == kNoContext) {
      id = frames_context(flat_->frames_list(list - 1), fmt::format("{}[{}]", dpath, i), trace);
    }
    return id;
  }

  void read_events(const Value& list_value, const std::string& dpath, Trace& trace) {
    const auto& events = list_items(list_value, dpath);
    trace.events.reserve(events_size(list_value, dpath));
    std::size_t i = 0;  // the entry's index in the list
    std::size_t next_run = 0;
    std::string path;
    for (std::size_t item = 0; item <= events.size(); ++item) {
      // The runs of entries the hook took (checked there) before this item.
      for (; next_run < list_value.taken_runs.size() &&
             list_value.taken_runs[next_run].at == item;
           ++next_run) {
        const auto& run = list_value.taken_runs[next_run];
        const std::size_t first = trace.events.size();
        flat_->move_run(static_cast<std::size_t>(run.first), run.count, trace.events, hand_back_);
        for (std::size_t k = first; k < trace.events.size(); ++k, ++i) {
          TraceEvent& ev = trace.events[k];
          ev.context = taken_context(ev.context, dpath, i, trace);
        }
      }
      if (item == events.size()) break;
      const Value& e = *events[item];
      if (e.kind == Kind::taken && flat_ != nullptr) {  // checked by the decoder's hook
        TraceEvent ev = flat_->at(static_cast<std::size_t>(e.integer));
        ev.context = taken_context(ev.context, dpath, i++, trace);
        trace.events.push_back(ev);
        continue;
      }
      const std::size_t this_entry = i++;
      // "device_traces[d][i]", into one buffer that keeps its capacity.
      path.assign(dpath);
      path += '[';
      char digits[24];
      path.append(digits, std::to_chars(digits, digits + sizeof(digits), this_entry).ptr);
      path += ']';
      const std::string& name = text(e, "action", path);
      note_unknown(e, kEventKeys, "device_traces[][].", trace);
      const std::optional<TraceAction> a = action_of(name);
      std::int64_t time_us = 0;
      if (const Value* t = e.find("time_us"); t != nullptr && t->kind != Kind::none) {
        time_us = t->kind == Kind::integer ? t->integer : as_integer(*t, path + ".time_us");
      }
      (void)optional_text(e, "compile_context", path);
      if (const Value* m = e.find("user_metadata");
          m != nullptr && m->kind != Kind::string && m->kind != Kind::none &&
          m->kind != Kind::dict) {
        fail(path + ".user_metadata", fmt::format("expected str, got {}", to_string(m->kind)));
      }
      if (!a) {
        if (name == "user_defined") {
          TraceAnnotation note;
          note.name = annotation_name(e, path);
          note.time_us = time_us;
          note.event = trace.events.size();
          trace.annotations.push_back(std::move(note));
        } else {
          ++trace.skipped_actions[name];
        }
        continue;
      }
      TraceEvent ev;
      ev.action = *a;
      if (*a == TraceAction::oom) {
        // PyTorch writes the device's free memory in place of an address.
        ev.addr = e.find("device_free") != nullptr ? unsigned_int(e, "device_free", path)
                  : e.find("addr") != nullptr      ? unsigned_int(e, "addr", path)
                                                   : 0;
      } else {
        ev.addr = unsigned_int(e, "addr", path);
      }
      ev.size = unsigned_int(e, "size", path);
      ev.stream = unsigned_int(e, "stream", path);
      ev.time_us = time_us;
      ev.context = context(e, path, trace);
      if (const Value* pool = e.find("pool_id"); pool != nullptr && pool->kind != Kind::none) {
        const auto& ids = list(*pool, path + ".pool_id");
        if (ids.size() != 2 || ids[0]->kind != Kind::integer || ids[1]->kind != Kind::integer ||
            ids[0]->integer < 0 || ids[1]->integer < 0) {
          fail(path + ".pool_id", "expected two ints that are not negative");
        }
        trace.event_pools_recorded = true;
        const PoolId id{static_cast<std::uint64_t>(ids[0]->integer), static_cast<std::uint64_t>(ids[1]->integer)};
        if (id != PoolId{0, 0}) trace.event_pools[trace.events.size()] = id;
      }
      trace.events.push_back(ev);
    }
    if (flat_ != nullptr && flat_->saw_pool_ids()) trace.event_pools_recorded = true;
  }

  // A user_defined event's name: its "name" where written, else the
  // innermost frame's function.
  std::string annotation_name(const Value& e, const std::string& path) const {
    if (std::string_view n = optional_text(e, "name", path); !n.empty()) return std::string(n);
    if (const Value* frames = e.find("frames"); frames != nullptr && frames->kind != Kind::none) {
      const auto& items = list(*frames, path + ".frames");
      if (!items.empty()) return frame(*items.front(), path + ".frames[0]").name;
    }
    return {};
  }

  // One entry of segments, for the device `trace` is of.
  void read_segment(const Value& s, const std::string& path, Trace& trace) {
    const int device = trace.device;
    note_unknown(s, kSegmentKeys, "segments[].", trace);
    SegmentInfo seg;
    seg.device = device;
    seg.address = unsigned_int(s, "address", path);
    seg.total_size = unsigned_int(s, "total_size", path);
    seg.stream = unsigned_int(s, "stream", path);
    const std::string& type = text(s, "segment_type", path);
    if (type != "large" && type != "small")
      fail(path + ".segment_type", fmt::format("'{}' is neither large nor small", type));
    seg.is_large = type == "large";
    if (const Value* x = s.find("is_expandable"); x != nullptr && x->kind != Kind::none) {
      if (x->kind != Kind::boolean && x->kind != Kind::integer) {
        fail(path + ".is_expandable", fmt::format("expected bool, got {}", to_string(x->kind)));
      }
      seg.is_expandable = x->kind == Kind::boolean ? x->boolean : x->integer != 0;
    }
    const auto& blocks = list(field(s, "blocks", path), path + ".blocks");
    DevicePtr cursor = seg.address;
    for (std::size_t j = 0; j < blocks.size(); ++j) {
      const std::string bpath = fmt::format("{}.blocks[{}]", path, j);
      const Value& b = *blocks[j];
      if (b.kind != Kind::dict) fail(bpath, fmt::format("expected a dict, got {}", to_string(b.kind)));
      note_unknown(b, kBlockKeys, "segments[].blocks[].", trace);
      BlockInfo block;
      block.address = b.find("address") ? unsigned_int(b, "address", bpath) : cursor;
      block.size = unsigned_int(b, "size", bpath);
      block.requested_size =
          b.find("requested_size") ? unsigned_int(b, "requested_size", bpath) : 0;
      const std::string& state = text(b, "state", bpath);
      if (state == "active_allocated") {
        block.state = BlockState::active_allocated;
      } else if (state == "active_pending_free" || state == "active_awaiting_free") {
        block.state = BlockState::active_pending_free;
      } else if (state == "inactive") {
        block.state = BlockState::inactive;
      } else {
        fail(bpath + ".state", fmt::format("unknown block state '{}'", state));
      }
      block.context = context(b, bpath, trace);
      if (block.context == 0 && block.state != BlockState::inactive) {
        block.context = history_context(b, block, bpath, trace);
      }
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
    if (const Value* pool = s.find("segment_pool_id"); pool != nullptr && pool->kind != Kind::none) {
      const auto& ids = list(*pool, path + ".segment_pool_id");
      if (ids.size() != 2 || ids[0]->kind != Kind::integer || ids[1]->kind != Kind::integer) {
        fail(path + ".segment_pool_id", "expected two ints");
      }
      seg.pool_id = {static_cast<std::uint64_t>(ids[0]->integer),
                     static_cast<std::uint64_t>(ids[1]->integer)};
    }
    // reservoir's native_paged segments: the bytes with memory behind them.
    if (s.find("reservoir_backed_size")) {
      const std::uint64_t backed = unsigned_int(s, "reservoir_backed_size", path);
      if (backed > seg.total_size) {
        fail(path + ".reservoir_backed_size",
             fmt::format("{} bytes backed in a segment of {}", backed, seg.total_size));
      }
      trace.final_state.backed_bytes[seg.address] = backed;
    }
    trace.final_state.segments.push_back(std::move(seg));
  }

  // The number of devices the snapshot holds traces of.
  std::size_t device_count(const Value& root) const {
    if (root.kind != Kind::dict)
      fail("top level", fmt::format("expected a dict, got {}", to_string(root.kind)));
    return device_traces(root).size();
  }

  // The snapshot's per-device lists. PyTorch numbers devices with an 8-bit
  // index; a list of more than kMostDevices is no snapshot PyTorch wrote,
  // and each device costs a trace of its own (with a count per device).
  static constexpr std::size_t kMostDevices = 1024;
  const std::vector<const Value*>& device_traces(const Value& root) const {
    const auto& traces = list(field(root, "device_traces", "top level"), "device_traces");
    if (traces.size() > kMostDevices) {
      fail("device_traces",
           fmt::format("{} device lists; PyTorch records at most one per device and numbers "
                       "devices with an 8-bit index, so no snapshot it writes has over {}",
                       traces.size(), kMostDevices));
    }
    return traces;
  }

  // A device's trace without what the snapshot lists for all devices
  // together (segments, external annotations): those come through
  // for_each_device_entry, then finish().
  Trace begin(const Value& root, int device) {
    Trace trace;
    trace.name = name_;
    trace.format = to_string(TraceFormat::pytorch_pickle);
    trace.has_addresses = true;
    if (root.kind != Kind::dict)
      fail("top level", fmt::format("expected a dict, got {}", to_string(root.kind)));
    note_unknown(root, kTopKeys, "", trace);
    if (const Value* settings = root.find("allocator_settings")) {
      read_settings(*settings, trace);
    } else {
      trace.settings_recorded = false;
    }
    if (const Value* contexts = root.find("contexts")) read_contexts(*contexts, trace);
    const auto& traces = device_traces(root);
    if (device < 0 || static_cast<std::size_t>(device) >= traces.size()) {
      fail("device_traces",
           fmt::format("no device {} (the snapshot has {})", device, traces.size()));
    }
    trace.device = device;
    trace.device_count = traces.size();
    for (std::size_t d = 0; d < traces.size(); ++d) {
      trace.device_events.push_back(events_size(*traces[d], fmt::format("device_traces[{}]", d)));
    }
    read_events(*traces[static_cast<std::size_t>(device)],
                fmt::format("device_traces[{}]", device), trace);
    return trace;
  }

  void finish(Trace& trace) const {
    place_annotations(trace);
    std::sort(trace.final_state.segments.begin(), trace.final_state.segments.end(),
              [](const SegmentInfo& a, const SegmentInfo& b) { return a.address < b.address; });
    trace.port = port_of(trace);
  }

  Trace read(const Value& root, int device) {
    Trace trace = begin(root, device);
    Reader* self = this;
    for_each_device_entry(root, {&self, 1}, {&trace, 1});
    finish(trace);
    return trace;
  }

  // The snapshot's lists of every device's entries (segments, external
  // annotations), walked once: each entry goes to the reader and trace of
  // its device (`traces[k]` is of device traces[k].device); an entry that
  // names no device goes to each of them.
  void for_each_device_entry(const Value& root, std::span<Reader* const> readers,
                             std::span<Trace> traces) const {
    auto walk = [&](const Value& list_value, const char* key, auto&& read_one) {
      const auto& items = list(list_value, key);
      for (std::size_t i = 0; i < items.size(); ++i) {
        const std::string path = fmt::format("{}[{}]", key, i);
        const Value& item = *items[i];
        if (item.kind != Kind::dict) {
          fail(path, fmt::format("expected a dict, got {}", to_string(item.kind)));
        }
        std::optional<std::int64_t> device;
        if (const Value* d = item.find("device"); d != nullptr && d->kind != Kind::none) {
          device = as_integer(*d, path + ".device");
        }
        for (std::size_t k = 0; k < traces.size(); ++k) {
          if (!device || *device == traces[k].device) read_one(*readers[k], item, path, traces[k]);
        }
      }
    };
    if (const Value* external = root.find("external_annotations");
        external != nullptr && external->kind != Kind::none) {
      walk(*external, "external_annotations",
           [](Reader& r, const Value& a, const std::string& path, Trace& t) {
             r.read_external_annotation(a, path, t);
           });
    }
    walk(field(root, "segments", "top level"), "segments",
         [](Reader& r, const Value& seg, const std::string& path, Trace& t) {
           r.read_segment(seg, path, t);
         });
  }

 private:
  // Each annotation before the first event recorded after it (by time for
  // the external ones, which are kept apart from the events).
  static void place_annotations(Trace& trace) {
    std::stable_sort(trace.annotations.begin(), trace.annotations.end(),
                     [](const TraceAnnotation& a, const TraceAnnotation& b) {
                       return a.time_us < b.time_us;
                     });
    std::size_t k = 0;
    for (TraceAnnotation& a : trace.annotations) {
      if (a.event != kUnplaced) continue;  // a user_defined event, placed where it was recorded
      while (k < trace.events.size() &&
             (trace.events[k].time_us == 0 || trace.events[k].time_us < a.time_us)) {
        ++k;
      }
      a.event = k;
    }
  }

  // torch_npu (Ascend) writes PyTorch's format from its own allocator; its
  // stacks name it.
  static std::string port_of(const Trace& trace) {
    for (const Context& c : trace.final_state.contexts) {
      for (const Frame& f : c.frames) {
        if (f.filename.find("torch_npu") != std::string::npos ||
            f.name.find("NPUCachingAllocator") != std::string::npos ||
            f.name.find("c10_npu::") != std::string::npos) {
          return "npu";
        }
      }
    }
    return "cuda";
  }

  std::string name_;
  static constexpr std::uint32_t kNoContext = std::numeric_limits<std::uint32_t>::max();
  FlatEvents* flat_ = nullptr;
  bool with_contexts_ = true;  // read stacks (the tools that show them)
  bool hand_back_ = false;     // flat_'s events are read once: its blocks go as they are read
  std::vector<std::uint32_t> list_contexts_;  // frames list id -> context
  std::unordered_map<const Value*, Frame> frames_read_;
  ContextBudget* budget_ = nullptr;  // not owned; null: unbounded
  std::unordered_map<std::string, std::uint32_t> context_ids_;
  std::unordered_map<const Value*, std::uint32_t> by_list_;  // frames list -> context
};

// The action of an event; nullopt for those that carry no allocator work
// (user_defined annotations) or that the reader does not know.
std::optional<TraceAction> action_of(std::string_view a) {
  if (a == "alloc") return TraceAction::alloc;
  if (a == "free_requested") return TraceAction::free_requested;
  if (a == "free_completed") return TraceAction::free_completed;
  if (a == "segment_alloc") return TraceAction::segment_alloc;
  if (a == "segment_free") return TraceAction::segment_free;
  if (a == "segment_map") return TraceAction::segment_map;
  if (a == "segment_unmap") return TraceAction::segment_unmap;
  if (a == "snapshot") return TraceAction::snapshot;
  if (a == "oom") return TraceAction::oom;
  if (a == "annotate") return TraceAction::annotate;
  return std::nullopt;
}

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

namespace {

pickle::Document decode_snapshot(std::span<const std::uint8_t> data, const std::string& name,
                                 FlatEvents& flat, const ReadOptions& options) {
  const pickle::FlatDictHook hook = [&](std::span<const pickle::FlatItem> items) {
    return flat.take(items);
  };
  pickle::DecodeOptions decode;
  decode.hook = &hook;
  decode.consumed = options.consumed;
  try {
    return pickle::decode(data, decode);
  } catch (const TraceError& e) {
    throw TraceError(fmt::format("snapshot {}: {}", name, e.what()));
  }
}

// Whether the events the hook took are each read at most once when the
// devices in `devices` are read (each device's list a run of its own, no
// taken entry held anywhere else), so that their blocks can go as they are
// read. False for anything unusual (the reader then checks it as usual).
bool read_once(const pickle::Document& doc, const std::vector<std::size_t>& devices) {
  if (doc.taken_values() != 0 || doc.root().kind != Kind::dict) return false;
  const Value* traces = doc.root().find("device_traces");
  if (traces == nullptr || traces->kind != Kind::list || !traces->taken_runs.empty()) return false;
  std::vector<std::pair<std::int64_t, std::size_t>> runs;
  for (const std::size_t d : devices) {
    if (d >= traces->items.size()) return false;
    for (const auto& run : traces->items[d]->taken_runs) runs.emplace_back(run.first, run.count);
  }
  std::sort(runs.begin(), runs.end());
  for (std::size_t i = 1; i < runs.size(); ++i) {
    if (runs[i - 1].first + static_cast<std::int64_t>(runs[i - 1].second) > runs[i].first) return false;
  }
  return true;
}

pickle::Document decode_json(const std::string& text, const std::string& name) {
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
  return doc;
}

std::vector<Trace> every_device(const pickle::Document& doc, const std::string& name,
                                std::size_t input_bytes, TraceFormat format,
                                FlatEvents* flat = nullptr, bool with_contexts = true) {
  const std::size_t n = Reader(name).device_count(doc.root());
  std::vector<std::size_t> all(n);
  for (std::size_t d = 0; d < n; ++d) all[d] = d;
  const bool hand_back = flat != nullptr && read_once(doc, all);
  // A reader per device (each trace interns its own contexts); the lists of
  // every device's entries are walked once for all of them.
  std::vector<Reader> readers;
  std::vector<Reader*> each;
  std::vector<Trace> out;
  if (n == 0) {
    Reader(name).fail("device_traces",
                      "the file holds no device: no segments and no device_traces entries, so "
                      "there is nothing to work on (was memory history recording when the "
                      "snapshot was taken?)");
  }
  readers.reserve(n);
  out.reserve(n);
  each.reserve(n);
  Reader::ContextBudget budget(input_bytes);
  for (std::size_t d = 0; d < n; ++d) {
    readers.emplace_back(name, flat, with_contexts, hand_back);
    readers.back().share_budget(&budget);
    out.push_back(readers.back().begin(doc.root(), static_cast<int>(d)));
  }
  for (Reader& r : readers) each.push_back(&r);
  readers.front().for_each_device_entry(doc.root(), each, out);
  for (std::size_t d = 0; d < n; ++d) {
    readers[d].finish(out[d]);
    out[d].format = to_string(format);
  }
  return out;
}

}  // namespace

Trace read_pytorch_snapshot(std::span<const std::uint8_t> data, const std::string& name,
                            int device, const ReadOptions& options) {
  FlatEvents flat;
  const pickle::Document doc = decode_snapshot(data, name, flat, options);
  const bool hand_back = device >= 0 && read_once(doc, {static_cast<std::size_t>(device)});
  Reader::ContextBudget budget(data.size());
  Reader reader(name, &flat, options.contexts, hand_back);
  reader.share_budget(&budget);
  return reader.read(doc.root(), device);
}

std::vector<Trace> read_pytorch_snapshot_devices(std::span<const std::uint8_t> data,
                                                 const std::string& name, const ReadOptions& options) {
  FlatEvents flat;
  const pickle::Document doc = decode_snapshot(data, name, flat, options);
  return every_device(doc, name, data.size(), TraceFormat::pytorch_pickle, &flat, options.contexts);
}

Trace read_snapshot_json(const std::string& text, const std::string& name, int device) {
  const pickle::Document doc = decode_json(text, name);
  Trace trace = Reader(name).read(doc.root(), device);
  trace.format = to_string(TraceFormat::snapshot_json);
  return trace;
}

std::vector<Trace> read_snapshot_json_devices(const std::string& text, const std::string& name) {
  return every_device(decode_json(text, name), name, text.size(), TraceFormat::snapshot_json);
}

}  // namespace reservoir
