// The answer at an out-of-memory error (reservoir/explain.hpp): a reservoir
// allocator's own error carries it, made from its own history; the lines
// for each cause; the files; and a failing explainer or an unwritable folder
// never hides the allocator's error.
#include <gtest/gtest.h>
#include <fmt/format.h>
#include <sched.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "reservoir/caching_allocator.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/explain.hpp"
#include "reservoir/sim_device.hpp"
#include "reservoir/trace.hpp"
#include "trace_fixture.hpp"

namespace reservoir {
namespace {

SimDeviceOptions capacity(std::size_t bytes) {
  SimDeviceOptions o;
  o.capacity = bytes;
  return o;
}

// Two 100 MiB holes pinned between live blocks of one 256 MiB segment, and a
// 160 MiB request on a 300 MiB device (trace_fixture.hpp's fragmented_oom).
std::string fragment_and_fail(CachingAllocator& a) {
  a.deallocate(a.allocate(256 * kMiB, 0));
  void* x = a.allocate(28 * kMiB, 0);
  void* hole1 = a.allocate(100 * kMiB, 0);
  void* y = a.allocate(28 * kMiB, 0);
  void* hole2 = a.allocate(100 * kMiB, 0);
  a.deallocate(hole1);
  a.deallocate(hole2);
  std::string message;
  try {
    (void)a.allocate(160 * kMiB, 0);
  } catch (const OutOfMemoryError& e) {
    message = e.what();
    EXPECT_EQ(e.requested_bytes(), 160 * kMiB);
  }
  a.deallocate(x);
  a.deallocate(y);
  return message;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t nl = text.find('\n', at);
    out.push_back(text.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  return out;
}

std::string plain_message() {
  SimDevice device(capacity(300 * kMiB));
  CachingAllocator a(device, AllocatorConfig{});
  return fragment_and_fail(a);
}

TEST(Explain, TheAllocatorsOwnErrorCarriesTheAnswerAfterItsMessage) {
  SimDevice device(capacity(300 * kMiB));
  CachingAllocator a(device, AllocatorConfig{});
  explain_oom_errors(a);
  const std::vector<std::string> lines = lines_of(fragment_and_fail(a));
  const std::string plain = plain_message();
  ASSERT_GE(lines.size(), 4u);
  EXPECT_EQ(lines[0], plain);  // PyTorch's message first, whole
  EXPECT_EQ(lines[1],
            "reservoir: out of memory on a 160.00 MiB request: fragmentation: 200.00 MiB sat reserved "
            "but unused, in pieces too small for it (the largest 100.00 MiB), and the device had "
            "44.00 MiB free: this request would have fit without it; whether the rest of the step fits is "
            "not known (it had not run).");
  // On reservoir's allocator, in the variable it reads first.
  EXPECT_EQ(lines[2].rfind("reservoir: set RESERVOIR_ALLOC_CONF=", 0), 0u) << lines[2];
  EXPECT_EQ(lines[3],
            "reservoir: this covers the program up to the failed request; the rest of the step was "
            "never recorded: rerun with the setting and RESERVOIR_EXPLAIN_OOM=1 to check it.");
  EXPECT_EQ(lines.size(), 4u);  // no folder: no files named
  a.validate();
}

TEST(Explain, AnExplainerThatThrowsLeavesTheErrorAsItWas) {
  SimDevice device(capacity(300 * kMiB));
  CachingAllocator a(device, AllocatorConfig{});
  a.set_oom_explainer([](const OutOfMemoryError&) -> std::string { throw std::runtime_error("broken"); });
  EXPECT_EQ(fragment_and_fail(a), plain_message());
  a.validate();
  a.set_oom_explainer([](const OutOfMemoryError&) { return std::string(); });  // "" adds nothing
  EXPECT_EQ(fragment_and_fail(a), plain_message());
}

TEST(Explain, TooLittleMemorySaysNoSettingHelpsAndByHowMuch) {
  Recorder r("", 300 * kMiB);
  void* a = r.alloc(200 * kMiB);
  EXPECT_THROW(r.alloc(200 * kMiB), OutOfMemoryError);
  r.allocator.deallocate(a);
  const Trace t = pickled(r.finish());
  const Advice advice = advise_at_error(t);
  const std::vector<std::string> lines = oom_answer_lines(t, advice, ErrorSite{3, std::nullopt}, std::nullopt, false, "", "", "");
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0],
            "reservoir [rank 3]: out of memory on a 200.00 MiB request: too little memory: the "
            "recorded part alone needs 400.00 MiB at its peak, 100.00 MiB more than the 300.00 MiB "
            "there is.");
  EXPECT_EQ(lines[1],
            "reservoir [rank 3]: no setting helps: the program must need 100.00 MiB less (smaller "
            "batches, activation checkpointing, lower precision).");
  // No setting named: nothing to rerun with.
  EXPECT_EQ(lines[2],
            "reservoir [rank 3]: this covers the program up to the failed request; the rest of the step was "
            "never recorded: the step needs at least this much.");
}

TEST(Explain, WhereNoStockSettingFitsButNativePagedDoesTheAnswerNamesIt) {
  // Five 20 MiB segments filled (100 MiB, the device), then in each the two
  // 8 MiB blocks freed around 2 MiB kept at 0 and at 10 MiB, then 60 MiB.
  // Every block is below the smallest max_split_size, and every 20 MiB page
  // of expandable segments holds two live blocks: no stock setting needs
  // less than 160 MiB. native_paged keeps only the live blocks' 2 MiB pages
  // (20 MiB) and maps 60, so it needs no more than the 100 MiB peak before
  // the frees: the live answer names it.
  Recorder r("", 100 * kMiB);
  std::vector<void*> live;
  std::vector<void*> holes;
  for (int i = 0; i < 5; ++i) {
    live.push_back(r.alloc(2 * kMiB));
    holes.push_back(r.alloc(8 * kMiB));
    live.push_back(r.alloc(2 * kMiB));
    holes.push_back(r.alloc(8 * kMiB));
  }
  for (void* p : holes) r.allocator.deallocate(p);
  EXPECT_THROW(r.alloc(60 * kMiB), OutOfMemoryError);
  for (void* p : live) r.allocator.deallocate(p);
  const Trace t = pickled(r.finish());
  const Advice advice = advise_at_error(t);
  const std::vector<std::string> lines = oom_answer_lines(t, advice, ErrorSite{}, std::nullopt, false, "", "", "");
  std::string all;
  for (const std::string& l : lines) all += l + "\n";
  ASSERT_EQ(lines.size(), 3u) << all;
  EXPECT_EQ(lines[1],
            "reservoir: no PyTorch setting does better than yours; reservoir's policy:native_paged needs "
            "100.00 MiB, 60.00 MiB less (RESERVOIR_ALLOC_CONF=policy:native_paged).");
}

TEST(Explain, MemoryHeldOutsideTheAllocatorIsNamed) {
  // 100 MiB of a 400 MiB device taken by someone else: the allocator sees 300.
  Recorder r("", 300 * kMiB);
  void* a = r.alloc(200 * kMiB);
  EXPECT_THROW(r.alloc(150 * kMiB), OutOfMemoryError);
  r.allocator.deallocate(a);
  const Trace t = pickled(r.finish());
  const std::vector<std::string> lines =
      oom_answer_lines(t, advise_at_error(t), ErrorSite{}, 400 * kMiB, false, "", "", "");
  EXPECT_EQ(lines[0],
            "reservoir: out of memory on a 150.00 MiB request: 100.00 MiB of the device's 400.00 MiB "
            "was held outside this allocator (another process, or other libraries of this one); and "
            "too little memory: the recorded part alone needs 350.00 MiB at its peak, 50.00 MiB more "
            "than the 300.00 MiB there is.");
}

// A 1 GiB device and a process limited to 256 MiB of it: 100 MiB of weights,
// then one 60 MiB segment per entry of `live` (MiB of it kept, the rest
// freed inside it: cached, not releasable), then the request.
Trace under_a_limit(const std::vector<std::size_t>& live, std::size_t request) {
  Recorder r("", 1024 * kMiB);
  r.allocator.set_memory_fraction(0.25);
  void* weights = r.alloc(100 * kMiB);
  std::vector<void*> kept;
  std::vector<void*> filler;
  for (std::size_t mib : live) {
    r.allocator.deallocate(r.alloc(60 * kMiB));
    kept.push_back(r.alloc(mib * kMiB));
    filler.push_back(r.alloc((60 - mib) * kMiB));  // the segment's rest: the next one is new
  }
  for (void* p : filler) r.allocator.deallocate(p);
  EXPECT_THROW(r.alloc(request), OutOfMemoryError);
  for (void* p : kept) r.allocator.deallocate(p);
  r.allocator.deallocate(weights);
  return pickled(r.finish());
}

TEST(Explain, AKnownMemoryLimitIsWhatTooLittleMemoryIsMeasuredAgainst) {
  // 120 MiB in use, 160 reserved, a 150 MiB request: 270 MiB at the peak,
  // 14 MiB more than the limit allows. From the recording alone the limit
  // is at least what the allocator held (160 MiB) and below that and the
  // new segment (310 MiB), so the answer cannot tell fragmentation from
  // too little memory and names both, measured against 160 MiB; the error
  // reports the limit (PyTorch's observers are given it), and the answer is
  // then the program's real shortfall alone.
  const Trace t = under_a_limit({20}, 150 * kMiB);
  const std::vector<std::string> inferred =
      oom_answer_lines(t, advise_at_error(t), ErrorSite{}, 1024 * kMiB, false, "", "", "");
  EXPECT_EQ(inferred[0],
            "reservoir: out of memory on a 150.00 MiB request: the process's memory fraction "
            "(set_per_process_memory_fraction) refused it: the device had 864.00 MiB free, the process was "
            "at its limit with 160.00 MiB reserved; and fragmentation: 40.00 MiB sat reserved but unused, in "
            "pieces too small for it (the largest 40.00 MiB), and the device had 864.00 MiB free; and too "
            "little memory: the recorded part alone needs 270.00 MiB at its peak, 110.00 MiB more than the "
            "160.00 MiB there is.");
  const Advice advice = advise_at_error(t, 1, 256 * kMiB);
  EXPECT_EQ(advice.capacity_bytes, 256 * kMiB);
  EXPECT_EQ(advice.capacity_source, "the process's memory limit (set_per_process_memory_fraction)");
  const std::vector<std::string> lines =
      oom_answer_lines(t, advice, ErrorSite{}, 1024 * kMiB, false, "", "", "", "reservoir advise", 256 * kMiB);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0],
            "reservoir: out of memory on a 150.00 MiB request: the process's memory fraction "
            "(set_per_process_memory_fraction) refused it: it allows 256.00 MiB, the process had 160.00 MiB "
            "reserved and the device 864.00 MiB free; and too little memory: the recorded part alone needs "
            "270.00 MiB at its peak, 14.00 MiB more than the 256.00 MiB its memory fraction allows.");
  EXPECT_EQ(lines[1],
            "reservoir: no setting helps: the program must need 14.00 MiB less (smaller batches, activation "
            "checkpointing, lower precision).");
}

