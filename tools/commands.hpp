// Subcommands of the `reservoir` command-line tool, one file each.
#pragma once

#include <CLI/CLI.hpp>

namespace reservoir::tools {

void add_replay(CLI::App& app);
void add_verify(CLI::App& app);

}  // namespace reservoir::tools
