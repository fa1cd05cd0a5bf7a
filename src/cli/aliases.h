#pragma once
// llama.cpp's multi-letter short flags (-sys, -np, -md, -lv). CLI11 takes only one letter after a
// single dash, so these are one table: expand_aliases rewrites them to their long names before
// parsing, and AliasFormatter shows them beside those names in --help.
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace microspec::cli {

struct FlagAlias {
  const char* alias;      // "-sys"
  const char* long_name;  // "--system-prompt"
};
const std::vector<FlagAlias>& flag_aliases();

// argv with every argument equal to an alias replaced by its long name ("-np 2" -> "--parallel 2",
// "-np=2" -> "--parallel=2"), in CLI11's parse order (last argument first). An option's value that
// is spelled exactly like an alias ("-p -sys") is taken as the flag too: write "-p=-sys".
std::vector<std::string> expand_aliases(int argc, char** argv);

// Help lines "-np,--parallel INT ..." for the options that have an alias.
class AliasFormatter : public CLI::Formatter {
 public:
  std::string make_option_name(const CLI::Option* opt, bool is_positional) const override;
};

}  // namespace microspec::cli
