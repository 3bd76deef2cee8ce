// The answer at the moment of an out-of-memory error, inside the program
// that met it: the recording of the allocator's events up to the failed
// request (PyTorch's snapshot, or a reservoir allocator's own history) is
// analysed in the process, on a simulated device, and the answer is a few
// lines for the error message and stderr: what failed and why, the setting
// that fits what was recorded, where the snapshot (and the full page) went.
//
// Python: reservoir.explain_oom() and RESERVOIR_EXPLAIN_OOM=1 (docs/tools.md).
// C++: explain_oom_errors() on an allocator appends the answer to its
// OutOfMemoryError.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reservoir/advise.hpp"
#include "reservoir/caching_allocator.hpp"

namespace reservoir {

// Where an error happened, as every line and file name of its answer says
// it: the job's rank (none for a process outside a job) and the CUDA device.
struct ErrorSite {
  std::optional<int> rank;
  std::optional<int> device;
  // "reservoir [rank 1, GPU 1]: " in a job; outside one "reservoir [GPU 3]: ",
  // or "reservoir: " on the first device (or where the device is not said).
  std::string prefix() const;
  // "-rank1-gpu1", "-gpu0", "": the part of a file name after the host's.
  std::string file_part() const;
};

struct ExplainOptions {
  // Where the snapshot and the page are written ("" writes nothing). The
  // files are named by host, rank, device and time:
  // HOST-rankR-gpuD-YYYYmmdd-HHMMSS.pickle.
  std::string directory;
  std::string host;           // "": this machine's name
  std::optional<int> rank;    // none: process_rank() (torch.distributed's, else a launcher's variables)
  std::optional<int> device;  // the device of the error (CUDA's index); none: not said
  // Replays in parallel; 0: explain_threads() (the program is stopped at its
  // error: its share of the machine's cores, at most 4).
  unsigned threads = 0;
  // The device's whole memory, as the error saw it (CUDA's total): what the
  // device held beyond this allocator's reserved memory and its free memory
  // was held outside it (another process, CUDA's context, other libraries).
  std::optional<std::uint64_t> device_total;
  // The process's own limit (torch.cuda.set_per_process_memory_fraction),
  // where one was set and the error reported it (PyTorch's out-of-memory
  // observers are given it in place of the device's total): what fits is
  // judged against it, and what refused the request is said with it. None:
  // inferred from the recording where it can be (Diagnosis::limit_at_least).
  std::optional<std::uint64_t> memory_limit;
  // The program runs on a reservoir allocator: settings are named as
  // RESERVOIR_ALLOC_CONF=..., which it reads first (oom_explainer sets it).
  bool on_reservoir = false;
  // The command the last line names for the folder's whole answer: "reservoir
  // advise", or what runs it where no `reservoir` is on PATH ("python3 -m
  // reservoir advise" for a package used from PYTHONPATH).
  std::string advise_command = "reservoir advise";
  // The HTML page of the advice, written beside the snapshot when given
  // (the command-line tool's and the Python module's views provide it).
  std::function<std::string(const Trace&, const Advice&)> page;
  // The errors whose files (snapshot, page) this process keeps in
  // `directory`: past that many, the oldest error's files are removed, and
  // the answer that first removes some says so. None: RESERVOIR_EXPLAIN_OOM_KEEP
  // from the environment, else kDefaultFilesKept. A process that meets
  // errors for hours fills no disk.
  std::optional<std::size_t> keep;
};

inline constexpr std::size_t kDefaultFilesKept = 20;
// The number of errors' files kept under `options` (its keep, else the
// environment's RESERVOIR_EXPLAIN_OOM_KEEP, a whole number from 1; else the
// default). Throws UsageError naming the variable for a value it cannot take.
std::size_t files_kept(const ExplainOptions& options);

// The cores the analysis at an error replays on: options.threads, else
// RESERVOIR_EXPLAIN_OOM_THREADS (a whole number from 1 to 1024), else this process's
// share of the cores it may run on (sched_getaffinity) among the ranks of its
// job on this machine (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE,
// MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE; 1 where none is set), from 1 to 4.
// Throws UsageError for a variable it does not accept.
unsigned explain_threads(const ExplainOptions& options);

struct OomExplanation {
  std::vector<std::string> lines;  // at most eight, each "reservoir: ..." (or "reservoir [rank R]: ...")
  std::string snapshot_path;       // "" when none was written
  std::string page_path;
  std::optional<Advice> advice;    // none when the analysis failed (lines say why)
  double seconds = 0.0;            // the analysis, writing included
};

// The settings the analysis at the error replays: the recorded ones, PyTorch's
// defaults, the few that most often make a fragmented job fit (each only where
// the release knows its keys), and reservoir's own policy.
std::vector<std::string> live_sweep(std::string_view pytorch_since);

// Advice within about a second at 100,000 recorded events on one core;
// judged against `memory_limit` where the process's limit is known.
Advice advise_at_error(const Trace& trace, unsigned threads = 1,
                       std::optional<std::uint64_t> memory_limit = std::nullopt);

// The part of a recording that the answer at its latest out-of-memory error
// analyses: the events after the error before it (a process that meets error
// after error: each answer speaks of what happened since the last), the
// whole recording when it holds one error. What was live when that part
// begins is rebuilt from the recorded state, as for a recording whose ring
// buffer dropped its oldest events; annotations opened before it and not
// closed stay open at its start.
Trace since_previous_error(const Trace& trace);

// The lines of the answer (at most eight). `site` names the rank and device in each;
// `device_total` (ExplainOptions) tells memory held outside the allocator,
// `memory_limit` the process's own limit (advice judged against it:
// advise_at_error's); `snapshot_path`, `page_path` and `directory` are
// named where given.
std::vector<std::string> oom_answer_lines(const Trace& trace, const Advice& advice,
                                          const ErrorSite& site,
                                          const std::optional<std::uint64_t>& device_total,
                                          bool on_reservoir, const std::string& snapshot_path,
                                          const std::string& page_path,
                                          const std::string& directory,
                                          const std::string& advise_command = "reservoir advise",
                                          const std::optional<std::uint64_t>& memory_limit = std::nullopt);

// The whole answer: analysis, files, lines. `snapshot_bytes` is the
// recording as the program took it (PyTorch's pickle), written as it is;
// empty: the trace is written as a PyTorch snapshot. Never throws for a
// failed analysis or write: the lines then say what went wrong.
OomExplanation explain_oom(const Trace& trace, std::span<const std::uint8_t> snapshot_bytes,
                           const ExplainOptions& options);

// The rank of this process in its job: options.rank, else the one
// set_process_rank() was given (the Python module gives torch.distributed's
// once a process group is made: torch.multiprocessing.spawn's jobs set no
// variable), else the first of the launchers' variables that is set: RANK
// (torchrun, torch.distributed.launch), SLURM_PROCID (srun), OMPI_COMM_WORLD_RANK
// (Open MPI's mpirun), PMI_RANK (MPICH's and Intel MPI's Hydra), PMIX_RANK
// (PMIx launchers), MV2_COMM_WORLD_RANK (MVAPICH). None outside a job.
std::optional<int> process_rank(const ExplainOptions& options);

// The process's rank as the program's own framework knows it (none: take it
// from the launchers' variables again). Thread-safe; later errors use it.
void set_process_rank(std::optional<int> rank);

// An explainer for a reservoir allocator (CachingAllocator::set_oom_explainer,
// Saver::set_oom_explainer): `state` returns the allocator's snapshot with its
// history, from which the answer is made; nothing else is needed.
OomExplainer oom_explainer(std::function<Snapshot()> state, ExplainOptions options,
                           std::string recorded_config = "");

// Turns on the allocator's history (the latest `max_entries` events, no
// stacks) and explains its out-of-memory errors from it.
void explain_oom_errors(CachingAllocator& allocator, ExplainOptions options = {},
                        std::size_t max_entries = 100'000);

}  // namespace reservoir
