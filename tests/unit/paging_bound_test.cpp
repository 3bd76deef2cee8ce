// policy:paging's native bound (paging_slack_mb, docs/config.md): reserved
// memory within what the native policy would reserve for the same program at
// the same point, plus the slack per stream. Checked over seeded programs of
// several families (training steps, inference with varying batch and
// sequence, huge allocations among small ones, several streams, empty_cache
// anywhere) run under both policies on a device without a capacity limit,
// the bound looked at after every step; a failing program shrinks to a
// minimal one. The model of the native policy the bound rests on is checked
// exactly: its reserved memory is the native policy's at every step.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "native_shadow.hpp"
#include "reservoir/caching_allocator.hpp"
#include "reservoir/sim_device.hpp"

namespace reservoir::testing {
namespace {

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

// One step of a program. Allocations are numbered in order; a free or a
// stream use names the allocation by its number.
struct Step {
  enum Kind : std::uint8_t { alloc, free, use, empty } kind;
  std::size_t size = 0;  // alloc: bytes
  int stream = 0;        // alloc: its stream; use: the other stream
  int id = -1;           // free, use: the allocation
};
using Program = std::vector<Step>;

struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return s >> 33;
  }
  std::size_t below(std::size_t n) { return n == 0 ? 0 : next() % n; }
  bool chance(int percent) { return static_cast<int>(next() % 100) < percent; }
};

// The program builder: allocations tracked so frees name live ones.
class Builder {
 public:
  explicit Builder(Rng& rng) : rng_(rng) {}
  int alloc(std::size_t size, int stream = 0) {
    prog_.push_back({Step::alloc, std::max<std::size_t>(size, 1), stream, -1});
    live_.push_back(next_id_);
    return next_id_++;
  }
  void free(int id) {
    prog_.push_back({Step::free, 0, 0, id});
    live_.erase(std::find(live_.begin(), live_.end(), id));
  }
  void free_random() {
    if (!live_.empty()) free(live_[rng_.below(live_.size())]);
  }
  void use(int id, int stream) { prog_.push_back({Step::use, 0, stream, id}); }
  void maybe_empty(int percent) {
    if (rng_.chance(percent)) prog_.push_back({Step::empty, 0, 0, -1});
  }
  const std::vector<int>& live() const { return live_; }
  Program take() { return std::move(prog_); }

 private:
  Rng& rng_;
  Program prog_;
  std::vector<int> live_;
  int next_id_ = 0;
};

std::size_t small_size(Rng& r) { return 1 + r.below(kMiB); }
std::size_t mid_size(Rng& r) { return kMiB + r.below(20 * kMiB); }
std::size_t big_size(Rng& r) { return 20 * kMiB + r.below(300 * kMiB); }

// Weights, then steps of forward (activations kept), backward (freed in
// reverse, gradients made), optimizer (temporaries).
void training(Builder& b, Rng& r) {
  const int layers = 2 + static_cast<int>(r.below(10));
  std::vector<std::size_t> weight(static_cast<std::size_t>(layers));
  for (auto& w : weight) {
    w = r.chance(30) ? small_size(r) : (r.chance(70) ? mid_size(r) : big_size(r));
    b.alloc(w);
  }
  const std::size_t act = kMiB * (1 + r.below(64));
  const int steps = 1 + static_cast<int>(r.below(4));
  std::vector<int> grads;
  for (int s = 0; s < steps; ++s) {
    std::vector<int> acts;
    for (int l = 0; l < layers; ++l) {
      acts.push_back(b.alloc(act + r.below(act / 4 + 1)));
      if (r.chance(40)) b.free(b.alloc(small_size(r)));  // a workspace
      b.maybe_empty(2);
    }
    for (int l = layers - 1; l >= 0; --l) {
      const int tmp = b.alloc(act);
      b.free(acts[static_cast<std::size_t>(l)]);
      if (s == 0) grads.push_back(b.alloc(weight[static_cast<std::size_t>(l)]));
      b.free(tmp);
    }
    for (int g = 0; g < layers; ++g) b.free(b.alloc(weight[static_cast<std::size_t>(g)] / 2 + 512));
    b.maybe_empty(5);
  }
}

