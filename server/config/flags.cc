#include "server/config/flags.h"

#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "server/config/config_schema.h"

namespace vlmgraph::server {
namespace {

// Flags that set one key; a value of "" means the flag takes no argument and sets "true"/"false".
struct FlagSpec {
  const char* key_path;
  const char* fixed_value;  // nullptr: the flag takes a value
  const char* help;
};

const std::map<std::string, FlagSpec>& Flags() {
  static const std::map<std::string, FlagSpec> flags = {
      {"--model",
       {"model", nullptr, "preset name (nanovlm-tiny, nanovlm-460m) or checkpoint directory"}},
      {"--device", {"device", nullptr, "cpu, cuda or cuda:N"}},
      {"--data-parallel-size",
       {"data_parallel_size", nullptr, "engines, one per GPU from --device on (0: every GPU)"}},
      {"--dtype", {"dtype", nullptr, "float32 or bfloat16"}},
      {"--seed", {"seed", nullptr, "random-init seed of preset models"}},
      {"--grpc-address",
       {"server.grpc_address", nullptr,
        "HOST:PORT or [IPV6]:PORT of the gRPC API (port 0: any free port)"}},
      {"--metrics-address",
       {"server.metrics_address", nullptr,
        "HOST:PORT or [IPV6]:PORT of /metrics (port 0: any free port)"}},
      {"--http-address",
       {"server.http_address", nullptr,
        "HOST:PORT or [IPV6]:PORT of the OpenAI-compatible HTTP API ('' = off)"}},
      {"--tokenizer", {"tokenizer", nullptr, "tokenizer.json of the model, or 'none'"}},
      {"--served-model-name",
       {"served_model_name", nullptr, "model id of GetModelInfo and /v1/models"}},
      {"--no-graphs", {"capture.enabled", "false", "run every region eagerly (no CUDA graphs)"}},
      {"--lazy-capture", {"capture.lazy", "true", "capture each bucket on first use"}},
      {"--max-queue-delay-us",
       {"batching.max_queue_delay_us", nullptr, "longest batching wait, microseconds"}},
      {"--max-queue-size",
       {"batching.max_queue_size", nullptr, "waiting requests before RESOURCE_EXHAUSTED"}},
      {"--api-keys-file",
       {"auth.api_keys_file", nullptr, "API keys with scopes, one 'SCOPES KEY' per line"}},
      {"--allow-unauthenticated",
       {"auth.allow_unauthenticated", "true", "allow a non-loopback listener without API keys"}},
      {"--tls-cert", {"tls.cert_file", nullptr, "PEM certificate chain: TLS for gRPC and HTTP"}},
      {"--tls-key", {"tls.key_file", nullptr, "PEM private key of --tls-cert"}},
      {"--tls-client-ca",
       {"tls.client_ca_file", nullptr, "PEM CA: require client certificates it signed"}},
      {"--checkpoint-dir",
       {"train.checkpoint_dir", nullptr, "root directory of Train checkpoint saves"}},
      {"--log-level", {"log_level", nullptr, "error, warn, info or debug"}},
  };
  return flags;
}

// Whether `path` names a listen-address key: its value is the text as given, since YAML reads
// [::1]:8000 as a list.
bool IsAddressKey(const std::string& path) {
  for (const ConfigKey& key : ConfigKeys()) {
    if (key.name == path) return key.type == ConfigType::kAddress;
  }
  return false;
}

// Sets `value` at the dotted `path` of `root`, creating maps on the way.
void SetPath(YAML::Node root, const std::string& path, const YAML::Node& value) {
  std::vector<std::string> parts;
  std::stringstream ss(path);
  for (std::string p; std::getline(ss, p, '.');) {
    if (p.empty()) throw ServerConfigError("--set " + path, "empty key in the path");
    parts.push_back(p);
  }
  if (parts.empty()) throw ServerConfigError("--set", "needs key.path=value");
  YAML::Node node = root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node child = node[parts[i]];
    if (!child.IsDefined() || child.IsNull() || !child.IsMap()) {
      node[parts[i]] = YAML::Node(YAML::NodeType::Map);
    }
    node.reset(node[parts[i]]);
  }
  node[parts.back()] = value;
}

}  // namespace

