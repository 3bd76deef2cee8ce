#include "reservoir/pickle.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "reservoir/errors.hpp"

namespace reservoir::pickle {

std::string_view to_string(Kind kind) noexcept {
  switch (kind) {
    case Kind::none: return "None";
    case Kind::boolean: return "bool";
    case Kind::integer: return "int";
    case Kind::floating: return "float";
    case Kind::string: return "str";
    case Kind::bytes: return "bytes";
    case Kind::list: return "list";
    case Kind::tuple: return "tuple";
    case Kind::dict: return "dict";
    case Kind::taken: return "trace entry";
  }
  return "unknown";
}

const Value* Value::find(std::string_view key) const {
  if (kind != Kind::dict) return nullptr;
  for (const auto& [k, v] : entries) {
    if (k->kind == Kind::string && k->text == key) return v;
  }
  return nullptr;
}

namespace {

// Opcodes of the supported subset.
enum Op : std::uint8_t {
  MARK = '(',
  STOP = '.',
  POP = '0',
  POP_MARK = '1',
  DUP = '2',
  NONE = 'N',
  BININT = 'J',
  BININT1 = 'K',
  BININT2 = 'M',
  BINFLOAT = 'G',
  BINUNICODE = 'X',
  BINBYTES = 'B',
  SHORT_BINBYTES = 'C',
  EMPTY_LIST = ']',
  APPEND = 'a',
  APPENDS = 'e',
  EMPTY_DICT = '}',
  SETITEM = 's',
  SETITEMS = 'u',
  EMPTY_TUPLE = ')',
  TUPLE = 't',
  BINGET = 'h',
  LONG_BINGET = 'j',
  BINPUT = 'q',
  LONG_BINPUT = 'r',
  PROTO = 0x80,
  TUPLE1 = 0x85,
  TUPLE2 = 0x86,
  TUPLE3 = 0x87,
  NEWTRUE = 0x88,
  NEWFALSE = 0x89,
  LONG1 = 0x8a,
  LONG4 = 0x8b,
  SHORT_BINUNICODE = 0x8c,
  BINUNICODE8 = 0x8d,
  BINBYTES8 = 0x8e,
  MEMOIZE = 0x94,
  FRAME = 0x95,
};

const char* refused_name(std::uint8_t op) {
  switch (op) {
    case 'c': return "GLOBAL";
    case 0x93: return "STACK_GLOBAL";
    case 'R': return "REDUCE";
    case 'b': return "BUILD";
    case 'i': return "INST";
    case 'o': return "OBJ";
    case 0x81: return "NEWOBJ";
    case 0x92: return "NEWOBJ_EX";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 0x82: return "EXT1";
    case 0x83: return "EXT2";
    case 0x84: return "EXT4";
    default: return nullptr;
  }
}

// What the decoder's stack and memo hold: a value, or a dict the hook took
// over (its index, tagged in the low bit; values are aligned).
class Ref {
 public:
  Ref() = default;
  static Ref of(const Value* v) { return Ref(reinterpret_cast<std::uintptr_t>(v)); }
  static Ref taken(std::uint64_t index) { return Ref((static_cast<std::uintptr_t>(index) << 1) | 1u); }
  bool empty() const { return bits_ == 0; }
  bool is_taken() const { return (bits_ & 1u) != 0; }
  std::uint64_t index() const { return bits_ >> 1; }
  const Value* value() const { return is_taken() ? nullptr : reinterpret_cast<const Value*>(bits_); }