TEST(Explain, FragmentationUnderAKnownMemoryLimit) {
  // Two 60 MiB segments holding 20 MiB each beside the weights: 140 MiB in
  // use, 220 reserved, 80 MiB free in pieces of 40. A 60 MiB request needs
  // a new segment the limit refuses (280 MiB), though what is in use and
  // the request (200 MiB) fit under it: fragmentation, and nothing else.
  const Trace t = under_a_limit({20, 20}, 60 * kMiB);
  const Advice advice = advise_at_error(t, 1, 256 * kMiB);
  const std::vector<std::string> lines =
      oom_answer_lines(t, advice, ErrorSite{}, 1024 * kMiB, false, "", "", "", "reservoir advise", 256 * kMiB);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines[0],
            "reservoir: out of memory on a 60.00 MiB request: the process's memory fraction "
            "(set_per_process_memory_fraction) refused it: it allows 256.00 MiB, the process had 220.00 MiB "
            "reserved and the device 804.00 MiB free; and fragmentation: 80.00 MiB sat reserved but unused, "
            "in pieces too small for it (the largest 40.00 MiB), and 36.00 MiB more was within the limit: "
            "this request would have fit without it; whether the rest of the step fits is not known (it had "
            "not run).");
}

TEST(Explain, EveryLineNamesTheRankAndTheDevice) {
  EXPECT_EQ((ErrorSite{1, 1}).prefix(), "reservoir [rank 1, GPU 1]: ");
  EXPECT_EQ((ErrorSite{0, 0}).prefix(), "reservoir [rank 0, GPU 0]: ");
  EXPECT_EQ((ErrorSite{4, std::nullopt}).prefix(), "reservoir [rank 4]: ");
  EXPECT_EQ((ErrorSite{std::nullopt, 3}).prefix(), "reservoir [GPU 3]: ");
  EXPECT_EQ((ErrorSite{std::nullopt, 0}).prefix(), "reservoir: ");
  EXPECT_EQ((ErrorSite{}).prefix(), "reservoir: ");
  EXPECT_EQ((ErrorSite{1, 1}).file_part(), "-rank1-gpu1");
  EXPECT_EQ((ErrorSite{std::nullopt, 0}).file_part(), "-gpu0");
  EXPECT_EQ((ErrorSite{}).file_part(), "");
  const Trace t = fragmented_oom();
  for (const std::string& line : oom_answer_lines(t, advise_at_error(t), ErrorSite{2, 1}, std::nullopt, false,
                                                  "", "", "dir")) {
    EXPECT_EQ(line.rfind("reservoir [rank 2, GPU 1]: ", 0), 0u) << line;
  }
}

