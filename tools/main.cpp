#include <fmt/format.h>

#include <cstdio>

#include "commands.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"reservoir: replay, verify, export, summarize, compare, report and advise on GPU allocation traces; list the allocator settings"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "reservoir " RESERVOIR_VERSION_STRING);
  reservoir::tools::add_replay(app);
  reservoir::tools::add_verify(app);
  reservoir::tools::add_export(app);
  reservoir::tools::add_summary(app);
  reservoir::tools::add_compare(app);
  reservoir::tools::add_report(app);
  reservoir::tools::add_advise(app);
  reservoir::tools::add_settings(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const reservoir::Error& e) {
    fmt::print(stderr, "reservoir: {}\n", e.what());
    return 2;
  }
  return 0;
}
