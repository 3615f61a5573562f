#include "server/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <sstream>

#include "model/config.h"

namespace vlmgraph::server {
namespace {

std::string Join(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

std::string Where(const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  return m.line >= 0 ? " (line " + std::to_string(m.line + 1) + ")" : "";
}

// Fails on keys of `map` not in `known`, so typos are reported instead of ignored.
void CheckKeys(const YAML::Node& map, const std::string& path,
               std::initializer_list<const char*> known) {
  if (!map.IsMap())
    throw ServerConfigError(path.empty() ? "(top level)" : path,
                            "must be a mapping of keys" + Where(map));
  for (const auto& kv : map) {
    const std::string key = kv.first.Scalar();
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return key == k; })) {
      std::string names;
      for (const char* k : known) names += (names.empty() ? "" : ", ") + std::string(k);
      throw ServerConfigError(Join(path, key),
                              "unknown key" + Where(kv.first) + "; known keys here: " + names);
    }
  }
}

template <typename T>
std::optional<T> Scalar(const YAML::Node& parent, const std::string& path, const char* key,
                        const char* type_name) {
  const YAML::Node n = parent[key];
  if (!n.IsDefined() || n.IsNull()) return std::nullopt;
  const std::string p = Join(path, key);
  if (!n.IsScalar()) throw ServerConfigError(p, std::string("must be ") + type_name + Where(n));
  try {
    return n.as<T>();
  } catch (const YAML::BadConversion&) {
    throw ServerConfigError(
        p, std::string("must be ") + type_name + ", got '" + n.Scalar() + "'" + Where(n));
  }
}

std::optional<int64_t> Int(const YAML::Node& parent, const std::string& path, const char* key) {
  return Scalar<int64_t>(parent, path, key, "an integer");
}
std::optional<std::string> Str(const YAML::Node& parent, const std::string& path, const char* key) {
  return Scalar<std::string>(parent, path, key, "a string");
}
std::optional<bool> Bool(const YAML::Node& parent, const std::string& path, const char* key) {
  return Scalar<bool>(parent, path, key, "true or false");
}

std::optional<std::vector<int64_t>> IntList(const YAML::Node& parent, const std::string& path,
                                            const char* key) {
  const YAML::Node n = parent[key];
  if (!n.IsDefined() || n.IsNull()) return std::nullopt;
  const std::string p = Join(path, key);
  if (!n.IsSequence())
    throw ServerConfigError(p, "must be a list of integers, like [1, 2, 4]" + Where(n));
  std::vector<int64_t> out;
  for (size_t i = 0; i < n.size(); ++i) {
    const std::string item = p + "[" + std::to_string(i) + "]";
    if (!n[i].IsScalar()) throw ServerConfigError(item, "must be an integer" + Where(n[i]));
    try {
      out.push_back(n[i].as<int64_t>());
    } catch (const YAML::BadConversion&) {
      throw ServerConfigError(item,
                              "must be an integer, got '" + n[i].Scalar() + "'" + Where(n[i]));
    }
  }
  return out;
}

YAML::Node Section(const YAML::Node& root, const char* key,
                   std::initializer_list<const char*> known) {
  const YAML::Node n = root[key];
  if (!n.IsDefined() || n.IsNull()) return YAML::Node(YAML::NodeType::Map);
  CheckKeys(n, key, known);
  return n;
}

template <typename T>
T Or(const std::optional<T>& v, const T& fallback) {
  return v ? *v : fallback;
}

void CheckList(const std::vector<int64_t>& list, const std::string& path) {
  if (list.empty()) throw ServerConfigError(path, "must not be empty");
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i] < 1) {
      throw ServerConfigError(path + "[" + std::to_string(i) + "]",
                              "must be >= 1, got " + std::to_string(list[i]));
    }
  }
}

void CheckRange(int64_t v, int64_t lo, int64_t hi, const std::string& path) {
  if (v < lo || v > hi) {
    throw ServerConfigError(path, "must lie in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                      "], got " + std::to_string(v));
  }
}

