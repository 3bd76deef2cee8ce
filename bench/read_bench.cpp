// Reading traces at the speed of the disk: a PyTorch snapshot pickle
// synthesized to RESERVOIR_BENCH_SNAPSHOT_MB (default 500) as PyTorch's
// pickler writes it (keys, frames and each allocation's frames list
// memoized, events in APPENDS batches of 1,000), and a text trace of 5,000,000 lines. Reports MB/s, the
// file per event or line, and the peak resident memory over the file size.
// Run: build/bin/read_bench
// Instructions: valgrind --tool=callgrind --toggle-collect='reservoir::read_text_trace*'
//               build/bin/read_bench --benchmark_filter=text
#include <benchmark/benchmark.h>

#include <sys/resource.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "reservoir/trace.hpp"

namespace {

namespace fs = std::filesystem;

// Writes pickle opcodes for the snapshot dict, event by event.
class PickleWriter {
 public:
  explicit PickleWriter(std::ofstream& out) : out_(out) {}
  void op(std::uint8_t o) { buf_.push_back(static_cast<char>(o)); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void memoize() { op(0x94), ++memo_; }
  // A string, memoized the first time, a BINGET after.
  void str(const std::string& s) {
    if (auto it = strings_.find(s); it != strings_.end()) return get(it->second);
    op(0x8c), op(static_cast<std::uint8_t>(s.size())), buf_ += s;
    strings_[s] = memo_;
    memoize();
  }
  void get(std::uint32_t m) {
    if (m < 256) {
      op('h'), op(static_cast<std::uint8_t>(m));
    } else {
      op('j'), u32(m);
    }
  }
  void integer(std::uint64_t v) {
    if (v < 256) {
      op('K'), op(static_cast<std::uint8_t>(v));
    } else if (v < 0x7fffffff) {
      op('J'), u32(static_cast<std::uint32_t>(v));
    } else {
      op(0x8a), op(8);
      for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    }
  }
  std::uint32_t memo() const { return memo_; }
  void flush() {
    out_.write(buf_.data(), static_cast<std::streamsize>(buf_.size()));
    buf_.clear();
  }
  std::size_t pending() const { return buf_.size(); }

 private:
  std::ofstream& out_;
  std::string buf_;
  std::uint32_t memo_ = 0;
  std::map<std::string, std::uint32_t> strings_;
};

std::size_t snapshot_mb() {
  const char* v = std::getenv("RESERVOIR_BENCH_SNAPSHOT_MB");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : 500;
}

const fs::path& snapshot_file() {
  static const fs::path path = [] {
    const std::size_t target = snapshot_mb() << 20;
    const fs::path p = fs::temp_directory_path() / ("reservoir_bench_" + std::to_string(snapshot_mb()) + "mb_v2.pickle");
    if (fs::exists(p) && fs::file_size(p) >= target) return p;
    std::ofstream out(p, std::ios::binary);
    PickleWriter w(out);
    w.op(0x80), w.op(4);
    w.op('}'), w.memoize();  // root
    w.op('(');
    w.str("segments"), w.op(']'), w.memoize();
    w.str("device_traces"), w.op(']'), w.memoize();
    w.op(']'), w.memoize();  // device 0's events
    // As PyTorch writes a snapshot: each allocation's stack is a frames list
    // written in place in its alloc entry (memoized), which its
    // free_requested and free_completed entries fetch from the memo; each
    // frame is a dict written the first time and fetched after. Stacks
    // repeat, as a training loop's do: 60 of 12 to 19 frames from 400.
    std::mt19937_64 rng(5);
    std::vector<std::vector<std::uint32_t>> stacks(60);
    for (auto& stack : stacks) {
      stack.resize(12 + rng() % 8);
      for (auto& f : stack) f = static_cast<std::uint32_t>(rng() % 400);
    }
    std::map<std::uint32_t, std::uint32_t> frame_memo;  // frame -> memo index
    struct Live {
      std::uint64_t addr;
      std::uint64_t size;
      std::uint32_t frames;  // memo index of its frames list
    };
    std::vector<Live> live;
    std::uint64_t addr = 0x7f0000000000;
    std::uint64_t time = 1766124544221968;
    std::size_t written = 0;
    std::size_t batch = 0;
    w.op('(');
    while (written + w.pending() < target) {
      const bool alloc = live.empty() || rng() % 2 == 0;
      Live block{};
      if (alloc) {
        block.size = 512 * (1 + rng() % 8192);
        addr += block.size;
        block.addr = addr;
      } else {
        const std::size_t k = rng() % live.size();
        block = live[k];
        live[k] = live.back();
        live.pop_back();
      }
      for (int part = 0; part < (alloc ? 1 : 2); ++part) {
        w.op('}'), w.memoize(), w.op('(');
        w.str("action"), w.str(alloc ? "alloc" : part == 0 ? "free_requested" : "free_completed");
        w.str("addr"), w.integer(block.addr);
        w.str("size"), w.integer(block.size);
        w.str("stream"), w.integer(0);
        w.str("time_us"), w.integer(time++);
        w.str("compile_context"), w.str("N/A");
        w.str("user_metadata"), w.str("");
        w.str("frames");
        if (!alloc) {
          w.get(block.frames);
        } else {
          block.frames = w.memo();
          w.op(']'), w.memoize(), w.op('(');
          for (const std::uint32_t f : stacks[rng() % stacks.size()]) {
            if (auto it = frame_memo.find(f); it != frame_memo.end()) {
              w.get(it->second);
              continue;
            }
            frame_memo[f] = w.memo();
            w.op('}'), w.memoize(), w.op('(');
            w.str("name"), w.str("fn_" + std::to_string(f));
            w.str("filename"), w.str("/src/model_" + std::to_string(f % 37) + ".py");
            w.str("line"), w.integer(10 + f);
            w.op('u');
          }
          w.op('e');
          live.push_back(block);
        }
        w.op('u');  // SETITEMS
        if (++batch == 1000) {
          w.op('e'), w.op('('), batch = 0;  // APPENDS, and the next batch
        }
      }
      if (w.pending() > (8u << 20)) {
        written += w.pending();
        w.flush();
      }
    }
    w.op('e');          // the last APPENDS
    w.op('a');          // device_traces.append(events)
    w.op('u');          // root SETITEMS
    w.op('.');          // STOP
    w.flush();
    return p;
  }();
  return path;
}

const fs::path& text_file() {
  static const fs::path path = [] {
    const fs::path p = fs::temp_directory_path() / "reservoir_bench_5m.trace";
    if (fs::exists(p) && fs::file_size(p) > 0) return p;
    std::ofstream out(p);
    out << "reservoir-trace 1\n";
    std::mt19937_64 rng(9);
    std::vector<std::uint64_t> live;
    std::uint64_t next = 0;
    for (int i = 0; i < 5'000'000; ++i) {
      if (!live.empty() && rng() % 2 == 0) {
        const std::size_t k = rng() % live.size();
        out << "free " << live[k] << "\n";
        live[k] = live.back();
        live.pop_back();
      } else {
        switch (rng() % 3) {
          case 0: out << "alloc " << next << " " << 1 + rng() % (1u << 24) << "\n"; break;
          case 1: out << "alloc " << next << " " << 1 + rng() % 900 << "KiB\n"; break;
          default: out << "alloc " << next << " " << 1 + rng() % 64 << "MiB stream 1\n"; break;
        }
        live.push_back(next++);
      }
    }
    return p;
  }();
  return path;
}

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

void read_file(benchmark::State& state, const fs::path& path) {
  const double bytes = static_cast<double>(fs::file_size(path));
  std::size_t events = 0;
  for (auto _ : state) {
    const reservoir::Trace t = reservoir::read_trace_file(path.string());
    events = t.events.size();
    benchmark::DoNotOptimize(events);
  }
  state.counters["MB_per_s"] = benchmark::Counter(bytes / 1e6, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["file_MB"] = bytes / 1e6;
  state.counters["bytes_per_event"] = events ? bytes / static_cast<double>(events) : 0.0;
  // The process's peak so far (run one benchmark per process to read it).
  state.counters["peak_rss_over_file"] = peak_rss_bytes() / bytes;
}

void snapshot(benchmark::State& state) { read_file(state, snapshot_file()); }
void text(benchmark::State& state) { read_file(state, text_file()); }

BENCHMARK(snapshot)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1);
BENCHMARK(text)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
