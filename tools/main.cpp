#include <fmt/format.h>

#include <cstdio>

#include "commands.hpp"
#include "support.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/version.hpp"

int main(int argc, char** argv) {
  using namespace reservoir::tools;
  CLI::App app{"reservoir: replay, verify, export, summarize, compare, report and advise on GPU allocation traces; list the allocator settings"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "reservoir " RESERVOIR_VERSION_STRING);
  app.footer(
      "Sizes take a unit: 80GiB, 512MiB, 4096B.\n"
      "Exit status: 0 ok; 1 a recording diverges from its replay (verify); 2 bad input (an\n"
      "argument, a file, a trace or a setting); 3 a recording that cannot be verified or read\n"
      "(verify, advise); 4 a replay ran out of memory (replay).\n"
      "`reservoir SUBCOMMAND --help` shows each one's options and examples.");
  add_replay(app);
  add_verify(app);
  add_export(app);
  add_summary(app);
  add_compare(app);
  add_report(app);
  add_advise(app);
  add_settings(app);
  add_completion(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::RuntimeError& e) {  // a subcommand's own status (1, 3, 4)
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitBadInput;
  } catch (const reservoir::Error& e) {
    fmt::print(stderr, "reservoir: {}\n", e.what());
    return kExitBadInput;
  }
  return kExitOk;
}
