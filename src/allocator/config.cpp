// Parser for RESERVOIR_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF strings.
//
// The grammar is PyTorch's: `key:value` pairs separated by commas, spaces
// ignored, and one list value `[k:v,k:v,>:v]` for roundup_power2_divisions.
// Unlike PyTorch's parser, every error names the key, the offending value and
// what is accepted, and nothing is half-applied: parse() builds a new config.
#include "reservoir/config.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <iterator>
#include <cstdlib>
#include <string_view>
#include <utility>
#include <vector>

#include "reservoir/errors.hpp"
#include "segment_source.hpp"

namespace reservoir {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

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
    // The release may come after roundup_power2_divisions in the text.
    config.set_pytorch_version(config.pytorch_version);
    if (config.paging_release_threshold != kNoReleaseThreshold &&
        config.policy != Policy::paging) {
      fail("key 'paging_release_threshold_mb' applies to policy:paging only; add policy:paging "
           "or leave the key out");
    }
    if (config.paging_slack != kNoPagingBound && config.policy != Policy::paging) {
      fail("key 'paging_slack_mb' applies to policy:paging only; add policy:paging or leave the "
           "key out");
    }
    if (!config.native_paged_rescue && config.policy != Policy::native_paged) {
      fail("key 'native_paged_rescue' applies to policy:native_paged only; add "
           "policy:native_paged or leave the key out");
    }
    if (config.max_split_size < config.large_segment_size) {
      fail(fmt::format("key 'max_split_size_mb': value '{}' is too small; accepted: a whole "
                       "number of MiB >= {} (large_segment_size_mb)",
                       config.max_split_size / kMiB, config.large_segment_size / kMiB));
    }
    return config;
  }

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

  void parse_value(AllocatorConfig& c, const std::string& key);

  std::size_t mib_value(const std::string& key, std::size_t min_mb, std::string_view accepted) {
    std::size_t mb = unsigned_value(key, accepted);
    if (mb < min_mb) {
      fail(fmt::format("key '{}': value '{}' is too small; accepted: {}", key, mb, accepted));
    }
    return std::min(mb, std::numeric_limits<std::size_t>::max() / kMiB - 1) * kMiB;
  }

  double number_value(const std::string& key, std::string_view accepted, bool one_included) {
    const std::string v = value_token(key, accepted);
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (end != v.c_str() + v.size() || !(d > 0.0 && (one_included ? d <= 1.0 : d < 1.0))) {
      fail(fmt::format("key '{}': value '{}' is not accepted; accepted: {}", key, v, accepted));
    }
    return d;
  }

  // A number in [0.0, 1.0], with PyTorch's message (the same words as its
  // own, which programs and tests look for) for one outside.
  double fraction_value(const std::string& key) {
    const std::string v = value_token(key, "a number in [0.0, 1.0]");
    char* end = nullptr;
    const double d = std::strtod(v.c_str(), &end);
    if (end != v.c_str() + v.size() || !(d >= 0.0 && d <= 1.0)) {
      fail(fmt::format("{} is invalid, set it in [0.0, 1.0] (the value given: '{}')", key, v));
    }
    return d;
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
      c.roundup_overlap = {};
      return;
    }
    ++pos_;  // '['
    auto& d = c.roundup_power2_divisions;
    c.roundup_overlap = {};
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
        if (!first) c.roundup_overlap = {last_index, d[last_index], divisions};
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
        if (c.roundup_overlap.index == index) c.roundup_overlap = {};  // given again after the '>'
      }
      first = false;
      const Token* sep = peek();
      if (sep != nullptr && sep->text == ",") ++pos_;
    }
    if (!closed) fail(fmt::format("key '{}': list is not closed with ']'", key));
  }

  // A reserve value as PyTorch 2.15 reads it: a positive, finite fraction of
  // the device ("0.5") or a number of GiB ("40G"); anything else is ignored
  // with its warning, the default kept.
  std::optional<AllocatorConfig::Reserve> reserve_value(AllocatorConfig& c, const std::string& token) {
    const bool gib = !token.empty() && (token.back() == 'G' || token.back() == 'g');
    const std::string number = gib ? token.substr(0, token.size() - 1) : token;
    char* end = nullptr;
    const double v = number.empty() ? 0.0 : std::strtod(number.c_str(), &end);
    if (number.empty() || end != number.c_str() + number.size() || !std::isfinite(v) || !(v > 0.0)) {
      c.warnings.list.push_back(fmt::format(
          "Ignoring invalid expandable-segment reserve value '{}' in PYTORCH_CUDA_ALLOC_CONF (expected a "
          "positive, finite fraction like 0.5 or an absolute size like 40G); using default.",
          token));
      return std::nullopt;
    }
    return AllocatorConfig::Reserve{!gib, v};
  }

  void parse_reserve(AllocatorConfig& c, const std::string& key) {
    const std::string token = value_token(key, kReserveAccepted);
    if (const auto r = reserve_value(c, token)) c.expandable_segments_reserve = *r;
  }

  // [name:value,...]: the list replaces any before it; a bad value skips its
  // entry (with the warning), the others apply.
  void parse_reserve_classes(AllocatorConfig& c, const std::string& key) {
    expect(key, "[");
    std::vector<std::pair<std::string, AllocatorConfig::Reserve>> parsed;
    bool closed = false;
    while (const Token* t = peek()) {
      if (t->text == "]") {
        ++pos_;
        closed = true;
        break;
      }
      const std::string name = value_token(key, "[class:value,...]");
      expect(key, ":");
      const std::string token = value_token(key, kReserveAccepted);
      if (const auto r = reserve_value(c, token)) {
        const auto it = std::find_if(parsed.begin(), parsed.end(), [&](const auto& e) { return e.first == name; });
        if (it != parsed.end()) {
          it->second = *r;
        } else {
          parsed.emplace_back(name, *r);
        }
      }
      const Token* sep = peek();
      if (sep != nullptr && sep->text == ",") ++pos_;
    }
    if (!closed) fail(fmt::format("key '{}': list is not closed with ']'", key));
    std::sort(parsed.begin(), parsed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    c.expandable_segments_reserve_by_class = std::move(parsed);
  }

  static constexpr std::string_view kReserveAccepted =
      "a positive fraction of the device's memory (0.5) or a number of GiB (40G)";

  const std::string& text_;
  std::vector<Token> tokens_;
  std::size_t pos_ = 0;
};

