#include "reservoir/explain.hpp"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <deque>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "reservoir/trace.hpp"

namespace reservoir {
namespace {

std::string host_name(const ExplainOptions& options) {
  if (!options.host.empty()) return options.host;
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "host";
  return name;
}

// A name part for a file: letters, digits, '-', '_' and '.' kept, others '_'.
std::string file_part(std::string s) {
  for (char& c : s) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '-' || c == '_' || c == '.';
    if (!keep) c = '_';
  }
  return s;
}

std::string utc_stamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char out[32];
  std::strftime(out, sizeof out, "%Y%m%d-%H%M%S", &tm);
  return out;
}

void write_bytes(const std::filesystem::path& path, std::span<const std::uint8_t> bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) throw UsageError(fmt::format("cannot write '{}'", path.string()));
}

// Why the request failed, in one sentence: the process's own limit, memory
// held outside the allocator, fragmentation, or simply too little memory.
// `limit`: the process's limit where the error reported it; else one is
// inferred (Diagnosis::limit_at_least) where the device had room.
std::string why(const Advice& a, const std::optional<std::uint64_t>& device_total,
                const std::optional<std::uint64_t>& limit) {
  const Diagnosis& d = a.diagnosis;
  const std::uint64_t unusable = d.reserved_bytes > d.allocated_bytes ? d.reserved_bytes - d.allocated_bytes : 0;
  // The known limit refused the request when a new segment would have
  // passed it (PyTorch checks the limit before it asks the device).
  const bool limit_refused = limit && d.request && d.reserved_bytes + d.request->segment_size > *limit;
  std::vector<std::string> causes;
  if (limit_refused) {
    causes.push_back(fmt::format(
        "the process's memory fraction (set_per_process_memory_fraction) refused it: it allows {}, the "
        "process had {} reserved{}",
        format_size(*limit), format_size(d.reserved_bytes),
        d.device_free_bytes ? fmt::format(" and the device {} free", format_size(*d.device_free_bytes)) : ""));
  } else if (!limit && d.limit_at_least) {
    causes.push_back(fmt::format(
        "the process's memory fraction (set_per_process_memory_fraction) refused it: the device "
        "had {} free, the process was at its limit with {} reserved",
        d.device_free_bytes ? format_size(*d.device_free_bytes) : "room", format_size(d.reserved_bytes)));
  }
  // Beyond a twentieth of the device (a GPU's own context and libraries
  // take a few hundred MiB of 80 GiB).
  if (!limit_refused && !(!limit && d.limit_at_least) && device_total && d.device_free_bytes &&
      *device_total > d.reserved_bytes + *d.device_free_bytes) {
    const std::uint64_t outside = *device_total - d.reserved_bytes - *d.device_free_bytes;
    if (outside * 20 > *device_total) {
      causes.push_back(fmt::format("{} of the device's {} was held outside this allocator (another "
                                   "process, or other libraries of this one)",
                                   format_size(outside), format_size(*device_total)));
    }
  }
  // Fragmentation: what was in use and the request would have fit in what
  // the allocator held and the device had free (within the process's limit
  // where it has one), but the held memory sat in pieces too small for it.
  // (Under a page policy a segment's address space counts as reserved
  // whether its pages are mapped or not: what is in use and the request
  // must also fit the device.)
  std::optional<std::uint64_t> room = d.device_free_bytes;
  if (limit) {
    const std::uint64_t under_limit = *limit > d.reserved_bytes ? *limit - d.reserved_bytes : 0;
    room = room ? std::min(*room, under_limit) : under_limit;
  }
  if (d.request && unusable > 0 && room && unusable + *room >= d.request->rounded &&
      (!device_total || d.allocated_bytes + d.request->rounded <= *device_total) &&
      (!limit || d.allocated_bytes + d.request->rounded <= *limit)) {
    // What is known is that this request would have fit; where the step had
    // not finished (the recording ends at the error), not whether the rest
    // of it fits: said, so that the cause is not read as the whole story.
    // A small request finds no block of its own pool: the unused memory
    // sits in the large pool's segments, which it cannot use.
    const std::uint64_t largest = std::max(d.request->largest_same_stream, d.request->largest_other_stream);
    causes.push_back(fmt::format(
        "fragmentation: {} sat reserved but unused, {}, {}{}", format_size(unusable),
        !d.request->large && largest == 0
            ? std::string("in segments of the large pool, which a request of 1 MiB or less cannot use, none "
                          "of them whole to give back")
            : fmt::format("in pieces too small for it (the largest {})", format_size(largest)),
        limit ? fmt::format("and {} more was within the limit", format_size(*room))
              : fmt::format("and the device had {} free", format_size(*room)),
        d.ends_at_error && !a.shrink_bytes ? ": this request would have fit without it; whether the rest of the step fits is "
                          "not known (it had not run)"
                        : ""));
  }
  if (a.shrink_bytes) {
    causes.push_back(fmt::format("too little memory: the recorded part alone needs {} at its peak, {} "
                                 "more than the {} {}",
                                 format_size(a.peak_requested_bytes), format_size(*a.shrink_bytes),
                                 format_size(*a.capacity_bytes),
                                 limit ? "its memory fraction allows" : "there is"));
  }
  if (causes.empty()) {
    causes.push_back(fmt::format("too little memory: {} was in use and {} reserved",
                                 format_size(d.allocated_bytes), format_size(d.reserved_bytes)));
  }
  std::string out = causes.front();
  for (std::size_t i = 1; i < causes.size(); ++i) out += "; and " + causes[i];
  return out;
}

