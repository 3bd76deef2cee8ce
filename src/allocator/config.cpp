// Parser for RESERVOIR_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF strings.
//
// The grammar is PyTorch's: `key:value` pairs separated by commas, spaces
// ignored, and one list value `[k:v,k:v,>:v]` for roundup_power2_divisions.
// Unlike PyTorch's parser, every error names the key, the offending value and
// what is accepted, and nothing is half-applied: parse() builds a new config.
#include "reservoir/config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "reservoir/errors.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kLargeBufferMiB = 20;

struct Token {
  std::string text;
  std::size_t column;  // 1-based position in the input
};

std::vector<Token> lex(const std::string& text) {
  std::vector<Token> tokens;
  std::string current;
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == ',' || c == ':' || c == '[' || c == ']') {
      if (!current.empty()) tokens.push_back({current, start + 1});
      current.clear();
      tokens.push_back({std::string(1, c), i + 1});
    } else if (c != ' ' && c != '\t' && c != '\n') {
      if (current.empty()) start = i;
      current.push_back(c);
    }
  }
  if (!current.empty()) tokens.push_back({current, start + 1});
  return tokens;
}

class Parser {
 public:
  explicit Parser(const std::string& text) : text_(text), tokens_(lex(text)) {}

  AllocatorConfig run() {
    AllocatorConfig config;
    while (pos_ < tokens_.size()) {
      const Token key = tokens_[pos_++];
      if (key.text == ",") continue;  // tolerate empty entries ("a:1,,b:2", trailing comma)
      expect(key.text, ":");
      parse_value(config, key.text);
      if (pos_ < tokens_.size()) expect_separator(key.text);
    }
    if (config.paging_release_threshold != kNoReleaseThreshold &&
        config.policy != Policy::paging) {
      fail("key 'paging_release_threshold_mb' applies to policy:paging only; add policy:paging "
           "or leave the key out");
    }
    return config;
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    throw ConfigError(fmt::format("allocator config \"{}\": {}", text_, message));
  }

  const Token* peek() const { return pos_ < tokens_.size() ? &tokens_[pos_] : nullptr; }

  void expect(const std::string& key, std::string_view symbol) {
    const Token* t = peek();
    if (t == nullptr || t->text != symbol) {
      fail(fmt::format("key '{}' at column {}: expected '{}' but found {}", key,
                       t ? t->column : text_.size() + 1, symbol,
                       t ? "'" + t->text + "'" : std::string("the end")));
    }
    ++pos_;
  }

  void expect_separator(const std::string& key) {
    const Token* t = peek();
    if (t->text != ",") {
      fail(fmt::format("key '{}': unexpected '{}' at column {}; entries are separated by ','", key,
                       t->text, t->column));
    }
    ++pos_;
  }

  std::string value_token(const std::string& key, std::string_view accepted) {
    const Token* t = peek();
    if (t == nullptr || t->text == "," || t->text == ":" || t->text == "]") {
      fail(fmt::format("key '{}' has no value; accepted: {}", key, accepted));
    }
    ++pos_;
    return t->text;
  }

  static bool parse_unsigned(const std::string& s, std::size_t* out) {
    const char* end = s.data() + s.size();
    auto [p, ec] = std::from_chars(s.data(), end, *out);
    return ec == std::errc() && p == end;
  }

  std::size_t unsigned_value(const std::string& key, std::string_view accepted) {
    const std::string v = value_token(key, accepted);
    std::size_t out = 0;
    if (!parse_unsigned(v, &out)) {
      fail(fmt::format("key '{}': value '{}' is not a whole number; accepted: {}", key, v,
                       accepted));
    }
    return out;
  }

  bool bool_value(const std::string& key) {
    const std::string v = value_token(key, "True or False");
    if (v == "True") return true;
    if (v == "False") return false;
    fail(fmt::format("key '{}': value '{}' is not accepted; accepted: True or False", key, v));
  }