// ---- the table -------------------------------------------------------------

using ParseFn = void (*)(Parser&, AllocatorConfig&, const std::string& key);
// Appends the key's "key:value" to `out` where the config differs from the defaults.
using PrintFn = void (*)(const AllocatorConfig&, std::vector<std::string>& out);

struct Entry {
  SettingInfo info;
  ParseFn parse;
  PrintFn print;  // null for aliases (the canonical row prints)
};

std::string mib(std::size_t bytes) { return fmt::format("{}", bytes / kMiB); }

// The registered policies' names: "native, expandable, paging or native_paged".
std::string policy_names() {
  std::string out;
  const auto all = policies();
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (i > 0) out += i + 1 == all.size() ? " or " : ", ";
    out += all[i].name;
  }
  return out;
}

constexpr std::string_view kMibFromLargeSegment =
    "a whole number of MiB >= large_segment_size_mb (default 20)";
constexpr std::string_view kMib20 = "a whole number of MiB >= 20";
constexpr std::string_view kBool = "True or False";
constexpr std::string_view kDivisions =
    "a power of two, or a list [MiB:divisions,...,>:divisions] with power-of-two MiB keys and "
    "power-of-two (or 0) divisions";

void set_bool(Parser& p, bool& field, const std::string& key) { field = p.bool_value(key); }

// "0.5", "40G": as the setting is written.
std::string reserve_text(const AllocatorConfig::Reserve& r) {
  return fmt::format("{}{}", r.value, r.fraction ? "" : "G");
}