CommandLine ParseCommandLine(int argc, const char* const* argv,
                             const std::vector<std::string>& extra_flags) {
  CommandLine cl;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) {
      cl.positional.push_back(arg);
      continue;
    }
    std::string value;
    bool has_value = false;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto take_value = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) throw ServerConfigError(arg, "needs a value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      cl.help = true;
    } else if (arg == "--print-config") {
      cl.print_config = true;
    } else if (arg == "--print-config-documented") {
      cl.print_config_documented = true;
    } else if (arg == "--config") {
      cl.config_path = take_value();
    } else if (arg == "--set") {
      const std::string kv = take_value();
      const size_t e = kv.find('=');
      if (e == std::string::npos || e == 0)
        throw ServerConfigError("--set", "needs key.path=value, got '" + kv + "'");
      cl.overrides.emplace_back(kv.substr(0, e), kv.substr(e + 1));
    } else if (auto it = Flags().find(arg); it != Flags().end()) {
      const FlagSpec& f = it->second;
      if (f.fixed_value) {
        if (has_value) throw ServerConfigError(arg, "takes no value");
        cl.overrides.emplace_back(f.key_path, f.fixed_value);
      } else {
        cl.overrides.emplace_back(f.key_path, take_value());
      }
    } else if (std::find(extra_flags.begin(), extra_flags.end(), arg) != extra_flags.end()) {
      cl.extra.emplace_back(arg, take_value());
    } else {
      throw ServerConfigError(arg, "unknown flag; see --help");
    }
  }
  return cl;
}

ConfigSource ReadServerConfig(const CommandLine& cl) {
  ConfigSource source;
  YAML::Node root(YAML::NodeType::Map);
  if (!cl.config_path.empty()) {
    // A directory opens and reads as empty, which would start on the defaults: refuse it first.
    struct stat st {};
    if (::stat(cl.config_path.c_str(), &st) != 0) {
      throw ServerConfigError(cl.config_path,
                              std::string("cannot read the config file: ") + std::strerror(errno));
    }
    if (S_ISDIR(st.st_mode)) {
      throw ServerConfigError(cl.config_path,
                              "is a directory; --config takes a YAML file (deploy/config.yaml)");
    }
    std::ifstream in(cl.config_path);
    if (!in) {
      throw ServerConfigError(cl.config_path,
                              std::string("cannot read the config file: ") + std::strerror(errno));
    }
    std::stringstream text;
    text << in.rdbuf();
    source.header = LeadingComment(text.str());
    root = LoadYaml(text.str(), cl.config_path);
    if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
    if (!root.IsMap()) throw ServerConfigError(cl.config_path, "must be a YAML mapping of keys");
  }
  for (const auto& [path, value] : cl.overrides) {
    // An empty value is the empty string (`--set server.http_address=` turns HTTP off), not YAML's
    // null, which would mean "the default"; `~` still means that. An address is its text.
    const bool text = value.empty() || (IsAddressKey(path) && value != "~");
    SetPath(root, path, text ? YAML::Node(value) : LoadYaml(value, "--set " + path));
  }
  source.raw = ParseConfig(root);
  return source;
}

ServerConfig LoadServerConfig(const CommandLine& cl, bool check_files) {
  ServerConfig config = FillDefaults(ReadServerConfig(cl).raw);
  if (const char* key = std::getenv("VLMGRAPH_API_KEY"); key && *key) config.server.api_key = key;
  ValidateConfig(config, check_files);
  return config;
}

std::string FlagsHelp() {
  std::ostringstream o;
  o << "  --config PATH                YAML config file (deploy/config.yaml documents every key)\n";
  for (const auto& [name, f] : Flags()) {
    std::string left = name + (f.fixed_value ? "" : " VALUE");
    left.resize(std::max<size_t>(left.size() + 1, 29), ' ');
    o << "  " << left << f.help << " [" << f.key_path << "]\n";
  }
  o << "  --set KEY=VALUE              set any config key (YAML value), e.g. --set "
       "buckets.batch_sizes=[1,2];\n"
    << "                               an empty VALUE is \"\" (--set server.http_address= turns "
       "HTTP off), ~ the default\n"
    << "  --print-config               print the effective config as YAML and exit (the model\n"
    << "                               directory is checked when the server starts, not here)\n"
    << "  --print-config-documented    print the config file with every key documented and exit\n"
    << "                               (values of --config and flags, else the defaults)\n"
    << "  --help                       this text\n";
  return o.str();
}

}  // namespace vlmgraph::server
