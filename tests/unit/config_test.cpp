#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>

#include "reservoir/config.hpp"
#include "reservoir/errors.hpp"
#include "source_dir.hpp"

using reservoir::AllocatorConfig;
using reservoir::compare_versions;
using reservoir::ConfigError;
using reservoir::find_setting;
using reservoir::SettingInfo;
using reservoir::settings;
using reservoir::settings_markdown;

namespace {
constexpr std::size_t kMiB = std::size_t{1} << 20;

std::string error_of(const std::string& text) {
  try {
    (void)AllocatorConfig::parse(text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}
// The PyTorch release whose rules the native policy follows.
TEST(Config, PyTorchVersion) {
  EXPECT_FALSE(AllocatorConfig{}.oldest_segment_first());
  EXPECT_FALSE(AllocatorConfig{}.oldest_block_first());
  EXPECT_FALSE(AllocatorConfig::parse("pytorch_version:2.11").oldest_segment_first());
  EXPECT_FALSE(AllocatorConfig::parse("pytorch_version:2.11").oldest_block_first());
  EXPECT_FALSE(AllocatorConfig::parse("pytorch_version:2.12").oldest_segment_first());
  EXPECT_TRUE(AllocatorConfig::parse("pytorch_version:2.12").oldest_block_first());
  EXPECT_TRUE(AllocatorConfig::parse("pytorch_version:2.13").oldest_segment_first());
  EXPECT_FALSE(AllocatorConfig::parse("pytorch_version:2.13").oldest_block_first());
  EXPECT_TRUE(AllocatorConfig::parse("pytorch_version:2.15").oldest_segment_first());
  EXPECT_EQ(AllocatorConfig::parse("pytorch_version:2.15").to_string(), "pytorch_version:2.15");
  EXPECT_EQ(error_of("pytorch_version:3.1"),
            "allocator config \"pytorch_version:3.1\": key 'pytorch_version': value '3.1' is not "
            "accepted; accepted: a PyTorch 2.x release, as 2.15");
  EXPECT_EQ(error_of("pytorch_version:2.x"),
            "allocator config \"pytorch_version:2.x\": key 'pytorch_version': value '2.x' is not "
            "accepted; accepted: a PyTorch 2.x release, as 2.15");
}

}  // namespace

TEST(Config, EmptyGivesPyTorchDefaults) {
  const AllocatorConfig c = AllocatorConfig::parse("");
  EXPECT_EQ(c.max_split_size, std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(c.max_non_split_rounding_size, 20 * kMiB);
  EXPECT_EQ(c.garbage_collection_threshold, 0.0);
  EXPECT_FALSE(c.expandable_segments);
  for (std::size_t d : c.roundup_power2_divisions) EXPECT_EQ(d, 0u);
  EXPECT_EQ(c.to_string(), "");
}

TEST(Config, ParsesEveryKey) {
  const AllocatorConfig c = AllocatorConfig::parse(
      "max_split_size_mb:40, max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
      "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,"
      "pinned_num_register_threads:8,pinned_use_background_threads:True,backend:native");
  EXPECT_EQ(c.max_split_size, 40 * kMiB);
  EXPECT_EQ(c.max_non_split_rounding_size, 30 * kMiB);
  EXPECT_EQ(c.garbage_collection_threshold, 0.5);
  EXPECT_TRUE(c.release_lock_on_cudamalloc);
  EXPECT_TRUE(c.pinned_use_host_register);
  EXPECT_EQ(c.pinned_num_register_threads, 8u);
  EXPECT_TRUE(c.pinned_use_background_threads);
  EXPECT_EQ(AllocatorConfig::parse(c.to_string()), c);
}

// The list form, with PyTorch's own expectations for these two strings.
TEST(Config, RoundupListFormMatchesPyTorch) {
  const AllocatorConfig a =
      AllocatorConfig::parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]");
  EXPECT_EQ(a.divisions_for(32 * kMiB), 8u);
  EXPECT_EQ(a.divisions_for(64 * kMiB), 8u);
  EXPECT_EQ(a.divisions_for(128 * kMiB), 2u);
  EXPECT_EQ(a.divisions_for(256 * kMiB), 4u);
  EXPECT_EQ(a.divisions_for(512 * kMiB), 2u);
  EXPECT_EQ(a.divisions_for(1024 * kMiB), 4u);
  EXPECT_EQ(a.divisions_for(2048 * kMiB), 1u);
  EXPECT_EQ(a.divisions_for(8192 * kMiB), 1u);
  const AllocatorConfig b =
      AllocatorConfig::parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
  EXPECT_EQ(b.divisions_for(64 * kMiB), 8u);
  EXPECT_EQ(b.divisions_for(128 * kMiB), 8u);
  EXPECT_EQ(b.divisions_for(256 * kMiB), 16u);
  EXPECT_EQ(b.divisions_for(512 * kMiB), 1u);
  EXPECT_EQ(b.divisions_for(1024 * kMiB), 0u);
  EXPECT_EQ(b.divisions_for(2048 * kMiB), 8u);
  EXPECT_EQ(b.divisions_for(4096 * kMiB), 2u);
  const AllocatorConfig c = AllocatorConfig::parse("roundup_power2_divisions:4");
  EXPECT_EQ(c.divisions_for(1000), 4u);
  EXPECT_EQ(c.divisions_for(64 * kMiB), 4u);
  EXPECT_EQ(c.divisions_for(std::size_t{1} << 40), 4u);
  EXPECT_EQ(AllocatorConfig::parse(b.to_string()), b);
}

// Before PyTorch 2.10 the list form's '>' fills from the interval before it,
// that one included: 2.3 to 2.9 record "[256:1,512:2,>:8]" with eight
// divisions at 512 (seen in their snapshots' allocator_settings), 2.10 on
// with two. The release may come before or after the list, or later
// (set_pytorch_version: the release reservoir is installed into).
TEST(Config, RoundupListFormAsEachReleaseReadsIt) {
  const std::string list = "roundup_power2_divisions:[256:1,512:2,>:8]";
  const AllocatorConfig modern = AllocatorConfig::parse(list);
  EXPECT_EQ(modern.divisions_for(256 * kMiB), 1u);
  EXPECT_EQ(modern.divisions_for(512 * kMiB), 2u);
  EXPECT_EQ(modern.divisions_for(1024 * kMiB), 8u);
  for (const char* text : {"roundup_power2_divisions:[256:1,512:2,>:8],pytorch_version:2.9",
                           "pytorch_version:2.3,roundup_power2_divisions:[256:1,512:2,>:8]"}) {
    const AllocatorConfig older = AllocatorConfig::parse(text);
    EXPECT_EQ(older.divisions_for(256 * kMiB), 1u) << text;
    EXPECT_EQ(older.divisions_for(512 * kMiB), 8u) << text;
    EXPECT_EQ(older.divisions_for(1024 * kMiB), 8u) << text;
  }
  EXPECT_EQ(AllocatorConfig::parse(list + ",pytorch_version:2.10").divisions_for(512 * kMiB), 2u);
  AllocatorConfig later = modern;
  later.set_pytorch_version("2.6");
  EXPECT_EQ(later.divisions_for(512 * kMiB), 8u);
  later.set_pytorch_version("2.15");
  EXPECT_EQ(later.divisions_for(512 * kMiB), 2u);
  // An interval given again after the '>' keeps its own; a '>' first has
  // nothing before it.
  AllocatorConfig again = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,>:8,512:4]");
  again.set_pytorch_version("2.9");
  EXPECT_EQ(again.divisions_for(512 * kMiB), 4u);
  AllocatorConfig only = AllocatorConfig::parse("roundup_power2_divisions:[>:8]");
  only.set_pytorch_version("2.9");
  EXPECT_EQ(only.divisions_for(kMiB), 8u);
  // Written out, a release's reading is explicit, and reads back the same.
  const AllocatorConfig written = AllocatorConfig::parse(later.to_string());
  EXPECT_EQ(written.divisions_for(512 * kMiB), 2u);
}

TEST(Config, ErrorsNameKeyValueAndWhatIsAccepted) {
  EXPECT_EQ(error_of("max_split_size_mb:19"),
            "allocator config \"max_split_size_mb:19\": key 'max_split_size_mb': value '19' is "
            "too small; accepted: a whole number of MiB >= 20 (large_segment_size_mb)");
  EXPECT_EQ(error_of("max_split_size_mb:abc"),
            "allocator config \"max_split_size_mb:abc\": key 'max_split_size_mb': value 'abc' is "
            "not a whole number; accepted: a whole number of MiB >= large_segment_size_mb (default 20)");
  EXPECT_EQ(error_of("max_split_size_mb"),
            "allocator config \"max_split_size_mb\": key 'max_split_size_mb' at column 18: "
            "expected ':' but found the end");
  EXPECT_EQ(error_of("max_split_size_mb:"),
            "allocator config \"max_split_size_mb:\": key 'max_split_size_mb' has no value; "
            "accepted: a whole number of MiB >= large_segment_size_mb (default 20)");
  EXPECT_EQ(error_of("garbage_collection_threshold:1.5"),
            "allocator config \"garbage_collection_threshold:1.5\": key "
            "'garbage_collection_threshold': value '1.5' is not accepted; accepted: a number in "
            "(0.0, 1.0)");
  EXPECT_EQ(error_of("expandable_segments:yes"),
            "allocator config \"expandable_segments:yes\": key 'expandable_segments': value 'yes' "
            "is not accepted; accepted: True or False");
  EXPECT_EQ(error_of("roundup_power2_divisions:3"),
            "allocator config \"roundup_power2_divisions:3\": key 'roundup_power2_divisions': "
            "value '3' is not a power of two; accepted: a power of two, or a list "
            "[MiB:divisions,...,>:divisions] with power-of-two MiB keys and power-of-two (or 0) "
            "divisions");
  EXPECT_EQ(error_of("roundup_power2_divisions:[64:8"),
            "allocator config \"roundup_power2_divisions:[64:8\": key 'roundup_power2_divisions': "
            "list is not closed with ']'");
  EXPECT_EQ(error_of("roundup_power2_divisions:[100:8]"),
            "allocator config \"roundup_power2_divisions:[100:8]\": key "
            "'roundup_power2_divisions': interval '100' is not a power-of-two number of MiB");
  EXPECT_EQ(error_of("backend:cudaMallocAsync"),
            "allocator config \"backend:cudaMallocAsync\": key 'backend': value 'cudaMallocAsync' "
            "is not supported by reservoir; accepted: native");
  EXPECT_EQ(error_of("foo:123"),
            "allocator config \"foo:123\": unknown key 'foo'; accepted keys: "
            "max_split_size_mb, max_non_split_rounding_mb, large_segment_size_mb, "
            "garbage_collection_threshold, roundup_power2_divisions, expandable_segments, "
            "expandable_segments_reserve, expandable_segments_reserve_by_class, "
            "per_process_memory_fraction, graph_capture_record_stream_reuse, "
            "throw_on_cudamalloc_oom, release_lock_on_cudamalloc, release_lock_on_hipmalloc, "
            "pinned_use_cuda_host_register, pinned_use_hip_host_register, "
            "pinned_num_register_threads, pinned_use_background_threads, "
            "pinned_reserve_segment_size_mb, pinned_free_catch_all, "
            "pinned_max_round_threshold_mb, pinned_max_cached_size_mb, backend, policy, "
            "paging_release_threshold_mb, paging_slack_mb, native_paged_rescue, retry_searches_pool, "
            "pytorch_version");
  EXPECT_EQ(error_of("max_split_size_mb:40 max_non_split_rounding_mb:30"),
            "allocator config \"max_split_size_mb:40 max_non_split_rounding_mb:30\": key "
            "'max_split_size_mb': value '40max_non_split_rounding_mb' is not a whole number; "
            "accepted: a whole number of MiB >= large_segment_size_mb (default 20)");
  EXPECT_EQ(error_of("pinned_num_register_threads:3"),
            "allocator config \"pinned_num_register_threads:3\": key "
            "'pinned_num_register_threads': value '3' is not accepted; accepted: a power of two "
            "from 1 to 128");
}

TEST(Config, PagingReleaseThreshold) {
  EXPECT_EQ(AllocatorConfig::parse("policy:paging").paging_release_threshold,
            std::numeric_limits<std::size_t>::max());
  const AllocatorConfig c = AllocatorConfig::parse("policy:paging,paging_release_threshold_mb:512");
  EXPECT_EQ(c.paging_release_threshold, 512 * kMiB);
  EXPECT_EQ(c.to_string(), "policy:paging,paging_release_threshold_mb:512");
  EXPECT_EQ(AllocatorConfig::parse(c.to_string()), c);
  EXPECT_EQ(AllocatorConfig::parse("paging_release_threshold_mb:0,policy:paging")
                .paging_release_threshold,
            0u);
  EXPECT_EQ(error_of("paging_release_threshold_mb:64"),
            "allocator config \"paging_release_threshold_mb:64\": key "
            "'paging_release_threshold_mb' applies to policy:paging only; add policy:paging or "
            "leave the key out");
  EXPECT_EQ(error_of("policy:paging,paging_release_threshold_mb:-1"),
            "allocator config \"policy:paging,paging_release_threshold_mb:-1\": key "
            "'paging_release_threshold_mb': value '-1' is not a whole number; accepted: a whole "
            "number of MiB (0: keep no cached memory)");
}

TEST(Config, PagingSlackIsTheNativeBound) {
  EXPECT_EQ(AllocatorConfig::parse("policy:paging").paging_slack, reservoir::kNoPagingBound);
  const AllocatorConfig c = AllocatorConfig::parse("policy:paging,paging_slack_mb:2");
  EXPECT_EQ(c.paging_slack, 2 * kMiB);
  EXPECT_EQ(c.to_string(), "policy:paging,paging_slack_mb:2");
  EXPECT_EQ(AllocatorConfig::parse(c.to_string()), c);
  EXPECT_EQ(AllocatorConfig::parse("policy:paging,paging_slack_mb:0").paging_slack, 0u);
  const AllocatorConfig off = AllocatorConfig::parse("policy:paging,paging_slack_mb:off");
  EXPECT_EQ(off.paging_slack, reservoir::kNoPagingBound);
  EXPECT_EQ(off.to_string(), "policy:paging");
  EXPECT_EQ(error_of("paging_slack_mb:2"),
            "allocator config \"paging_slack_mb:2\": key 'paging_slack_mb' applies to "
            "policy:paging only; add policy:paging or leave the key out");
  EXPECT_EQ(error_of("policy:paging,paging_slack_mb:on"),
            "allocator config \"policy:paging,paging_slack_mb:on\": key 'paging_slack_mb': "
            "value 'on' is not a whole number; accepted: a whole number of MiB, or off");
}

TEST(Config, RetrySearchesPool) {
  EXPECT_TRUE(AllocatorConfig{}.retry_searches_pool);
  EXPECT_TRUE(AllocatorConfig::parse("").retry_searches_pool);
  const AllocatorConfig c = AllocatorConfig::parse("retry_searches_pool:False");
  EXPECT_FALSE(c.retry_searches_pool);
  EXPECT_EQ(c.to_string(), "retry_searches_pool:False");
  EXPECT_EQ(AllocatorConfig::parse(c.to_string()), c);
  EXPECT_EQ(AllocatorConfig::parse("retry_searches_pool:True").to_string(), "");
  EXPECT_EQ(error_of("retry_searches_pool:maybe"),
            "allocator config \"retry_searches_pool:maybe\": key 'retry_searches_pool': value "
            "'maybe' is not accepted; accepted: True or False");
  EXPECT_FALSE(find_setting("retry_searches_pool")->replayed);
}

TEST(Config, NativePagedRescue) {
  EXPECT_TRUE(AllocatorConfig::parse("policy:native_paged").native_paged_rescue);
  const AllocatorConfig c = AllocatorConfig::parse("policy:native_paged,native_paged_rescue:False");
  EXPECT_FALSE(c.native_paged_rescue);
  EXPECT_EQ(c.to_string(), "policy:native_paged,native_paged_rescue:False");
  EXPECT_EQ(AllocatorConfig::parse(c.to_string()), c);
  EXPECT_EQ(AllocatorConfig::parse("policy:native_paged,native_paged_rescue:True").to_string(),
            "policy:native_paged");
  EXPECT_EQ(error_of("native_paged_rescue:False"),
            "allocator config \"native_paged_rescue:False\": key 'native_paged_rescue' applies to "
            "policy:native_paged only; add policy:native_paged or leave the key out");
  EXPECT_EQ(error_of("policy:native_paged,native_paged_rescue:no"),
            "allocator config \"policy:native_paged,native_paged_rescue:no\": key "
            "'native_paged_rescue': value 'no' is not accepted; accepted: True or False");
}

// The keys of newer PyTorch releases: parsed, printed back, and checked.
TEST(Config, NewerPyTorchKeys) {
  const std::string text =
      "large_segment_size_mb:12,per_process_memory_fraction:0.5,"
      "graph_capture_record_stream_reuse:True,throw_on_cudamalloc_oom:True,"
      "pinned_reserve_segment_size_mb:64,pinned_free_catch_all:True,"
      "pinned_max_round_threshold_mb:8,pinned_max_cached_size_mb:256";
  const AllocatorConfig c = AllocatorConfig::parse(text);
  EXPECT_EQ(c.large_segment_size, 12 * kMiB);
  EXPECT_EQ(c.per_process_memory_fraction, 0.5);
  EXPECT_TRUE(c.graph_capture_record_stream_reuse);
  EXPECT_TRUE(c.throw_on_cudamalloc_oom);
  EXPECT_EQ(c.pinned_reserve_segment_size, 64 * kMiB);
  EXPECT_TRUE(c.pinned_free_catch_all);
  EXPECT_EQ(c.pinned_max_round_threshold, 8 * kMiB);
  EXPECT_EQ(c.pinned_max_cached_size, 256 * kMiB);
  EXPECT_EQ(c.to_string(), text);
  EXPECT_EQ(AllocatorConfig::parse(c.to_string()), c);
  // ROCm's names set the same fields.
  const AllocatorConfig rocm =
      AllocatorConfig::parse("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:True");
  EXPECT_TRUE(rocm.release_lock_on_cudamalloc);
  EXPECT_TRUE(rocm.pinned_use_host_register);
  EXPECT_EQ(rocm.to_string(), "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True");

  EXPECT_EQ(error_of("large_segment_size_mb:13"),
            "allocator config \"large_segment_size_mb:13\": key 'large_segment_size_mb': value "
            "'13' is not even; accepted: an even whole number of MiB >= 2 (segments are made of 2 "
            "MiB pages)");
  EXPECT_EQ(error_of("large_segment_size_mb:40,max_split_size_mb:30"),
            "allocator config \"large_segment_size_mb:40,max_split_size_mb:30\": key "
            "'max_split_size_mb': value '30' is too small; accepted: a whole number of MiB >= 40 "
            "(large_segment_size_mb)");
  // PyTorch's range and words: 0.0 allows no memory at all; outside [0, 1] is invalid.
  EXPECT_EQ(AllocatorConfig::parse("per_process_memory_fraction:0").per_process_memory_fraction, 0.0);
  EXPECT_EQ(error_of("per_process_memory_fraction:-0.1"),
            "allocator config \"per_process_memory_fraction:-0.1\": per_process_memory_fraction is "
            "invalid, set it in [0.0, 1.0] (the value given: '-0.1')");
  EXPECT_EQ(error_of("per_process_memory_fraction:1.1"),
            "allocator config \"per_process_memory_fraction:1.1\": per_process_memory_fraction is "
            "invalid, set it in [0.0, 1.0] (the value given: '1.1')");
  EXPECT_EQ(AllocatorConfig::parse("per_process_memory_fraction:1").per_process_memory_fraction,
            1.0);
}

// docs/config.md holds the table verbatim, and every row is a key the
// parser takes and the printer writes back.
TEST(Config, TheTableIsTheDocsAndTheParser) {
  std::ifstream in(std::string(RESERVOIR_SOURCE_DIR) + "/docs/config.md");
  const std::string docs((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(docs.find(settings_markdown()), std::string::npos)
      << "docs/config.md does not hold the table `reservoir settings` prints";
  std::set<std::string_view> keys;
  for (const SettingInfo& s : settings()) {
    EXPECT_TRUE(keys.insert(s.key).second) << s.key << " is declared twice";
    EXPECT_EQ(find_setting(s.key), &s);
    if (!s.since.empty()) {
      EXPECT_EQ(s.pytorch.find(s.since), s.pytorch[0] == '~' ? 1u : 0u) << s.key;
    }
  }
  EXPECT_EQ(find_setting("no_such_key"), nullptr);
  EXPECT_EQ(keys.size(), 28u);
}

// PyTorch 2.15's reserve of each expandable segment: a fraction of the
// device or GiB; an invalid value is ignored with PyTorch's warning (its
// default kept), a list's bad entry alone; the list replaces an earlier one.
TEST(Config, TheExpandableSegmentReserveIsReadAsPyTorch215ReadsIt) {
  constexpr std::size_t kGiB = std::size_t{1} << 30;
  const std::size_t total = 80 * kGiB;
  const AllocatorConfig none = AllocatorConfig::parse("expandable_segments:True");
  EXPECT_EQ(none.segment_reserve("", total), total + total / 8);
  const AllocatorConfig half = AllocatorConfig::parse("expandable_segments:True,expandable_segments_reserve:0.5");
  EXPECT_EQ(half.segment_reserve("", total), total / 2);
  EXPECT_EQ(half.segment_reserve("decode", total), total / 2);  // a class without an entry takes the global one
  EXPECT_TRUE(half.warnings.list.empty());
  EXPECT_EQ(half.to_string(), "expandable_segments:True,expandable_segments_reserve:0.5");
  const AllocatorConfig gib = AllocatorConfig::parse("expandable_segments_reserve:40G");
  EXPECT_EQ(gib.segment_reserve("", total), 40 * kGiB);
  EXPECT_EQ(AllocatorConfig::parse("expandable_segments_reserve:1e20G").segment_reserve("", total),
            total + total / 8);  // at most 9/8 of the device
  EXPECT_EQ(AllocatorConfig::parse("expandable_segments_reserve:2").segment_reserve("", total), total + total / 8);
  const AllocatorConfig classes = AllocatorConfig::parse(
      "expandable_segments_reserve:0.25,expandable_segments_reserve_by_class:[prefill:0.5,decode:4G,bad:x]");
  EXPECT_EQ(classes.segment_reserve("prefill", total), total / 2);
  EXPECT_EQ(classes.segment_reserve("decode", total), 4 * kGiB);
  EXPECT_EQ(classes.segment_reserve("bad", total), total / 4);
  EXPECT_EQ(classes.segment_reserve("", total), total / 4);
  ASSERT_EQ(classes.warnings.list.size(), 1u);
  EXPECT_EQ(classes.warnings.list[0],
            "Ignoring invalid expandable-segment reserve value 'x' in PYTORCH_CUDA_ALLOC_CONF (expected a "
            "positive, finite fraction like 0.5 or an absolute size like 40G); using default.");
  EXPECT_EQ(classes.to_string(),
            "expandable_segments_reserve:0.25,expandable_segments_reserve_by_class:[decode:4G,prefill:0.5]");
  EXPECT_EQ(AllocatorConfig::parse(classes.to_string()), classes);
  for (const char* bad : {"0", "-0.5", "inf", "nan", "G", "0.5GB", "abc"}) {
    const AllocatorConfig c = AllocatorConfig::parse(std::string("expandable_segments_reserve:") + bad);
    EXPECT_FALSE(c.expandable_segments_reserve.has_value()) << bad;
    EXPECT_EQ(c.warnings.list.size(), 1u) << bad;
    EXPECT_EQ(c, AllocatorConfig{}) << bad;
  }
  EXPECT_EQ(AllocatorConfig::parse("expandable_segments_reserve_by_class:[a:0.5],"
                                   "expandable_segments_reserve_by_class:[b:0.25]")
                .expandable_segments_reserve_by_class.size(),
            1u);
  EXPECT_THROW(AllocatorConfig::parse("expandable_segments_reserve_by_class:[a:0.5"), ConfigError);
  EXPECT_THROW(AllocatorConfig::parse("expandable_segments_reserve_by_class:a"), ConfigError);
}

TEST(Config, VersionsCompareByNumber) {
  EXPECT_LT(compare_versions("2.9", "2.14"), 0);
  EXPECT_GT(compare_versions("2.10", "2.9"), 0);
  EXPECT_EQ(compare_versions("2.4", "2.4"), 0);
  EXPECT_LT(compare_versions("2", "2.1"), 0);
}

// PYTORCH_ALLOC_CONF (PyTorch's name since 2.9) before the older
// PYTORCH_CUDA_ALLOC_CONF; RESERVOIR_ALLOC_CONF before both.
TEST(Config, PyTorchAllocConfBeforeTheOlderName) {
  ::unsetenv("RESERVOIR_ALLOC_CONF");
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:100", 1);
  ::setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:300", 1);
  EXPECT_EQ(AllocatorConfig::from_env().max_split_size, 300 * kMiB);
  ::unsetenv("PYTORCH_ALLOC_CONF");
  EXPECT_EQ(AllocatorConfig::from_env().max_split_size, 100 * kMiB);
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
}

TEST(Config, EnvironmentPrefersOursOverPyTorchs) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:100", 1);
  ::unsetenv("RESERVOIR_ALLOC_CONF");
  EXPECT_EQ(AllocatorConfig::from_env().max_split_size, 100 * kMiB);
  ::setenv("RESERVOIR_ALLOC_CONF", "max_split_size_mb:200", 1);
  EXPECT_EQ(AllocatorConfig::from_env().max_split_size, 200 * kMiB);
  ::unsetenv("RESERVOIR_ALLOC_CONF");
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  EXPECT_EQ(AllocatorConfig::from_env(), AllocatorConfig{});
}