// The launchers' variables, each alone, then their order; torch.distributed's
// rank (set_process_rank) before them all; an explicit rank before that.
TEST(Explain, TheRankIsTakenFromEveryLauncher) {
  const char* const names[] = {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                               "MV2_COMM_WORLD_RANK"};
  std::map<std::string, std::string> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved[n] = v;
    ::unsetenv(n);
  }
  set_process_rank(std::nullopt);
  EXPECT_EQ(process_rank({}), std::nullopt);
  int value = 10;
  for (const char* n : names) {
    ::setenv(n, std::to_string(value).c_str(), 1);
    EXPECT_EQ(process_rank({}), value) << n;
    ::unsetenv(n);
    ++value;
  }
  ::setenv("PMI_RANK", "7", 1);
  ::setenv("SLURM_PROCID", "6", 1);
  EXPECT_EQ(process_rank({}), 6);  // srun's before PMI's: torchrun or srun started this process
  ::setenv("SLURM_PROCID", "x6", 1);
  EXPECT_EQ(process_rank({}), 7);  // a value that is not a rank is passed over
  set_process_rank(2);
  EXPECT_EQ(process_rank({}), 2);
  ExplainOptions given;
  given.rank = 9;
  EXPECT_EQ(process_rank(given), 9);
  set_process_rank(std::nullopt);
  EXPECT_EQ(process_rank({}), 7);
  for (const char* n : names) ::unsetenv(n);
  for (const auto& [n, v] : saved) ::setenv(n.c_str(), v.c_str(), 1);
}

