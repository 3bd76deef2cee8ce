// Generated programs (generated.hpp).
#include "reservoir/generated.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <vector>

namespace reservoir {
namespace {

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

// A 64-bit linear congruential generator: the same numbers everywhere
// (std's distributions are not specified bit for bit).
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return s >> 33;
  }
  std::size_t below(std::size_t n) { return n == 0 ? 0 : next() % n; }
  bool chance(int percent) { return static_cast<int>(next() % 100) < percent; }
};

// Builds the program; allocations are tracked so that frees name live ones.
class Builder {
 public:
  Builder(Rng& rng, ReplayProgram& program) : rng_(rng), program_(program) {}
  std::uint32_t alloc(std::size_t size, StreamId stream = 0) {
    const std::uint32_t id = program_.id_count++;
    program_.ops.push_back({ReplayOp::Kind::alloc, id, std::max<std::size_t>(size, 1), stream});
    live_.push_back(id);
    return id;
  }
  void free(std::uint32_t id) {
    program_.ops.push_back({ReplayOp::Kind::free, id, 0, 0});
    live_.erase(std::find(live_.begin(), live_.end(), id));
  }
  void free_random() {
    if (!live_.empty()) free(live_[rng_.below(live_.size())]);
  }
  void use(std::uint32_t id, StreamId stream) {
    program_.ops.push_back({ReplayOp::Kind::stream_use, id, 0, stream});
  }
  void maybe_empty(int percent) {
    if (rng_.chance(percent)) program_.ops.push_back({ReplayOp::Kind::empty_cache, 0, 0, 0});
  }
  const std::vector<std::uint32_t>& live() const { return live_; }

 private:
  Rng& rng_;
  ReplayProgram& program_;
  std::vector<std::uint32_t> live_;
};

std::size_t small_size(Rng& r) { return 1 + r.below(kMiB); }
std::size_t mid_size(Rng& r) { return kMiB + r.below(20 * kMiB); }
std::size_t big_size(Rng& r) { return 20 * kMiB + r.below(300 * kMiB); }

void training(Builder& b, Rng& r) {
  const auto layers = 2 + r.below(10);
  std::vector<std::size_t> weight(layers);
  for (auto& w : weight) {
    w = r.chance(30) ? small_size(r) : (r.chance(70) ? mid_size(r) : big_size(r));
    b.alloc(w);
  }
  const std::size_t act = kMiB * (1 + r.below(64));
  const auto steps = 1 + r.below(4);
  for (std::size_t s = 0; s < steps; ++s) {
    std::vector<std::uint32_t> acts;
    for (std::size_t l = 0; l < layers; ++l) {
      acts.push_back(b.alloc(act + r.below(act / 4 + 1)));
      if (r.chance(40)) b.free(b.alloc(small_size(r)));  // a workspace
      b.maybe_empty(2);
    }
    for (std::size_t l = layers; l-- > 0;) {
      const std::uint32_t tmp = b.alloc(act);
      b.free(acts[l]);
      if (s == 0) b.alloc(weight[l]);  // its gradient
      b.free(tmp);
    }
    for (std::size_t g = 0; g < layers; ++g) b.free(b.alloc(weight[g] / 2 + 512));
    b.maybe_empty(5);
  }
}

void inference(Builder& b, Rng& r) {
  b.alloc(big_size(r));  // weights
  const auto requests = 2 + r.below(8);
  for (std::size_t q = 0; q < requests; ++q) {
    const std::size_t batch = 1 + r.below(16);
    const std::size_t seq = 16 * (1 + r.below(128));
    std::vector<std::uint32_t> mine;
    mine.push_back(b.alloc(batch * seq * 4 * kKiB));  // KV cache
    const auto layers = 2 + r.below(6);
    for (std::size_t l = 0; l < layers; ++l) {
      const std::uint32_t h = b.alloc(batch * seq * 2 * kKiB + r.below(4096));
      b.free(b.alloc(batch * seq * seq * 2 / 16 + 512));  // attention scores
      mine.push_back(h);
      if (mine.size() > 3) {
        b.free(mine[1]);
        mine.erase(mine.begin() + 1);
      }
    }
    for (std::uint32_t id : mine) b.free(id);
    b.maybe_empty(10);
  }
}

void huge_among_small(Builder& b, Rng& r) {
  const auto n = 40 + r.below(200);
  for (std::size_t i = 0; i < n; ++i) {
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

void streams(Builder& b, Rng& r) {
  const auto nstreams = 2 + r.below(3);
  const auto n = 40 + r.below(200);
  for (std::size_t i = 0; i < n; ++i) {
    const StreamId s = r.below(nstreams);
    const std::size_t size =
        r.chance(50) ? small_size(r) : (r.chance(80) ? mid_size(r) : big_size(r));
    const std::uint32_t id = b.alloc(size, s);
    if (r.chance(10)) b.use(id, (s + 1) % nstreams);
    if (r.chance(48)) b.free_random();
    b.maybe_empty(1);
  }
}

// Streams taking turns: weights on the default stream, then each step runs
// on the next stream and allocates buffers of the program's few sizes, freed
// at the step's end (a block now and then lives on into the next step, used
// there by its stream).
void turns(Builder& b, Rng& r) {
  b.alloc(big_size(r));  // weights
  const auto nstreams = 2 + r.below(2);
  std::vector<std::size_t> sizes(1 + r.below(4));
  for (auto& size : sizes) size = r.chance(40) ? small_size(r) : (r.chance(85) ? mid_size(r) : big_size(r));
  const auto steps = 20 + r.below(100);
  std::uint32_t carried = 0;
  bool carrying = false;
  for (std::size_t i = 0; i < steps; ++i) {
    const auto s = static_cast<StreamId>(i % nstreams);
    std::vector<std::uint32_t> mine;
    mine.reserve(sizes.size());
    for (std::size_t size : sizes) mine.push_back(b.alloc(size, s));
    if (carrying) {
      b.use(carried, s);
      b.free(carried);
      carrying = false;
    }
    if (r.chance(15)) {
      carried = mine.back();
      mine.pop_back();
      carrying = true;
    }
    for (std::uint32_t id : mine) b.free(id);
    b.maybe_empty(1);
  }
  if (carrying) b.free(carried);
}

}  // namespace

ReplayProgram generated_program(std::uint64_t seed) {
  ReplayProgram program;
  Rng r{seed * 0x9e3779b97f4a7c15ULL + 1};
  Builder b(r, program);
  std::vector<std::string> families;
  const auto parts = 1 + r.below(3);
  for (std::size_t i = 0; i < parts; ++i) {
    switch (r.below(4)) {
      case 0:
        training(b, r);
        families.emplace_back("training");
        break;
      case 1:
        inference(b, r);
        families.emplace_back("inference");
        break;
      case 2:
        huge_among_small(b, r);
        families.emplace_back("huge");
        break;
      default:
        if (r.chance(35)) {
          turns(b, r);
          families.emplace_back("turns");
        } else {
          streams(b, r);
          families.emplace_back("streams");
        }
        break;
    }
  }
  if (r.chance(50)) {
    const std::vector<std::uint32_t> live = b.live();
    for (std::uint32_t id : live) b.free(id);
  }
  program.name = fmt::format("generated #{} ({})", seed, fmt::join(families, "+"));
  program.recorded_events = program.ops.size();
  program.op_events.resize(program.ops.size());
  for (std::size_t i = 0; i < program.ops.size(); ++i) program.op_events[i] = i;
  program.contexts.assign(program.id_count, 0);
  return program;
}

}  // namespace reservoir
