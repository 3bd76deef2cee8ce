#include <fmt/format.h>

#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "commands.hpp"
#include "support.hpp"
#include "reservoir/errors.hpp"
#include "reservoir/version.hpp"

namespace {

// The commands, as the user types them.
std::string command_list(const CLI::App& app) {
  std::string out;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    out += (out.empty() ? "" : ", ") + sub->get_name();
  }
  return out;
}

// The command the arguments name, or nullptr.
const CLI::App* named_command(const CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
      if (sub->get_name() == argv[i]) return sub;
    }
  }
  return nullptr;
}

// A parse error in reservoir's words: what was wrong, in which command, and
// where to read how it is called (CLI11's own sentences name its own terms).
std::string parse_error_text(const CLI::App& app, const CLI::ParseError& e, int argc, char** argv) {
  const std::string what = e.what();
  const CLI::App* sub = named_command(app, argc, argv);
  if (sub == nullptr) {
    std::string first;
    for (int i = 1; i < argc && first.empty(); ++i) {
      if (argv[i][0] != '-') first = argv[i];
    }
    if (!first.empty()) {
      return fmt::format("reservoir: '{}' is not a command: the commands are {} (`reservoir --help` says what "
                         "each does)",
                         first, command_list(app));
    }
    if (what == "A subcommand is required") {
      return fmt::format("reservoir: no command given: the commands are {} (`reservoir --help` says what each "
                         "does)",
                         command_list(app));
    }
    return fmt::format("reservoir: {} (`reservoir --help`)", what);
  }
  const std::string name = sub->get_name();
  const std::string help = fmt::format("`reservoir {} --help` shows how it is called", name);
  std::smatch m;
  static const std::regex kRequired("^(\\S+) is required$");
  static const std::regex kExtras("^The following arguments? (?:was|were) not expected: (.*)$");
  static const std::regex kMissingFile("^(?:.*: )?File does not exist: (.*)$");
  if (std::regex_match(what, m, kRequired)) {
    const CLI::Option* option = sub->get_option_no_throw(m[1].str());
    const std::string argument = m[1].str();
    const bool positional = !argument.empty() && argument[0] != '-';
    return fmt::format("reservoir {}: {} {} is missing{}; {}", name, positional ? "the argument" : "the option",
                       positional ? "'" + argument + "'" : argument,
                       option != nullptr && !option->get_description().empty()
                           ? " (" + option->get_description() + ")"
                           : std::string(),
                       help);
  }
  if (std::regex_match(what, m, kExtras)) {
    return fmt::format("reservoir {}: not an argument or option of {}: {}; {}", name, name, m[1].str(), help);
  }
  if (std::regex_match(what, m, kMissingFile)) {
    return fmt::format("reservoir {}: no such file: {}", name, m[1].str());
  }
  return fmt::format("reservoir {}: {}; {}", name, what, help);
}

}  // namespace

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
    fmt::print(stderr, "{}\n", parse_error_text(app, e, argc, argv));
    return kExitBadInput;
  } catch (const reservoir::Error& e) {
    fmt::print(stderr, "reservoir: {}\n", e.what());
    return kExitBadInput;
  }
  return kExitOk;
}