  void parse_value(AllocatorConfig& c, const std::string& key) {
    if (key == "max_split_size_mb" || key == "max_non_split_rounding_mb") {
      const std::string accepted = fmt::format("a whole number of MiB >= {}", kLargeBufferMiB);
      std::size_t mb = unsigned_value(key, accepted);
      if (mb < kLargeBufferMiB) {
        fail(fmt::format("key '{}': value '{}' is too small; accepted: {}", key, mb, accepted));
      }
      mb = std::min(mb, std::numeric_limits<std::size_t>::max() / kMiB);
      (key == "max_split_size_mb" ? c.max_split_size : c.max_non_split_rounding_size) = mb * kMiB;
    } else if (key == "paging_release_threshold_mb") {
      std::size_t mb = unsigned_value(key, "a whole number of MiB (0: keep no cached memory)");
      mb = std::min(mb, std::numeric_limits<std::size_t>::max() / kMiB - 1);
      c.paging_release_threshold = mb * kMiB;
    } else if (key == "garbage_collection_threshold") {
      const std::string v = value_token(key, "a number in (0.0, 1.0)");
      char* end = nullptr;
      const double d = std::strtod(v.c_str(), &end);
      if (end != v.c_str() + v.size() || !(d > 0.0 && d < 1.0)) {
        fail(fmt::format("key '{}': value '{}' is not accepted; accepted: a number in (0.0, 1.0)",
                         key, v));
      }
      c.garbage_collection_threshold = d;
    } else if (key == "roundup_power2_divisions") {
      parse_divisions(c, key);
    } else if (key == "expandable_segments") {
      c.expandable_segments = bool_value(key);
    } else if (key == "release_lock_on_cudamalloc") {
      c.release_lock_on_cudamalloc = bool_value(key);
    } else if (key == "pinned_use_cuda_host_register") {
      c.pinned_use_host_register = bool_value(key);
    } else if (key == "pinned_use_background_threads") {
      c.pinned_use_background_threads = bool_value(key);
    } else if (key == "pinned_num_register_threads") {
      const std::size_t n = unsigned_value(key, "a power of two from 1 to 128");
      if (n == 0 || !std::has_single_bit(n) || n > 128) {
        fail(
            fmt::format("key '{}': value '{}' is not accepted; accepted: a power of two from 1 "
                        "to 128",
                        key, n));
      }
      c.pinned_num_register_threads = n;
    } else if (key == "backend") {
      const std::string v = value_token(key, "native");
      if (v != "native") {
        fail(
            fmt::format("key 'backend': value '{}' is not supported by reservoir; accepted: "
                        "native",
                        v));
      }
    } else if (key == "policy") {
      const std::string v = value_token(key, "native, expandable or paging");
      if (v == "native") {
        c.policy = Policy::native;
      } else if (v == "expandable") {
        c.policy = Policy::expandable;
      } else if (v == "paging") {
        c.policy = Policy::paging;
      } else {
        fail(
            fmt::format("key 'policy': value '{}' is not accepted; accepted: native, "
                        "expandable or paging",
                        v));
      }
    } else {
      fail(fmt::format(
          "unknown key '{}'; accepted keys: max_split_size_mb, max_non_split_rounding_mb, "
          "garbage_collection_threshold, roundup_power2_divisions, expandable_segments, "
          "release_lock_on_cudamalloc, pinned_use_cuda_host_register, "
          "pinned_num_register_threads, pinned_use_background_threads, backend, policy, "
          "paging_release_threshold_mb",
          key));
    }
  }

