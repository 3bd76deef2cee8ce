// advise on a job of many ranks: every rank advised on, one setting judged
// by the rank that needs the most, unreadable files named and left out.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>

#include "error_text.hpp"
#include "reservoir/advise.hpp"
#include "reservoir/errors.hpp"
#include "trace_fixture.hpp"

namespace reservoir {
namespace {

namespace fs = std::filesystem;


// A rank that does not.
Trace calm() {
  Recorder r("");
  void* a = r.alloc(40 * kMiB);
  void* b = r.alloc(3 * kMiB);
  r.allocator.deallocate(a);
  r.allocator.deallocate(b);
  return pickled(r.finish());
}

class Job : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("reservoir_job_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& bytes) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p.string();
  }
  fs::path dir_;
};

TEST_F(Job, EveryRankAndOneSettingForAll) {
  const Trace oom = fragmented_oom();
  const Trace ok = calm();
  const std::string r0 = write("rank0.pickle", write_pytorch_snapshot(oom));
  const std::string r1 = write("rank1.pickle", write_pytorch_snapshot(ok));
  const std::string r2 = write("rank2.pickle", "not a snapshot");
  std::vector<std::pair<std::size_t, std::size_t>> progress;
  JobOptions options;
  options.threads = 2;
  options.progress = [&](std::size_t done, std::size_t total) { progress.emplace_back(done, total); };
  std::atomic<std::size_t> pages{0};  // on_rank runs on the workers, concurrently
  options.on_rank = [&](const Trace&, const Advice&, const RankAdvice&) { ++pages; };
  const JobAdvice job = advise_job({r0, r1, r2}, options);

  ASSERT_EQ(job.ranks.size(), 3u);
  EXPECT_EQ(job.ranks[0].name, "rank 0");
  EXPECT_TRUE(job.ranks[0].ok);
  EXPECT_TRUE(job.ranks[0].ran_out);
  EXPECT_EQ(job.ranks[0].oom_request, 160 * kMiB);
  EXPECT_EQ(job.ranks[0].allocated_bytes, 56 * kMiB);
  EXPECT_EQ(job.ranks[0].reserved_bytes, 256 * kMiB);
  EXPECT_EQ(job.ranks[0].unusable_bytes, 200 * kMiB);
  EXPECT_EQ(job.ranks[0].largest_allocation, 28 * kMiB);
  EXPECT_TRUE(job.ranks[1].ok);
  EXPECT_FALSE(job.ranks[1].ran_out);
  EXPECT_EQ(job.ranks[1].moment, "peak_reserved");
  EXPECT_FALSE(job.ranks[2].ok);
  EXPECT_EQ(job.ranks[2].name, "rank 2");
  EXPECT_EQ(job.ranks[2].error.rfind("trace " + r2 + ": line 1:", 0), 0u) << job.ranks[2].error;
  EXPECT_EQ(job.unreadable, 1u);
  EXPECT_EQ(pages, 2u);
  EXPECT_EQ(progress.size(), 3u);
  EXPECT_EQ(progress.back(), std::make_pair(std::size_t{3}, std::size_t{3}));

  // Each setting is judged by the rank that needs the most under it: the
  // same figures each rank's own advice gives.
  const Advice a0 = advise(oom);
  const Advice a1 = advise(ok);
  ASSERT_EQ(job.candidates.size(), a0.candidates.size());
  for (std::size_t i = 0; i < job.candidates.size(); ++i) {
    const JobCandidate& c = job.candidates[i];
    EXPECT_EQ(c.config, a0.candidates[i].config);
    const auto other = std::find_if(a1.candidates.begin(), a1.candidates.end(),
                                    [&](const Candidate& x) { return x.config == c.config; });
    ASSERT_NE(other, a1.candidates.end());
    EXPECT_EQ(c.worst_min_capacity_bytes,
              std::max(a0.candidates[i].min_capacity_bytes, other->min_capacity_bytes));
  }
  // The oom rank's capacity (reserved + device free at its oom) is the job's.
  EXPECT_EQ(job.capacity_bytes, a0.capacity_bytes);
  ASSERT_TRUE(job.best_pytorch.has_value());
  const JobCandidate& best = job.candidates[*job.best_pytorch];
  for (const JobCandidate& c : job.candidates) {
    if (!c.reservoir_only) {
      EXPECT_LE(best.worst_min_capacity_bytes, c.worst_min_capacity_bytes);
    }
  }
  EXPECT_EQ(best.worst_rank, "rank 0");
  EXPECT_EQ(job.fits, best.worst_min_capacity_bytes <= *job.capacity_bytes);
  EXPECT_TRUE(*job.fits);  // max_split_size_mb keeps the 160 MiB request out of the holes
}

TEST_F(Job, FilesFromFoldersAndGlobsInNaturalOrder) {
  for (const char* name : {"rank10.pickle", "rank2.pickle", "rank1.json", "notes.txt"}) write(name, "x");
  const std::vector<std::string> folder = job_files({dir_.string()});
  EXPECT_EQ(folder, (std::vector<std::string>{(dir_ / "rank1.json").string(),
                                              (dir_ / "rank2.pickle").string(),
                                              (dir_ / "rank10.pickle").string()}));
  const std::vector<std::string> glob = job_files({(dir_ / "rank*.pickle").string()});
  EXPECT_EQ(glob, (std::vector<std::string>{(dir_ / "rank2.pickle").string(),
                                            (dir_ / "rank10.pickle").string()}));
  EXPECT_EQ(testing::error_of<UsageError>([&] { (void)job_files({(dir_ / "none*.pickle").string()}); }),
            "advise: no file matches '" + (dir_ / "none*.pickle").string() + "'");
  EXPECT_EQ(testing::error_of<UsageError>([&] { (void)job_files({(dir_ / "absent.pickle").string()}); }),
            "advise: '" + (dir_ / "absent.pickle").string() + "' does not exist");
  fs::create_directories(dir_ / "empty");
  EXPECT_EQ(testing::error_of<UsageError>([&] { (void)job_files({(dir_ / "empty").string()}); }),
            "advise: the folder '" + (dir_ / "empty").string() + "' holds no .pickle or .json file");
}

// A folder where processes that caught their errors and went on wrote one
// file per error: each process and rank's latest error stands for it, the
// earlier ones are set aside and named.
TEST_F(Job, EachProcesssLatestErrorStandsForItsRank) {
  for (const char* name : {"node1-rank0-20261128-101500.pickle", "node1-rank0-20261128-101500-2.pickle",
                           "node1-rank0-20261128-101500-10.pickle", "node1-rank0-20261128-101459.pickle",
                           "node1-rank1-20261128-101502.pickle", "node2-rank0-20261128-090000.pickle",
                           "node2-rank0-20261128-100000.pickle", "rank3.pickle"}) {
    write(name, "x");
  }
  std::vector<RankErrors> errors_of;
  const std::vector<std::string> files = job_files({dir_.string()}, &errors_of);
  EXPECT_EQ(files, (std::vector<std::string>{(dir_ / "node1-rank0-20261128-101500-10.pickle").string(),
                                             (dir_ / "node1-rank1-20261128-101502.pickle").string(),
                                             (dir_ / "node2-rank0-20261128-100000.pickle").string(),
                                             (dir_ / "rank3.pickle").string()}));
  ASSERT_EQ(errors_of.size(), 2u);
  EXPECT_EQ(errors_of[0].latest, (dir_ / "node1-rank0-20261128-101500-10.pickle").string());
  EXPECT_EQ(errors_of[0].earlier, (std::vector<std::string>{(dir_ / "node1-rank0-20261128-101459.pickle").string(),
                                                            (dir_ / "node1-rank0-20261128-101500.pickle").string(),
                                                            (dir_ / "node1-rank0-20261128-101500-2.pickle").string()}));
  EXPECT_EQ(errors_of[1].latest, (dir_ / "node2-rank0-20261128-100000.pickle").string());
  EXPECT_EQ(errors_of[1].earlier, (std::vector<std::string>{(dir_ / "node2-rank0-20261128-090000.pickle").string()}));
  // Files named on the command line are each advised on, as given.
  EXPECT_EQ(job_files({(dir_ / "node2-rank0-*.pickle").string()}).size(), 2u);
}

}  // namespace
}  // namespace reservoir
