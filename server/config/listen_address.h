// server/config/listen_address.h: the address a listener binds (server.grpc_address,
// server.metrics_address, server.http_address), parsed once with the config
// (server/config/config.h) and used by every listener, the exposure rule (server/core/auth.h) and
// the start-up line.
//
//   ListenAddress a = ListenAddress::Parse("[::1]:8000");
//   a.host();                     // "::1" (no brackets)
//   a.port();                     // 8000; 0 = any free port
//   a.ToString();                 // "[::1]:8000", what gRPC's AddListeningPort and clients take
//   a.WithPort(41234).ToString(); // "[::1]:41234": the bound address, once port 0 is resolved
//   a.IsLoopback();               // true
//
// Accepted forms (the whole text, no spaces):
//   HOST:PORT     HOST is an IPv4 address (127.0.0.1, 0.0.0.0 = every IPv4 address) or a host name
//                 (localhost, letters, digits, '-', '.', '_')
//   [IPV6]:PORT   IPV6 is an IPv6 address in brackets ([::1], [::] = every address)
//   PORT is 0 .. 65535 in decimal digits (0 = any free port, the listener reports the bound one).
// Refused, with a message that says what to write: an empty host (":8000"), "*", an IPv6 address
// without brackets ("::1:8000"), an IPv4 address in brackets, a malformed IPv4 or IPv6 address, a
// missing, non-numeric or out-of-range port. Host names are not resolved here (the listener does).
//
// Loopback: 127.0.0.0/8, ::1, ::ffff:127.0.0.0/104 and "localhost"; 0.0.0.0, :: and every other
// host are not (Note [Exposure rule], server/core/auth.h).
//
// The empty ListenAddress (default-constructed) is "no address": server.http_address "" turns
// HTTP off, and Metrics without an address serves no endpoint.
//
// Errors: Parse throws std::invalid_argument whose what() quotes the text, says what is wrong and
// gives the forms to write; the config wraps it in ServerConfigError naming the key.
// Thread rules: an immutable value type; any thread.
#pragma once

#include <string>
#include <string_view>
#include <utility>

namespace vlmgraph::server {

class ListenAddress {
 public:
  ListenAddress() = default;  // the empty address

  // "HOST:PORT" or "[IPV6]:PORT" as above; throws std::invalid_argument otherwise (also for "").
  static ListenAddress Parse(std::string_view text);

  bool empty() const { return host_.empty(); }
  // The host without brackets: "127.0.0.1", "::1", "localhost"; "" when empty.
  const std::string& host() const { return host_; }
  int port() const { return port_; }
  bool is_ipv6() const { return host_.find(':') != std::string::npos; }

  // 127.0.0.0/8, ::1, ::ffff:127.x.y.z or localhost.
  bool IsLoopback() const;
  // 0.0.0.0 or :: (every address of the machine).
  bool IsWildcard() const;

  // "HOST:PORT" or "[IPV6]:PORT"; "" when empty. Parse(ToString()) gives the same address.
  std::string ToString() const;
  // The same host with another port (the bound one, when port() is 0).
  ListenAddress WithPort(int port) const;

  friend bool operator==(const ListenAddress& a, const ListenAddress& b) {
    return a.host_ == b.host_ && a.port_ == b.port_;
  }
  friend bool operator!=(const ListenAddress& a, const ListenAddress& b) { return !(a == b); }

 private:
  ListenAddress(std::string host, int port) : host_(std::move(host)), port_(port) {}

  std::string host_;
  int port_ = 0;
};

}  // namespace vlmgraph::server