// The program's own history of the failed request: where the recording
// shows the same request succeed before (the same call stack where stacks
// were recorded; else the same size, for requests of 64 MiB and more), what
// the program went on to hold while that allocation lived. A long-lived
// process that served the request before tells how much the step needs,
// which the part since the error before cannot.
struct EarlierSuccess {
  std::size_t times = 0;         // successes of the request the recording shows
  std::uint64_t held_bytes = 0;  // the most held while the latest of them lived
};

std::optional<EarlierSuccess> earlier_success(const Trace& trace) {
  std::size_t failed = trace.events.size();
  for (std::size_t i = trace.events.size(); i-- > 0;) {
    if (trace.events[i].action == TraceAction::oom && trace.events[i].size != 0) {
      failed = i;
      break;
    }
  }
  if (failed == trace.events.size()) return std::nullopt;
  const TraceEvent& oom = trace.events[failed];
  const bool by_stack = oom.context != 0;
  if (!by_stack && oom.size < (std::uint64_t{64} << 20)) return std::nullopt;
  auto same = [&](const TraceEvent& e) {
    return e.action == TraceAction::alloc && e.size == oom.size && e.stream == oom.stream &&
           (!by_stack || e.context == oom.context);
  };
  std::unordered_map<DevicePtr, std::uint64_t> live;   // address -> size
  std::unordered_map<DevicePtr, std::uint64_t> open;   // a success of the request still live -> most held
  std::uint64_t held = 0;
  EarlierSuccess out;
  for (std::size_t i = 0; i < failed; ++i) {
    const TraceEvent& e = trace.events[i];
    if (e.action == TraceAction::alloc) {
      live[e.addr] = e.size;
      held += e.size;
      for (auto& entry : open) entry.second = std::max(entry.second, held);
      if (same(e)) {
        ++out.times;
        open[e.addr] = held;
      }
    } else if (e.action == TraceAction::free_requested) {
      const auto it = live.find(e.addr);
      if (it == live.end()) continue;  // made before the recording began
      held -= std::min(held, it->second);
      live.erase(it);
      if (const auto o = open.find(e.addr); o != open.end()) {
        out.held_bytes = o->second;  // the latest success that ended (never 0: it held the request)
        open.erase(o);
      }
    }
  }
  if (out.held_bytes == 0) return std::nullopt;  // none ended within the recording
  return out;
}