 private:
  explicit Ref(std::uintptr_t bits) : bits_(bits) {}
  std::uintptr_t bits_ = 0;
};
static_assert(alignof(Value) >= 2, "Ref tags values in the low bit");

// The offset of the first byte that is not UTF-8 as Python's pickle decodes
// it ('utf-8' with 'surrogatepass': encoded surrogates are accepted), or
// the size when all of it is.
std::size_t invalid_utf8(std::span<const std::uint8_t> s) noexcept {
  std::size_t i = 0;
  while (i < s.size()) {
    const std::uint8_t c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t n = 0;
    std::uint32_t cp = 0;
    std::uint32_t least = 0;
    if ((c & 0xe0) == 0xc0) {
      n = 1, cp = c & 0x1fu, least = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2, cp = c & 0x0fu, least = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3, cp = c & 0x07u, least = 0x10000;
    } else {
      return i;
    }
    if (n > s.size() - i - 1) return i;
    for (std::size_t k = 1; k <= n; ++k) {
      if ((s[i + k] & 0xc0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3fu);
    }
    if (cp < least || cp > 0x10ffff) return i;  // overlong, or beyond Unicode
    i += n + 1;
  }
  return s.size();
}

class Decoder {
 public:
  explicit Decoder(std::span<const std::uint8_t> data, const DecodeOptions& options = {})
      : data_(data), hook_(options.hook), consumed_(options.consumed) {}

  Document run() {
    while (true) {
      if (pos_ >= data_.size()) fail(pos_, "truncated: the pickle ends before its STOP opcode");
      const std::size_t at = pos_;
      const std::uint8_t op = data_[pos_++];
      if (op == STOP) {
        if (!marks_.empty()) fail(at, "STOP with an unclosed MARK");
        if (stack_.size() != 1) {
          fail(at, fmt::format("STOP with {} values on the stack (expected 1)", stack_.size()));
        }
        if (pos_ != data_.size()) {
          fail(pos_, fmt::format("{} unexpected bytes after STOP", data_.size() - pos_));
        }
        doc_.set_root(value(stack_.back()));
        return std::move(doc_);
      }
      step(at, op);
      if (frame_end_ != 0) [[likely]] {
        // Python's pickler ends a frame between opcodes: one that runs past
        // its frame's end means bytes were cut out of (or added to) it.
        if (pos_ > frame_end_) {
          fail(at, fmt::format("this opcode ends at byte {}, past the end of its FRAME at byte "
                               "{}: bytes are missing from the frame, or were added",
                               pos_, frame_end_));
        }
        if (pos_ == frame_end_) frame_end_ = 0;
      }
      if (consumed_ && pos_ - reported_ >= kReportEvery) {
        reported_ = pos_;
        consumed_(at);
      }
    }
  }

 private:
  static constexpr std::size_t kReportEvery = std::size_t{16} << 20;

  [[noreturn]] void fail(std::size_t at, const std::string& what) const {
    throw TraceError(fmt::format("pickle: byte {}: {}", at, what));
  }

  std::span<const std::uint8_t> take(std::size_t n, std::size_t at, const char* what) {
    if (n > data_.size() - pos_) {
      fail(at,
           fmt::format("truncated: {} needs {} bytes, {} remain", what, n, data_.size() - pos_));
    }
    auto out = data_.subspan(pos_, n);
    pos_ += n;
    return out;
  }

  std::uint64_t little(std::size_t n, std::size_t at, const char* what) {
    auto bytes = take(n, at, what);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t{bytes[i]} << (8 * i);
    return v;
  }

  // A value for a reference: a taken dict becomes a Kind::taken value.
  const Value* value(Ref r) {
    if (!r.is_taken()) return r.value();
    Value* v = doc_.make(Kind::taken);
    v->integer = static_cast<std::int64_t>(r.index());
    doc_.count_taken_value();
    return v;
  }

  void push(const Value* v) { stack_.push_back(Ref::of(v)); }

  Ref pop(std::size_t at, const char* what) {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) {
      fail(at, fmt::format("{} needs a value but the stack is empty", what));
    }
    const Ref r = stack_.back();
    stack_.pop_back();
    return r;
  }

  std::size_t pop_mark(std::size_t at, const char* what) {
    if (marks_.empty()) fail(at, fmt::format("{} without a MARK", what));
    std::size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }

  // The container a value goes into, checked: its kind, and not a list the
  // decoder keeps once per content.
  Value* container(Ref r, std::size_t at, Kind kind, const char* what) const {
    const Kind got = r.is_taken() ? Kind::taken : r.value()->kind;
    if (got != kind) {
      fail(at, fmt::format("{} applied to a {}, expected a {}", what, to_string(got),
                           to_string(kind)));
    }
    Value* v = const_cast<Value*>(r.value());
    if (v->shared_by_content) {
      fail(at, fmt::format("{} extends a list of stack frames after it was written (no pickler "
                           "writes this)",
                           what));
    }
    return v;
  }

  Value* top_container(std::size_t at, Kind kind, const char* what) {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) {
      fail(at, fmt::format("{} needs a {} on the stack", what, to_string(kind)));
    }
    return container(stack_.back(), at, kind, what);
  }