const Entry kTable[] = {
    {{"max_split_size_mb", kMibFromLargeSegment, "unlimited", "2.0+", "2.0", "max_split_size",
      "blocks this large or larger are never split; a smaller request never takes one", true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       c.max_split_size = p.mib_value(k, 1, kMibFromLargeSegment);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.max_split_size != AllocatorConfig{}.max_split_size)
         out.push_back("max_split_size_mb:" + mib(c.max_split_size));
     }},
    {{"max_non_split_rounding_mb", kMib20, "20", "2.6+", "2.6", "",
      "a request >= max_split_size takes a cached block only if it is less than this much "
      "larger",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       c.max_non_split_rounding_size = p.mib_value(k, 20, kMib20);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.max_non_split_rounding_size != AllocatorConfig{}.max_non_split_rounding_size)
         out.push_back("max_non_split_rounding_mb:" + mib(c.max_non_split_rounding_size));
     }},
    {{"large_segment_size_mb", "an even whole number of MiB >= 2", "20", "2.11+", "2.11", "",
      "the segment a large-pool request below 10 MiB gets (20 MiB before), and the large "
      "pool's page under expandable segments",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       const std::size_t bytes = p.mib_value(k, 2, "an even whole number of MiB >= 2");
       if ((bytes / kMiB) % 2 != 0) {
         p.fail(fmt::format("key '{}': value '{}' is not even; accepted: an even whole number "
                            "of MiB >= 2 (segments are made of 2 MiB pages)",
                            k, bytes / kMiB));
       }
       c.large_segment_size = bytes;
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.large_segment_size != AllocatorConfig{}.large_segment_size)
         out.push_back("large_segment_size_mb:" + mib(c.large_segment_size));
     }},
    {{"garbage_collection_threshold", "a number in (0.0, 1.0)", "0 (off)", "2.0+", "2.0",
      "garbage_collection_threshold",
      "with a memory fraction set, when reserved memory exceeds threshold x allowed, free "
      "unsplit cached large blocks at least as old (in cache searches) as the average, before "
      "asking the device",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       c.garbage_collection_threshold = p.number_value(k, "a number in (0.0, 1.0)", false);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.garbage_collection_threshold != 0.0)
         out.push_back(fmt::format("garbage_collection_threshold:{}", c.garbage_collection_threshold));
     }},
    {{"roundup_power2_divisions", kDivisions, "0 (512-byte rounding)", "2.0+ (the list form 2.1+)",
      "2.0", "roundup_power2_divisions",
      "round requests up to one of `div` steps between powers of two; list keys are "
      "power-of-two MiB interval starts (1 MiB .. 32 GiB+), `>` sets every interval after the "
      "last one named (before PyTorch 2.10 that one too, as pytorch_version reads it)",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) { p.parse_divisions(c, k); },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.roundup_power2_divisions == AllocatorConfig{}.roundup_power2_divisions) return;
       std::string list = "roundup_power2_divisions:[";
       for (std::size_t i = 0; i < kRoundupIntervals; ++i) {
         if (i) list += ",";
         list += fmt::format("{}:{}", std::size_t{1} << i, c.roundup_power2_divisions[i]);
       }
       out.push_back(list + "]");
     }},
    {{"expandable_segments", kBool, "False", "2.1+", "2.1", "expandable_segments",
      "PyTorch's expandable segments (same as `policy:expandable`); needs a device with "
      "virtual memory",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.expandable_segments, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.expandable_segments) out.emplace_back("expandable_segments:True");
     }},
    {{"expandable_segments_reserve", "a positive fraction of the device (0.5) or GiB (40G)",
      "9/8 of the device", "2.15+", "2.15", "",
      "the address space each expandable segment reserves (at most 9/8 of the device), for streams "
      "without a reserve class of their own; a request larger than it fails; an invalid value is "
      "ignored with a warning",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) { p.parse_reserve(c, k); },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.expandable_segments_reserve) {
         out.push_back("expandable_segments_reserve:" + reserve_text(*c.expandable_segments_reserve));
       }
     }},
    {{"expandable_segments_reserve_by_class", "[class:value,...], each value as for expandable_segments_reserve",
      "[]", "2.15+", "2.15", "",
      "the reserve of the expandable segments of streams given a class "
      "(setExpandableSegmentReserveClassForStream); an entry with an invalid value is ignored "
      "with a warning",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) { p.parse_reserve_classes(c, k); },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.expandable_segments_reserve_by_class.empty()) return;
       std::vector<std::string> entries;
       for (const auto& [name, r] : c.expandable_segments_reserve_by_class) {
         entries.push_back(name + ":" + reserve_text(r));
       }
       out.push_back(fmt::format("expandable_segments_reserve_by_class:[{}]", fmt::join(entries, ",")));
     }},
    {{"per_process_memory_fraction", "a number in [0.0, 1.0]", "1.0", "2.10+", "2.10", "",
      "as torch.cuda.set_per_process_memory_fraction before the first allocation: reserved "
      "memory may not exceed this fraction of the device (enables garbage collection; 0.0 "
      "allows none)",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       c.per_process_memory_fraction = p.fraction_value(k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.per_process_memory_fraction != 1.0)
         out.push_back(fmt::format("per_process_memory_fraction:{}", c.per_process_memory_fraction));
     }},
    {{"graph_capture_record_stream_reuse", kBool, "False", "2.9+", "2.9",
      "graph_capture_record_stream_reuse",
      "lets CUDA-graph capture reuse blocks freed on other streams once the capture joined them; "
      "modelled where the capture's graph is known (reservoir as PyTorch's allocator); replay "
      "follows the recording",
      false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.graph_capture_record_stream_reuse, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.graph_capture_record_stream_reuse)
         out.emplace_back("graph_capture_record_stream_reuse:True");
     }},
    {{"throw_on_cudamalloc_oom", kBool, "False", "2.12+", "2.12", "",
      "fail a request before cudaMalloc when it would exceed free memory; accepted, not "
      "modelled: the same requests fail either way, only the device call differs",
      false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.throw_on_cudamalloc_oom, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.throw_on_cudamalloc_oom) out.emplace_back("throw_on_cudamalloc_oom:True");
     }},
    {{"release_lock_on_cudamalloc", kBool, "False", "~2.2+", "2.2", "release_lock_on_cudamalloc",
      "accepted for compatibility; reservoir keeps its lock around device calls", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.release_lock_on_cudamalloc, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.release_lock_on_cudamalloc) out.emplace_back("release_lock_on_cudamalloc:True");
     }},
    {{"release_lock_on_hipmalloc", kBool, "False", "~2.2+", "2.2", "",
      "ROCm's name for release_lock_on_cudamalloc", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.release_lock_on_cudamalloc, k);
     },
     nullptr},
    {{"pinned_use_cuda_host_register", kBool, "False", "~2.2+", "2.2",
      "pinned_use_cuda_host_register",
      "pinned host memory by cudaHostRegister (the saver's staging buffers)", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.pinned_use_host_register, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.pinned_use_host_register) out.emplace_back("pinned_use_cuda_host_register:True");
     }},
    {{"pinned_use_hip_host_register", kBool, "False", "~2.2+", "2.2", "",
      "ROCm's name for pinned_use_cuda_host_register", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.pinned_use_host_register, k);
     },
     nullptr},
    {{"pinned_num_register_threads", "a power of two from 1 to 128", "1", "~2.2+", "2.2",
      "pinned_num_register_threads", "threads registering pinned host memory", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       const std::size_t n = p.unsigned_value(k, "a power of two from 1 to 128");
       if (n == 0 || !std::has_single_bit(n) || n > 128) {
         p.fail(fmt::format("key '{}': value '{}' is not accepted; accepted: a power of two "
                            "from 1 to 128",
                            k, n));
       }
       c.pinned_num_register_threads = n;
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.pinned_num_register_threads != 1)
         out.push_back(fmt::format("pinned_num_register_threads:{}", c.pinned_num_register_threads));
     }},
    {{"pinned_use_background_threads", kBool, "False", "2.6+", "2.6", "",
      "pinned host allocator's background event processing", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.pinned_use_background_threads, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.pinned_use_background_threads) out.emplace_back("pinned_use_background_threads:True");
     }},
    {{"pinned_reserve_segment_size_mb", "a whole number of MiB", "0", "2.10+", "2.10", "",
      "pinned host memory reserved up front; accepted, not modelled", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       c.pinned_reserve_segment_size = p.mib_value(k, 0, "a whole number of MiB");
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.pinned_reserve_segment_size != 0)
         out.push_back("pinned_reserve_segment_size_mb:" + mib(c.pinned_reserve_segment_size));
     }},
    {{"pinned_free_catch_all", kBool, "False", "2.12+", "2.12", "",
      "pinned host allocator frees through one catch-all path; accepted, not modelled", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.pinned_free_catch_all, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.pinned_free_catch_all) out.emplace_back("pinned_free_catch_all:True");
     }},
    {{"pinned_max_round_threshold_mb", "a whole number of MiB", "unlimited", "2.13+", "2.13",
      "max_round_threshold",
      "pinned host allocator rounds requests up to a power of two only below this size; accepted, "
      "not modelled",
      false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       c.pinned_max_round_threshold = p.mib_value(k, 0, "a whole number of MiB");
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.pinned_max_round_threshold != AllocatorConfig{}.pinned_max_round_threshold)
         out.push_back("pinned_max_round_threshold_mb:" + mib(c.pinned_max_round_threshold));
     }},
    {{"pinned_max_cached_size_mb", "a whole number of MiB", "unlimited", "2.13+", "2.13",
      "max_cached_size",
      "pinned host allocator caches no freed block above this size; accepted, not modelled", false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       c.pinned_max_cached_size = p.mib_value(k, 0, "a whole number of MiB");
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.pinned_max_cached_size != AllocatorConfig{}.pinned_max_cached_size)
         out.push_back("pinned_max_cached_size_mb:" + mib(c.pinned_max_cached_size));
     }},
    {{"backend", "native", "native", "2.0+", "2.0", "",
      "`cudaMallocAsync` is refused: reservoir is the allocator", true},
     [](Parser& p, AllocatorConfig&, const std::string& k) {
       const std::string v = p.value_token(k, "native");
       if (v != "native") {
         p.fail(fmt::format("key 'backend': value '{}' is not supported by reservoir; accepted: "
                            "native",
                            v));
       }
     },
     [](const AllocatorConfig&, std::vector<std::string>&) {}},
    {{"policy", "native, expandable, paging or native_paged", "native", "reservoir", "", "",
      "reservoir's own key: the segment policy (below); any but `native` and "
      "`expandable_segments:True` exclude each other",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       const std::string v = p.value_token(k, "native, expandable, paging or native_paged");
       if (const detail::SegmentSourceEntry* e = detail::find_segment_source(v)) {
         c.policy = e->info.policy;
       } else {
         p.fail(fmt::format("key 'policy': value '{}' is not accepted; accepted: {}", v,
                            policy_names()));
       }
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.policy != Policy::native) out.push_back(fmt::format("policy:{}", to_string(c.policy)));
     }},
    {{"paging_release_threshold_mb", "a whole number of MiB (0: keep no cached memory)",
      "unlimited", "reservoir", "", "",
      "`policy:paging` only: after a free, whole free handles beyond this much cached memory "
      "(reserved minus allocated) go back to the device at once, largest first, as "
      "`cudaMallocAsync`'s release threshold does; 0 keeps none. For GPUs shared with other "
      "processes; costs device calls when the memory is needed again",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       c.paging_release_threshold =
           p.mib_value(k, 0, "a whole number of MiB (0: keep no cached memory)");
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.paging_release_threshold != kNoReleaseThreshold)
         out.push_back("paging_release_threshold_mb:" + mib(c.paging_release_threshold));
     }},
    {{"paging_slack_mb", "a whole number of MiB, or off", "off", "reservoir", "", "",
      "`policy:paging` only: the native bound. Wherever paging grows, reserved memory is held "
      "within what the native policy would reserve for the same program at that point (a model "
      "of the native policy follows the program) plus this much per stream: mapping ahead stops "
      "there, growth takes free handles from elsewhere first, and free handles above it go back "
      "to the device. Costs device calls; see docs/config.md for what it does not yet hold",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       const Token* t = p.peek();
       if (t != nullptr && t->text == "off") {
         (void)p.value_token(k, "a whole number of MiB, or off");
         c.paging_slack = kNoPagingBound;
       } else {
         c.paging_slack = p.mib_value(k, 0, "a whole number of MiB, or off");
       }
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (c.paging_slack != kNoPagingBound) out.push_back("paging_slack_mb:" + mib(c.paging_slack));
     }},
    {{"native_paged_rescue", kBool, "True", "reservoir", "", "",
      "`policy:native_paged` only: where the native policy's choice finds no memory (after "
      "free pages went back and the retry ladder ran), the request is served from the free "
      "block, of either default pool and any stream (after synchronizing it), whose pages are "
      "mapped the most, before out-of-memory is raised; False keeps the native policy's "
      "decisions even then",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.native_paged_rescue, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (!c.native_paged_rescue) out.emplace_back("native_paged_rescue:False");
     }},
    {{"retry_searches_pool", kBool, "True", "reservoir", "", "",
      "after the retry ladder has waited for the frees pending on other streams' events and "
      "released the cache, the pool is searched again before the device is asked: a block that "
      "wait freed serves the request (PyTorch raises out-of-memory there and serves the same "
      "request an instant later, pytorch/pytorch#189504); False keeps PyTorch's ladder. Replay "
      "and verify model each release's ladder",
      false},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       set_bool(p, c.retry_searches_pool, k);
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (!c.retry_searches_pool) out.emplace_back("retry_searches_pool:False");
     }},
    {{"pytorch_version", "a PyTorch 2.x release, as 2.15", "2.11", "reservoir", "", "",
      "the release whose decisions the native policy takes where releases differ: of cached blocks "
      "of equal size, from 2.13 the one whose segment was made first, in 2.12 the block made first "
      "(a split's front is a new block, a merge keeps the freed block's age), before 2.12 the "
      "lowest address; from 2.13, memory_stats reports each private pool's reserved bytes; from "
      "2.5, a private pool's memory is expandable segments of its own under "
      "expandable_segments:True (before: ordinary segments). Replay, verify and advise take it from a snapshot that shows its release; "
      "installed into PyTorch (own or pluggable allocator), the running release",
      true},
     [](Parser& p, AllocatorConfig& c, const std::string& k) {
       const std::string v = p.value_token(k, "a PyTorch 2.x release, as 2.15");
       const bool ok = v.size() >= 3 && v.starts_with("2.") &&
                       v.find_first_not_of("0123456789", 2) == std::string::npos && v.size() <= 4;
       if (!ok) {
         p.fail(fmt::format("key '{}': value '{}' is not accepted; accepted: a PyTorch 2.x release, "
                            "as 2.15",
                            k, v));
       }
       c.pytorch_version = v;
     },
     [](const AllocatorConfig& c, std::vector<std::string>& out) {
       if (!c.pytorch_version.empty()) out.push_back("pytorch_version:" + c.pytorch_version);
     }},
};

}  // namespace

