#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "reservoir/errors.hpp"
#include "reservoir/pickle.hpp"

namespace reservoir::pickle {
namespace {

std::span<const std::uint8_t> bytes(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

std::string error_of(const std::string& data) {
  try {
    (void)decode(bytes(data));
  } catch (const TraceError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Pickle, RoundTripsEveryKind) {
  Document doc;
  Value* root = doc.make(Kind::dict);
  auto add = [&](const char* key, Value* v) {
    Value* k = doc.make(Kind::string);
    k->text = key;
    root->entries.emplace_back(k, v);
  };
  Value* n = doc.make(Kind::integer);
  n->integer = -5;
  add("neg", n);
  for (std::int64_t i :
       {std::int64_t{0}, std::int64_t{255}, std::int64_t{65535}, std::int64_t{1} << 31,
        std::int64_t{140587049156608}, std::numeric_limits<std::int64_t>::min()}) {
    Value* v = doc.make(Kind::integer);
    v->integer = i;
    add(("int" + std::to_string(i)).c_str(), v);
  }
  Value* big = doc.make(Kind::integer);
  big->integer = -1;
  big->above_int64 = true;  // 2^64 - 1
  add("big", big);
  Value* f = doc.make(Kind::floating);
  f->floating = 0.25;
  add("float", f);
  Value* t = doc.make(Kind::boolean);
  t->boolean = true;
  add("true", t);
  add("none", doc.make(Kind::none));
  Value* s = doc.make(Kind::string);
  s->text = std::string(300, 'x');
  add("long", s);
  Value* list = doc.make(Kind::list);
  for (int i = 0; i < 2500; ++i) {
    Value* v = doc.make(Kind::integer);
    v->integer = i;
    list->items.push_back(v);
  }
  add("list", list);
  Value* tuple = doc.make(Kind::tuple);
  tuple->items = {n, f};
  add("tuple", tuple);
  doc.set_root(root);

  const std::string encoded = encode(*root);
  const Document back = decode(bytes(encoded));
  EXPECT_EQ(encode(back.root()), encoded);
  EXPECT_EQ(back.root().find("neg")->integer, -5);
  EXPECT_EQ(back.root().find("int140587049156608")->integer, 140587049156608);
  EXPECT_TRUE(back.root().find("big")->above_int64);
  EXPECT_EQ(static_cast<std::uint64_t>(back.root().find("big")->integer), ~std::uint64_t{0});
  EXPECT_EQ(back.root().find("float")->floating, 0.25);
  EXPECT_EQ(back.root().find("list")->items.size(), 2500u);
  EXPECT_EQ(back.root().find("list")->items[2499]->integer, 2499);
  EXPECT_EQ(back.root().find("tuple")->items.size(), 2u);
  EXPECT_EQ(back.root().find("long")->text.size(), 300u);
}

// Bytes written by Python 3.11: pickle.dumps({'a': [1, 'x', 'x'], 'b': (True, None)}, protocol=4)
TEST(Pickle, ReadsWhatPythonWrites) {
  const std::string data(
      "\x80\x04\x95\x1d\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01"
      "a\x94]\x94(K\x01\x8c\x01x\x94"
      "h\x03"
      "e\x8c\x01"
      "b\x94\x88N\x86\x94u.",
      40);
  const Document doc = decode(bytes(data));
  const Value* a = doc.root().find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->items.size(), 3u);
  EXPECT_EQ(a->items[0]->integer, 1);
  EXPECT_EQ(a->items[1]->text, "x");
  EXPECT_EQ(a->items[2], a->items[1]);  // a memo reference, shared
  const Value* b = doc.root().find("b");
  ASSERT_EQ(b->kind, Kind::tuple);
  EXPECT_TRUE(b->items[0]->boolean);
  EXPECT_EQ(b->items[1]->kind, Kind::none);
}

TEST(Pickle, CorruptInputGetsExactErrors) {
  EXPECT_EQ(error_of(""), "pickle: byte 0: truncated: the pickle ends before its STOP opcode");
  EXPECT_EQ(error_of("\x80\x04J\x01\x02"),
            "pickle: byte 2: truncated: BININT needs 4 bytes, 2 remain");
  EXPECT_EQ(error_of("\x80\x04}\x8c\x05"
                     "ab"),
            "pickle: byte 3: truncated: SHORT_BINUNICODE needs 5 bytes, 2 remain");
  EXPECT_EQ(error_of("\x80\x04\x63os\nsystem\n."),
            "pickle: byte 2: opcode GLOBAL (0x63) builds objects and is refused: a snapshot holds "
            "only plain data");
  EXPECT_EQ(error_of("\x80\x04\xff."), "pickle: byte 2: unknown or unsupported opcode 0xff");
  EXPECT_EQ(error_of("\x80\x04h\x07."), "pickle: byte 2: memo index 7 was never stored");
  EXPECT_EQ(error_of("\x80\x04K\x01K\x02."),
            "pickle: byte 6: STOP with 2 values on the stack (expected 1)");
  EXPECT_EQ(error_of("\x80\x04N.junk"), "pickle: byte 4: 4 unexpected bytes after STOP");
  EXPECT_EQ(error_of("\x80\x04K\x01K\x02s."), "pickle: byte 6: SETITEM needs a dict on the stack");
  EXPECT_EQ(error_of("\x80\x04]K\x01u."), "pickle: byte 5: SETITEMS without a MARK");
  EXPECT_EQ(error_of(std::string("\x80\x04\x8a\x0a", 4) + std::string(10, '\x01') + "."),
            "pickle: byte 2: integer of 10 bytes does not fit 64 bits");
  EXPECT_EQ(error_of("\x80\x04X\xff\xff\xff\x7f."),
            "pickle: byte 2: BINUNICODE length 2147483647 exceeds the file");
  // Strings are UTF-8 (encoded surrogates pass, as Python's 'surrogatepass').
  EXPECT_EQ(error_of("\x80\x04\x8c\x03"
                     "a\xff"
                     "b."),
            "pickle: byte 2: SHORT_BINUNICODE: a string of 3 bytes that is not UTF-8 (byte 1 of it)");
  EXPECT_EQ(error_of("\x80\x04\x8c\x02\xc0\x80."),  // an overlong NUL
            "pickle: byte 2: SHORT_BINUNICODE: a string of 2 bytes that is not UTF-8 (byte 0 of it)");
  EXPECT_EQ(error_of("\x80\x04\x8c\x03\xed\xa0\x80\x94."), "no error");
  EXPECT_EQ(error_of("\x80\x04\x8c\x04\xf0\x9f\x98\x80."), "no error");
  // FRAME: its length within the file; its opcodes end at its end; the
  // next frame starts there (Python's pickler writes them so).
  const std::string frame8 = std::string("\x95\x08\x00\x00\x00\x00\x00\x00\x00", 9);
  EXPECT_EQ(error_of("\x80\x04" + frame8 + "K\x01."),
            "pickle: byte 2: truncated: the FRAME holds 8 bytes, 3 remain");
  EXPECT_EQ(error_of("\x80\x04" + std::string("\x95\x02\x00\x00\x00\x00\x00\x00\x00", 9) + "J\x01\x02\x03\x04."),
            "pickle: byte 11: this opcode ends at byte 16, past the end of its FRAME at byte 13: "
            "bytes are missing from the frame, or were added");
  EXPECT_EQ(error_of("\x80\x04" + std::string("\x95\x03\x00\x00\x00\x00\x00\x00\x00", 9) + "K\x01" +
                     std::string("\x95\x01\x00\x00\x00\x00\x00\x00\x00", 9) + "."),
            "pickle: byte 13: a FRAME begins 1 bytes before the current frame ends (at byte 14): "
            "bytes are missing from that frame, or were added");
  EXPECT_EQ(error_of("\x80\x04" + std::string("\x95\x03\x00\x00\x00\x00\x00\x00\x00", 9) + "K\x01."),
            "no error");
}

// Writes pickle opcodes, counting the memo as Python's pickler does.
class Writer {
 public:
  Writer() { out_ = "\x80\x04"; }
  Writer& op(char o) { return out_.push_back(o), *this; }
  std::uint32_t memoize() { return op('\x94'), memo_++; }
  std::uint32_t str(const std::string& s) {
    op('\x8c'), op(static_cast<char>(s.size()));
    out_ += s;
    return memoize();
  }
  Writer& get(std::uint32_t m) { return op('h'), op(static_cast<char>(m)); }
  Writer& small(int v) { return op('K'), op(static_cast<char>(v)); }
  std::string done() { return out_ + "."; }

 private:
  std::string out_;
  std::uint32_t memo_ = 0;
};

// A snapshot's millions of trace entries: dicts the hook takes become runs
// of its indices in their list (no value each); a list of memo references
// written in place inside one (a stack) is kept once per content.
TEST(Pickle, AHookTakesFlatDictsAsRunsAndKeepsStacksOncePerContent) {
  Writer w;
  w.op(']'), w.memoize(), w.op('(');  // the root list
  const std::uint32_t k = w.str("k");
  const std::uint32_t f = w.str("f");
  std::uint32_t first_stack = 0;
  for (int i = 0; i < 7; ++i) {
    w.op('}'), w.memoize(), w.op('(');
    if (i == 2) {
      w.str("declined"), w.small(i);  // a key not from the memo: decoded as usual
    } else {
      w.get(k).small(i);
    }
    if (i >= 5) {  // a stack written in place, the same twice
      w.get(f).op(']');
      const std::uint32_t m = w.memoize();
      if (i == 5) first_stack = m;
      w.op('(').get(k).get(f).op('e');
    }
    w.op('u');
  }
  // A dict the hook declines, holding the first stack from the memo.
  w.op('}'), w.memoize(), w.op('(').str("z"), w.get(first_stack).op('u');
  w.op('e');
  const std::string data = w.done();

  std::vector<const Value*> stacks;
  std::int64_t next = 0;
  const FlatDictHook hook = [&](std::span<const FlatItem> items) -> std::int64_t {
    for (const FlatItem& it : items) {
      if (it.key->text == "f") stacks.push_back(it.ref);
    }
    return next++;
  };
  const Document doc = decode(bytes(data), hook);
  const Value& root = doc.root();
  ASSERT_EQ(root.kind, Kind::list);
  // Items: "k", "f", the declined dict, the dict holding the stack.
  ASSERT_EQ(root.items.size(), 4u);
  EXPECT_EQ(root.items[2]->kind, Kind::dict);
  ASSERT_EQ(root.taken_runs.size(), 2u);
  EXPECT_EQ(root.taken_runs[0].at, 2u);
  EXPECT_EQ(root.taken_runs[0].first, 0);
  EXPECT_EQ(root.taken_runs[0].count, 2u);
  EXPECT_EQ(root.taken_runs[1].at, 3u);
  EXPECT_EQ(root.taken_runs[1].first, 2);
  EXPECT_EQ(root.taken_runs[1].count, 4u);
  EXPECT_EQ(doc.taken_values(), 0u);
  ASSERT_EQ(stacks.size(), 2u);
  EXPECT_EQ(stacks[0], stacks[1]);  // one value for both stacks
  ASSERT_EQ(stacks[0]->items.size(), 2u);
  EXPECT_EQ(stacks[0]->items[0]->text, "k");
  EXPECT_EQ(stacks[0]->items[1]->text, "f");
  EXPECT_EQ(root.items[3]->find("z"), stacks[0]);  // the memo slot of the stack
  // Encoding such a document refuses: the taken dicts have no contents here.
  EXPECT_THROW((void)encode(root), TraceError);
}

// A taken dict anywhere but a list (here a dict's value, from the memo)
// becomes a value holding its index; extending a stack kept once per
// content is refused (no pickler writes it).
TEST(Pickle, TakenDictsElsewhereAndSharedStacksExtended) {
  Writer w;
  w.op('}'), w.memoize(), w.op('(');  // the root dict
  const std::uint32_t k = w.str("k");
  w.op('}');
  const std::uint32_t taken = w.memoize();
  w.op('(').get(k).small(1).op('u');  // root["k"] = a taken dict
  w.str("again"), w.get(taken);
  w.op('u');
  std::int64_t next = 0;
  const FlatDictHook hook = [&](std::span<const FlatItem>) -> std::int64_t { return next++; };
  const Document doc = decode(bytes(w.done()), hook);
  ASSERT_EQ(doc.root().entries.size(), 2u);
  const Value* first = doc.root().find("k");
  const Value* again = doc.root().find("again");
  ASSERT_EQ(first->kind, Kind::taken);
  EXPECT_EQ(first->integer, 0);
  ASSERT_EQ(again->kind, Kind::taken);
  EXPECT_EQ(again->integer, 0);
  EXPECT_EQ(doc.taken_values(), 2u);

  Writer x;
  x.op(']'), x.memoize(), x.op('(');
  const std::uint32_t key = x.str("k");
  x.op('}'), x.memoize(), x.op('(').get(key).op(']');
  const std::uint32_t stack = x.memoize();
  x.op('(').get(key).get(key).op('e').op('u');
  x.get(stack).small(3).op('a');  // stack.append(3)
  x.op('e');
  try {
    (void)decode(bytes(x.done()), hook);
    ADD_FAILURE() << "no error";
  } catch (const TraceError& e) {
    EXPECT_STREQ(e.what(),
                 "pickle: byte 27: APPEND extends a list of stack frames after it was written (no "
                 "pickler writes this)");
  }
}

// The decoder says how far it has read, every 16 MiB, so that a mapped
// file's pages behind it can go.
TEST(Pickle, TheDecoderSaysHowFarItHasRead) {
  const std::uint32_t len = 10u << 20;
  std::string data = "\x80\x04]\x94(";
  for (int i = 0; i < 4; ++i) {
    data += "B";
    for (int b = 0; b < 4; ++b) data.push_back(static_cast<char>((len >> (8 * b)) & 0xff));
    data += std::string(len, 'x');
  }
  data += "e.";
  std::vector<std::size_t> offsets;
  DecodeOptions options;
  options.consumed = [&](std::size_t offset) { offsets.push_back(offset); };
  const Document doc = decode(bytes(data), options);
  ASSERT_EQ(doc.root().items.size(), 4u);
  // Four 10 MiB strings: 16 MiB are passed within the second and the
  // fourth, and each report names where that string's opcode began.
  const std::size_t each = 5 + len;
  EXPECT_EQ(offsets, (std::vector<std::size_t>{5 + each, 5 + 3 * each}));
}

}  // namespace
}  // namespace reservoir::pickle