// Requests of varying batch and sequence length: a KV cache and activations
// scaled by both, all freed at the end of the request.
void inference(Builder& b, Rng& r) {
  b.alloc(big_size(r));  // weights
  const int requests = 2 + static_cast<int>(r.below(8));
  for (int q = 0; q < requests; ++q) {
    const std::size_t batch = 1 + r.below(16);
    const std::size_t seq = 16 * (1 + r.below(128));
    std::vector<int> mine;
    mine.push_back(b.alloc(batch * seq * 4 * kKiB));  // KV cache
    const int layers = 2 + static_cast<int>(r.below(6));
    for (int l = 0; l < layers; ++l) {
      const int h = b.alloc(batch * seq * 2 * kKiB + r.below(4096));
      const int scores = b.alloc(batch * seq * seq * 2 / 16 + 512);
      b.free(scores);
      mine.push_back(h);
      if (mine.size() > 3) {
        b.free(mine[1]);
        mine.erase(mine.begin() + 1);
      }
    }
    for (int id : mine) b.free(id);
    b.maybe_empty(10);
  }
}

// Many small allocations with a few huge ones among them.
void huge_among_small(Builder& b, Rng& r) {
  const int n = 40 + static_cast<int>(r.below(200));
  for (int i = 0; i < n; ++i) {
    if (r.chance(4)) {
      b.alloc(kGiB / 2 + r.below(2 * kGiB));
    } else if (r.chance(20)) {
      b.alloc(mid_size(r));
    } else {
      b.alloc(small_size(r));
    }
    if (r.chance(45)) b.free_random();
    b.maybe_empty(1);
  }
}

// Random work on two to four streams, with uses on other streams.
void streams(Builder& b, Rng& r) {
  const int nstreams = 2 + static_cast<int>(r.below(3));
  const int n = 40 + static_cast<int>(r.below(200));
  for (int i = 0; i < n; ++i) {
    const int s = static_cast<int>(r.below(static_cast<std::size_t>(nstreams)));
    const std::size_t size = r.chance(50) ? small_size(r) : (r.chance(80) ? mid_size(r) : big_size(r));
    const int id = b.alloc(size, s);
    if (r.chance(10)) b.use(id, (s + 1) % nstreams);
    if (r.chance(48)) b.free_random();
    b.maybe_empty(1);
  }
}

Program generate(std::uint64_t seed) {
  Rng r{seed * 0x9e3779b97f4a7c15ULL + 1};
  Builder b(r);
  const int parts = 1 + static_cast<int>(r.below(3));
  for (int i = 0; i < parts; ++i) {
    switch (r.below(4)) {
      case 0: training(b, r); break;
      case 1: inference(b, r); break;
      case 2: huge_among_small(b, r); break;
      default: streams(b, r); break;
    }
  }
  if (r.chance(50)) {
    const std::vector<int> live = b.live();
    for (int id : live) b.free(id);
  }
  return b.take();
}

// Runs a program under the native policy and under `paging_config`;
// returns the first step where paging's reserved memory passes the native
// policy's plus the slack per stream allocated on so far, described.
std::optional<std::string> first_violation(const Program& prog, const std::string& paging_config,
                                           std::size_t slack = 2 * kMiB,
                                           std::size_t* worst_excess = nullptr) {
  SimDeviceOptions options;
  options.capacity = std::size_t{1} << 40;  // no capacity pressure
  options.auto_complete_events = true;
  SimDevice native_device(options);
  SimDevice paging_device(options);
  CachingAllocator native(native_device, AllocatorConfig::parse(""));
  CachingAllocator paging(paging_device, AllocatorConfig::parse(paging_config));
  std::map<int, std::pair<void*, void*>> ptrs;
  std::set<int> streams;
  int id = 0;
  for (std::size_t i = 0; i < prog.size(); ++i) {
    const Step& s = prog[i];
    switch (s.kind) {
      case Step::alloc:
        streams.insert(s.stream);
        ptrs[id++] = {native.allocate(s.size, static_cast<StreamId>(s.stream)),
                      paging.allocate(s.size, static_cast<StreamId>(s.stream))};
        break;
      case Step::free:
        if (auto it = ptrs.find(s.id); it != ptrs.end()) {
          native.deallocate(it->second.first);
          paging.deallocate(it->second.second);
          ptrs.erase(it);
        }
        break;
      case Step::use:
        if (auto it = ptrs.find(s.id); it != ptrs.end()) {
          native.record_stream(it->second.first, static_cast<StreamId>(s.stream));
          paging.record_stream(it->second.second, static_cast<StreamId>(s.stream));
        }
        break;
      case Step::empty:
        native.empty_cache();
        paging.empty_cache();
        break;
    }
    const auto n = static_cast<std::size_t>(native.stats().reserved_bytes[0].current);
    const auto p = static_cast<std::size_t>(paging.stats().reserved_bytes[0].current);
    const std::size_t allowed = n + slack * std::max<std::size_t>(streams.size(), 1);
    if (worst_excess != nullptr && p > n) *worst_excess = std::max(*worst_excess, p - n);
    if (p > allowed) {
      return fmt::format("step {} of {}: paging reserves {} bytes, native {} (+{} allowed)", i,
                         prog.size(), p, n, allowed - n);
    }
  }
  return std::nullopt;
}