// The replay under the program's own settings fits the capacity the
// program ran out of: it does not show the error it is to explain.
bool reproduces_nothing(const Advice& a) {
  if (!a.capacity_bytes || a.diagnosis.moment != "oom") return false;
  for (const Candidate& c : a.candidates) {
    if (c.recorded) return c.min_capacity_bytes <= *a.capacity_bytes;
  }
  return false;
}

}  // namespace

std::vector<std::string> live_sweep(std::string_view pytorch_since) {
  static const char* const kLive[] = {"",
                                      "expandable_segments:True",
                                      "expandable_segments:True,large_segment_size_mb:12",
                                      "large_segment_size_mb:40",
                                      "max_split_size_mb:128",
                                      "roundup_power2_divisions:4",
                                      "garbage_collection_threshold:0.6,max_split_size_mb:128",
                                      "policy:native_paged"};
  const std::vector<std::string> all = default_sweep(pytorch_since);
  std::vector<std::string> out;
  for (const char* c : kLive) {
    if (std::find(all.begin(), all.end(), c) != all.end()) out.emplace_back(c);
  }
  return out;
}

Trace since_previous_error(const Trace& trace) {
  // Just after the second oom from the end; 0: the recording holds one.
  std::size_t cut = 0;
  std::size_t ooms = 0;
  for (std::size_t i = trace.events.size(); i-- > 0 && cut == 0;) {
    const TraceEvent& e = trace.events[i];
    if (e.action == TraceAction::oom && e.size != 0 && ++ooms == 2) cut = i + 1;
  }
  if (cut == 0) return trace;
  Trace out = trace;
  out.events.erase(out.events.begin(), out.events.begin() + static_cast<std::ptrdiff_t>(cut));
  out.event_pools.clear();
  for (const auto& [i, pool] : trace.event_pools) {
    if (i >= cut) out.event_pools.emplace(i - cut, pool);
  }
  out.device_events = {out.events.size()};
  out.annotations.clear();
  // Annotations: those still open at the cut move to its start.
  std::vector<TraceAnnotation> open;
  for (const TraceAnnotation& a : trace.annotations) {
    if (a.event >= cut) break;
    if (a.stage == "START") {
      open.push_back(a);
    } else if (a.stage == "END") {
      const auto it = std::find_if(open.rbegin(), open.rend(),
                                   [&a](const TraceAnnotation& o) { return o.name == a.name; });
      if (it != open.rend()) open.erase(std::next(it).base());
    }
  }
  for (TraceAnnotation a : open) {
    a.event = 0;
    out.annotations.push_back(std::move(a));
  }
  for (const TraceAnnotation& a : trace.annotations) {
    if (a.event < cut) continue;
    TraceAnnotation moved = a;
    moved.event = a.event - cut;
    out.annotations.push_back(std::move(moved));
  }
  return out;
}

Advice advise_at_error(const Trace& trace, unsigned threads, std::optional<std::uint64_t> memory_limit) {
  AdviseOptions options;
  options.threads = threads;
  options.capacity = memory_limit;
  // The other settings' minimum capacities within 1/32 (the page shows them
  // so); the recorded and the best ones exact, as the lines give them.
  options.tolerance = 1.0 / 32;
  options.count_ooms_at_capacity = false;  // the answer shows no such count
  options.configs = live_sweep(trace.pytorch_since);
  const AllocatorConfig recorded = AllocatorConfig::parse(trace.recorded_config);
  bool have_recorded = false;
  for (const std::string& c : options.configs) have_recorded |= AllocatorConfig::parse(c) == recorded;
  if (!have_recorded) options.configs.push_back(trace.recorded_config);
  Advice advice = advise(trace, options);
  if (memory_limit) advice.capacity_source = "the process's memory limit (set_per_process_memory_fraction)";
  return advice;
}

