// reservoir completion bash|zsh: a shell completion script, written from the
// command line's own definition (subcommands, their options and whether an
// option takes a value), so that it never falls behind the tool. CLI11 has
// no completion generator; this walks its App.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "support.hpp"

namespace reservoir::tools {
namespace {

struct OptionInfo {
  std::vector<std::string> names;  // "-c", "--config"
  std::string description;
  bool takes_value = false;
  bool file_value = false;  // -o/--output: a path
  bool repeatable = false;  // -c/--config: given again and again
};

struct CommandInfo {
  std::string name;
  std::string description;
  std::vector<OptionInfo> options;
};

std::vector<CommandInfo> describe(const CLI::App& app) {
  std::vector<CommandInfo> commands;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    CommandInfo c{sub->get_name(), sub->get_description(), {}};
    for (const CLI::Option* opt : sub->get_options()) {
      if (opt->get_positional()) continue;
      OptionInfo o;
      for (const std::string& s : opt->get_snames()) o.names.push_back("-" + s);
      for (const std::string& l : opt->get_lnames()) o.names.push_back("--" + l);
      if (o.names.empty()) continue;
      o.description = opt->get_description();
      o.takes_value = opt->get_items_expected_max() != 0;
      o.repeatable = opt->get_expected_max() > 1;
      for (const std::string& l : opt->get_lnames()) o.file_value = o.file_value || l == "output";
      c.options.push_back(std::move(o));
    }
    commands.push_back(std::move(c));
  }
  return commands;
}

// For zsh's _arguments and _describe: brackets, colons, quotes and
// backslashes would end a field early.
std::string zsh_escape(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    if (ch == '\'') {
      out += "'\\''";
    } else if (ch == '[' || ch == ']' || ch == ':' || ch == '\\') {
      out += '\\';
      out += ch;
    } else {
      out += ch;
    }
  }
  // One line: the first sentence is enough in a menu.
  const std::size_t end = out.find('\n');
  return end == std::string::npos ? out : out.substr(0, end);
}

std::string bash_script(const std::vector<CommandInfo>& commands) {
  std::vector<std::string> names;
  std::string cases;
  std::vector<std::string> value_options;
  for (const CommandInfo& c : commands) {
    names.push_back(c.name);
    std::string opts = "--help";
    for (const OptionInfo& o : c.options) {
      for (const std::string& n : o.names) {
        opts += " " + n;
        if (o.takes_value && !o.file_value) value_options.push_back(c.name + ":" + n);
      }
    }
    cases += fmt::format("    {}) opts=\"{}\" ;;\n", c.name, opts);
  }
  return fmt::format(
      R"(# bash completion for reservoir (from `reservoir completion bash`).
# Load it with: source <(reservoir completion bash)
_reservoir() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
  local sub="" i opts
  for ((i = 1; i < COMP_CWORD; i++)); do
    case "${{COMP_WORDS[i]}}" in
      {}) sub="${{COMP_WORDS[i]}}"; break ;;
    esac
  done
  if [[ -z "$sub" ]]; then
    COMPREPLY=($(compgen -W "{} --help --version" -- "$cur"))
    return
  fi
  case "$sub" in
{}  esac
  # Options that take a value other than a path: nothing to offer.
  case " {} " in
    *" $sub:$prev "*) COMPREPLY=(); return ;;
  esac
  if [[ "$cur" == -* ]]; then
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
  else
    COMPREPLY=($(compgen -f -- "$cur"))
  fi
}}
complete -o filenames -F _reservoir reservoir
)",
      fmt::join(names, "|"), fmt::join(names, " "), cases, fmt::join(value_options, " "));
}

std::string zsh_script(const std::vector<CommandInfo>& commands) {
  std::string described;
  std::string cases;
  for (const CommandInfo& c : commands) {
    described += fmt::format("    '{}:{}'\n", c.name, zsh_escape(c.description));
    std::string specs;
    for (const OptionInfo& o : c.options) {
      const std::string value = o.takes_value ? (o.file_value ? ":file:_files" : ":value: ") : "";
      for (const std::string& n : o.names) {
        specs += fmt::format("        '{}{}[{}]{}' \\\n", o.repeatable ? "*" : "", n,
                             zsh_escape(o.description), value);
      }
    }
    cases += fmt::format("    {})\n      _arguments \\\n{}        '*:file:_files'\n      ;;\n", c.name,
                         specs);
  }
  return fmt::format(
      R"(#compdef reservoir
# zsh completion for reservoir (from `reservoir completion zsh`). Load it with
#   source <(reservoir completion zsh)
# or save it as _reservoir in a directory of $fpath.
_reservoir() {{
  local -a commands
  commands=(
{}  )
  if (( CURRENT == 2 )); then
    _describe 'command' commands
    return
  fi
  local cmd="$words[2]"
  shift words
  (( CURRENT-- ))
  case "$cmd" in
{}  esac
}}
if [[ "$funcstack[1]" == "_reservoir" ]]; then
  _reservoir "$@"
else
  compdef _reservoir reservoir
fi
)",
      described, cases);
}

}  // namespace

void add_completion(CLI::App& app) {
  auto shell = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "completion", "Print a shell completion script for bash or zsh (source <(reservoir "
                    "completion bash))");
  cmd->add_option("shell", *shell, "bash or zsh")->required()->check(CLI::IsMember({"bash", "zsh"}));
  set_examples(*cmd, {
      {"source <(reservoir completion bash)",
       "complete subcommands, options and files in bash"},
      {"reservoir completion zsh > ~/.zfunc/_reservoir",
       "the same for zsh (a directory of $fpath)"},
  });
  cmd->callback([&app, shell] {
    const std::vector<CommandInfo> commands = describe(app);
    fmt::print("{}", *shell == "bash" ? bash_script(commands) : zsh_script(commands));
  });
}

}  // namespace reservoir::tools
