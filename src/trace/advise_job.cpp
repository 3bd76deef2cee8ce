// Advice for a job of many ranks: each rank's recording advised on by
// advise(), the files analysed in parallel with a bounded number in memory,
// and one setting that fits every rank.
#include <fmt/format.h>

#include <glob.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <tuple>

#include "reservoir/advise.hpp"
#include "reservoir/detail/parallel.hpp"
#include "reservoir/errors.hpp"

namespace reservoir {
namespace {

// "rank 3" for rank3.pickle, rank_3_snapshot.pickle, rank-03.json; else the file name.
std::string rank_name(const std::string& path) {
  std::string base = std::filesystem::path(path).filename().string();
  std::string lower = base;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (std::size_t at = lower.find("rank"); at != std::string::npos; at = lower.find("rank", at + 1)) {
    std::size_t i = at + 4;
    while (i < lower.size() && (lower[i] == '_' || lower[i] == '-')) ++i;
    std::size_t j = i;
    while (j < lower.size() && std::isdigit(static_cast<unsigned char>(lower[j])) != 0) ++j;
    if (j > i) return fmt::format("rank {}", std::stoull(lower.substr(i, j - i)));
  }
  return base;
}

// The answer at the error's file names carry the device: HOST-rank1-gpu1-....
bool names_gpu(const std::string& path) {
  static const std::regex kGpu(R"((^|[-_])gpu\d+($|[-_.]))");
  return std::regex_search(std::filesystem::path(path).filename().string(), kGpu);
}

// Natural order: digit runs compare as numbers.
bool natural_less(const std::string& a, const std::string& b) {
  std::size_t i = 0;
  std::size_t j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = std::isdigit(static_cast<unsigned char>(a[i])) != 0;
    const bool db = std::isdigit(static_cast<unsigned char>(b[j])) != 0;
    if (da && db) {
      std::size_t ei = i;
      std::size_t ej = j;
      while (ei < a.size() && std::isdigit(static_cast<unsigned char>(a[ei])) != 0) ++ei;
      while (ej < b.size() && std::isdigit(static_cast<unsigned char>(b[ej])) != 0) ++ej;
      const std::string na = a.substr(i, ei - i);
      const std::string nb = b.substr(j, ej - j);
      const std::string ta = na.substr(std::min(na.find_first_not_of('0'), na.size()));
      const std::string tb = nb.substr(std::min(nb.find_first_not_of('0'), nb.size()));
      if (ta.size() != tb.size()) return ta.size() < tb.size();
      if (ta != tb) return ta < tb;
      i = ei;
      j = ej;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

RankAdvice summarize(const Trace& trace, const Advice& advice, const std::string& path,
                     bool several_devices) {
  RankAdvice r;
  r.path = path;
  r.device = trace.device;
  r.name = rank_name(path);
  // The device as the answer at the error names it (its files say "-gpuD"),
  // or as the file's devices tell them apart.
  if (several_devices || names_gpu(path)) r.name += fmt::format(" (GPU {})", trace.device);
  r.ok = true;
  const Diagnosis& d = advice.diagnosis;
  r.ran_out = d.moment == "oom";
  if (d.request) r.oom_request = d.request->size;
  r.ends_at_error = advice.diagnosis.ends_at_error;
  r.moment = d.moment;
  r.peak_requested_bytes = advice.peak_requested_bytes;
  r.allocated_bytes = d.allocated_bytes;
  r.reserved_bytes = d.reserved_bytes;
  r.unusable_bytes = d.reserved_bytes - std::min(d.reserved_bytes, d.allocated_bytes);
  for (const SegmentInfo& s : d.segments.segments) {
    for (const BlockInfo& b : s.blocks) {
      if (b.state == BlockState::active_allocated) {
        r.largest_allocation = std::max<std::uint64_t>(r.largest_allocation, b.size);
      }
    }
  }
  r.capacity_bytes = advice.capacity_bytes;
  r.during = d.during;
  r.candidates = advice.candidates;
  r.pytorch_since = advice.pytorch_since;
  r.pytorch_release_known = advice.pytorch_release_known;
  return r;
}

}  // namespace

namespace {

// The live answer's file name split: the process and rank's part, and the
// error's time and number ("-N" for the Nth error of one second; none is 1).
struct ErrorFile {
  std::string process;
  std::string stamp;
  unsigned long long n = 1;
};

std::optional<ErrorFile> error_file(const std::string& path) {
  static const std::regex kName(R"(^(.+)-(\d{8}-\d{6})(?:-(\d{1,9}))?\.(?:pickle|pkl|json)$)");
  const std::string base = std::filesystem::path(path).filename().string();
  std::smatch m;
  if (!std::regex_match(base, m, kName)) return std::nullopt;
  ErrorFile f{m[1].str(), m[2].str(), 1};
  if (m[3].matched) f.n = std::stoull(m[3].str());
  return f;
}

// A folder's files with each process's errors but the latest set aside.
std::vector<std::string> latest_errors(const std::vector<std::string>& found,
                                       std::vector<RankErrors>* errors_of) {
  std::map<std::string, std::vector<std::pair<ErrorFile, std::string>>> by_process;
  for (const std::string& f : found) {
    if (const auto e = error_file(f)) by_process[e->process].emplace_back(*e, f);
  }
  std::set<std::string> set_aside;
  for (auto& [process, files] : by_process) {
    if (files.size() < 2) continue;
    std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) {
      return std::tie(a.first.stamp, a.first.n) < std::tie(b.first.stamp, b.first.n);
    });
    RankErrors r;
    r.latest = files.back().second;
    for (std::size_t i = 0; i + 1 < files.size(); ++i) {
      r.earlier.push_back(files[i].second);
      set_aside.insert(files[i].second);
    }
    if (errors_of != nullptr) errors_of->push_back(std::move(r));
  }
  std::vector<std::string> out;
  for (const std::string& f : found) {
    if (!set_aside.contains(f)) out.push_back(f);
  }
  return out;
}

}  // namespace

std::vector<std::string> job_files(const std::vector<std::string>& args, std::vector<RankErrors>* errors_of) {
  std::vector<std::string> out;
  for (const std::string& arg : args) {
    std::error_code ec;
    if (std::filesystem::is_directory(arg, ec)) {
      std::vector<std::string> found;
      for (const auto& entry : std::filesystem::directory_iterator(arg, ec)) {
        const auto ext = entry.path().extension();
        if (entry.is_regular_file() && (ext == ".pickle" || ext == ".pkl" || ext == ".json")) {
          found.push_back(entry.path().string());
        }
      }
      if (found.empty()) {
        throw UsageError(fmt::format("advise: the folder '{}' holds no .pickle or .json file", arg));
      }
      std::sort(found.begin(), found.end(), natural_less);
      found = latest_errors(found, errors_of);
      out.insert(out.end(), found.begin(), found.end());
    } else if (std::filesystem::exists(arg, ec)) {
      out.push_back(arg);
    } else if (arg.find_first_of("*?[") != std::string::npos) {
      glob_t g{};
      const int rc = ::glob(arg.c_str(), 0, nullptr, &g);
      std::vector<std::string> found;
      if (rc == 0) {
        for (std::size_t i = 0; i < g.gl_pathc; ++i) found.emplace_back(g.gl_pathv[i]);
      }
      ::globfree(&g);
      if (found.empty()) throw UsageError(fmt::format("advise: no file matches '{}'", arg));
      std::sort(found.begin(), found.end(), natural_less);
      out.insert(out.end(), found.begin(), found.end());
    } else {
      throw UsageError(fmt::format("advise: '{}' does not exist", arg));
    }
  }
  return out;
}

JobAdvice advise_job(const std::vector<std::string>& paths, const JobOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  JobAdvice job;
  std::vector<std::vector<RankAdvice>> per_file(paths.size());
  AdviseOptions one;
  one.capacity = options.capacity;
  one.torch_version = options.torch_version;
  one.configs = options.configs;
  one.threads = 1;  // the files are the parallel work
  // A rank's error is its own (in its RankAdvice): the other files go on.
  detail::parallel_for(paths.size(), options.threads, [&](std::size_t i) {
    std::vector<RankAdvice>& out = per_file[i];
    try {
      const std::vector<Trace> devices = select_devices(read_trace_devices(paths[i]), options.device);
      for (const Trace& trace : devices) {
        const Advice advice = advise(trace, one);
        out.push_back(summarize(trace, advice, paths[i], devices.size() > 1));
        if (options.on_rank) options.on_rank(trace, advice, out.back());
      }
    } catch (const std::exception& e) {  // this rank's file; the others go on
      RankAdvice bad;
      bad.path = paths[i];
      bad.name = rank_name(paths[i]);
      bad.error = e.what();
      out.clear();
      out.push_back(std::move(bad));
    }
  }, options.progress);
  for (auto& f : per_file) {
    for (RankAdvice& r : f) job.ranks.push_back(std::move(r));
  }

  // One setting for every rank: each setting all ranks swept, judged by the
  // rank that needs the most memory under it.
  const RankAdvice* first = nullptr;
  bool all_versions = true;
  for (const RankAdvice& r : job.ranks) {
    if (!r.ok) {
      ++job.unreadable;
      continue;
    }
    if (first == nullptr) first = &r;
    if (r.capacity_bytes && !options.capacity) {
      job.capacity_bytes = std::min(job.capacity_bytes.value_or(*r.capacity_bytes), *r.capacity_bytes);
    }
    if (r.pytorch_since.empty()) all_versions = false;
    if (!r.pytorch_since.empty() &&
        (job.pytorch_since.empty() || compare_versions(r.pytorch_since, job.pytorch_since) < 0)) {
      job.pytorch_since = r.pytorch_since;
    }
  }
  if (options.capacity) job.capacity_bytes = options.capacity;
  if (!all_versions) job.pytorch_since.clear();
  job.pytorch_release_known = !job.ranks.empty() && !job.pytorch_since.empty();
  for (const RankAdvice& r : job.ranks) {
    if (!r.ok) continue;
    if (!r.pytorch_release_known || r.pytorch_since != job.pytorch_since) job.pytorch_release_known = false;
  }
  job.pytorch_env = std::string(pytorch_env_var(job.pytorch_since));
  if (first != nullptr) {
    for (const Candidate& c : first->candidates) {
      JobCandidate jc;
      jc.config = c.config;
      jc.reservoir_only = c.reservoir_only;
      jc.memory_fraction = c.memory_fraction;
      bool everywhere = true;
      for (const RankAdvice& r : job.ranks) {
        if (!r.ok) continue;
        const auto it = std::find_if(r.candidates.begin(), r.candidates.end(),
                                     [&](const Candidate& x) { return x.config == c.config; });
        if (it == r.candidates.end()) {
          everywhere = false;
          break;
        }
        if (jc.worst_rank.empty() || it->min_capacity_bytes > jc.worst_min_capacity_bytes) {
          jc.worst_min_capacity_bytes = it->min_capacity_bytes;
          jc.worst_rank = r.name;
        }
      }
      if (everywhere) job.candidates.push_back(std::move(jc));
    }
    for (std::size_t i = 0; i < job.candidates.size(); ++i) {
      const JobCandidate& c = job.candidates[i];
      if (c.worst_min_capacity_bytes < job.candidates[job.best_reservoir].worst_min_capacity_bytes) {
        job.best_reservoir = i;
      }
      if (!c.reservoir_only &&
          (!job.best_pytorch ||
           c.worst_min_capacity_bytes < job.candidates[*job.best_pytorch].worst_min_capacity_bytes)) {
        job.best_pytorch = i;
      }
    }
    if (job.capacity_bytes && !job.candidates.empty()) {
      const JobCandidate& chosen = job.candidates[job.best_pytorch.value_or(job.best_reservoir)];
      job.fits = chosen.worst_min_capacity_bytes <= *job.capacity_bytes;
    }
  }
  job.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return job;
}

}  // namespace reservoir