  void parse_divisions(AllocatorConfig& c, const std::string& key) {
    const char* accepted =
        "a power of two, or a list [MiB:divisions,...,>:divisions] with power-of-two MiB keys "
        "and power-of-two (or 0) divisions";
    const Token* t = peek();
    if (t == nullptr) fail(fmt::format("key '{}' has no value; accepted: {}", key, accepted));
    if (t->text != "[") {
      const std::size_t n = unsigned_value(key, accepted);
      if (!std::has_single_bit(n)) {
        fail(fmt::format("key '{}': value '{}' is not a power of two; accepted: {}", key, n,
                         accepted));
      }
      c.roundup_power2_divisions.fill(n);
      return;
    }
    ++pos_;  // '['
    auto& d = c.roundup_power2_divisions;
    bool first = true;
    std::size_t last_index = 0;
    bool closed = false;
    while (const Token* entry = peek()) {
      if (entry->text == "]") {
        ++pos_;
        closed = true;
        break;
      }
      const std::string interval = value_token(key, accepted);
      expect(key, ":");
      const std::size_t divisions = unsigned_value(key, accepted);
      if (divisions != 0 && !std::has_single_bit(divisions)) {
        fail(fmt::format("key '{}': divisions '{}' for interval '{}' is not a power of two or 0",
                         key, divisions, interval));
      }
      if (interval == ">") {
        std::fill(d.begin() +
                      static_cast<std::ptrdiff_t>(std::min(last_index + (first ? 0 : 1), d.size())),
                  d.end(), divisions);
      } else {
        std::size_t mb = 0;
        if (!parse_unsigned(interval, &mb) || !std::has_single_bit(mb)) {
          fail(fmt::format("key '{}': interval '{}' is not a power-of-two number of MiB", key,
                           interval));
        }
        std::size_t index = static_cast<std::size_t>(std::bit_width(mb) - 1);
        index = std::min(index, d.size() - 1);
        if (first) std::fill(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(index), divisions);
        d[index] = divisions;
        last_index = index;
      }
      first = false;
      const Token* sep = peek();
      if (sep != nullptr && sep->text == ",") ++pos_;
    }
    if (!closed) fail(fmt::format("key '{}': list is not closed with ']'", key));
  }

  const std::string& text_;
  std::vector<Token> tokens_;
  std::size_t pos_ = 0;
};

}  // namespace

std::size_t AllocatorConfig::divisions_for(std::size_t size) const noexcept {
  // Interval 0 holds sizes below 2 MiB, interval 15 sizes of 32 GiB and more.
  const int log = static_cast<int>(std::bit_width(size)) - 1;
  int index = log - 20;
  index = std::clamp(index, 0, static_cast<int>(kRoundupIntervals) - 1);
  return roundup_power2_divisions[static_cast<std::size_t>(index)];
}

AllocatorConfig AllocatorConfig::parse(const std::string& text) {
  return Parser(text).run();
}

AllocatorConfig AllocatorConfig::from_env() {
  if (const char* ours = std::getenv("RESERVOIR_ALLOC_CONF")) return parse(ours);
  if (const char* theirs = std::getenv("PYTORCH_CUDA_ALLOC_CONF")) return parse(theirs);
  return AllocatorConfig{};
}

std::string AllocatorConfig::to_string() const {
  const AllocatorConfig defaults;
  std::vector<std::string> parts;
  if (policy != defaults.policy) {
    parts.push_back(policy == Policy::expandable ? "policy:expandable" : "policy:paging");
  }
  if (max_split_size != defaults.max_split_size) {
    parts.push_back(fmt::format("max_split_size_mb:{}", max_split_size / kMiB));
  }
  if (max_non_split_rounding_size != defaults.max_non_split_rounding_size) {
    parts.push_back(
        fmt::format("max_non_split_rounding_mb:{}", max_non_split_rounding_size / kMiB));
  }
  if (garbage_collection_threshold != 0.0) {
    parts.push_back(fmt::format("garbage_collection_threshold:{}", garbage_collection_threshold));
  }
  if (roundup_power2_divisions != defaults.roundup_power2_divisions) {
    std::string list = "roundup_power2_divisions:[";
    for (std::size_t i = 0; i < kRoundupIntervals; ++i) {
      if (i) list += ",";
      list += fmt::format("{}:{}", std::size_t{1} << i, roundup_power2_divisions[i]);
    }
    parts.push_back(list + "]");
  }
  if (expandable_segments) parts.push_back("expandable_segments:True");
  if (release_lock_on_cudamalloc) parts.push_back("release_lock_on_cudamalloc:True");
  if (pinned_use_host_register) parts.push_back("pinned_use_cuda_host_register:True");
  if (pinned_num_register_threads != 1) {
    parts.push_back(fmt::format("pinned_num_register_threads:{}", pinned_num_register_threads));
  }
  if (pinned_use_background_threads) parts.push_back("pinned_use_background_threads:True");
  if (paging_release_threshold != kNoReleaseThreshold) {
    parts.push_back(
        fmt::format("paging_release_threshold_mb:{}", paging_release_threshold / kMiB));
  }
  return fmt::format("{}", fmt::join(parts, ","));
}

}  // namespace reservoir
