// AllocatorConfig: the allocator's policy, as data.
//
// Parsed from RESERVOIR_ALLOC_CONF in PyTorch's syntax and key names
// ("max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:8]");
// PYTORCH_ALLOC_CONF, then PYTORCH_CUDA_ALLOC_CONF, are read when it is
// unset. Unknown keys and bad values raise ConfigError naming the key, the
// value and what is accepted. Every key is declared once, in the table
// settings() gives: the parser, its errors, the printer, the reading of a
// snapshot's allocator_settings, advise's sweep and docs/config.md follow it.
#pragma once

#include <array>
#include <cstddef>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace reservoir {

inline constexpr std::size_t kRoundupIntervals = 16;  // 1 MiB .. 64 GiB, powers of two

enum class Policy { native, expandable, paging, native_paged };

// paging_release_threshold's default: keep all cached memory.
inline constexpr std::size_t kNoReleaseThreshold = std::numeric_limits<std::size_t>::max();

// paging_slack's value for no bound (the default).
inline constexpr std::size_t kNoPagingBound = std::numeric_limits<std::size_t>::max();

struct AllocatorConfig {
  // Blocks of this size or more are never split (default: unlimited).
  std::size_t max_split_size = std::numeric_limits<std::size_t>::max();
  // The segment a large-pool request below 10 MiB gets, and the large pool's
  // page under expandable segments (PyTorch's large_segment_size_mb).
  std::size_t large_segment_size = std::size_t{20} << 20;
  // A request >= max_split_size may take a cached block up to this much larger.
  std::size_t max_non_split_rounding_size = std::size_t{20} << 20;
  // Divisions per power-of-two interval, for sizes from 1 MiB (index 0) to
  // 32 GiB and beyond (index 15); 0 or 1 means plain 512-byte rounding.
  std::array<std::size_t, kRoundupIntervals> roundup_power2_divisions{};
  // Fraction of the allowed memory above which cached blocks are reclaimed
  // by age (only with a memory fraction set); 0 disables.
  double garbage_collection_threshold = 0.0;
  bool expandable_segments = false;
  // Accepted for compatibility; reservoir never drops its lock around device calls.
  bool release_lock_on_cudamalloc = false;
  // Pinned host allocator settings (used by the saver).
  bool pinned_use_host_register = false;
  std::size_t pinned_num_register_threads = 1;
  bool pinned_use_background_threads = false;
  std::size_t pinned_reserve_segment_size = 0;
  bool pinned_free_catch_all = false;
  std::size_t pinned_max_round_threshold = std::numeric_limits<std::size_t>::max();
  std::size_t pinned_max_cached_size = std::numeric_limits<std::size_t>::max();
  // Accepted, not modelled: replay does not route allocations to the
  // private pools of CUDA graphs, nor fail before the device would.
  bool graph_capture_record_stream_reuse = false;
  bool throw_on_cudamalloc_oom = false;
  // policy:native_paged: where the native policy's choice finds no memory,
  // serve the request from the free block (of either default pool, any
  // stream's) with the fewest pages still to map before raising
  // out-of-memory. False: the native policy's decisions even then.
  bool native_paged_rescue = true;
  // After the retry ladder has waited for the frees pending on other
  // streams' events (and released the cache), search the pool again before
  // asking the device: a block freed by that wait serves the request rather
  // than out-of-memory being raised (pytorch/pytorch#189504). Every release
  // of PyTorch only asks the device again there; replay and verify model
  // that (false), a live allocator of reservoir's searches (true).
  bool retry_searches_pool = true;
  // set_per_process_memory_fraction from the config string (1.0: none).
  double per_process_memory_fraction = 1.0;
  // PyTorch 2.15's virtual-address reserve of each expandable segment: a
  // fraction of the device's memory ("0.5") or GiB ("40G"); the segment
  // reserves that much (at most 9/8 of the device, its reserve without the
  // setting). expandable_segments_reserve applies to every stream without a
  // class of its own; _by_class to the streams given that class
  // (CachingAllocator::set_stream_reserve_class, PyTorch's
  // setExpandableSegmentReserveClassForStream). A request larger than its
  // stream's reserve fails: no segment can hold it.
  struct Reserve {
    bool fraction = true;  // of the device's memory; else GiB
    double value = 0.0;
    // Resolved against the device's memory, saturating.
    std::size_t bytes(std::size_t device_total) const noexcept;
    bool operator==(const Reserve&) const = default;
  };
  std::optional<Reserve> expandable_segments_reserve;
  std::vector<std::pair<std::string, Reserve>> expandable_segments_reserve_by_class;  // by name
  // The reserve of a segment for a stream of `reserve_class` ("" none) on a
  // device of `device_total` bytes: as PyTorch 2.15 decides it.
  std::size_t segment_reserve(std::string_view reserve_class, std::size_t device_total) const;
  // What the text set that its release ignores with a warning rather than
  // refuses (an invalid reserve value: PyTorch keeps its default), in the
  // order given. Not compared.
  struct Warnings {
    std::vector<std::string> list;
    bool operator==(const Warnings&) const { return true; }
  };
  Warnings warnings;
  Policy policy = Policy::native;
  // policy:paging: cached memory (reserved minus allocated) kept after a
  // free; whole free handles beyond it go back to the device at once rather
  // than when memory runs short or empty_cache() is called. Default:
  // unlimited (PyTorch's caching: nothing goes back unasked).
  std::size_t paging_release_threshold = kNoReleaseThreshold;
  // policy:paging with the native bound: reserved memory held, wherever
  // paging grows, within what the native policy would reserve for the same
  // program at the same point plus this much per stream; free handles above
  // that go back to the device. kNoPagingBound (the default): no bound, and
  // no model of the native policy kept beside the allocator.
  std::size_t paging_slack = kNoPagingBound;
  // The PyTorch release whose decisions the native policy takes where
  // releases differ ("2.15"); empty: those of 2.11 and before.
  std::string pytorch_version;
  // What a release before 2.10 reads differently in roundup_power2_divisions'
  // list form: its '>' fills from the last interval given, that one
  // included ("[256:1,512:2,>:8]" gives 512 eight divisions in 2.3 to 2.9;
  // 2.10 fills after it). The interval (kRoundupIntervals: none), what it
  // was given and what the '>' gave. set_pytorch_version applies it. Not
  // compared: two settings that decide alike now are equal.
  struct RoundupOverlap {
    std::size_t index = kRoundupIntervals;
    std::size_t given = 0;
    std::size_t after = 0;
    bool operator==(const RoundupOverlap&) const { return true; }
  };
  RoundupOverlap roundup_overlap;
  // Takes `release`'s decisions (pytorch_version) and reads the settings text
  // as that release does (roundup_overlap).
  void set_pytorch_version(std::string release);