void CheckAddress(const std::string& address, const std::string& path) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    throw ServerConfigError(path, "must be host:port, like 127.0.0.1:50051, got '" + address + "'");
  }
  const std::string port = address.substr(colon + 1);
  if (!std::all_of(port.begin(), port.end(), ::isdigit) || port.size() > 5 ||
      std::stol(port) > 65535) {
    throw ServerConfigError(path, "port must be a number in [0, 65535], got '" + port + "'");
  }
}

// The last path component of a checkpoint directory ("/models/smollm2-135m/" -> "smollm2-135m"),
// or the preset name.
std::string DefaultServedModelName(const std::string& model) {
  std::filesystem::path p(model);
  // "/" is its own parent: stop there (model "/" is then refused by ValidateConfig).
  while (p.has_parent_path() && p.filename().empty() && p.parent_path() != p) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() ? model : name;
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
  RawConfig r;
  if (!root.IsDefined() || root.IsNull()) return r;
  CheckKeys(root, "",
            {"model", "seed", "dtype", "device", "model_stop_token_ids", "tokenizer",
             "served_model_name", "buckets", "capture", "batching", "server", "auth", "tls",
             "limits", "train", "shutdown_timeout_seconds", "log_level"});
  r.model = Str(root, "", "model");
  r.tokenizer = Str(root, "", "tokenizer");
  r.served_model_name = Str(root, "", "served_model_name");
  if (auto seed = Int(root, "", "seed")) {
    if (*seed < 0) throw ServerConfigError("seed", "must be >= 0, got " + std::to_string(*seed));
    r.seed = static_cast<uint64_t>(*seed);
  }
  r.dtype = Str(root, "", "dtype");
  r.device = Str(root, "", "device");
  r.model_stop_token_ids = IntList(root, "", "model_stop_token_ids");
  r.log_level = Str(root, "", "log_level");
  r.shutdown_timeout_seconds =
      Scalar<double>(root, "", "shutdown_timeout_seconds", "a number of seconds");

  const YAML::Node b = Section(root, "buckets",
                               {"batch_sizes", "seq_lens", "context_lens", "tile_counts",
                                "train_batch_sizes", "train_seq_lens", "oversize"});
  r.batch_sizes = IntList(b, "buckets", "batch_sizes");
  r.seq_lens = IntList(b, "buckets", "seq_lens");
  r.context_lens = IntList(b, "buckets", "context_lens");
  r.tile_counts = IntList(b, "buckets", "tile_counts");
  r.train_batch_sizes = IntList(b, "buckets", "train_batch_sizes");
  r.train_seq_lens = IntList(b, "buckets", "train_seq_lens");
  r.oversize = Str(b, "buckets", "oversize");
  if (r.oversize && *r.oversize != "eager" && *r.oversize != "reject") {
    throw ServerConfigError("buckets.oversize", "must be 'eager' or 'reject', got '" + *r.oversize +
                                                    "'" + Where(b["oversize"]));
  }

  const YAML::Node c =
      Section(root, "capture", {"enabled", "lazy", "programmatic_dependent_launch"});
  r.capture_enabled = Bool(c, "capture", "enabled");
  r.capture_lazy = Bool(c, "capture", "lazy");
  r.capture_programmatic_dependent_launch = Bool(c, "capture", "programmatic_dependent_launch");

  const YAML::Node q = Section(root, "batching", {"max_queue_delay_us", "max_queue_size"});
  r.max_queue_delay_us = Int(q, "batching", "max_queue_delay_us");
  r.max_queue_size = Int(q, "batching", "max_queue_size");

  const YAML::Node s =
      Section(root, "server", {"grpc_address", "metrics_address", "http_address", "api_key"});
  r.grpc_address = Str(s, "server", "grpc_address");
  r.metrics_address = Str(s, "server", "metrics_address");
  r.http_address = Str(s, "server", "http_address");
  r.api_key = Str(s, "server", "api_key");

  const YAML::Node a = Section(root, "auth", {"api_keys_file", "allow_unauthenticated"});
  r.api_keys_file = Str(a, "auth", "api_keys_file");
  r.allow_unauthenticated = Bool(a, "auth", "allow_unauthenticated");

  const YAML::Node tls = Section(root, "tls", {"cert_file", "key_file", "client_ca_file"});
  r.tls_cert_file = Str(tls, "tls", "cert_file");
  r.tls_key_file = Str(tls, "tls", "key_file");
  r.tls_client_ca_file = Str(tls, "tls", "client_ca_file");

  const YAML::Node l =
      Section(root, "limits",
              {"max_image_bytes", "max_image_pixels", "max_images_per_request", "max_new_tokens",
               "default_max_new_tokens", "max_logits_positions", "max_train_batch_examples",
               "max_train_batch_tokens", "max_request_bytes"});
  r.max_image_bytes = Int(l, "limits", "max_image_bytes");
  r.max_image_pixels = Int(l, "limits", "max_image_pixels");
  r.max_images_per_request = Int(l, "limits", "max_images_per_request");
  r.max_new_tokens = Int(l, "limits", "max_new_tokens");
  r.default_max_new_tokens = Int(l, "limits", "default_max_new_tokens");
  r.max_logits_positions = Int(l, "limits", "max_logits_positions");
  r.max_train_batch_examples = Int(l, "limits", "max_train_batch_examples");
  r.max_request_bytes = Int(l, "limits", "max_request_bytes");
  r.max_train_batch_tokens = Int(l, "limits", "max_train_batch_tokens");

  const YAML::Node t = Section(root, "train", {"checkpoint_dir", "idle_timeout_seconds"});
  r.checkpoint_dir = Str(t, "train", "checkpoint_dir");
  r.train_idle_timeout_seconds =
      Scalar<double>(t, "train", "idle_timeout_seconds", "a number of seconds");
  return r;
}

