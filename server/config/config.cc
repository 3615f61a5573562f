#include "server/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>

#include "model/config.h"
#include "server/config/config_schema.h"

namespace vlmgraph::server {
namespace {

constexpr size_t kDocumentedWidth = 100;  // columns of DocumentedConfigYaml's comments

std::string Join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

// The names known at one level of the file, in table order: the top level's keys and sections,
// or one section's keys.
std::vector<std::string> KnownNames(const std::string& section) {
  std::vector<std::string> names;
  for (const ConfigKey& key : ConfigKeys()) {
    std::string name;
    if (section.empty()) {
      name = key.section().empty() ? key.name : key.section();
    } else if (key.section() == section) {
      name = key.leaf();
    } else {
      continue;
    }
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

// Fails on keys of `map` not known at `section`, so typos are reported instead of ignored.
void CheckKeys(const YAML::Node& map, const std::string& section) {
  if (!map.IsMap()) {
    throw ServerConfigError(section.empty() ? "(top level)" : section,
                            "must be a mapping of keys" + YamlLine(map));
  }
  const std::vector<std::string> known = KnownNames(section);
  for (const auto& kv : map) {
    const std::string key = kv.first.Scalar();
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      std::string names;
      for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
      throw ServerConfigError(Join(section, key),
                              "unknown key" + YamlLine(kv.first) + "; known keys here: " + names);
    }
  }
}

// A key's value as one line of YAML: "[1, 2, 4]", "0.0.0.0:50051", "\"\"".
std::string ValueText(const ConfigKey& key, const ServerConfig& config) {
  YAML::Emitter out;
  key.emit(config, out);
  return out.c_str();
}

// A range bound in documentation: 2^30 and 2^31-1 read better than their digits.
std::string Bound(double v) {
  for (int k = 30; k < 63; ++k) {
    const double p = std::ldexp(1.0, k);
    if (v == p) return "2^" + std::to_string(k);
    if (v == p - 1) return "2^" + std::to_string(k) + "-1";
  }
  std::ostringstream o;
  o.precision(15);
  o << v;
  return o.str();
}

// "Range 0 .. 10000000.", "A non-empty list, each entry >= 1.", "One of eager, reject.", or "".
std::string RangeText(const ConfigKey& key) {
  if (key.type == ConfigType::kEnum) {
    std::string names;
    for (const std::string& a : key.allowed) names += (names.empty() ? "" : ", ") + a;
    return "One of " + names + ".";
  }
  std::string bounds;
  if (key.min && key.max) {
    bounds = Bound(*key.min) + " .. " + Bound(*key.max);
  } else if (key.min) {
    bounds = ">= " + Bound(*key.min);
  } else if (key.max) {
    bounds = "<= " + Bound(*key.max);
  }
  if (key.type == ConfigType::kIntegerList) {
    const std::string each = bounds.empty() ? "" : "each entry " + bounds;
    if (key.non_empty) return "A non-empty list" + (each.empty() ? "" : ", " + each) + ".";
    return each.empty() ? "" : "E" + each.substr(1) + ".";
  }
  if (bounds.empty()) return "";
  return key.min && key.max ? "Range " + bounds + "." : "At least " + Bound(*key.min) + ".";
}

// `text` as "# " comment lines of at most kDocumentedWidth columns (a longer word gets a line of
// its own), each starting with `indent`.
std::string Comment(const std::string& text, const std::string& indent) {
  const std::string prefix = indent + "#";
  std::string out, line = prefix;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    if (line.size() > prefix.size() && line.size() + 1 + word.size() > kDocumentedWidth) {
      out += line + "\n";
      line = prefix;
    }
    line += " " + word;
  }
  if (line.size() > prefix.size()) out += line + "\n";
  return out;
}

std::string SectionDoc(const std::string& section) {
  for (const ConfigSection& s : ConfigSections()) {
    if (s.name == section) return s.doc;
  }
  return "";
}

}  // namespace

bool IsPresetModel(const std::string& model) {
  const auto names = VlmConfig::PresetNames();
  return std::find(names.begin(), names.end(), model) != names.end();
}

YAML::Node LoadYaml(const std::string& text, const std::string& source_name) {
  try {
    return YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw ServerConfigError(source_name, "is not valid YAML: " + e.msg + " (line " +
                                             std::to_string(e.mark.line + 1) + ", column " +
                                             std::to_string(e.mark.column + 1) + ")");
  }
}

RawConfig ParseConfig(const YAML::Node& root) {
  RawConfig raw;
  if (!root.IsDefined() || root.IsNull()) return raw;
  CheckKeys(root, "");
  std::set<std::string> checked_sections;
  for (const ConfigKey& key : ConfigKeys()) {
    const std::string section = key.section();
    if (!section.empty()) {
      const YAML::Node map = root[section];
      if (!map.IsDefined() || map.IsNull()) continue;
      if (checked_sections.insert(section).second) CheckKeys(map, section);
    }
    const YAML::Node value = section.empty() ? root[key.name] : root[section][key.leaf()];
    if (!value.IsDefined() || value.IsNull()) continue;
    key.parse(value, raw.values);
    raw.set_keys.insert(key.name);
  }
  return raw;
}

ServerConfig FillDefaults(const RawConfig& raw) {
  ServerConfig c = raw.values;
  for (const ConfigKey& key : ConfigKeys()) {
    if (raw.set_keys.count(key.name) == 0) key.set_default(c);
  }
  return c;
}

void ValidateConfig(const ServerConfig& c, bool check_files) {
  for (const ConfigKey& key : ConfigKeys()) key.check_range(c);

  // Consistency checks that span keys or the file system.
  // The error_code overloads: a name the file system refuses (too long, ...) is "not a file", not
  // a std::filesystem_error.
  std::error_code ec;
  if (check_files && !IsPresetModel(c.model) &&
      !std::filesystem::is_regular_file(std::filesystem::path(c.model) / "config.json", ec)) {
    std::string names;
    for (const auto& n : VlmConfig::PresetNames()) names += (names.empty() ? "" : ", ") + n;
    throw ServerConfigError("model",
                            "'" + c.model + "' is neither a built-in preset (" + names +
                                ") nor a checkpoint directory with a config.json (a nanoVLM "
                                "checkpoint, or a transformers Llama / SmolLM2 "
                                "checkpoint)");
  }
  const bool cuda_index = c.device.rfind("cuda:", 0) == 0 && c.device.size() > 5 &&
                          std::all_of(c.device.begin() + 5, c.device.end(), ::isdigit);
  if (c.device != "cpu" && c.device != "cuda" && !cuda_index) {
    throw ServerConfigError("device", "must be 'cpu', 'cuda' or 'cuda:N', got '" + c.device + "'");
  }
  if (c.data_parallel_size == 0 && c.device == "cpu") {
    throw ServerConfigError("data_parallel_size",
                            "0 (every CUDA device) needs device cuda; on cpu give the number of "
                            "engines");
  }
  const auto& b = c.buckets;
  if (b.batch_sizes.empty() && c.device == "cpu") {
    throw ServerConfigError(
        "buckets.batch_sizes",
        "must not be empty on CPU ([] = derived from device memory, CUDA only)");
  }
  if (!b.batch_sizes.empty() &&
      *std::min_element(b.batch_sizes.begin(), b.batch_sizes.end()) > b.max_prefill_batch) {
    throw ServerConfigError("buckets.max_prefill_batch",
                            "is below every buckets.batch_sizes entry, so no prefill bucket is "
                            "left; raise it to at least the smallest entry");
  }
  const int64_t max_seq = *std::max_element(b.seq_lens.begin(), b.seq_lens.end());
  const int64_t max_ctx = *std::max_element(b.context_lens.begin(), b.context_lens.end());
  if (max_seq > max_ctx) {
    throw ServerConfigError("buckets.seq_lens",
                            "largest entry (" + std::to_string(max_seq) +
                                ") exceeds the largest buckets.context_lens entry (" +
                                std::to_string(max_ctx) + "): a prompt must fit the KV cache");
  }
  if (check_files && !c.tokenizer.empty() && c.tokenizer != "none" &&
      !std::filesystem::is_regular_file(c.tokenizer, ec)) {
    throw ServerConfigError("tokenizer", "'" + c.tokenizer +
                                             "' is not a file; give a Hugging Face tokenizer.json, "
                                             "leave it unset to use the checkpoint's, or 'none'");
  }
  const auto& l = c.limits;
  if (l.default_max_new_tokens > l.max_new_tokens) {
    throw ServerConfigError("limits.default_max_new_tokens",
                            "must lie in [1, " + std::to_string(l.max_new_tokens) + "], got " +
                                std::to_string(l.default_max_new_tokens));
  }
}

std::string ConfigToYaml(const ServerConfig& c) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  std::string open_section;
  for (const ConfigKey& key : ConfigKeys()) {
    const std::string section = key.section();
    if (section != open_section) {
      if (!open_section.empty()) e << YAML::EndMap;
      if (!section.empty()) e << YAML::Key << section << YAML::Value << YAML::BeginMap;
      open_section = section;
    }
    e << YAML::Key << key.leaf() << YAML::Value;
    key.emit(c, e);
  }
  if (!open_section.empty()) e << YAML::EndMap;
  e << YAML::EndMap;
  return e.c_str();
}