  // Appends to a list: a taken dict joins the list's runs of them.
  void append(Value* list, Ref r) {
    if (!r.is_taken()) {
      list->items.push_back(r.value());
      return;
    }
    const auto index = static_cast<std::int64_t>(r.index());
    auto& runs = list->taken_runs;
    if (!runs.empty() && runs.back().at == list->items.size() &&
        runs.back().first + static_cast<std::int64_t>(runs.back().count) == index) {
      ++runs.back().count;
      return;
    }
    runs.push_back({list->items.size(), index, 1});
  }

  void push_string(Kind kind, std::size_t n, std::size_t at, const char* what) {
    if (n > data_.size()) fail(at, fmt::format("{} length {} exceeds the file", what, n));
    auto bytes = take(n, at, what);
    if (kind == Kind::string) {
      if (const std::size_t bad = invalid_utf8(bytes); bad != bytes.size()) {
        fail(at, fmt::format("{}: a string of {} bytes that is not UTF-8 (byte {} of it)", what, n,
                             bad));
      }
    }
    Value* v = doc_.make(kind);
    v->text.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    push(v);
  }

  void push_int(std::int64_t i) {
    Value* v = doc_.make(Kind::integer);
    v->integer = i;
    push(v);
  }

  void push_long(std::size_t n, std::size_t at) {
    if (n > 9) fail(at, fmt::format("integer of {} bytes does not fit 64 bits", n));
    auto bytes = take(n, at, "LONG");
    if (n == 9) {
      // Python writes values in [2^63, 2^64) with a ninth, zero sign byte.
      std::uint64_t u = 0;
      for (std::size_t i = 0; i < 8; ++i) u |= std::uint64_t{bytes[i]} << (8 * i);
      if (bytes[8] != 0 || u < (std::uint64_t{1} << 63)) {
        fail(at, "integer of 9 bytes does not fit 64 bits");
      }
      push_int(static_cast<std::int64_t>(u));
      const_cast<Value*>(stack_.back().value())->above_int64 = true;
      return;
    }
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t{bytes[i]} << (8 * i);
    if (n > 0 && n < 8 && (bytes[n - 1] & 0x80)) v |= ~std::uint64_t{0} << (8 * n);  // sign-extend
    push_int(static_cast<std::int64_t>(v));
  }

  void memo_put(std::size_t index, std::size_t at) {
    if (stack_.empty()) fail(at, "memo store with an empty stack");
    if (index > data_.size()) fail(at, fmt::format("memo index {} is implausible", index));
    if (memo_.size() <= index) memo_.resize(index + 1);
    memo_[index] = stack_.back();
  }

  void memo_get(std::size_t index, std::size_t at) {
    if (index >= memo_.size() || memo_[index].empty()) {
      fail(at, fmt::format("memo index {} was never stored", index));
    }
    stack_.push_back(memo_[index]);
  }

  // A list of stack frames read in place, kept once per distinct content.
  const Value* shared_list(std::span<const Value* const> refs) {
    std::uint64_t h = 0x9e3779b97f4a7c15u ^ refs.size();
    for (const Value* r : refs) {
      h ^= reinterpret_cast<std::uintptr_t>(r) + 0x9e3779b97f4a7c15u + (h << 6) + (h >> 2);
    }
    auto [lo, hi] = lists_.equal_range(h);
    for (auto it = lo; it != hi; ++it) {
      const auto& items = it->second->items;
      if (std::equal(items.begin(), items.end(), refs.begin(), refs.end())) return it->second;
    }
    Value* list = doc_.make(Kind::list);
    list->items.assign(refs.begin(), refs.end());
    list->shared_by_content = true;
    lists_.emplace(h, list);
    return list;
  }