std::size_t AllocatorConfig::Reserve::bytes(std::size_t device_total) const noexcept {
  const double b = fraction ? value * static_cast<double>(device_total) : value * static_cast<double>(std::size_t{1} << 30);
  if (!(b < static_cast<double>(std::numeric_limits<std::size_t>::max()))) return std::numeric_limits<std::size_t>::max();
  return static_cast<std::size_t>(b);
}

std::size_t AllocatorConfig::segment_reserve(std::string_view reserve_class, std::size_t device_total) const {
  const std::size_t full = device_total + device_total / 8;
  for (const auto& [name, r] : expandable_segments_reserve_by_class) {
    if (name == reserve_class) return std::min(r.bytes(device_total), full);
  }
  if (expandable_segments_reserve) return std::min(expandable_segments_reserve->bytes(device_total), full);
  return full;
}

bool AllocatorConfig::empty_cache_spares_default_pools_while_routed() const {
  return pytorch_version.empty() || compare_versions(pytorch_version, "2.15") < 0;
}

bool AllocatorConfig::one_division_keeps_size() const {
  return !pytorch_version.empty() && compare_versions(pytorch_version, "2.4") < 0;
}

bool AllocatorConfig::private_pools_expandable() const {
  return pytorch_version.empty() || compare_versions(pytorch_version, "2.5") >= 0;
}

