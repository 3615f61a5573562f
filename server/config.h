// server/config.h: the server's YAML configuration (deploy/config.yaml documents every key).
//
// Three separate steps, as Triton does it:
//   RawConfig raw = ParseConfig(YAML::LoadFile(path));   // types and key names; unset = nullopt
//   ServerConfig cfg = FillDefaults(raw);                // every field set
//   ValidateConfig(cfg);                                 // ranges and consistency
// LoadServerConfig() runs all three on a file plus command-line overrides (server/flags.h).
// With no file at all the defaults are the quick start: the built-in nanovlm-tiny model on CPU
// with small buckets.
//
// Errors: ServerConfigError, whose what() is "<key path>: <what is wrong>", for example
// "buckets.batch_sizes[2]: must be >= 1, got 0" or "batching.max_queue_delay_us: must be an
// integer (line 12)". Unknown keys are errors too (typos must not be ignored silently).
// Thread rules: value types and pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/bucket.h"

namespace YAML {
class Node;
}

namespace vlmgraph::server {

class ServerConfigError : public std::runtime_error {
 public:
  ServerConfigError(const std::string& key_path, const std::string& message)
      : std::runtime_error(key_path + ": " + message), key_path_(key_path) {}
  const std::string& key_path() const { return key_path_; }

 private:
  std::string key_path_;
};

// The complete configuration (after FillDefaults). Units are in the names.
struct ServerConfig {
  std::string model;   // preset name ("nanovlm-tiny", "nanovlm-460m") or checkpoint directory
  uint64_t seed = 0;   // random-init seed of preset models (deterministic demo output)
  std::string dtype;   // "float32" or "bfloat16"
  std::string device;  // "cpu", "cuda" or "cuda:N"
  std::vector<int64_t> model_stop_token_ids;  // suggested to clients by GetModelInfo
  // Hugging Face tokenizer.json of the model: "" = `<model>/tokenizer.json` when the checkpoint
  // directory has one (text, chat and the OpenAI endpoint need it), "none" = no tokenizer.
  std::string tokenizer;
  // Model id reported by GetModelInfo and OpenAI's /v1/models, and the only `model` value the
  // OpenAI endpoint accepts. Default: the preset name or the checkpoint directory's last component.
  std::string served_model_name;

  BucketSpec buckets;

  struct Capture {
    bool enabled = true;  // capture CUDA graphs (ignored on CPU)
    bool lazy = false;    // capture each bucket on first use instead of at start-up
    // Chain the fused decode kernels with programmatic dependent launch (Hopper and newer);
    // VLMGRAPH_PDL=0 in the environment turns it off whatever this says.
    bool programmatic_dependent_launch = true;
  } capture;

  struct Batching {
    int64_t max_queue_delay_us = 0;  // longest wait to group requests into one prefill batch
    int64_t max_queue_size = 0;      // waiting requests (all RPCs) before RESOURCE_EXHAUSTED
  } batching;

  struct Endpoints {
    std::string grpc_address;     // host:port of the gRPC API (port 0 = any free port)
    std::string metrics_address;  // host:port of the Prometheus /metrics endpoint (port 0 = any)
    std::string http_address;     // host:port of the OpenAI-compatible HTTP API; "" = off
    // One API key with every scope (server/auth.h), required as `authorization: Bearer <key>`
    // by gRPC and HTTP when not empty. The environment variable VLMGRAPH_API_KEY overrides it
    // (keeps the key out of files).
    std::string api_key;
  } server;

  struct Auth {
    std::string api_keys_file;           // "SCOPES KEY" per line (server/auth.h); "" = none
    bool allow_unauthenticated = false;  // allow a non-loopback listener without keys
  } auth;

  struct Tls {  // PEM files; cert + key turn TLS on for gRPC and HTTP
    std::string cert_file, key_file;
    std::string client_ca_file;  // set: clients must present a certificate signed by it
  } tls;

  struct Limits {
    int64_t max_image_bytes = 0;   // encoded bytes per image
    int64_t max_image_pixels = 0;  // width x height per image
    int64_t max_images_per_request = 0;
    int64_t max_new_tokens = 0;          // per Generate request
    int64_t default_max_new_tokens = 0;  // when a request leaves it unset
    int64_t max_logits_positions = 0;    // per Forward request
    int64_t max_train_batch_examples = 0;
    // Examples x longest example of one Train batch (the padded step); 0 = no limit. Default:
    // the largest train bucket, so no step runs eagerly for longer than that bucket would.
    int64_t max_train_batch_tokens = 0;
    int64_t max_request_bytes = 0;  // gRPC message size cap (derived when unset)
  } limits;

  struct Train {
    std::string checkpoint_dir;  // root of SaveCheckpoint directories
    // A Train stream that sends nothing for this long is cancelled (counted as DEADLINE_EXCEEDED);
    // 0 = never.
    double idle_timeout_seconds = 0;
  } train;

  double shutdown_timeout_seconds = 0;  // SIGTERM: in-flight work gets this long, then is cancelled
  std::string log_level;                // "error", "warn", "info", "debug"
};

// What the YAML (plus overrides) said: every field optional.
struct RawConfig {
  std::optional<std::string> model, dtype, device, log_level, tokenizer, served_model_name;
  std::optional<uint64_t> seed;
  std::optional<std::vector<int64_t>> model_stop_token_ids;
  std::optional<std::vector<int64_t>> batch_sizes, seq_lens, context_lens, tile_counts,
      train_batch_sizes, train_seq_lens;
  std::optional<std::string> oversize;
  std::optional<bool> capture_enabled, capture_lazy, capture_programmatic_dependent_launch;
  std::optional<int64_t> max_queue_delay_us, max_queue_size;
  std::optional<std::string> grpc_address, metrics_address, http_address, api_key;
  std::optional<std::string> api_keys_file, tls_cert_file, tls_key_file, tls_client_ca_file;
  std::optional<bool> allow_unauthenticated;
  std::optional<int64_t> max_image_bytes, max_image_pixels, max_images_per_request, max_new_tokens,
      default_max_new_tokens, max_logits_positions, max_train_batch_examples, max_request_bytes,
      max_train_batch_tokens;
  std::optional<std::string> checkpoint_dir;
  std::optional<double> train_idle_timeout_seconds;
  std::optional<double> shutdown_timeout_seconds;
};

// Step 1: reads known keys with their types. A null or missing root gives an all-unset RawConfig.
RawConfig ParseConfig(const YAML::Node& root);

// Step 2: unset fields take their defaults (buckets default small on CPU, the engine's on CUDA).
ServerConfig FillDefaults(const RawConfig& raw);

// Step 3: ranges and consistency. Also checks that `model` names a preset or a directory with a
// config.json. Does not check that a CUDA device exists (main does, when building the engine).
void ValidateConfig(const ServerConfig& config);

// Parses a YAML document (file contents); errors name the line.
YAML::Node LoadYaml(const std::string& text, const std::string& source_name);

// The effective configuration as YAML (for --print-config and the start-up log).
std::string ConfigToYaml(const ServerConfig& config);

bool IsPresetModel(const std::string& model);

}  // namespace vlmgraph::server