ServerConfig FillDefaults(const RawConfig& r) {
  ServerConfig c;
  c.model = Or<std::string>(r.model, "nanovlm-tiny");
  c.seed = Or<uint64_t>(r.seed, 0);
  c.dtype = Or<std::string>(r.dtype, "float32");
  c.device = Or<std::string>(r.device, "cpu");
  c.model_stop_token_ids = Or<std::vector<int64_t>>(r.model_stop_token_ids, {});
  c.tokenizer = Or<std::string>(r.tokenizer, "");
  c.served_model_name = Or<std::string>(r.served_model_name, DefaultServedModelName(c.model));

  // CPU runs every region eagerly, so small buckets waste the least padding; on CUDA the engine's
  // defaults (sized for nanovlm-460m) apply.
  BucketSpec defaults;
  if (c.device == "cpu") {
    defaults.batch_sizes = {1, 2, 4, 8};
    defaults.seq_lens = {32, 64, 128, 256};
    defaults.context_lens = {128, 256, 512};
    defaults.tile_counts = {1, 2, 4, 8, 17};
    defaults.train_batch_sizes = {1, 2, 4, 8};
    defaults.train_seq_lens = {64, 128, 256};
  }
  c.buckets.batch_sizes = Or(r.batch_sizes, defaults.batch_sizes);
  c.buckets.seq_lens = Or(r.seq_lens, defaults.seq_lens);
  c.buckets.context_lens = Or(r.context_lens, defaults.context_lens);
  c.buckets.tile_counts = Or(r.tile_counts, defaults.tile_counts);
  c.buckets.train_batch_sizes = Or(r.train_batch_sizes, defaults.train_batch_sizes);
  c.buckets.train_seq_lens = Or(r.train_seq_lens, defaults.train_seq_lens);
  c.buckets.oversize = Or<std::string>(r.oversize, "eager") == "reject" ? OversizePolicy::kReject
                                                                        : OversizePolicy::kEager;

  c.capture.enabled = Or(r.capture_enabled, true);
  c.capture.lazy = Or(r.capture_lazy, false);
  c.capture.programmatic_dependent_launch = Or(r.capture_programmatic_dependent_launch, true);
  c.batching.max_queue_delay_us = Or<int64_t>(r.max_queue_delay_us, 2000);
  c.batching.max_queue_size = Or<int64_t>(r.max_queue_size, 256);
  c.server.grpc_address = Or<std::string>(r.grpc_address, "127.0.0.1:50051");
  c.server.metrics_address = Or<std::string>(r.metrics_address, "127.0.0.1:9464");
  c.server.http_address = Or<std::string>(r.http_address, "127.0.0.1:8000");
  c.server.api_key = Or<std::string>(r.api_key, "");
  c.auth.api_keys_file = Or<std::string>(r.api_keys_file, "");
  c.auth.allow_unauthenticated = Or(r.allow_unauthenticated, false);
  c.tls.cert_file = Or<std::string>(r.tls_cert_file, "");
  c.tls.key_file = Or<std::string>(r.tls_key_file, "");
  c.tls.client_ca_file = Or<std::string>(r.tls_client_ca_file, "");

  c.limits.max_image_bytes = Or<int64_t>(r.max_image_bytes, 20 << 20);
  c.limits.max_image_pixels = Or<int64_t>(r.max_image_pixels, 40000000);
  c.limits.max_images_per_request = Or<int64_t>(r.max_images_per_request, 8);
  c.limits.max_new_tokens = Or<int64_t>(r.max_new_tokens, 1024);
  c.limits.default_max_new_tokens =
      Or<int64_t>(r.default_max_new_tokens, std::min<int64_t>(32, c.limits.max_new_tokens));
  c.limits.max_logits_positions = Or<int64_t>(r.max_logits_positions, 64);
  c.limits.max_train_batch_examples = Or<int64_t>(r.max_train_batch_examples, 64);
  const auto& tb = c.buckets.train_batch_sizes;
  const auto& ts = c.buckets.train_seq_lens;
  const int64_t largest_train_bucket =
      tb.empty() || ts.empty()
          ? 0
          : *std::max_element(tb.begin(), tb.end()) * *std::max_element(ts.begin(), ts.end());
  c.limits.max_train_batch_tokens = Or<int64_t>(r.max_train_batch_tokens, largest_train_bucket);
  const int64_t derived = std::min<int64_t>(
      INT_MAX, c.limits.max_images_per_request * c.limits.max_image_bytes + (4 << 20));
  c.limits.max_request_bytes = Or<int64_t>(r.max_request_bytes, derived);

  c.train.checkpoint_dir = Or<std::string>(r.checkpoint_dir, "checkpoints");
  c.train.idle_timeout_seconds = Or(r.train_idle_timeout_seconds, 600.0);
  c.shutdown_timeout_seconds = Or(r.shutdown_timeout_seconds, 30.0);
  c.log_level = Or<std::string>(r.log_level, "info");
  return c;
}