std::string ErrorSite::prefix() const {
  if (rank && device) return fmt::format("reservoir [rank {}, GPU {}]: ", *rank, *device);
  if (rank) return fmt::format("reservoir [rank {}]: ", *rank);
  // A process outside a job names its device where it is not the first.
  if (device && *device != 0) return fmt::format("reservoir [GPU {}]: ", *device);
  return "reservoir: ";
}

std::string ErrorSite::file_part() const {
  return fmt::format("{}{}", rank ? fmt::format("-rank{}", *rank) : std::string(),
                     device ? fmt::format("-gpu{}", *device) : std::string());
}

std::vector<std::string> oom_answer_lines(const Trace& trace, const Advice& a, const ErrorSite& site,
                                          const std::optional<std::uint64_t>& device_total,
                                          bool on_reservoir, const std::string& snapshot_path, const std::string& page_path,
                                          const std::string& directory, const std::string& advise_command,
                                          const std::optional<std::uint64_t>& memory_limit) {
  const std::string p = site.prefix();
  const Diagnosis& d = a.diagnosis;
  std::vector<std::string> lines;
  if (d.moment == "oom" && d.request) {
    lines.push_back(fmt::format("{}out of memory on a {} request: {}.", p, format_size(d.request->size),
                                why(a, device_total, memory_limit)));
  } else {
    lines.push_back(fmt::format("{}the recording shows no failed request to explain ({} events).", p,
                                trace.events.size()));
  }
  const Candidate* recorded = nullptr;
  for (const Candidate& c : a.candidates) {
    if (c.recorded) recorded = &c;
  }
  const Candidate* best = a.best_pytorch ? &a.candidates[*a.best_pytorch] : nullptr;
  const Candidate& best_any = a.candidates[a.best_reservoir];
  const bool fits = a.fits.value_or(false);
  bool named_setting = true;
  if (a.shrink_bytes) {
    named_setting = false;
    lines.push_back(fmt::format("{}no setting helps: the program must need {} less (smaller batches, "
                                "activation checkpointing, lower precision).",
                                p, format_size(*a.shrink_bytes)));
  } else if (best != nullptr && recorded != nullptr && best != recorded &&
             best->min_capacity_bytes < recorded->min_capacity_bytes) {
    lines.push_back(fmt::format(
        "{}set {}{}: the recorded part needs {} under it, {} less than under your settings{}.", p,
        env_line(*best, on_reservoir, a.pytorch_env),
        best->memory_fraction ? fmt::format(" and call torch.cuda.set_per_process_memory_fraction({:.1f}) "
                                            "(garbage collection runs only under one)",
                                            *best->memory_fraction)
                              : std::string(),
        format_size(best->min_capacity_bytes),
        format_size(recorded->min_capacity_bytes - best->min_capacity_bytes),
        a.capacity_bytes ? fmt::format(", and {} {}", memory_limit ? "its memory fraction allows" : "the device had",
                                       format_size(*a.capacity_bytes))
                         : ""));
    if (!fits && best_any.reservoir_only && best_any.min_capacity_bytes < best->min_capacity_bytes) {
      lines.push_back(fmt::format("{}reservoir's {} needs {} (RESERVOIR_ALLOC_CONF={}).", p, best_any.config,
                                  format_size(best_any.min_capacity_bytes), best_any.config));
    }
  } else if (best_any.reservoir_only && recorded != nullptr &&
             best_any.min_capacity_bytes < recorded->min_capacity_bytes) {
    lines.push_back(fmt::format("{}no PyTorch setting does better than yours; reservoir's {} needs {}, {} "
                                "less (RESERVOIR_ALLOC_CONF={}).",
                                p, best_any.config, format_size(best_any.min_capacity_bytes),
                                format_size(recorded->min_capacity_bytes - best_any.min_capacity_bytes),
                                best_any.config));
  } else {
    named_setting = false;
    lines.push_back(fmt::format("{}no setting does better than yours: the recorded part needs {} at its "
                                "peak; less live memory is what helps.",
                                p, format_size(a.peak_requested_bytes)));
  }
  if (d.ends_at_error) {
    // With a setting named, how to check the rest; without, what it means.
    lines.push_back(fmt::format(
        "{}this covers the program up to the failed request; the rest of the step was never recorded: {}", p,
        named_setting ? "rerun with the setting and RESERVOIR_EXPLAIN_OOM=1 to check it."
                      : "the step needs at least this much."));
  }
  if (!snapshot_path.empty()) {
    lines.push_back(page_path.empty()
                        ? fmt::format("{}snapshot: {}", p, snapshot_path)
                        : fmt::format("{}snapshot: {}; the full answer: {}", p, snapshot_path, page_path));
  }
  if (!directory.empty()) {
    // The answer here weighs a few settings, to stay within a second;
    // advise weighs every one the release knows, and may name another.
    lines.push_back(fmt::format("{}{}: {} {} (it weighs every setting of your release, not only the {} "
                                "weighed here)",
                                p, site.rank ? "for the whole job" : "next", advise_command, directory,
                                a.candidates.size()));
  }
  if (lines.size() > 8) lines.resize(8);
  return lines;
}

