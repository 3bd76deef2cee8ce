#include <gtest/gtest.h>

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
}

}  // namespace
}  // namespace reservoir::pickle