TEST(Explain, TheAnalysisTakesThisProcesssShareOfItsCores) {
  const char* const names[] = {"RESERVOIR_EXPLAIN_OOM_THREADS", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                               "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"};
  std::map<std::string, std::string> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved[n] = v;
    ::unsetenv(n);
  }
  cpu_set_t all;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(all), &all), 0);
  const auto cores = static_cast<unsigned>(CPU_COUNT(&all));
  EXPECT_EQ(explain_threads({}), std::clamp(cores, 1u, 4u));
  // Eight ranks on the machine: each its share, at least one.
  ::setenv("LOCAL_WORLD_SIZE", "8", 1);
  EXPECT_EQ(explain_threads({}), std::clamp(cores / 8, 1u, 4u));
  ::unsetenv("LOCAL_WORLD_SIZE");
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1);
  ::setenv("SLURM_NTASKS_PER_NODE", "2(x3)", 1);  // not a count: passed over
  EXPECT_EQ(explain_threads({}), std::clamp(cores, 1u, 4u));
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ::setenv("SLURM_NTASKS_PER_NODE", "1024", 1);
  EXPECT_EQ(explain_threads({}), 1u);
  // The variable, then the option, take precedence; a bad value is named.
  ::setenv("RESERVOIR_EXPLAIN_OOM_THREADS", "3", 1);
  EXPECT_EQ(explain_threads({}), 3u);
  ExplainOptions given;
  given.threads = 2;
  EXPECT_EQ(explain_threads(given), 2u);
  for (const char* bad : {"0", "-1", "two", "2x", "5000"}) {
    ::setenv("RESERVOIR_EXPLAIN_OOM_THREADS", bad, 1);
    try {
      (void)explain_threads({});
      ADD_FAILURE() << bad << " was accepted";
    } catch (const UsageError& e) {
      EXPECT_EQ(std::string(e.what()), fmt::format("RESERVOIR_EXPLAIN_OOM_THREADS='{}': not accepted; accepted: a "
                                                   "whole number from 1 to 1024 (the cores the analysis at an "
                                                   "error replays on)",
                                                   bad));
    }
  }
  // At the error, the answer says what was wrong and the error stands.
  ::setenv("RESERVOIR_EXPLAIN_OOM_THREADS", "0", 1);
  const OomExplanation e = explain_oom(fragmented_oom(), {}, ExplainOptions{});
  EXPECT_FALSE(e.advice.has_value());
  ASSERT_FALSE(e.lines.empty());
  EXPECT_NE(e.lines.front().find("could not analyse the recording: RESERVOIR_EXPLAIN_OOM_THREADS='0'"),
            std::string::npos)
      << e.lines.front();
  for (const char* n : names) ::unsetenv(n);
  for (const auto& [n, v] : saved) ::setenv(n.c_str(), v.c_str(), 1);
}