  // Of cached blocks of equal size, PyTorch 2.13 and later take the one
  // whose segment was made first (then the lowest address); 2.12 the block
  // made first (a split's front is a new block, a merge keeps the freed
  // one's age); before, the one at the lowest address. Measured on the
  // real releases (tests/torch/test_oracle.py, under each).
  bool oldest_segment_first() const;
  bool oldest_block_first() const;
  // Before PyTorch 2.15, empty_cache leaves the default pools' cached blocks
  // (and their pending events) alone while a pool route is open (a graph
  // capture or use_mem_pool: its captures_underway), and releases only the
  // private pools no longer in use; 2.15 releases both. Measured on 2.11
  // and 2.15 (tests/torch/test_graphs.py); 2.12 to 2.14 are taken as 2.11.
  bool empty_cache_spares_default_pools_while_routed() const;
  // From PyTorch 2.5 (pytorch/pytorch#128068) a private pool's memory (a CUDA
  // graph's, a MemPool's) comes from expandable segments too when they are
  // on, one reservation per stream and pool; before, private pools kept
  // ordinary segments. Measured on 2.11 and 2.15 (tests/torch/test_graphs.py).
  bool private_pools_expandable() const;
  // Before PyTorch 2.4, a request of more than 512 bytes in an interval of
  // one division (roundup_power2_divisions) keeps its size, unaligned;
  // from 2.4 it is rounded to 512 bytes. Measured on 2.3.1 and 2.4.1
  // (tests/torch/test_oracle.py under each).
  bool one_division_keeps_size() const;

  // The division count for a (rounded) request size.
  std::size_t divisions_for(std::size_t size) const noexcept;

  // Parses a configuration string. An empty string gives the defaults.
  static AllocatorConfig parse(const std::string& text);
  // RESERVOIR_ALLOC_CONF, else PYTORCH_ALLOC_CONF, else
  // PYTORCH_CUDA_ALLOC_CONF, else defaults.
  static AllocatorConfig from_env();
  // The canonical string for this configuration ("" for the defaults).
  std::string to_string() const;
  // The same settings under the native policy (reservoir's policy keys
  // dropped): what native_paged and paging's native bound compare with.
  AllocatorConfig with_native_policy() const;

  bool operator==(const AllocatorConfig&) const = default;
};

// A segment policy reservoir has: where memory comes from when no cached
// block serves a request. Listed in one table (src/allocator/segment_sources.cpp).
struct PolicyInfo {
  Policy policy;
  std::string_view name;     // its `policy:` value
  std::string_view summary;  // one line
  bool needs_virtual_memory;
  // Its blocks are where the native policy puts them, in segments of the
  // native policy's sizes (only how memory backs them differs): it never
  // reserves more than the native policy for the same program.
  bool native_layout;
};
// Every policy, in the table's order (native first).
std::span<const PolicyInfo> policies() noexcept;
// A policy's `policy:` value.
std::string_view to_string(Policy policy) noexcept;

// One allocator setting, as declared in the table.
struct SettingInfo {
  std::string_view key;            // as written in a config string
  std::string_view value;          // what is accepted (errors and docs say this)
  std::string_view default_value;  // for docs
  std::string_view pytorch;        // the PyTorch versions that know it ("2.1+"; "reservoir")
  std::string_view since;          // the first of them ("2.1"; "" for reservoir's own keys)
  std::string_view snapshot_key;   // its key in a snapshot's allocator_settings ("" none)
  std::string_view effect;         // what it sets
  bool replayed;                   // replay, verify and advise apply it
};

// Every key the parser accepts, in docs order (aliases are separate rows).
std::span<const SettingInfo> settings();
// The row of `key`, or null.
const SettingInfo* find_setting(std::string_view key);

// The table as Markdown (docs/config.md holds it verbatim; `reservoir
// settings` prints it).
std::string settings_markdown();

// "2.9" < "2.14": compares dotted version numbers.
int compare_versions(std::string_view a, std::string_view b);

}  // namespace reservoir