// Drops the steps of allocation `id` (its free and uses too) and renumbers.
Program without_alloc(const Program& prog, int id) {
  Program out;
  int seen = -1;
  for (const Step& s : prog) {
    if (s.kind == Step::alloc) {
      ++seen;
      if (seen == id) continue;
      out.push_back(s);
    } else if (s.kind == Step::free || s.kind == Step::use) {
      if (s.id == id) continue;
      Step t = s;
      if (t.id > id) --t.id;
      out.push_back(t);
    } else {
      out.push_back(s);
    }
  }
  return out;
}

// A minimal failing program: allocations (with their frees and uses), then
// frees, uses and empty_cache steps, removed one at a time while it still fails.
Program shrink(Program prog, const std::string& config) {
  bool smaller = true;
  while (smaller) {
    smaller = false;
    int allocs = 0;
    for (const Step& s : prog) allocs += s.kind == Step::alloc ? 1 : 0;
    for (int id = allocs - 1; id >= 0; --id) {
      Program candidate = without_alloc(prog, id);
      if (first_violation(candidate, config)) {
        prog = std::move(candidate);
        smaller = true;
      }
    }
    for (std::size_t i = prog.size(); i-- > 0;) {
      if (prog[i].kind == Step::alloc) continue;
      Program candidate = prog;
      candidate.erase(candidate.begin() + static_cast<std::ptrdiff_t>(i));
      if (first_violation(candidate, config)) {
        prog = std::move(candidate);
        smaller = true;
      }
    }
  }
  return prog;
}

std::string describe(const Program& prog) {
  std::string out = "{";
  for (const Step& s : prog) {
    switch (s.kind) {
      case Step::alloc: out += fmt::format("A({}, {}), ", s.size, s.stream); break;
      case Step::free: out += fmt::format("F({}), ", s.id); break;
      case Step::use: out += fmt::format("U({}, {}), ", s.id, s.stream); break;
      case Step::empty: out += "E(), "; break;
    }
  }
  return out + "}";
}

constexpr int kPrograms = 1500;