TEST(Explain, TheFilesOfAnErrorOnAnotherDeviceNameItAndHoldItsEvents) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "explain_device_files";
  std::filesystem::remove_all(dir);
  Trace t = fragmented_oom();
  t.device = 1;
  for (SegmentInfo& seg : t.final_state.segments) seg.device = 1;
  ExplainOptions options;
  options.directory = dir.string();
  options.host = "node";
  options.rank = 1;
  options.device = 1;
  const OomExplanation e = explain_oom(t, {}, options);
  const std::string name = std::filesystem::path(e.snapshot_path).filename().string();
  EXPECT_EQ(name.rfind("node-rank1-gpu1-", 0), 0u) << name;
  EXPECT_EQ(e.lines.front().rfind("reservoir [rank 1, GPU 1]: out of memory", 0), 0u) << e.lines.front();
  // The snapshot keeps the events as device 1's, as PyTorch's does.
  const std::vector<Trace> devices = select_devices(read_trace_devices(e.snapshot_path), std::nullopt);
  ASSERT_EQ(devices.size(), 1u);
  EXPECT_EQ(devices[0].device, 1);
  EXPECT_EQ(devices[0].events.size(), t.events.size());
  const JobAdvice job = advise_job({e.snapshot_path}, {});
  ASSERT_EQ(job.ranks.size(), 1u);
  EXPECT_EQ(job.ranks[0].name, "rank 1 (GPU 1)");
  std::filesystem::remove_all(dir);
}

// A reservoir allocator's recording names the release it runs (its
// settings' pytorch_version): its snapshot says so, and the advice names
// that release's variable, as PyTorch's allocator's recording of the same
// release gets it (2.13 or newer there: PYTORCH_ALLOC_CONF).
TEST(Explain, TheOwnAllocatorsSnapshotCarriesItsRelease) {
  for (const auto& [release, variable] : std::vector<std::pair<std::string, std::string>>{
           {"2.15", "PYTORCH_ALLOC_CONF"}, {"2.6", "PYTORCH_CUDA_ALLOC_CONF"}}) {
    Recorder r("pytorch_version:" + release, 300 * kMiB);
    HistoryOptions history;
    history.max_entries = 100;
    r.allocator.record_history(history);
    void* kept = r.alloc(100 * kMiB);
    r.allocator.deallocate(r.alloc(50 * kMiB));
    const Trace own = to_trace(r.allocator.snapshot(), "own", r.allocator.config().to_string());
    EXPECT_EQ(own.pytorch_since, release);
    EXPECT_TRUE(own.pytorch_release_known);
    const Trace back = read_pytorch_snapshot(bytes(write_pytorch_snapshot(own)), "own");
    EXPECT_EQ(back.pytorch_since, release);
    EXPECT_TRUE(back.pytorch_release_known);
    const Advice a = advise_at_error(back);
    EXPECT_EQ(a.pytorch_env, variable) << release;
    EXPECT_TRUE(a.pytorch_release_known);
    r.allocator.deallocate(kept);
  }
  // PyTorch's own recording tells only the oldest release that writes it.
  const Trace pytorch = fragmented_oom();
  EXPECT_FALSE(pytorch.pytorch_release_known);
}

// A long-lived process that served the request before: the recording shows
// what the program held while that success lived (290 MiB), more than the
// part since the error before needs; the first line says so.
TEST(Explain, TheRequestsEarlierSuccessTellsWhatTheStepHeld) {
  Recorder r("", 300 * kMiB);
  void* request = r.alloc(100 * kMiB);
  void* rest = r.alloc(190 * kMiB);  // the step goes on while the request's memory lives
  r.allocator.deallocate(rest);
  r.allocator.deallocate(request);
  r.allocator.empty_cache();
  EXPECT_THROW(r.alloc(400 * kMiB), OutOfMemoryError);  // an error before: the answer's part starts after it
  // Then a 240 MiB segment carved into four 60 MiB blocks, two of them freed:
  // the request finds holes too small, and no room for a segment of its own.
  r.allocator.deallocate(r.alloc(240 * kMiB));
  std::vector<void*> blocks(4);
  for (void*& b : blocks) b = r.alloc(60 * kMiB);
  r.allocator.deallocate(blocks[1]);
  r.allocator.deallocate(blocks[3]);
  EXPECT_THROW(r.alloc(100 * kMiB), OutOfMemoryError);
  r.allocator.deallocate(blocks[0]);
  r.allocator.deallocate(blocks[2]);
  const Trace t = pickled(r.finish());
  const OomExplanation e = explain_oom(t, {}, ExplainOptions{});
  ASSERT_FALSE(e.lines.empty());
  const std::string tail =
      "; the last time it served this request (1 success recorded), the program went on to hold 290.00 MiB "
      "while it lived: the step may need that much.";
  ASSERT_GE(e.lines[0].size(), tail.size());
  EXPECT_EQ(e.lines[0].substr(e.lines[0].size() - tail.size()), tail) << e.lines[0];
  EXPECT_EQ(e.lines[0].rfind("reservoir: out of memory on a 100.00 MiB request: ", 0), 0u) << e.lines[0];
  // Without the earlier success, nothing is said of it.
  const OomExplanation plain = explain_oom(fragmented_oom(), {}, ExplainOptions{});
  EXPECT_EQ(plain.lines[0].find("the last time"), std::string::npos) << plain.lines[0];
}