namespace {
std::atomic<int> framework_rank{-1};  // set_process_rank's; -1: none

std::optional<int> rank_variable(const char* name) {
  const char* r = std::getenv(name);
  if (r == nullptr || *r == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(r, &end, 10);
  if (*end != '\0' || errno != 0 || v < 0 || v > 1'000'000 || r[0] == '+' || r[0] == ' ') return std::nullopt;
  return static_cast<int>(v);
}
// A whole number from 1 to `most` in the variable `name`; none where it is
// unset or empty. UsageError naming it and what is `accepted` otherwise.
std::optional<unsigned long long> count_variable(const char* name, unsigned long long most,
                                                 std::string_view accepted) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (*end != '\0' || errno != 0 || v == 0 || v > most || text[0] == '-' || text[0] == '+') {
    throw UsageError(fmt::format("{}='{}': not accepted; accepted: {}", name, text, accepted));
  }
  return v;
}
}  // namespace

void set_process_rank(std::optional<int> rank) {
  framework_rank.store(rank && *rank >= 0 ? *rank : -1, std::memory_order_relaxed);
}

std::optional<int> process_rank(const ExplainOptions& options) {
  if (options.rank) return options.rank;
  if (const int r = framework_rank.load(std::memory_order_relaxed); r >= 0) return r;
  for (const char* name : {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                           "MV2_COMM_WORLD_RANK"}) {
    if (const auto r = rank_variable(name)) return r;
  }
  return std::nullopt;
}

unsigned explain_threads(const ExplainOptions& options) {
  constexpr unsigned kMostThreads = 4;
  if (options.threads != 0) return options.threads;
  if (const auto v = count_variable("RESERVOIR_EXPLAIN_OOM_THREADS", 1024,
                                     "a whole number from 1 to 1024 (the cores the analysis at an error replays on)")) {
    return static_cast<unsigned>(*v);
  }
  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
    cores = static_cast<unsigned>(CPU_COUNT(&set));
  }
  unsigned local = 1;
  for (const char* name : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                           "SLURM_NTASKS_PER_NODE"}) {
    if (const auto n = rank_variable(name); n && *n > 0) {
      local = static_cast<unsigned>(*n);
      break;
    }
  }
  return std::clamp(cores / local, 1u, kMostThreads);
}