bool AllocatorConfig::oldest_segment_first() const {
  return !pytorch_version.empty() && compare_versions(pytorch_version, "2.13") >= 0;
}

bool AllocatorConfig::oldest_block_first() const {
  return !pytorch_version.empty() && compare_versions(pytorch_version, "2.12") >= 0 &&
         compare_versions(pytorch_version, "2.13") < 0;
}

namespace {

const Entry* find_entry(std::string_view key) {
  for (const Entry& e : kTable) {
    if (e.info.key == key) return &e;
  }
  return nullptr;
}

void Parser::parse_value(AllocatorConfig& c, const std::string& key) {
  if (const Entry* e = find_entry(key)) {
    e->parse(*this, c, key);
    return;
  }
  std::vector<std::string_view> keys;
  for (const Entry& e : kTable) keys.push_back(e.info.key);
  fail(fmt::format("unknown key '{}'; accepted keys: {}", key, fmt::join(keys, ", ")));
}

}  // namespace

std::span<const SettingInfo> settings() {
  static const std::vector<SettingInfo> kRows = [] {
    std::vector<SettingInfo> out;
    out.reserve(std::size(kTable));
    for (const Entry& e : kTable) out.push_back(e.info);
    return out;
  }();
  return kRows;
}

const SettingInfo* find_setting(std::string_view key) {
  for (const SettingInfo& s : settings()) {
    if (s.key == key) return &s;
  }
  return nullptr;
}

