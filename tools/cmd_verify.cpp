// reservoir verify TRACE...
#include <fmt/format.h>

#include <memory>

#include "commands.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/trace.hpp"

namespace reservoir::tools {
namespace {

struct VerifyArgs {
  std::vector<std::string> traces;
};

void run(const VerifyArgs& args) {
  bool all_agree = true;
  for (const std::string& path : args.traces) {
    const Trace trace = read_trace_file(path);
    const VerifyResult r = verify(trace);
    if (r.agreed) {
      fmt::print(
          "{}: agrees with the recording\n"
          "  {} events; started from {} segments and {} live blocks ({} with an unsplit tail)\n"
          "  {} alloc addresses, {} segment_alloc sizes and addresses, {} segment_free "
          "checked; final segment layout {}\n",
          path, r.events, r.initial_segments, r.initial_live_blocks, r.unsplit_tails,
          r.allocs_checked, r.segment_allocs_checked, r.segment_frees_checked,
          r.final_state_checked ? "identical" : "not recorded");
    } else {
      all_agree = false;
      fmt::print(
          "{}: DIVERGES at event {} of {}\n  {}\n  agreed before it: {} alloc addresses, "
          "{} segment_allocs, {} segment_frees\n",
          path, r.divergence_event, r.events, r.divergence, r.allocs_checked,
          r.segment_allocs_checked, r.segment_frees_checked);
    }
  }
  if (!all_agree) throw CLI::RuntimeError(1);
}

}  // namespace

void add_verify(CLI::App& app) {
  auto args = std::make_shared<VerifyArgs>();
  CLI::App* cmd = app.add_subcommand(
      "verify",
      "Replay PyTorch snapshots exactly as recorded and check every device request and address");
  cmd->add_option("traces", args->traces, "PyTorch snapshot pickles")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
