// The hot paths, counted in instructions under callgrind: the cache-hit
// allocate+free pair (one size; eight mixed sizes; two streams; through a
// saver with a tag existing; inside a tag), under each policy, and one
// replayed event. Instructions, unlike time, are the same on every run of
// the same binary, so a slowdown shows at once (scripts/instruction_budget.py
// holds each case to bench/instruction_budgets.json).
//
// usage: pair_instructions CASE [N]     (pair_instructions --list for the cases)
//
// The case is set up and warmed, then N operations (default 20,000) run
// between CALLGRIND_TOGGLE_COLLECT marks; run under
// `valgrind --tool=callgrind --collect-atstart=no`, the collected total
// divided by N is the cost of one. Outside valgrind it runs the same work
// and prints the operation count.
#include <fmt/format.h>
#include <valgrind/callgrind.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/saver.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"

namespace {

using reservoir::AllocatorConfig;
using reservoir::CachingAllocator;
using reservoir::Saver;
using reservoir::SimDevice;

constexpr std::array<std::size_t, 8> kMixed = {512,     4096,    65536,   300000,
                                               1048576, 2097152, 5000000, 8388608};

// A measured loop: `make` prepares and returns the i-th call, which does
// `units` of the counted work (pairs, or replayed events).
struct Case {
  std::function<std::function<void(std::size_t)>()> make;
  std::size_t units = 1;
};

template <typename Alloc>
void warm(Alloc& a, std::size_t size, std::uint64_t stream) {
  a.deallocate(a.allocate(size, stream));
}

// A plain allocator under a policy: the pair of one size, of mixed sizes, or
// alternating between two streams.
Case allocator_case(const char* config, int kind) {
  return {[config, kind] {
    struct State {
      SimDevice device;
      CachingAllocator allocator;
      explicit State(const char* c) : allocator(device, AllocatorConfig::parse(c)) {}
    };
    auto s = std::make_shared<State>(config);
    for (const std::size_t size : kMixed) {
      warm(s->allocator, size, 0);
      warm(s->allocator, size, 1);
    }
    return std::function<void(std::size_t)>([s, kind](std::size_t i) {
      const std::size_t size = kind == 1 ? kMixed[i % kMixed.size()] : 4096;
      const reservoir::StreamId stream = kind == 2 ? i % 2 : 0;
      void* p = s->allocator.allocate(size, stream);
      s->allocator.deallocate(p);
    });
  }};
}

// Through a saver: with no tag, with a tag existing (the pair outside it),
// or inside it.
enum class Tag { none, exists, inside };
Case saver_case(const char* config, Tag tag) {
  return {[config, tag] {
    struct State {
      SimDevice device;
      std::unique_ptr<Saver> saver;
      std::uint64_t token = 0;
    };
    auto s = std::make_shared<State>();
    reservoir::SaverOptions o;
    o.config = AllocatorConfig::parse(config);
    s->saver = std::make_unique<Saver>(s->device, o);
    if (tag != Tag::none) {
      auto r = s->saver->region("kv_cache");
      s->saver->deallocate(s->saver->allocate(4096));
    }
    if (tag == Tag::inside) s->token = s->saver->push_region("kv_cache");
    s->saver->deallocate(s->saver->allocate(4096));
    return std::function<void(std::size_t)>([s](std::size_t) {
      void* p = s->saver->allocate(4096);
      s->saver->deallocate(p);
    });
  }};
}

// glibc's malloc+free of the same size, for scale.
Case glibc_case(bool mixed) {
  return {[mixed] {
    return std::function<void(std::size_t)>([mixed](std::size_t i) {
      void* p = std::malloc(mixed ? kMixed[i % kMixed.size()] : 4096);
      asm volatile("" : : "r"(p) : "memory");
      std::free(p);
    });
  }};
}

// A synthetic program of allocations and frees (sizes 512 B to 32 MiB,
// about half live), as a replayed trace holds them.
reservoir::Trace synthetic_trace() {
  reservoir::Trace t;
  t.name = "synthetic";
  t.format = "reservoir-text";
  std::uint64_t rng = 88172645463325252ULL;
  const auto random = [&rng] {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  };
  std::vector<std::pair<std::uint64_t, std::uint64_t>> held;
  std::uint64_t next = 0x1000;
  for (int i = 0; i < 4000; ++i) {
    if (held.empty() || random() % 100 < 55) {
      const std::uint64_t size = (std::uint64_t{1} << (9 + random() % 16)) + random() % 4096;
      t.events.push_back({.action = reservoir::TraceAction::alloc, .addr = next, .size = size});
      held.emplace_back(next, size);
      next += std::uint64_t{1} << 26;
    } else {
      const std::size_t k = random() % held.size();
      t.events.push_back({.action = reservoir::TraceAction::free_completed,
                          .addr = held[k].first,
                          .size = held[k].second});
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  return t;
}

// One replayed event: each call replays the whole program on a fresh
// allocator (its setup spread over the events, as a replay pays it).
Case replay_case() {
  const reservoir::Trace t = synthetic_trace();
  auto program = std::make_shared<reservoir::ReplayProgram>(reservoir::compile(t));
  return {[program] {
            return std::function<void(std::size_t)>([program](std::size_t) {
              (void)reservoir::replay(*program, AllocatorConfig{}, "");
            });
          },
          t.events.size()};
}

const std::map<std::string, Case>& cases() {
  static const std::map<std::string, Case> all = [] {
    std::map<std::string, Case> m;
    const std::array<std::pair<const char*, const char*>, 4> policies = {
        {{"native", ""},
         {"expandable", "expandable_segments:True"},
         {"paging", "policy:paging"},
         {"native_paged", "policy:native_paged"}}};
    for (const auto& [name, config] : policies) {
      m[fmt::format("{}/one_size", name)] = allocator_case(config, 0);
      m[fmt::format("{}/mixed_sizes", name)] = allocator_case(config, 1);
      m[fmt::format("{}/two_streams", name)] = allocator_case(config, 2);
      m[fmt::format("{}/saver_no_tag", name)] = saver_case(config, Tag::none);
      m[fmt::format("{}/saver_tag_exists", name)] = saver_case(config, Tag::exists);
      m[fmt::format("{}/saver_inside_tag", name)] = saver_case(config, Tag::inside);
    }
    m["glibc/one_size"] = glibc_case(false);
    m["glibc/mixed_sizes"] = glibc_case(true);
    m["replay/event"] = replay_case();
    return m;
  }();
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--list") {
    for (const auto& [name, c] : cases()) fmt::print("{}\n", name);
    return 0;
  }
  if (argc < 2) {
    fmt::print(stderr, "usage: pair_instructions CASE [N] (--list: the cases)\n");
    return 2;
  }
  const auto it = cases().find(argv[1]);
  if (it == cases().end()) {
    fmt::print(stderr, "pair_instructions: no case '{}' (--list: the cases)\n", argv[1]);
    return 2;
  }
  const Case& c = it->second;
  const std::size_t n =
      argc >= 3 ? std::strtoull(argv[2], nullptr, 10) : std::max<std::size_t>(1, 20000 / c.units);
  const std::function<void(std::size_t)> op = c.make();
  for (std::size_t i = 0; i < std::min<std::size_t>(n, 64); ++i)
    op(i);  // warm: every request a hit
  CALLGRIND_TOGGLE_COLLECT;
  for (std::size_t i = 0; i < n; ++i) op(i);
  CALLGRIND_TOGGLE_COLLECT;
  // The units counted: what the collected instructions are divided by.
  fmt::print("{} {}\n", it->first, n * c.units);
  return 0;
}
