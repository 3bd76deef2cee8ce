// reservoir settings: every allocator setting, as the table declares it.
#include <fmt/format.h>

#include "commands.hpp"
#include "support.hpp"
#include "reservoir/config.hpp"

namespace reservoir::tools {

void add_settings(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "settings",
      "List every allocator setting: what it accepts, its default, the PyTorch versions that "
      "know it, its key in a snapshot's allocator_settings, and whether replay applies it");
  set_examples(*cmd, {
      {"reservoir settings",
       "every allocator setting, what it accepts and which PyTorch versions know it"},
  });
  cmd->callback([] { fmt::print("{}", settings_markdown()); });
}

}  // namespace reservoir::tools