  // EMPTY_DICT MEMOIZE MARK (key value)* SETITEMS with keys from the memo
  // and values that are small ints, bools, None, from the memo, or a list
  // of values from the memo written in place (EMPTY_LIST MEMOIZE, then
  // MARK refs APPENDS, or one ref and APPEND, or nothing): read ahead
  // without making values, and offered to the hook. False (nothing changed
  // but lists kept by content) for any other shape, or when the hook leaves
  // it.
  bool flat_dict() {
    std::size_t p = pos_;
    auto byte = [&](std::size_t at) -> int { return at < data_.size() ? data_[at] : -1; };
    auto le = [&](std::size_t at, std::size_t n) {
      std::uint64_t v = 0;
      for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t{data_[at + i]} << (8 * i);
      return v;
    };
    auto memo_ref = [&](std::size_t& at) -> const Value* {
      const int op = byte(at);
      std::size_t index = 0;
      if (op == BINGET && at + 1 < data_.size()) {
        index = data_[at + 1];
        at += 2;
      } else if (op == LONG_BINGET && at + 4 < data_.size()) {
        index = le(at + 1, 4);
        at += 5;
      } else {
        return nullptr;
      }
      return index < memo_.size() ? memo_[index].value() : nullptr;
    };
    if (byte(p) != MEMOIZE || byte(p + 1) != MARK) return false;
    p += 2;
    std::array<FlatItem, 16> items;
    std::array<const Value*, 16> lists{};  // written in place, in order
    std::size_t n = 0;
    std::size_t n_lists = 0;
    while (byte(p) != SETITEMS) {
      if (n == items.size()) return false;
      FlatItem& item = items[n];
      item = FlatItem{};
      item.key = memo_ref(p);
      if (item.key == nullptr || item.key->kind != Kind::string) return false;
      const int op = byte(p);
      if (op == BININT1 && p + 1 < data_.size()) {
        item.kind = Kind::integer, item.integer = data_[p + 1], p += 2;
      } else if (op == BININT2 && p + 2 < data_.size()) {
        item.kind = Kind::integer, item.integer = static_cast<std::int64_t>(le(p + 1, 2)), p += 3;
      } else if (op == BININT && p + 4 < data_.size()) {
        item.kind = Kind::integer;
        item.integer = static_cast<std::int32_t>(le(p + 1, 4));
        p += 5;
      } else if (op == LONG1 && p + 1 < data_.size()) {
        const std::size_t len = data_[p + 1];
        if (len == 0 || len > 8 || p + 1 + len >= data_.size()) return false;
        std::uint64_t v = le(p + 2, len);
        if (len < 8 && (data_[p + 1 + len] & 0x80) != 0) v |= ~std::uint64_t{0} << (8 * len);
        item.kind = Kind::integer, item.integer = static_cast<std::int64_t>(v), p += 2 + len;
      } else if (op == NONE) {
        item.kind = Kind::none, ++p;
      } else if (op == NEWTRUE || op == NEWFALSE) {
        item.kind = Kind::boolean, item.integer = op == NEWTRUE ? 1 : 0, ++p;
      } else if (op == BINGET || op == LONG_BINGET) {
        item.ref = memo_ref(p);
        if (item.ref == nullptr) return false;
        item.kind = item.ref->kind;
      } else if (op == EMPTY_LIST && byte(p + 1) == MEMOIZE) {
        p += 2;
        refs_.clear();
        if (byte(p) == MARK) {
          ++p;
          while (byte(p) != APPENDS) {
            const Value* r = memo_ref(p);
            if (r == nullptr) return false;
            refs_.push_back(r);
          }
          ++p;
        } else if (byte(p) == BINGET || byte(p) == LONG_BINGET) {
          const Value* r = memo_ref(p);
          if (r == nullptr || byte(p) != APPEND) return false;
          refs_.push_back(r);
          ++p;
        }
        item.ref = shared_list(refs_);
        item.kind = Kind::list;
        lists[n_lists++] = item.ref;
      } else {
        return false;
      }
      ++n;
    }
    const std::int64_t taken = (*hook_)(std::span<const FlatItem>(items.data(), n));
    if (taken < 0) return false;
    stack_.push_back(Ref::taken(static_cast<std::uint64_t>(taken)));
    memo_.push_back(stack_.back());  // its MEMOIZE
    for (std::size_t i = 0; i < n_lists; ++i) memo_.push_back(Ref::of(lists[i]));
    pos_ = p + 1;  // past SETITEMS
    return true;
  }

  void make_tuple(std::size_t from) {
    Value* t = doc_.make(Kind::tuple);
    t->items.reserve(stack_.size() - from);
    for (std::size_t i = from; i < stack_.size(); ++i) t->items.push_back(value(stack_[i]));
    stack_.resize(from);
    push(t);
  }