TEST(PagingBound, TheNativeModelReservesWhatTheNativePolicyDoesAtEveryStep) {
  // Both ways a request reaches the model: logged after it was served (a
  // cached block), or begun before (a miss, retried by the ladder once).
  for (int seed = 0; seed < 300; ++seed) {
    const Program prog = generate(static_cast<std::uint64_t>(seed) + 7000);
    SimDeviceOptions options;
    options.capacity = std::size_t{1} << 40;
    options.auto_complete_events = true;
    SimDevice device(options);
    const AllocatorConfig config = AllocatorConfig::parse(
        seed % 3 == 0 ? "roundup_power2_divisions:4" : (seed % 3 == 1 ? "max_split_size_mb:64" : ""));
    CachingAllocator native(device, config);
    detail::NativeShadow model(config);
    Rng r{static_cast<std::uint64_t>(seed)};
    std::vector<void*> ptrs;
    std::set<int> streams;
    for (std::size_t i = 0; i < prog.size(); ++i) {
      const Step& s = prog[i];
      if (s.kind == Step::alloc) {
        const auto stream = static_cast<StreamId>(s.stream);
        streams.insert(s.stream);
        if (r.chance(30)) {
          model.begin_request(s.size, stream);
          if (r.chance(20)) model.begin_request(s.size, stream);  // the ladder's retry
        }
        ptrs.push_back(native.allocate(s.size, stream));
        model.allocated(reinterpret_cast<DevicePtr>(ptrs.back()), s.size, stream);
      } else if (s.kind == Step::free) {
        if (ptrs[static_cast<std::size_t>(s.id)] == nullptr) continue;
        native.deallocate(ptrs[static_cast<std::size_t>(s.id)]);
        model.freed(reinterpret_cast<DevicePtr>(ptrs[static_cast<std::size_t>(s.id)]));
        ptrs[static_cast<std::size_t>(s.id)] = nullptr;
      } else if (s.kind == Step::use) {
        if (ptrs[static_cast<std::size_t>(s.id)] == nullptr) continue;
        native.record_stream(ptrs[static_cast<std::size_t>(s.id)], static_cast<StreamId>(s.stream));
        model.stream_used(reinterpret_cast<DevicePtr>(ptrs[static_cast<std::size_t>(s.id)]),
                          static_cast<StreamId>(s.stream));
      } else {
        native.empty_cache();
        model.cache_emptied();
      }
      ASSERT_EQ(model.reserved(),
                static_cast<std::size_t>(native.stats().reserved_bytes[0].current))
          << "seed " << seed << " step " << i;
    }
    EXPECT_EQ(model.streams(), streams.size());
  }
}

TEST(PagingBound, MappingAheadStopsAtTheBound) {
  // A 200 MiB request: paging maps room for half another like it (300 MiB);
  // with the bound, no more than the native policy's 200 MiB plus 2 MiB.
  SimDevice unbounded_device;
  CachingAllocator unbounded(unbounded_device, AllocatorConfig::parse("policy:paging"));
  void* p = unbounded.allocate(200 * kMiB);
  EXPECT_EQ(unbounded.stats().reserved_bytes[0].current, std::int64_t{300} << 20);
  SimDevice bounded_device;
  CachingAllocator bounded(bounded_device,
                           AllocatorConfig::parse("policy:paging,paging_slack_mb:2"));
  void* q = bounded.allocate(200 * kMiB);
  EXPECT_EQ(bounded.stats().reserved_bytes[0].current, std::int64_t{202} << 20);
  unbounded.deallocate(p);
  bounded.deallocate(q);
  bounded.validate();
}

TEST(PagingBound, CutsTheProgramsWherePagingPassesNative) {
  // Where the bound does not hold yet is measured, not hidden: the count of
  // programs with a step above native plus 2 MiB per stream, with and
  // without the bound (docs/config.md lists what is left).
  int with_bound = 0;
  int without = 0;
  std::size_t worst = 0;
  std::size_t steps = 0;
  for (int seed = 0; seed < kPrograms; ++seed) {
    const Program prog = generate(static_cast<std::uint64_t>(seed));
    steps += prog.size();
    with_bound += first_violation(prog, "policy:paging,paging_slack_mb:2", 2 * kMiB, &worst) ? 1 : 0;
    without += first_violation(prog, "policy:paging") ? 1 : 0;
  }
  EXPECT_GT(steps, std::size_t{100000});  // the programs are not trivial
  EXPECT_GT(without, kPrograms * 9 / 10);
  EXPECT_LT(with_bound, without * 7 / 10);
  RecordProperty("programs_above_native_with_bound", with_bound);
  RecordProperty("programs_above_native_without", without);
  RecordProperty("worst_excess_mib", static_cast<int>(worst >> 20));
}

TEST(PagingBound, AFailureShrinksToAFewSteps) {
  const std::string config = "policy:paging";
  std::optional<Program> found;
  for (int seed = 0; seed < kPrograms && !found; ++seed) {
    Program prog = generate(static_cast<std::uint64_t>(seed));
    if (first_violation(prog, config)) found = std::move(prog);
  }
  ASSERT_TRUE(found.has_value());
  const Program minimal = shrink(*found, config);
  EXPECT_TRUE(first_violation(minimal, config).has_value());
  EXPECT_LE(minimal.size(), 8u) << describe(minimal);
}

}  // namespace
}  // namespace reservoir::testing