TEST(Explain, TheSnapshotAndThePageAreWrittenByHostRankAndTime) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "explain_files";
  std::filesystem::remove_all(dir);
  const Trace t = fragmented_oom();
  ExplainOptions options;
  options.directory = dir.string();
  options.host = "node/7";
  options.rank = 5;
  options.page = [](const Trace&, const Advice&) { return std::string("<html>page</html>"); };
  const OomExplanation e = explain_oom(t, {}, options);
  ASSERT_TRUE(e.advice.has_value());
  const std::string name = std::filesystem::path(e.snapshot_path).filename().string();
  EXPECT_EQ(name.rfind("node_7-rank5-", 0), 0u) << name;
  EXPECT_EQ(std::filesystem::path(e.page_path).filename().string(),
            name.substr(0, name.size() - 7) + "-advice.html");
  // The snapshot reads back as the same recording.
  const Trace back = read_trace_file(e.snapshot_path);
  EXPECT_EQ(back.events.size(), t.events.size());
  EXPECT_EQ(e.lines[e.lines.size() - 2],
            fmt::format("reservoir [rank 5]: snapshot: {}; the full answer: {}", e.snapshot_path, e.page_path));
  EXPECT_EQ(e.lines.back(), fmt::format("reservoir [rank 5]: for the whole job: reservoir advise {} (it weighs "
                                        "every setting of your release, not only the {} weighed here)",
                                        dir.string(), e.advice->candidates.size()));
  // A second error in the same second gets files of its own.
  const OomExplanation again = explain_oom(t, {}, options);
  EXPECT_NE(again.snapshot_path, e.snapshot_path);
  EXPECT_TRUE(std::filesystem::exists(again.snapshot_path));
  std::filesystem::remove_all(dir);
}

// A process that meets error after error keeps the files of the most recent
// N (RESERVOIR_EXPLAIN_OOM_KEEP; ExplainOptions::keep), says so once, and
// leaves the files of others alone.
TEST(Explain, TheFilesOfTheMostRecentErrorsAreKeptAndThatIsSaidOnce) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "explain_keep";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "other-process.pickle") << "x";
  const Trace t = fragmented_oom();
  ExplainOptions options;
  options.directory = dir.string();
  options.keep = 3;
  options.page = [](const Trace&, const Advice&) { return std::string("<html>page</html>"); };
  std::vector<OomExplanation> answers;
  std::size_t said = 0;
  for (int i = 0; i < 7; ++i) {
    answers.push_back(explain_oom(t, {}, options));
    for (const std::string& line : answers.back().lines) {
      if (line.find("most recent errors are kept") != std::string::npos) {
        ++said;
        EXPECT_EQ(line, fmt::format("reservoir: the files of this process's 3 most recent errors are kept in "
                                    "{}, older ones removed (RESERVOIR_EXPLAIN_OOM_KEEP sets how many)",
                                    dir.string()));
        EXPECT_EQ(i, 3);  // the fourth error removes the first's files
      }
    }
  }
  EXPECT_EQ(said, 1u);
  for (int i = 0; i < 7; ++i) {
    const bool kept = i >= 4;
    EXPECT_EQ(std::filesystem::exists(answers[i].snapshot_path), kept) << i;
    EXPECT_EQ(std::filesystem::exists(answers[i].page_path), kept) << i;
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "other-process.pickle"));
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) files += entry.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 7u);  // 3 errors' snapshot and page, and the other process's file
  std::filesystem::remove_all(dir);
}

