// reservoir advise TRACE... [--capacity SIZE] [--config C]... [--json] [-o advice.html]
#include <fmt/format.h>

#include <cctype>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>

#include "advice_view.hpp"
#include "commands.hpp"
#include "progress.hpp"
#include "report_html.hpp"
#include "reservoir/advise.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/format.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {

struct AdviseArgs {
  std::vector<std::string> traces;
  std::vector<std::string> configs;
  std::string capacity;
  std::string output;
  std::string torch_version;
  bool json = false;
  unsigned threads = 0;
  std::optional<int> device;
};

// Many files (or a folder, or a glob): one job-level answer, every rank
// analysed in parallel, a page per rank linked from the job's page.
void run_job(const AdviseArgs& args, const std::vector<std::string>& files) {
  JobOptions options;
  if (!args.capacity.empty()) options.capacity = parse_size(args.capacity);
  options.torch_version = args.torch_version;
  options.configs = args.configs;
  options.device = args.device;
  options.threads = args.threads;
  for (const std::string& c : args.configs) (void)AllocatorConfig::parse(c);  // fail before replaying
  Progress progress;
  options.progress = [&](std::size_t done, std::size_t total) {
    progress.task(fmt::format("advise: {}/{} rank files analysed", done, total));
  };
  // Each rank's page, written while its trace and advice are in memory.
  namespace fs = std::filesystem;
  const fs::path out(args.output);
  const fs::path rank_dir = out.parent_path() / (out.stem().string() + "_ranks");
  std::mutex pages_mutex;
  std::map<std::pair<std::string, int>, std::string> pages;
  if (!args.output.empty()) {
    std::error_code ec;
    fs::create_directories(rank_dir, ec);
    if (ec) throw UsageError(fmt::format("advise: cannot make '{}': {}", rank_dir.string(), ec.message()));
    options.on_rank = [&](const Trace& trace, const Advice& advice, const RankAdvice& r) {
      std::string file = r.name;
      for (char& c : file) {
        if (std::isalnum(static_cast<unsigned char>(c)) == 0) c = '_';
      }
      file += ".html";
      const std::string html = html_page(
          fmt::format("reservoir advise: {}", r.name),
          fmt::format("<p class=\"note\">{} ({}), {} recorded events. <a href=\"../{}\">The "
                      "job</a>.</p>\n{}",
                      esc(r.path), esc(trace.format), trace.events.size(),
                      esc(out.filename().string()), advice_html(trace, advice, "advice")));
      write_file((rank_dir / file).string(), html, "advise");
      const std::lock_guard<std::mutex> lock(pages_mutex);
      pages[{r.path, r.device}] = rank_dir.filename().string() + "/" + file;
    };
  }
  const JobAdvice job = advise_job(files, options);
  progress.clear();
  if (!args.output.empty()) {
    std::vector<std::string> links;
    for (const RankAdvice& r : job.ranks) {
      const auto it = pages.find({r.path, r.device});
      links.push_back(it != pages.end() ? it->second : "");
    }
    write_file(args.output, job_html(job, links), "advise");
  }
  if (args.json) {
    fmt::print("{}\n", job_json(job).dump(2));
  } else {
    fmt::print("{}", wrapped(job_text(job)));
    if (!args.output.empty()) {
      fmt::print("\n{}: written, with a page per rank in {}/\n", args.output, rank_dir.string());
    }
  }
  // Some ranks could not be read: the others are advised, and the status says so.
  if (job.unreadable > 0) throw CLI::RuntimeError(kExitCannotVerify);
}