  void step(std::size_t at, std::uint8_t op) {
    switch (op) {
      case PROTO: {
        const auto version = take(1, at, "PROTO")[0];
        if (version > 5) fail(at, fmt::format("unsupported pickle protocol {}", version));
        return;
      }
      case FRAME: {
        if (frame_end_ != 0) {
          fail(at, fmt::format("a FRAME begins {} bytes before the current frame ends (at byte "
                               "{}): bytes are missing from that frame, or were added",
                               frame_end_ - at, frame_end_));
        }
        const std::uint64_t n = little(8, at, "FRAME");
        if (n > data_.size() - pos_) {
          fail(at, fmt::format("truncated: the FRAME holds {} bytes, {} remain", n,
                               data_.size() - pos_));
        }
        if (n != 0) frame_end_ = pos_ + n;
        return;
      }
      case MARK: marks_.push_back(stack_.size()); return;
      case POP: pop(at, "POP"); return;
      case POP_MARK: stack_.resize(pop_mark(at, "POP_MARK")); return;
      case DUP: {
        const Ref r = pop(at, "DUP");
        stack_.push_back(r);
        stack_.push_back(r);
        return;
      }
      case NONE: push(doc_.make(Kind::none)); return;
      case NEWTRUE:
      case NEWFALSE: {
        Value* v = doc_.make(Kind::boolean);
        v->boolean = op == NEWTRUE;
        push(v);
        return;
      }
      case BININT: push_int(static_cast<std::int32_t>(little(4, at, "BININT"))); return;
      case BININT1: push_int(static_cast<std::int64_t>(little(1, at, "BININT1"))); return;
      case BININT2: push_int(static_cast<std::int64_t>(little(2, at, "BININT2"))); return;
      case LONG1: push_long(little(1, at, "LONG1"), at); return;
      case LONG4: push_long(little(4, at, "LONG4"), at); return;
      case BINFLOAT: {
        auto b = take(8, at, "BINFLOAT");
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i)
          bits = (bits << 8) | b[static_cast<std::size_t>(i)];  // big-endian
        Value* v = doc_.make(Kind::floating);
        v->floating = std::bit_cast<double>(bits);
        push(v);
        return;
      }
      case SHORT_BINUNICODE:
        push_string(Kind::string, little(1, at, "SHORT_BINUNICODE"), at, "SHORT_BINUNICODE");
        return;
      case BINUNICODE:
        push_string(Kind::string, little(4, at, "BINUNICODE"), at, "BINUNICODE");
        return;
      case BINUNICODE8:
        push_string(Kind::string, little(8, at, "BINUNICODE8"), at, "BINUNICODE8");
        return;
      case SHORT_BINBYTES:
        push_string(Kind::bytes, little(1, at, "SHORT_BINBYTES"), at, "SHORT_BINBYTES");
        return;
      case BINBYTES: push_string(Kind::bytes, little(4, at, "BINBYTES"), at, "BINBYTES"); return;
      case BINBYTES8: push_string(Kind::bytes, little(8, at, "BINBYTES8"), at, "BINBYTES8"); return;
      case EMPTY_LIST: push(doc_.make(Kind::list)); return;
      case EMPTY_DICT:
        if (hook_ == nullptr || !flat_dict()) push(doc_.make(Kind::dict));
        return;
      case EMPTY_TUPLE: push(doc_.make(Kind::tuple)); return;
      case APPEND: {
        const Ref r = pop(at, "APPEND");
        append(top_container(at, Kind::list, "APPEND"), r);
        return;
      }
      case APPENDS: {
        const std::size_t m = pop_mark(at, "APPENDS");
        if (m == 0) fail(at, "APPENDS with no list below its MARK");
        Value* list = container(stack_[m - 1], at, Kind::list, "APPENDS");
        for (std::size_t i = m; i < stack_.size(); ++i) append(list, stack_[i]);
        stack_.resize(m);
        return;
      }
      case SETITEM: {
        const Ref value_ref = pop(at, "SETITEM");
        const Ref key = pop(at, "SETITEM");
        Value* dict = top_container(at, Kind::dict, "SETITEM");
        dict->entries.emplace_back(value(key), value(value_ref));
        return;
      }
      case SETITEMS: {
        const std::size_t m = pop_mark(at, "SETITEMS");
        if (m == 0) fail(at, "SETITEMS with no dict below its MARK");
        if ((stack_.size() - m) % 2 != 0) fail(at, "SETITEMS with an odd number of values");
        Value* dict = container(stack_[m - 1], at, Kind::dict, "SETITEMS");
        for (std::size_t i = m; i < stack_.size(); i += 2) {
          dict->entries.emplace_back(value(stack_[i]), value(stack_[i + 1]));
        }
        stack_.resize(m);
        return;
      }
      case TUPLE: make_tuple(pop_mark(at, "TUPLE")); return;
      case TUPLE1:
      case TUPLE2:
      case TUPLE3: {
        const std::size_t n = op - TUPLE1 + 1u;
        const std::size_t floor = marks_.empty() ? 0 : marks_.back();
        if (stack_.size() < floor + n) fail(at, fmt::format("TUPLE{} needs {} values", n, n));
        make_tuple(stack_.size() - n);
        return;
      }
      case MEMOIZE: memo_put(memo_.size(), at); return;
      case BINPUT: memo_put(little(1, at, "BINPUT"), at); return;
      case LONG_BINPUT: memo_put(little(4, at, "LONG_BINPUT"), at); return;
      case BINGET: memo_get(little(1, at, "BINGET"), at); return;
      case LONG_BINGET: memo_get(little(4, at, "LONG_BINGET"), at); return;
      default: break;
    }
    if (const char* name = refused_name(op)) {
      fail(at, fmt::format("opcode {} (0x{:02x}) builds objects and is refused: a snapshot holds "
                           "only plain data",
                           name, op));
    }
    fail(at, fmt::format("unknown or unsupported opcode 0x{:02x}", op));
  }