std::size_t files_kept(const ExplainOptions& options) {
  if (options.keep) {
    if (*options.keep == 0) throw UsageError("explain_oom: keep must be at least 1 (the error's own files)");
    return *options.keep;
  }
  const auto v = count_variable(
      "RESERVOIR_EXPLAIN_OOM_KEEP", std::numeric_limits<unsigned long long>::max(),
      fmt::format("a whole number from 1 (the errors whose files are kept; default {})", kDefaultFilesKept));
  return v ? static_cast<std::size_t>(*v) : kDefaultFilesKept;
}

namespace {

// The errors' files this process wrote, per directory, oldest first.
struct WrittenFiles {
  std::mutex mutex;
  std::map<std::string, std::deque<std::vector<std::filesystem::path>>> by_directory;
  std::set<std::string> names;  // directory and snapshot path of every error's files
  bool said = false;
};

WrittenFiles& written_files() {
  static WrittenFiles* files = new WrittenFiles;  // never destroyed: errors may come during exit
  return *files;
}

// A name this process gave an error's files, even where they were removed
// since (a name is never given twice: removing an old error's files must
// not remove a new error's).
bool named_before(const std::string& directory, const std::filesystem::path& snapshot) {
  WrittenFiles& w = written_files();
  std::lock_guard lock(w.mutex);
  return w.names.contains(directory + '\n' + snapshot.string());
}

// Records an error's files and removes the oldest errors' beyond `keep`.
// Returns the sentence to add to the answer the first time any are removed.
std::string keep_most_recent(const std::string& directory, std::vector<std::filesystem::path> files,
                             std::size_t keep) {
  WrittenFiles& w = written_files();
  std::lock_guard lock(w.mutex);
  auto& errors = w.by_directory[directory];
  if (!files.empty()) w.names.insert(directory + '\n' + files.front().string());
  errors.push_back(std::move(files));
  std::size_t removed = 0;
  while (errors.size() > keep) {
    for (const std::filesystem::path& f : errors.front()) {
      std::error_code ignored;
      removed += std::filesystem::remove(f, ignored) ? 1 : 0;
    }
    errors.pop_front();
  }
  if (removed == 0 || w.said) return {};
  w.said = true;
  return fmt::format("the files of this process's {} most recent errors are kept in {}, older ones removed "
                     "(RESERVOIR_EXPLAIN_OOM_KEEP sets how many)",
                     keep, directory);
}

}  // namespace