void ValidateConfig(const ServerConfig& c) {
  if (c.model.empty()) throw ServerConfigError("model", "must not be empty");
  // The error_code overloads: a name the file system refuses (too long, ...) is "not a file", not
  // a std::filesystem_error.
  std::error_code ec;
  if (!IsPresetModel(c.model) &&
      !std::filesystem::is_regular_file(std::filesystem::path(c.model) / "config.json", ec)) {
    std::string names;
    for (const auto& n : VlmConfig::PresetNames()) names += (names.empty() ? "" : ", ") + n;
    throw ServerConfigError("model", "'" + c.model + "' is neither a built-in preset (" + names +
                                         ") nor a checkpoint directory with a config.json");
  }
  if (c.dtype != "float32" && c.dtype != "bfloat16") {
    throw ServerConfigError("dtype", "must be 'float32' or 'bfloat16', got '" + c.dtype + "'");
  }
  const bool cuda_index = c.device.rfind("cuda:", 0) == 0 && c.device.size() > 5 &&
                          std::all_of(c.device.begin() + 5, c.device.end(), ::isdigit);
  if (c.device != "cpu" && c.device != "cuda" && !cuda_index) {
    throw ServerConfigError("device", "must be 'cpu', 'cuda' or 'cuda:N', got '" + c.device + "'");
  }
  for (size_t i = 0; i < c.model_stop_token_ids.size(); ++i) {
    if (c.model_stop_token_ids[i] < 0) {
      throw ServerConfigError("model_stop_token_ids[" + std::to_string(i) + "]", "must be >= 0");
    }
  }
  const auto& b = c.buckets;
  CheckList(b.batch_sizes, "buckets.batch_sizes");
  CheckList(b.seq_lens, "buckets.seq_lens");
  CheckList(b.context_lens, "buckets.context_lens");
  CheckList(b.tile_counts, "buckets.tile_counts");
  CheckList(b.train_batch_sizes, "buckets.train_batch_sizes");
  CheckList(b.train_seq_lens, "buckets.train_seq_lens");
  const int64_t max_seq = *std::max_element(b.seq_lens.begin(), b.seq_lens.end());
  const int64_t max_ctx = *std::max_element(b.context_lens.begin(), b.context_lens.end());
  if (max_seq > max_ctx) {
    throw ServerConfigError("buckets.seq_lens",
                            "largest entry (" + std::to_string(max_seq) +
                                ") exceeds the largest buckets.context_lens entry (" +
                                std::to_string(max_ctx) + "): a prompt must fit the KV cache");
  }
  CheckRange(c.batching.max_queue_delay_us, 0, 10000000, "batching.max_queue_delay_us");
  CheckRange(c.batching.max_queue_size, 1, 1000000, "batching.max_queue_size");
  CheckAddress(c.server.grpc_address, "server.grpc_address");
  CheckAddress(c.server.metrics_address, "server.metrics_address");
  if (!c.server.http_address.empty()) CheckAddress(c.server.http_address, "server.http_address");
  if (c.served_model_name.empty())
    throw ServerConfigError("served_model_name", "must not be empty");
  if (!c.tokenizer.empty() && c.tokenizer != "none" &&
      !std::filesystem::is_regular_file(c.tokenizer, ec)) {
    throw ServerConfigError("tokenizer", "'" + c.tokenizer +
                                             "' is not a file; give a Hugging Face tokenizer.json, "
                                             "leave it unset to use the checkpoint's, or 'none'");
  }
  CheckRange(c.limits.max_image_bytes, 1, INT_MAX, "limits.max_image_bytes");
  CheckRange(c.limits.max_image_pixels, 1, int64_t{1} << 40, "limits.max_image_pixels");
  CheckRange(c.limits.max_images_per_request, 0, 1024, "limits.max_images_per_request");
  CheckRange(c.limits.max_new_tokens, 1, int64_t{1} << 30, "limits.max_new_tokens");
  CheckRange(c.limits.default_max_new_tokens, 1, c.limits.max_new_tokens,
             "limits.default_max_new_tokens");
  CheckRange(c.limits.max_logits_positions, 0, 1 << 20, "limits.max_logits_positions");
  CheckRange(c.limits.max_train_batch_examples, 1, 1 << 20, "limits.max_train_batch_examples");
  CheckRange(c.limits.max_request_bytes, 1024, INT_MAX, "limits.max_request_bytes");
  CheckRange(c.limits.max_train_batch_tokens, 0, int64_t{1} << 40, "limits.max_train_batch_tokens");
  if (c.train.checkpoint_dir.empty())
    throw ServerConfigError("train.checkpoint_dir", "must not be empty");
  if (!(c.train.idle_timeout_seconds >= 0 && c.train.idle_timeout_seconds <= 86400)) {
    throw ServerConfigError("train.idle_timeout_seconds", "must lie in [0, 86400] (0 = never)");
  }
  if (!(c.shutdown_timeout_seconds >= 0 && c.shutdown_timeout_seconds <= 3600)) {
    throw ServerConfigError("shutdown_timeout_seconds", "must lie in [0, 3600]");
  }
  static const char* kLevels[] = {"error", "warn", "info", "debug"};
  if (std::none_of(std::begin(kLevels), std::end(kLevels),
                   [&](const char* l) { return c.log_level == l; })) {
    throw ServerConfigError("log_level",
                            "must be one of error, warn, info, debug; got '" + c.log_level + "'");
  }
}