  std::span<const std::uint8_t> data_;
  std::size_t pos_ = 0;
  std::size_t frame_end_ = 0;  // where the current FRAME ends; 0: outside every frame
  Document doc_;
  std::vector<Ref> stack_;
  std::vector<std::size_t> marks_;
  std::vector<Ref> memo_;
  const FlatDictHook* hook_ = nullptr;
  std::function<void(std::size_t)> consumed_;
  std::size_t reported_ = 0;
  std::vector<const Value*> refs_;                           // flat_dict's scratch
  std::unordered_multimap<std::uint64_t, const Value*> lists_;  // by content hash
};

class Encoder {
 public:
  std::string run(const Value& root) {
    count_references(root, 0);
    out_.push_back(static_cast<char>(PROTO));
    out_.push_back(4);
    write(root, 0);
    out_.push_back(static_cast<char>(STOP));
    return std::move(out_);
  }

 private:
  void byte(std::uint8_t b) { out_.push_back(static_cast<char>(b)); }
  void little(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) byte(static_cast<std::uint8_t>(v >> (8 * i)));
  }

  // Values reached more than once are written once and then fetched from
  // the memo, as Python's pickler does for shared objects.
  void count_references(const Value& v, int depth) {
    if (depth > 10000) throw TraceError("pickle encode: value nests too deeply (cycle?)");
    if (++references_[&v] > 1) return;
    for (const Value* item : v.items) count_references(*item, depth + 1);
    for (const auto& [k, item] : v.entries) {
      count_references(*k, depth + 1);
      count_references(*item, depth + 1);
    }
  }

  // Fetches a value written before; false when it must be written now.
  bool fetch(const Value& v) {
    const auto it = memo_.find(&v);
    if (it == memo_.end()) return false;
    if (it->second < 256) {
      byte(BINGET);
      little(it->second, 1);
    } else {
      byte(LONG_BINGET);
      little(it->second, 4);
    }
    return true;
  }
  // Stores the value just pushed in the memo when it is shared.
  void remember(const Value& v) {
    if (references_[&v] < 2) return;
    byte(MEMOIZE);
    memo_.emplace(&v, memo_.size());
  }

  void write(const Value& v, int depth) {
    if (depth > 10000) throw TraceError("pickle encode: value nests too deeply (cycle?)");
    const bool shareable = v.kind == Kind::string || v.kind == Kind::bytes ||
                           v.kind == Kind::list || v.kind == Kind::dict;
    if (shareable && fetch(v)) return;
    switch (v.kind) {
      case Kind::taken:
        throw TraceError("pickle encode: a dict taken over by a decode hook has no contents");
      case Kind::none: byte(NONE); return;
      case Kind::boolean: byte(v.boolean ? NEWTRUE : NEWFALSE); return;
      case Kind::integer: {
        const std::int64_t i = v.integer;
        if (v.above_int64) {
          byte(LONG1);
          byte(9);
          little(static_cast<std::uint64_t>(i), 8);
          byte(0);
        } else if (i >= 0 && i < 256) {
          byte(BININT1);
          little(static_cast<std::uint64_t>(i), 1);
        } else if (i >= 0 && i < 65536) {
          byte(BININT2);
          little(static_cast<std::uint64_t>(i), 2);
        } else if (i >= std::numeric_limits<std::int32_t>::min() &&
                   i <= std::numeric_limits<std::int32_t>::max()) {
          byte(BININT);
          little(static_cast<std::uint32_t>(static_cast<std::int32_t>(i)), 4);
        } else {
          // Shortest two's-complement little-endian form, as Python writes it.
          int n = 8;
          while (n > 1) {
            const std::int64_t shifted = i >> (8 * (n - 1) - 1);
            if (shifted != 0 && shifted != -1) break;
            --n;
          }
          byte(LONG1);
          byte(static_cast<std::uint8_t>(n));
          little(static_cast<std::uint64_t>(i), n);
        }
        return;
      }
      case Kind::floating: {
        byte(BINFLOAT);
        const auto bits = std::bit_cast<std::uint64_t>(v.floating);
        for (int i = 7; i >= 0; --i) byte(static_cast<std::uint8_t>(bits >> (8 * i)));
        return;
      }
      case Kind::string:
      case Kind::bytes: {
        const bool str = v.kind == Kind::string;
        if (v.text.size() < 256) {
          byte(str ? SHORT_BINUNICODE : SHORT_BINBYTES);
          little(v.text.size(), 1);
        } else {
          byte(str ? BINUNICODE : BINBYTES);
          little(v.text.size(), 4);
        }
        out_ += v.text;
        remember(v);
        return;
      }
      case Kind::list: {
        if (!v.taken_runs.empty()) {
          throw TraceError("pickle encode: a list of dicts taken over by a decode hook has no contents");
        }
        byte(EMPTY_LIST);
        remember(v);
        for (std::size_t i = 0; i < v.items.size(); i += 1000) {
          byte(MARK);
          for (std::size_t j = i; j < std::min(v.items.size(), i + 1000); ++j) {
            write(*v.items[j], depth + 1);
          }
          byte(APPENDS);
        }
        return;
      }
      case Kind::tuple: {
        if (v.items.empty()) {
          byte(EMPTY_TUPLE);
          return;
        }
        if (v.items.size() > 3) byte(MARK);
        for (const Value* item : v.items) write(*item, depth + 1);
        byte(v.items.size() > 3 ? static_cast<std::uint8_t>(TUPLE)
                                : static_cast<std::uint8_t>(TUPLE1 + v.items.size() - 1));
        return;
      }
      case Kind::dict: {
        byte(EMPTY_DICT);
        remember(v);
        for (std::size_t i = 0; i < v.entries.size(); i += 1000) {
          byte(MARK);
          for (std::size_t j = i; j < std::min(v.entries.size(), i + 1000); ++j) {
            write(*v.entries[j].first, depth + 1);
            write(*v.entries[j].second, depth + 1);
          }
          byte(SETITEMS);
        }
        return;
      }
    }
  }

  std::string out_;
  std::unordered_map<const Value*, std::size_t> references_;
  std::unordered_map<const Value*, std::size_t> memo_;
};

}  // namespace

Document decode(std::span<const std::uint8_t> data) {
  return Decoder(data).run();
}

Document decode(std::span<const std::uint8_t> data, const FlatDictHook& hook) {
  DecodeOptions options;
  options.hook = &hook;
  return Decoder(data, options).run();
}

Document decode(std::span<const std::uint8_t> data, const DecodeOptions& options) {
  return Decoder(data, options).run();
}

std::string encode(const Value& root) {
  return Encoder().run(root);
}

}  // namespace reservoir::pickle
