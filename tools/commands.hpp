// Subcommands of the `reservoir` command-line tool, one file each.
#pragma once

#include <CLI/CLI.hpp>

namespace reservoir::tools {

void add_replay(CLI::App& app);
void add_verify(CLI::App& app);
void add_export(CLI::App& app);
void add_summary(CLI::App& app);
void add_compare(CLI::App& app);
void add_report(CLI::App& app);
void add_advise(CLI::App& app);
void add_settings(CLI::App& app);
void add_completion(CLI::App& app);

}  // namespace reservoir::tools
