#include "server/core/auth.h"

#include <fstream>
#include <sstream>

#include "server/core/status.h"

namespace vlmgraph::server {
namespace {

constexpr size_t kMinKeyBytes = 16;
constexpr size_t kMaxKeyBytes = 256;

// Compares in time that depends on the lengths only, not on where the texts differ.
bool ConstantTimeEquals(std::string_view given, const std::string& key) {
  if (given.size() != key.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ key[i]);
  return diff == 0;
}

unsigned ParseScopes(const std::string& text, const std::string& where) {
  unsigned scopes = 0;
  std::stringstream ss(text);
  for (std::string s; std::getline(ss, s, ',');) {
    if (s == "inference") {
      scopes |= static_cast<unsigned>(Scope::kInference);
    } else if (s == "train") {
      scopes |= static_cast<unsigned>(Scope::kTrain);
    } else if (s == "publish") {
      scopes |= static_cast<unsigned>(Scope::kPublish);
    } else if (s == "all") {
      scopes |= kAllScopes;
    } else {
      throw ServerConfigError(
          where,
          "unknown scope '" + s + "'; use inference, train, publish, all or a comma list of them");
    }
  }
  if (scopes == 0) throw ServerConfigError(where, "no scope given");
  return scopes;
}

}  // namespace

const char* ScopeName(Scope scope) {
  switch (scope) {
    case Scope::kTrain:
      return "train";
    case Scope::kPublish:
      return "publish";
    case Scope::kInference:
      break;
  }
  return "inference";
}

void ApiKeys::Add(const std::string& key, unsigned scopes, const std::string& source) {
  if (key.size() < kMinKeyBytes || key.size() > kMaxKeyBytes) {
    throw ServerConfigError(source, "an API key must have " + std::to_string(kMinKeyBytes) +
                                        " to " + std::to_string(kMaxKeyBytes) +
                                        " characters, this one has " + std::to_string(key.size()));
  }
  for (char c : key) {
    if (c <= ' ' || c > '~')
      throw ServerConfigError(source, "an API key may hold printable ASCII characters only");
  }
  for (const Key& k : keys_) {
    if (k.key == key) throw ServerConfigError(source, "the same API key is listed twice");
  }
  keys_.push_back({key, scopes});
}

ApiKeys ApiKeys::Parse(const std::string& text, const std::string& source) {
  ApiKeys keys;
  std::stringstream in(text);
  int line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    std::stringstream fields(line);
    std::string scopes, key, extra;
    fields >> scopes >> key >> extra;
    const std::string where = source + " line " + std::to_string(line_number);
    if (key.empty() || !extra.empty())
      throw ServerConfigError(where, "expected two fields: SCOPES KEY (e.g. 'inference,train KEY')");
    keys.Add(key, ParseScopes(scopes, where), where);
  }
  return keys;
}

ApiKeys ApiKeys::Load(const ServerConfig& config) {
  ApiKeys keys;
  const std::string& file = config.auth.api_keys_file;
  if (!file.empty()) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw ServerConfigError("auth.api_keys_file", "cannot read '" + file + "'");
    std::stringstream text;
    text << in.rdbuf();
    keys = Parse(text.str(), "auth.api_keys_file '" + file + "'");
    if (!keys.enabled())
      throw ServerConfigError("auth.api_keys_file", "'" + file + "' holds no key");
  }
  if (!config.server.api_key.empty()) {
    keys.Add(config.server.api_key, kAllScopes, "server.api_key");
  }
  return keys;
}

void ApiKeys::Authorize(std::string_view authorization, Scope scope,
                        const std::string& what) const {
  if (keys_.empty()) return;
  if (authorization.empty()) {
    throw ServerError(grpc::StatusCode::UNAUTHENTICATED,
                      "missing API key: send `authorization: Bearer <key>` (gRPC metadata or "
                      "HTTP header)");
  }
  std::string_view given;
  if (authorization.size() > 7 && (authorization.substr(0, 7) == "Bearer " ||
                                    authorization.substr(0, 7) == "bearer ")) {
    given = authorization.substr(7);
  } else {
    throw ServerError(grpc::StatusCode::UNAUTHENTICATED,
                      "malformed authorization: expected `Bearer <key>`");
  }
  const Key* match = nullptr;
  for (const Key& k : keys_) {  // every key is compared: the time does not say which matched
    if (ConstantTimeEquals(given, k.key)) match = &k;
  }
  if (match == nullptr)
    throw ServerError(grpc::StatusCode::UNAUTHENTICATED, "incorrect API key");
  if ((match->scopes & static_cast<unsigned>(scope)) == 0) {
    throw ServerError(grpc::StatusCode::PERMISSION_DENIED,
                      std::string("this API key may not call ") + what + ": it needs the '" +
                          ScopeName(scope) + "' scope (auth.api_keys_file)");
  }
}

std::string ReadPemFile(const std::string& path, const std::string& key_path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ServerConfigError(key_path, "cannot read '" + path + "'");
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN ") == std::string::npos)
    throw ServerConfigError(key_path, "'" + path + "' is not a PEM file");
  return text.str();
}

void CheckExposure(const ServerConfig& config, const ApiKeys& keys) {
  const ServerConfig::Tls& tls = config.tls;
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    throw ServerConfigError(tls.cert_file.empty() ? "tls.cert_file" : "tls.key_file",
                            "TLS needs both tls.cert_file and tls.key_file");
  }
  if (!tls.client_ca_file.empty() && tls.cert_file.empty()) {
    throw ServerConfigError("tls.client_ca_file",
                            "client certificates need TLS: set tls.cert_file and tls.key_file");
  }
  if (keys.enabled() || config.auth.allow_unauthenticated) return;
  for (const auto& [key, address] :
       {std::pair<const char*, ListenAddress>{"server.grpc_address", config.server.grpc_address},
        {"server.http_address", config.server.http_address}}) {
    if (address.empty() || address.IsLoopback()) continue;
    throw ServerConfigError(
        key, "listens on " + address.ToString() +
                 ", which is not a loopback address, and no API key is configured: anyone who "
                 "reaches it could generate, train and save. Set auth.api_keys_file (or "
                 "VLMGRAPH_API_KEY), or set auth.allow_unauthenticated: true if the server is "
                 "meant to be open (docs/security.md)");
  }
}

}  // namespace vlmgraph::server