std::string DocumentedConfigYaml(const RawConfig& raw, const std::string& header) {
  const ServerConfig config = FillDefaults(raw);
  std::string out = header.empty() ? DefaultConfigHeader() : header;
  if (out.back() != '\n') out += "\n";
  std::string open_section;
  for (const ConfigKey& key : ConfigKeys()) {
    const std::string section = key.section();
    // A blank line after the header, before each section and after the last one.
    if (&key == &ConfigKeys().front() || section != open_section) out += "\n";
    if (section != open_section && !section.empty()) {
      out += Comment(SectionDoc(section), "") + section + ":\n";
    }
    open_section = section;
    const bool set = raw.set_keys.count(key.name) > 0;
    const std::string value = ValueText(key, config);
    if (key.secret && value != "\"\"") {
      throw ServerConfigError(key.name,
                              "is set; the documented config never holds a secret: keep the key "
                              "in auth.api_keys_file or the VLMGRAPH_API_KEY environment variable");
    }
    const std::string indent = section.empty() ? "" : "  ";
    const std::string range = RangeText(key);
    out += Comment(key.doc, indent);
    out += Comment((range.empty() ? "" : range + " ") +
                       (key.derived_default ? "Default: " : "Default ") + key.default_text + ".",
                   indent);
    out += indent + key.leaf() + ": " + (key.derived_default && !set ? std::string("~") : value) +
           "\n";
  }
  return out;
}

std::string LeadingComment(const std::string& text) {
  size_t end = 0;
  while (end < text.size() && text[end] == '#') {
    const size_t newline = text.find('\n', end);
    end = newline == std::string::npos ? text.size() : newline + 1;
  }
  const bool blank_follows = end == text.size() || text[end] == '\n';
  return blank_follows ? text.substr(0, end) : "";
}

}  // namespace vlmgraph::server
