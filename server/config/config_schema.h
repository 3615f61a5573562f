// server/config/config_schema.h: the one table of the server's YAML keys. Each key is described
// here once; server/config/config.h's steps (ParseConfig, FillDefaults, the range part of
// ValidateConfig) and printers (ConfigToYaml, DocumentedConfigYaml) walk the table, and
// deploy/config.yaml is generated from it (`vlmgraph-server --config deploy/config.yaml
// --print-config-documented`).
//
//   for (const ConfigKey& key : ConfigKeys())
//     std::cout << key.name << " (default " << key.default_text << "): " << key.doc << "\n";
//
// Adding a key: a ServerConfig field, one entry in server/config/config_schema.cc, then regenerate
// deploy/config.yaml (tests/server_config_test.cc fails until it matches).
// Thread rules: the tables are built on first use (a thread-safe static) and read-only afterwards.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "server/config/config.h"

namespace YAML {
class Emitter;
}

namespace vlmgraph::server {

// What a key's YAML value is.
enum class ConfigType {
  kString,       // any scalar, read as text
  kBool,         // true or false
  kInteger,      // int64
  kUnsigned,     // int64 >= 0, stored as uint64
  kSeconds,      // a number (double): seconds, or the unit the key's name or doc gives
  kIntegerList,  // a sequence of int64, like [1, 2, 4]
  kEnum,         // one of `allowed`
  kAddress,  // a listen address, HOST:PORT or [IPV6]:PORT (server/config/listen_address.h); "" =
             // none
};

struct ConfigKey {
  std::string name;  // dotted path: "model", "buckets.batch_sizes" (at most one section level)
  ConfigType type = ConfigType::kString;
  std::string doc;  // what the key does, one paragraph (printers wrap it at 100 columns)

  // The default: a constant, or derived from keys earlier in the table (FillDefaults fills them in
  // table order). `default_text` is the constant as YAML ("2000", "\"\"", "[]") or the derivation
  // in words ("min(32, limits.max_new_tokens)").
  bool derived_default = false;
  std::string default_text;

  // Range, checked by ValidateConfig: numbers lie in [min, max]; list entries too; strings and
  // lists and addresses with `non_empty` must not be empty; an enum is one of `allowed`.
  std::optional<double> min, max;
  bool non_empty = false;
  std::vector<std::string> allowed;

  bool secret = false;  // ConfigToYaml prints "<set>"; DocumentedConfigYaml refuses a set one

  // Typed access to the key's ServerConfig field. Each throws ServerConfigError naming `name`.
  // parse: reads a non-null YAML value (type errors name the line).
  std::function<void(const YAML::Node& value, ServerConfig& config)> parse;
  // set_default: writes the default; a derived one reads only keys earlier in the table.
  std::function<void(ServerConfig& config)> set_default;
  // check_range: fails when the field is outside the range above.
  std::function<void(const ServerConfig& config)> check_range;
  // emit: writes the field's value (lists in flow style; a set secret as "<set>").
  std::function<void(const ServerConfig& config, YAML::Emitter& out)> emit;

  // "buckets" for "buckets.batch_sizes", "" for a top-level key.
  std::string section() const;
  // "batch_sizes" for "buckets.batch_sizes".
  std::string leaf() const;
};

struct ConfigSection {
  std::string name;  // "buckets"
  std::string doc;   // printed above the section; "" = none
};

// Every key, in file order (a section's keys are contiguous).
const std::vector<ConfigKey>& ConfigKeys();

// The sections, in file order.
const std::vector<ConfigSection>& ConfigSections();

// " (line N)" of a parsed YAML node, "" when the node has no position (built, not parsed).
std::string YamlLine(const YAML::Node& node);

// A bound or a setting in a message or a printed config, with up to 15 significant digits and no
// trailing zeros: 86400 -> "86400", 0.5 -> "0.5", 5.12e-3 -> "0.00512".
std::string ConfigNumber(double v);

// The header comment of a documented YAML whose source has none: "# " lines, each ending in "\n".
const std::string& DefaultConfigHeader();

}  // namespace vlmgraph::server