std::string ConfigToYaml(const ServerConfig& c) {
  YAML::Emitter e;
  auto list = [&e](const char* key, const std::vector<int64_t>& v) {
    e << YAML::Key << key << YAML::Value << YAML::Flow << v;
  };
  e << YAML::BeginMap;
  e << YAML::Key << "model" << YAML::Value << c.model << YAML::Key << "seed" << YAML::Value
    << c.seed;
  e << YAML::Key << "dtype" << YAML::Value << c.dtype << YAML::Key << "device" << YAML::Value
    << c.device;
  list("model_stop_token_ids", c.model_stop_token_ids);
  e << YAML::Key << "tokenizer" << YAML::Value << c.tokenizer;
  e << YAML::Key << "served_model_name" << YAML::Value << c.served_model_name;
  e << YAML::Key << "buckets" << YAML::Value << YAML::BeginMap;
  list("batch_sizes", c.buckets.batch_sizes);
  list("seq_lens", c.buckets.seq_lens);
  list("context_lens", c.buckets.context_lens);
  list("tile_counts", c.buckets.tile_counts);
  list("train_batch_sizes", c.buckets.train_batch_sizes);
  list("train_seq_lens", c.buckets.train_seq_lens);
  e << YAML::Key << "oversize" << YAML::Value
    << (c.buckets.oversize == OversizePolicy::kReject ? "reject" : "eager");
  e << YAML::EndMap;
  e << YAML::Key << "capture" << YAML::Value << YAML::BeginMap << YAML::Key << "enabled"
    << YAML::Value << c.capture.enabled << YAML::Key << "lazy" << YAML::Value << c.capture.lazy
    << YAML::Key << "programmatic_dependent_launch" << YAML::Value
    << c.capture.programmatic_dependent_launch << YAML::EndMap;
  e << YAML::Key << "batching" << YAML::Value << YAML::BeginMap << YAML::Key << "max_queue_delay_us"
    << YAML::Value << c.batching.max_queue_delay_us << YAML::Key << "max_queue_size" << YAML::Value
    << c.batching.max_queue_size << YAML::EndMap;
  e << YAML::Key << "server" << YAML::Value << YAML::BeginMap << YAML::Key << "grpc_address"
    << YAML::Value << c.server.grpc_address << YAML::Key << "metrics_address" << YAML::Value
    << c.server.metrics_address << YAML::Key << "http_address" << YAML::Value
    << c.server.http_address << YAML::Key << "api_key" << YAML::Value
    << (c.server.api_key.empty() ? "" : "<set>") << YAML::EndMap;
  e << YAML::Key << "auth" << YAML::Value << YAML::BeginMap << YAML::Key << "api_keys_file"
    << YAML::Value << c.auth.api_keys_file << YAML::Key << "allow_unauthenticated" << YAML::Value
    << c.auth.allow_unauthenticated << YAML::EndMap;
  e << YAML::Key << "tls" << YAML::Value << YAML::BeginMap << YAML::Key << "cert_file"
    << YAML::Value << c.tls.cert_file << YAML::Key << "key_file" << YAML::Value << c.tls.key_file
    << YAML::Key << "client_ca_file" << YAML::Value << c.tls.client_ca_file << YAML::EndMap;
  const auto& l = c.limits;
  e << YAML::Key << "limits" << YAML::Value << YAML::BeginMap;
  for (const auto& [k, v] : std::vector<std::pair<const char*, int64_t>>{
           {"max_image_bytes", l.max_image_bytes},
           {"max_image_pixels", l.max_image_pixels},
           {"max_images_per_request", l.max_images_per_request},
           {"max_new_tokens", l.max_new_tokens},
           {"default_max_new_tokens", l.default_max_new_tokens},
           {"max_logits_positions", l.max_logits_positions},
           {"max_train_batch_examples", l.max_train_batch_examples},
           {"max_train_batch_tokens", l.max_train_batch_tokens},
           {"max_request_bytes", l.max_request_bytes}}) {
    e << YAML::Key << k << YAML::Value << v;
  }
  e << YAML::EndMap;
  e << YAML::Key << "train" << YAML::Value << YAML::BeginMap << YAML::Key << "checkpoint_dir"
    << YAML::Value << c.train.checkpoint_dir << YAML::Key << "idle_timeout_seconds" << YAML::Value
    << c.train.idle_timeout_seconds << YAML::EndMap;
  e << YAML::Key << "shutdown_timeout_seconds" << YAML::Value << c.shutdown_timeout_seconds;
  e << YAML::Key << "log_level" << YAML::Value << c.log_level;
  e << YAML::EndMap;
  return e.c_str();
}

}  // namespace vlmgraph::server
