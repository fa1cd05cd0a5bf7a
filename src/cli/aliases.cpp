#include "cli/aliases.h"

#include <algorithm>

namespace microspec::cli {

const std::vector<FlagAlias>& flag_aliases() {
  static const std::vector<FlagAlias> table = {
      {"-sys", "--system-prompt"},
      {"-np", "--parallel"},
      {"-md", "--model-draft"},
      {"-lv", "--log-verbosity"},
  };
  return table;
}

namespace {

// The argument with its alias replaced, or as it is.
std::string expanded(const std::string& arg) {
  for (const FlagAlias& a : flag_aliases()) {
    const std::string alias = a.alias;
    if (arg == alias) return a.long_name;
    if (arg.rfind(alias + "=", 0) == 0) return a.long_name + arg.substr(alias.size());
  }
  return arg;
}

}  // namespace

std::vector<std::string> expand_aliases(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = argc - 1; i >= 1; --i) args.push_back(expanded(argv[i]));
  return args;
}

std::string AliasFormatter::make_option_name(const CLI::Option* opt, bool is_positional) const {
  std::string names = CLI::Formatter::make_option_name(opt, is_positional);
  for (const FlagAlias& a : flag_aliases()) {
    const std::vector<std::string>& longs = opt->get_lnames();
    if (std::find(longs.begin(), longs.end(), std::string(a.long_name).substr(2)) != longs.end())
      return std::string(a.alias) + "," + names;
  }
  return names;
}

}  // namespace microspec::cli