TEST(Explain, HowManyErrorsFilesAreKeptIsReadFromTheEnvironment) {
  ExplainOptions options;
  ::unsetenv("RESERVOIR_EXPLAIN_OOM_KEEP");
  EXPECT_EQ(files_kept(options), kDefaultFilesKept);
  ::setenv("RESERVOIR_EXPLAIN_OOM_KEEP", "5", 1);
  EXPECT_EQ(files_kept(options), 5u);
  options.keep = 2;
  EXPECT_EQ(files_kept(options), 2u);  // given beats the environment
  options.keep.reset();
  for (const char* bad : {"0", "-3", "many", "4x"}) {
    ::setenv("RESERVOIR_EXPLAIN_OOM_KEEP", bad, 1);
    try {
      (void)files_kept(options);
      ADD_FAILURE() << bad;
    } catch (const UsageError& e) {
      EXPECT_EQ(std::string(e.what()),
                fmt::format("RESERVOIR_EXPLAIN_OOM_KEEP='{}': not accepted; accepted: a whole number from 1 (the "
                            "errors whose files are kept; default 20)",
                            bad));
    }
  }
  ::unsetenv("RESERVOIR_EXPLAIN_OOM_KEEP");
}

TEST(Explain, AFolderThatCannotBeWrittenIsSaidAndTheAnswerStands) {
  const std::filesystem::path file = std::filesystem::path(::testing::TempDir()) / "explain_not_a_dir";
  std::ofstream(file) << "x";
  ExplainOptions options;
  options.directory = (file / "sub").string();
  const OomExplanation e = explain_oom(fragmented_oom(), {}, options);
  ASSERT_TRUE(e.advice.has_value());
  EXPECT_TRUE(e.snapshot_path.empty());
  EXPECT_EQ(e.lines.front().rfind("reservoir: out of memory on a 160.00 MiB request: fragmentation", 0), 0u);
  EXPECT_EQ(e.lines.back().rfind("reservoir: the snapshot could not be written: ", 0), 0u) << e.lines.back();
  std::filesystem::remove(file);
}

TEST(Explain, ARecordingWithNothingToReplayIsSaidNotThrown) {
  Trace t;
  t.name = "empty";
  t.format = "pytorch-snapshot";
  t.has_addresses = true;
  const OomExplanation e = explain_oom(t, {}, ExplainOptions{});
  EXPECT_FALSE(e.advice.has_value());
  ASSERT_EQ(e.lines.size(), 1u);
  EXPECT_EQ(e.lines[0].rfind("reservoir: could not analyse the recording: ", 0), 0u) << e.lines[0];
}

// native_paged, its history turned on after memory was taken: the answer is
// made from the allocator's state at the error (which a replay from the
// recording's start cannot rebuild), counting a segment's pages with memory
// behind them, not its address space; the snapshot written says the same.
TEST(Explain, UnderNativePagedTheAnswerCountsTheMemoryMappedNotTheAddressSpace) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "explain_paged";
  std::filesystem::remove_all(dir);
  SimDevice device(capacity(1024 * kMiB));
  CachingAllocator a(device, AllocatorConfig::parse("policy:native_paged"));
  void* weights = a.allocate(400 * kMiB, 0);  // before the history
  ExplainOptions options;
  options.directory = dir.string();
  explain_oom_errors(a, options);
  a.deallocate(a.allocate(320 * kMiB, 0));
  void* kept = a.allocate(20 * kMiB, 0);  // pins the 320 MiB segment; 300 MiB of it cached
  std::string message;
  try {
    (void)a.allocate(700 * kMiB, 0);  // the cached pages go back; still too little
  } catch (const OutOfMemoryError& e) {
    message = e.what();
  }
  const std::int64_t reserved = a.stats().reserved_bytes[0].current;
  EXPECT_EQ(reserved, std::int64_t{420} << 20);
  const std::vector<std::string> lines = lines_of(message);
  ASSERT_GE(lines.size(), 3u) << message;
  EXPECT_EQ(lines[1],
            "reservoir: out of memory on a 700.00 MiB request: too little memory: the recorded part alone "
            "needs 1.09 GiB at its peak, 96.00 MiB more than the 1024.00 MiB there is.");
  std::vector<std::filesystem::path> snapshots;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().extension() == ".pickle") snapshots.push_back(f.path());
  }
  ASSERT_EQ(snapshots.size(), 1u);
  const Trace back = read_trace_file(snapshots[0].string());
  const Advice advice = advise_at_error(back);
  EXPECT_EQ(advice.diagnosis.source, "recorded");
  EXPECT_EQ(advice.diagnosis.reserved_bytes, static_cast<std::uint64_t>(reserved));
  EXPECT_EQ(advice.diagnosis.allocated_bytes, 420 * kMiB);
  a.deallocate(kept);
  a.deallocate(weights);
  std::filesystem::remove_all(dir);
}