OomExplanation explain_oom(const Trace& trace, std::span<const std::uint8_t> snapshot_bytes,
                           const ExplainOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  OomExplanation out;
  const ErrorSite site{process_rank(options), options.device};
  std::vector<std::string> problems;
  std::filesystem::path stem;
  if (!options.directory.empty()) {
    try {
      std::filesystem::create_directories(options.directory);
      const std::string name = fmt::format("{}{}-{}", file_part(host_name(options)), site.file_part(), utc_stamp());
      stem = std::filesystem::path(options.directory) / name;
      // Two errors in one second: the second's files get "-2", and so on.
      for (int n = 2; std::filesystem::exists(stem.string() + ".pickle") ||
                      named_before(options.directory, stem.string() + ".pickle");
           ++n) {
        stem = std::filesystem::path(options.directory) / fmt::format("{}-{}", name, n);
      }
      const std::filesystem::path snap = stem.string() + ".pickle";
      if (snapshot_bytes.empty()) {
        const std::string written = write_pytorch_snapshot(trace);
        write_bytes(snap, std::span(reinterpret_cast<const std::uint8_t*>(written.data()), written.size()));
      } else {
        write_bytes(snap, snapshot_bytes);
      }
      out.snapshot_path = snap.string();
    } catch (const std::exception& e) {
      problems.push_back(fmt::format("the snapshot could not be written: {}", e.what()));
    }
  }
  try {
    const unsigned threads = explain_threads(options);
    Trace window = since_previous_error(trace);
    out.advice = advise_at_error(window, threads, options.memory_limit);
    // The part since the error before starts from the blocks live then,
    // without the segments the allocator had cached: where its replay under
    // the program's settings serves the request that failed, it lost what
    // was in the way, and the whole recording is weighed instead.
    if (window.events.size() != trace.events.size() && reproduces_nothing(*out.advice)) {
      window = trace;
      out.advice = advise_at_error(window, threads, options.memory_limit);
    }
    if (!stem.empty() && options.page) {
      try {
        const std::string html = options.page(window, *out.advice);
        const std::filesystem::path page = stem.string() + "-advice.html";
        write_bytes(page, std::span(reinterpret_cast<const std::uint8_t*>(html.data()), html.size()));
        out.page_path = page.string();
      } catch (const std::exception& e) {
        problems.push_back(fmt::format("the page could not be written: {}", e.what()));
      }
    }
    out.lines = oom_answer_lines(window, *out.advice, site, options.device_total, options.on_reservoir,
                                 out.snapshot_path, out.page_path,
                                 out.snapshot_path.empty() ? "" : options.directory, options.advise_command,
                                 options.memory_limit);
    // What the program held when it served this request before, where that
    // is more than the part since the error before shows: the step's need.
    if (const auto before = earlier_success(trace);
        before && !out.lines.empty() && out.advice->diagnosis.request &&
        before->held_bytes > out.advice->peak_requested_bytes) {
      std::string& first = out.lines.front();
      if (!first.empty() && first.back() == '.') first.pop_back();
      first += fmt::format("; the last time it served this request ({} {} recorded), the program went on to "
                           "hold {} while it lived: the step may need that much.",
                           before->times, before->times == 1 ? "success" : "successes",
                           format_size(before->held_bytes));
    }
  } catch (const std::exception& e) {
    out.advice.reset();
    out.lines.push_back(fmt::format("{}could not analyse the recording: {}", site.prefix(), e.what()));
    if (!out.snapshot_path.empty()) {
      out.lines.push_back(fmt::format("{}snapshot: {} (reservoir advise {})", site.prefix(), out.snapshot_path,
                                      out.snapshot_path));
    }
  }
  if (!out.snapshot_path.empty()) {
    std::vector<std::filesystem::path> files{out.snapshot_path};
    if (!out.page_path.empty()) files.emplace_back(out.page_path);
    try {
      const std::string said = keep_most_recent(options.directory, std::move(files), files_kept(options));
      if (!said.empty()) {
        // Said once per process: in place of the last line where all eight are taken.
        if (out.lines.size() >= 8) out.lines.resize(7);
        out.lines.push_back(site.prefix() + said);
      }
    } catch (const std::exception& e) {
      problems.push_back(e.what());
    }
  }
  for (const std::string& problem : problems) {
    if (out.lines.size() < 8) out.lines.push_back(site.prefix() + problem);
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

OomExplainer oom_explainer(std::function<Snapshot()> state, ExplainOptions options, std::string recorded_config) {
  return [state = std::move(state), options = std::move(options),
          recorded_config = std::move(recorded_config)](const OutOfMemoryError& error) {
    Trace trace = to_trace(state(), "this process", recorded_config);
    if (options.device) trace.device = *options.device;
    ExplainOptions with_total = options;
    with_total.on_reservoir = true;
    if (!with_total.device_total && error.device_total() > 0) with_total.device_total = error.device_total();
    const OomExplanation e = explain_oom(trace, {}, with_total);
    std::string text;
    for (const std::string& line : e.lines) {
      if (!text.empty()) text += "\n";
      text += line;
    }
    return text;
  };
}

void explain_oom_errors(CachingAllocator& allocator, ExplainOptions options, std::size_t max_entries) {
  HistoryOptions history;
  history.max_entries = max_entries;
  history.stacks = false;
  allocator.record_history(history);
  allocator.set_oom_explainer(
      oom_explainer([&allocator] { return allocator.snapshot(); }, std::move(options),
                    allocator.config().to_string()));
}

}  // namespace reservoir
