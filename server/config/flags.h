// server/config/flags.h: command-line flags of vlmgraph-server and vlmgraph-generate. Flags
// override the YAML file key by key: each flag names a key path, and `--set key.path=value` reaches
// any key (the value is YAML: `--set buckets.batch_sizes=[1,2]`).
//
//   CommandLine cl = ParseCommandLine(argc, argv);  // throws ServerConfigError("--flag", ...)
//   ServerConfig cfg = LoadServerConfig(cl);        // file -> overrides -> parse -> defaults ->
//                                                   // VLMGRAPH_API_KEY -> validate
//
// Thread rules: pure functions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "server/config/config.h"

namespace vlmgraph::server {

struct CommandLine {
  std::string config_path;  // --config; empty = built-in defaults
  // (key path, YAML value), in order; an empty value is the empty string, not null
  std::vector<std::pair<std::string, std::string>> overrides;
  bool print_config = false;             // --print-config: print and exit
  bool print_config_documented = false;  // --print-config-documented: print with docs and exit
  bool help = false;
  std::vector<std::string> positional;                     // arguments that are not flags
  std::vector<std::pair<std::string, std::string>> extra;  // flags in `extra_flags` (name, value)
};

// `extra_flags`: additional "--name" flags taking a value that the caller handles itself
// (vlmgraph-generate's request flags). Unknown flags throw.
CommandLine ParseCommandLine(int argc, const char* const* argv,
                             const std::vector<std::string>& extra_flags = {});

// The configuration as read, before defaults.
struct ConfigSource {
  RawConfig raw;       // the file (if any) with the overrides applied, parsed
  std::string header;  // the file's leading comment block (LeadingComment), "" without one
};

// Reads the file (if any), applies the overrides in order, then ParseConfig. Throws
// ServerConfigError naming the file (unreadable, a directory, not YAML, not a mapping), the
// override, or the key.
ConfigSource ReadServerConfig(const CommandLine& command_line);

// ReadServerConfig, FillDefaults, the VLMGRAPH_API_KEY environment variable (server.api_key when
// set and not empty), then ValidateConfig. check_files false: the files of the machine that will
// serve (the model's directory) are not checked, as --print-config prints a config made for
// another machine (deploy/config.yaml names the image's model).
ServerConfig LoadServerConfig(const CommandLine& command_line, bool check_files = true);

// The --help text of the shared flags.
std::string FlagsHelp();

}  // namespace vlmgraph::server
