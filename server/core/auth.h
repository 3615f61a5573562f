// server/core/auth.h: API keys with scopes, TLS settings and the exposure rule, for gRPC and HTTP.
//
//   ApiKeys keys = ApiKeys::Load(config);                 // server.api_key + auth.api_keys_file
//   CheckExposure(config, keys);                          // at start-up: refuse an open listener
//   keys.Authorize(bearer_header, Scope::kTrain, "Train");  // per call: ServerError if refused
//
// Keys travel as `authorization: Bearer <key>` (gRPC metadata, HTTP header), as OpenAI's API and
// vLLM's --api-key do. The keys file (auth.api_keys_file) holds one key per line:
//
//   # scopes     key (16 .. 256 printable ASCII characters, no spaces)
//   inference    4f1c0f0e7d9b2a65c2e1d0aa
//   inference,train  9a8b7c6d5e4f3a2b1c0d9e8f
//   all          0a1b2c3d4e5f60718293a4b5
//
// Scopes: `inference` (GetModelInfo, Generate, Forward, every OpenAI endpoint), `train` (the
// Train RPC: steps and checkpoint saves) and `publish` (changing what every client is served: a
// Train job's publish request or publish_on_end, RollbackWeights); `all` is every scope.
// Training and saving need no right to change the served model, so `train` does not include
// `publish`. server.api_key (or the environment variable VLMGRAPH_API_KEY) adds one key with
// every scope. With no key at all, calls need none. Health checks (gRPC health service, HTTP
// /health), reflection and /metrics never need a key. Keys are compared in constant time per key;
// no key or part of one is ever logged.
//
// Note [Exposure rule]: a server whose gRPC or HTTP address is not a loopback address
// (ListenAddress::IsLoopback: 127.0.0.0/8, ::1 and its IPv4-mapped form, localhost) refuses to
// start without keys unless auth.allow_unauthenticated is true, so a published port is never open
// by accident. TLS (tls.cert_file + tls.key_file, both PEM) covers gRPC and HTTP;
// tls.client_ca_file additionally requires every client to present a certificate signed by that CA
// (mutual TLS).
//
// Thread rules: an ApiKeys is immutable after Load; Authorize is safe from any thread.
// Errors: Load and CheckExposure throw ServerConfigError (naming the key path or file line);
// Authorize throws ServerError UNAUTHENTICATED (no key / unknown key) or PERMISSION_DENIED (the key
// lacks the scope), with a message that says what to send.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "server/config/config.h"

namespace vlmgraph::server {

enum class Scope : unsigned { kInference = 1, kTrain = 2, kPublish = 4 };

// Every scope's bit: what `all` and server.api_key grant.
constexpr unsigned kAllScopes = static_cast<unsigned>(Scope::kInference) |
                                static_cast<unsigned>(Scope::kTrain) |
                                static_cast<unsigned>(Scope::kPublish);

const char* ScopeName(Scope scope);

class ApiKeys {
 public:
  ApiKeys() = default;
  static ApiKeys Load(const ServerConfig& config);
  // Parses a keys file's text (the format above); `source` names it in errors.
  static ApiKeys Parse(const std::string& text, const std::string& source);
  void Add(const std::string& key, unsigned scopes, const std::string& source);

  bool enabled() const { return !keys_.empty(); }
  size_t size() const { return keys_.size(); }

  // `authorization` is the header / metadata value ("Bearer <key>", "" when absent). Returns when
  // keys are off or the key has `scope`; throws ServerError otherwise. `what` names the call in
  // the PERMISSION_DENIED message ("Train", "Train publish").
  void Authorize(std::string_view authorization, Scope scope, const std::string& what) const;

 private:
  struct Key {
    std::string key;
    unsigned scopes;
  };
  std::vector<Key> keys_;
};

// The exposure rule (Note [Exposure rule]) and the TLS files' presence: ServerConfigError naming
// the key to set.
void CheckExposure(const ServerConfig& config, const ApiKeys& keys);

// Reads a whole PEM file; ServerConfigError naming `key_path` when it cannot.
std::string ReadPemFile(const std::string& path, const std::string& key_path);

}  // namespace vlmgraph::server