std::string settings_markdown() {
  std::string out =
      "| key | value | default | PyTorch | snapshot key | replayed | effect |\n"
      "|---|---|---|---|---|---|---|\n";
  for (const SettingInfo& s : settings()) {
    out += fmt::format("| `{}` | {} | {} | {} | {} | {} | {} |\n", s.key, s.value, s.default_value,
                       s.pytorch, s.snapshot_key.empty() ? "-" : fmt::format("`{}`", s.snapshot_key),
                       s.replayed ? "yes" : "no", s.effect);
  }
  return out;
}

int compare_versions(std::string_view a, std::string_view b) {
  while (!a.empty() || !b.empty()) {
    auto take = [](std::string_view& s) {
      std::size_t n = 0;
      std::size_t i = 0;
      while (i < s.size() && s[i] >= '0' && s[i] <= '9') n = n * 10 + static_cast<std::size_t>(s[i++] - '0');
      s.remove_prefix(std::min(s.size(), i + 1));  // the number and its dot
      return n;
    };
    const std::size_t x = take(a);
    const std::size_t y = take(b);
    if (x != y) return x < y ? -1 : 1;
  }
  return 0;
}

void AllocatorConfig::set_pytorch_version(std::string release) {
  pytorch_version = std::move(release);
  if (roundup_overlap.index < kRoundupIntervals) {
    const bool before_2_10 = !pytorch_version.empty() && compare_versions(pytorch_version, "2.10") < 0;
    roundup_power2_divisions[roundup_overlap.index] = before_2_10 ? roundup_overlap.after : roundup_overlap.given;
  }
}

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
  for (const char* name : {"RESERVOIR_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    if (const char* text = std::getenv(name)) return parse(text);
  }
  return AllocatorConfig{};
}

AllocatorConfig AllocatorConfig::with_native_policy() const {
  AllocatorConfig c = *this;
  c.policy = Policy::native;
  c.expandable_segments = false;
  c.paging_release_threshold = kNoReleaseThreshold;
  c.paging_slack = kNoPagingBound;
  return c;
}

std::string AllocatorConfig::to_string() const {
  std::vector<std::string> parts;
  // The policy first, as written by hand.
  for (const Entry& e : kTable) {
    if (e.info.key == "policy") e.print(*this, parts);
  }
  for (const Entry& e : kTable) {
    if (e.print != nullptr && e.info.key != "policy") e.print(*this, parts);
  }
  return fmt::format("{}", fmt::join(parts, ","));
}

}  // namespace reservoir