// A process that meets error after error: the answer at the second is of
// what happened since the first (the first's 400 MiB request is not the
// second's), and only that part is replayed: the same answer as from the
// whole recording, whatever came before.
TEST(Explain, TheAnswerAtALaterErrorIsOfWhatHappenedSinceTheOneBefore) {
  Recorder r("", 300 * kMiB);
  void* a = r.alloc(200 * kMiB);
  EXPECT_THROW(r.alloc(200 * kMiB), OutOfMemoryError);
  r.allocator.deallocate(a);
  r.allocator.empty_cache();
  void* b = r.alloc(100 * kMiB);
  void* c = r.alloc(150 * kMiB);
  EXPECT_THROW(r.alloc(100 * kMiB), OutOfMemoryError);
  const Trace t = pickled(r.finish());
  const Trace w = since_previous_error(t);
  std::size_t first_oom = 0;
  while (t.events[first_oom].action != TraceAction::oom) ++first_oom;
  ASSERT_EQ(w.events.size(), t.events.size() - first_oom - 1);
  EXPECT_EQ(w.events.front().action, TraceAction::free_requested);  // a's free
  EXPECT_EQ(w.final_state.segments.size(), t.final_state.segments.size());
  const std::vector<std::string> lines = oom_answer_lines(w, advise_at_error(w), ErrorSite{}, std::nullopt,
                                                          false, "", "", "");
  EXPECT_EQ(lines[0],
            "reservoir: out of memory on a 100.00 MiB request: too little memory: the recorded part alone "
            "needs 350.00 MiB at its peak, 50.00 MiB more than the 300.00 MiB there is.");
  EXPECT_EQ(oom_answer_lines(t, advise_at_error(t), ErrorSite{}, std::nullopt, false, "", "", "")[0], lines[0]);
  // A recording of one error is its own window.
  EXPECT_EQ(since_previous_error(w).events.size(), w.events.size());
  r.allocator.deallocate(b);
  r.allocator.deallocate(c);
}

// A 200 MiB segment cached before the error before, then split again: the
// part since that error starts from the blocks live then, without the
// segment, and its replay under the program's settings serves the small
// request that failed. The whole recording, which shows the segment, is
// weighed instead, and the cause is named as it was: the unused memory sat in
// the large pool's segments, which a small request cannot use.
TEST(Explain, WhereThePartSinceTheErrorBeforeLostWhatWasCachedTheWholeRecordingIsWeighed) {
  Recorder r("", 300 * kMiB);
  void* weights = r.alloc(100 * kMiB);
  r.allocator.deallocate(r.alloc(200 * kMiB));  // cached whole
  void* pin = r.alloc(30 * kMiB);               // splits it
  EXPECT_THROW(r.alloc(180 * kMiB), OutOfMemoryError);
  r.allocator.deallocate(pin);
  void* again = r.alloc(30 * kMiB);  // splits it again
  EXPECT_THROW(r.alloc(500 << 10), OutOfMemoryError);
  r.allocator.deallocate(again);
  r.allocator.deallocate(weights);
  const Trace t = pickled(r.finish());
  const OomExplanation e = explain_oom(t, {}, ExplainOptions{});
  ASSERT_GE(e.lines.size(), 2u);
  EXPECT_EQ(e.lines[0],
            "reservoir: out of memory on a 500.00 KiB request: fragmentation: 170.00 MiB sat reserved but unused, "
            "in segments of the large pool, which a request of 1 MiB or less cannot use, none of them whole to "
            "give back, and the device had 0 bytes free: this request would have fit without it; whether the "
            "rest of the step fits is not known (it had not run).");
  EXPECT_EQ(e.lines[1],
            "reservoir: set PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,max_split_size_mb:128 and "
            "call torch.cuda.set_per_process_memory_fraction(1.0) (garbage collection runs only under one): the "
            "recorded part needs 300.00 MiB under it, 2.00 MiB less than under your settings, and the device had "
            "300.00 MiB.");
  // The part since the error before alone shows no error: its replay under
  // the program's settings fits.
  const Trace w = since_previous_error(t);
  const Advice part = advise_at_error(w);
  for (const Candidate& c : part.candidates) {
    if (c.recorded) {
      EXPECT_LE(c.min_capacity_bytes, 300 * kMiB);
    }
  }
}

}  // namespace
}  // namespace reservoir
