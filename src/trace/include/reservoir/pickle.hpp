// A small, strict codec for the subset of Python's pickle format (protocols 2
// to 4) that holds plain data: None, bool, int (64-bit), float, str, bytes,
// list, tuple and dict. Integers are 64-bit (signed, or unsigned up to 2^64 - 1). PyTorch's memory
// snapshots use nothing else. Opcodes that build objects (GLOBAL, REDUCE, BUILD, ...) are refused:
// reading a snapshot never runs code.
//
// Why our own: no packaged C++ library reads pickle.
#pragma once

#include <cstdint>
#include <memory>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace reservoir::pickle {

enum class Kind : std::uint8_t {
  none,
  boolean,
  integer,
  floating,
  string,
  bytes,
  list,
  tuple,
  dict,
  // A dict decode()'s hook took over (integer: the index the hook gave it);
  // only in documents decoded with a hook.
  taken
};
std::string_view to_string(Kind kind) noexcept;

struct Value {
  Kind kind = Kind::none;
  bool boolean = false;
  std::int64_t integer = 0;
  bool above_int64 = false;  // integer holds the bits of a value in [2^63, 2^64)
  double floating = 0.0;
  std::string text;                                            // string or bytes
  std::vector<const Value*> items;                             // list or tuple
  std::vector<std::pair<const Value*, const Value*>> entries;  // dict, in insertion order
  // A list's dicts that a decode hook took over, in runs of consecutive
  // hook indices: run r stands before items[r.at] (after every item when
  // at == items.size()), in place of its dicts. Such a list holds no value
  // for a taken dict: its items are the rest of its contents.
  struct TakenRun {
    std::size_t at = 0;
    std::int64_t first = 0;  // the hook's index of its first dict
    std::size_t count = 0;
  };
  std::vector<TakenRun> taken_runs;
  // A list of stack frames the decoder read inside a taken dict and keeps
  // once per distinct content (equal lists are one value): it refuses to
  // extend it later, which no pickler does.
  bool shared_by_content = false;

  // Dict lookup by string key; nullptr when absent or not a dict.
  const Value* find(std::string_view key) const;
};

// Owns every Value of one decoded pickle (values may be shared through the
// memo, and may even form cycles, so ownership is by the document).
class Document {
 public:
  const Value& root() const { return *root_; }
  Value* make(Kind kind) {
    // Values live in blocks of kBlock, so that pointers stay valid and a
    // large document makes few allocations.
    if (blocks_.empty() || used_ == kBlock) {
      blocks_.push_back(std::make_unique<Value[]>(kBlock));
      used_ = 0;
    }
    Value* v = &blocks_.back()[used_++];
    v->kind = kind;
    ++size_;
    return v;
  }
  void set_root(const Value* root) { root_ = root; }
  std::size_t size() const { return size_; }
  // Taken dicts made into Kind::taken values (held somewhere other than a
  // list of taken dicts alone); 0 for every snapshot PyTorch writes.
  std::size_t taken_values() const { return taken_values_; }
  void count_taken_value() { ++taken_values_; }

 private:
  static constexpr std::size_t kBlock = 4096;
  std::vector<std::unique_ptr<Value[]>> blocks_;
  std::size_t used_ = 0;
  std::size_t size_ = 0;
  std::size_t taken_values_ = 0;
  const Value* root_ = nullptr;
};

// Decodes a pickle. Throws TraceError with the byte offset of the problem:
// truncation, an unknown or unsupported opcode, a stack underflow, a bad memo
// reference, an integer beyond 64 bits, or bytes after STOP.
Document decode(std::span<const std::uint8_t> data);

// One item of a flat dict, as the decoder read it without making values: a
// key the memo holds, and an int, bool or None value, a value the memo holds
// (`ref`), or a list of values the memo holds written in place (a trace
// entry's stack: `ref` is then the list, kept once per distinct content).
struct FlatItem {
  const Value* key = nullptr;
  const Value* ref = nullptr;  // set for values from the memo
  Kind kind = Kind::none;      // of the value (ref's kind when set)
  std::int64_t integer = 0;
  bool above_int64 = false;
};
// Sees each flat dict (at most 16 items, keys and non-scalar values already
// in the memo: the shape of the millions of trace entries in a snapshot)
// before any value of it is made. It returns an index of its own to take
// the dict over (none of its values are made: a list holds taken dicts as
// runs of indices, Value::taken_runs; anywhere else a taken dict is a
// Kind::taken value holding its index), or -1 to have it decoded as usual.
using FlatDictHook = std::function<std::int64_t(std::span<const FlatItem> items)>;
struct DecodeOptions {
  const FlatDictHook* hook = nullptr;
  // Called with a byte offset once decoding has moved past it (every few
  // MB): no byte before it is read again, so a mapped file's reader can hand
  // those pages back.
  std::function<void(std::size_t offset)> consumed;
};
Document decode(std::span<const std::uint8_t> data, const FlatDictHook& hook);
Document decode(std::span<const std::uint8_t> data, const DecodeOptions& options);

// Encodes a value tree as protocol 4 (readable by Python's pickle.load).
std::string encode(const Value& root);

}  // namespace reservoir::pickle