void run(const AdviseArgs& args) {
  std::vector<RankErrors> errors_of;
  const std::vector<std::string> files = job_files(args.traces, &errors_of);
  bool folder = false;
  for (const std::string& t : args.traces) folder |= std::filesystem::is_directory(t);
  if (files.size() > 1 || folder) {
    // A process that met error after error: its latest is advised on.
    if (!args.json) {
      for (const RankErrors& r : errors_of) {
        std::vector<std::string> earlier;
        for (const std::string& e : r.earlier) earlier.push_back(base_name(e));
        fmt::print("{}", wrapped(fmt::format(
                             "{}: the latest of {} errors one process met is advised on; the earlier ones "
                             "({}) are set aside (reservoir advise FILE reads any of them alone)\n",
                             base_name(r.latest), r.earlier.size() + 1, fmt::join(earlier, ", "))));
      }
      if (!errors_of.empty()) fmt::print("\n");
    }
    run_job(args, files);
    return;
  }
  AdviseOptions options;
  if (!args.capacity.empty()) options.capacity = parse_size(args.capacity);
  options.torch_version = args.torch_version;
  options.configs = args.configs;
  options.threads = args.threads;
  for (const std::string& c : args.configs) (void)AllocatorConfig::parse(c);  // fail before replaying
  Progress progress;
  std::string label;
  options.progress = [&](std::size_t done, std::size_t total) {
    progress.task(fmt::format("{}: {}/{} settings swept", label, done, total));
  };
  nlohmann::json all = nlohmann::json::array();
  std::string text;
  std::string sections;
  std::size_t section = 0;
  for (const std::string& path : files) {  // one file (a glob may have named it)
    label = base_name(path);
    progress.task(fmt::format("{}: reading and diagnosing", label));
    // A snapshot of several devices: each device's recording is advised on.
    for (const Trace& trace : load_devices(path, args.device)) {
      const Advice advice = advise(trace, options);
      all.push_back(advice_json(trace, advice));
      if (!text.empty()) text += "\n";
      text += advice_text(trace, advice);
      if (args.output.empty()) continue;
      sections += fmt::format("<h2>{}</h2>\n<p class=\"note\">{} ({}), {} recorded events{}.</p>\n",
                              esc(base_name(trace.name)), esc(trace.name), esc(trace.format),
                              trace.events.size(),
                              trace.recorded_config.empty()
                                  ? ""
                                  : fmt::format("; recorded with <code>{}</code>",
                                                esc(trace.recorded_config)));
      sections += advice_html(trace, advice, fmt::format("advice{}", section++));
    }
  }
  progress.clear();
  if (!args.output.empty()) {
    const std::string html = html_page(
        "reservoir advise",
        fmt::format("<p class=\"note\">{} trace(s), each replayed on a simulated device under "
                    "every setting swept, {}.</p>\n{}",
                    files.size(), utc_now(), sections));
    write_file(args.output, html, "advise");
  }
  if (args.json) {
    fmt::print("{}\n", (all.size() == 1 ? all.front() : all).dump(2));
  } else {
    fmt::print("{}", wrapped(text));
    if (!args.output.empty()) fmt::print("\n{}: written\n", args.output);
  }
}

}  // namespace

void add_advise(CLI::App& app) {
  auto args = std::make_shared<AdviseArgs>();
  CLI::App* cmd = app.add_subcommand(
      "advise", "Why a recording ran out of memory (or where it peaked), and which allocator "
                "setting makes it fit: every setting replayed to its minimum capacity");
  cmd->add_option("traces", args->traces,
                  "PyTorch snapshots (or any trace replay reads); several files, a folder or a "
                  "glob ('rank*.pickle') advise on a job of many ranks")
      ->required();
  add_size_option(*cmd, "--capacity", args->capacity,
                  "memory the allocator may have, e.g. 80GiB (default: what the recording's "
                  "out-of-memory event shows it had)");
  cmd->add_option("--torch-version", args->torch_version,
                  "the PyTorch release the settings are written for, e.g. 2.5 (default: the "
                  "oldest the recording shows)");
  cmd->add_option("--config,-c", args->configs,
                  "sweep these settings instead of the default list (repeatable; '' = defaults)");
  cmd->add_flag("--json", args->json, "print the advice as JSON (keys: docs/tools.md)");
  cmd->add_option("-o,--output", args->output, "also write the advice as an HTML page")
      ->check(output_path());
  cmd->add_option("--threads", args->threads, "replays run in parallel (default: every core)")
      ->check(whole_number(0, 1024, "threads (0: every core)"));
  add_device_option(*cmd, args->device);
  set_examples(*cmd, {
      {"reservoir advise rank0.pickle",
       "why the job ran out of memory and the PYTORCH_CUDA_ALLOC_CONF line that makes it fit"},
      {"reservoir advise 'dumps/rank*.pickle' -o advice.html",
       "one answer for every rank of a job, also as a page"},
      {"reservoir advise run.pickle --capacity 40GiB --json",
       "would it fit on a 40 GiB device? (keys: docs/tools.md)"},
  });
  cmd->callback([args] { run(*args); });
}

}  // namespace reservoir::tools
