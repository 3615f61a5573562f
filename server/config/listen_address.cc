#include "server/config/listen_address.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cctype>
#include <stdexcept>

namespace vlmgraph::server {
namespace {

constexpr const char* kForms =
    "write HOST:PORT or [IPV6]:PORT, like 127.0.0.1:8000, 0.0.0.0:8000 (every IPv4 address), "
    "[::1]:8000 or [::]:8000 (every address); port 0 picks a free port";

// `text` in quotes, a byte outside printable ASCII as \xNN (a message is a C string).
std::string Quoted(std::string_view text) {
  std::string out = "'";
  for (char c : text) {
    if (c >= ' ' && c <= '~') {
      out += c;
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      const auto byte = static_cast<unsigned char>(c);
      out += std::string("\\x") + kHex[byte >> 4] + kHex[byte & 15];
    }
  }
  return out + "'";
}

[[noreturn]] void Fail(std::string_view text, const std::string& what) {
  throw std::invalid_argument(Quoted(text) + " " + what + ": " + kForms);
}

bool IsHostNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
}

// inet_pton reads up to a NUL: a host with one inside is no address.
bool ParseIpv4(const std::string& host, in_addr* out) {
  return host.find('\0') == std::string::npos && inet_pton(AF_INET, host.c_str(), out) == 1;
}

bool ParseIpv6(const std::string& host, in6_addr* out) {
  return host.find('\0') == std::string::npos && inet_pton(AF_INET6, host.c_str(), out) == 1;
}

}  // namespace

ListenAddress ListenAddress::Parse(std::string_view text) {
  if (text.empty()) Fail(text, "is empty");
  std::string host;
  std::string_view rest;  // ":PORT"
  if (text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos) Fail(text, "lacks the ']' that closes the IPv6 address");
    host = std::string(text.substr(1, close - 1));
    rest = text.substr(close + 1);
    in6_addr v6{};
    if (host.empty() || !ParseIpv6(host, &v6)) {
      in_addr v4{};
      if (ParseIpv4(host, &v4)) Fail(text, "puts an IPv4 address in brackets, which are for IPv6");
      Fail(text, "has " + Quoted(host) + " in brackets, which is not an IPv6 address");
    }
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) Fail(text, "has no port");
    host = std::string(text.substr(0, colon));
    rest = text.substr(colon);
    if (host.empty()) Fail(text, "has no host");
    if (host == "*") Fail(text, "has '*' for a host");
    if (host.find(':') != std::string::npos) {
      in6_addr v6{};
      if (ParseIpv6(host, &v6))
        Fail(text,
             "has an IPv6 address without brackets; write [" + host + "]" + std::string(rest));
      if (ParseIpv6(std::string(text), &v6))
        Fail(text, "is an IPv6 address without brackets and port; write [" + std::string(text) +
                       "]:PORT");
      Fail(text, "has more than one ':' outside brackets");
    }
    for (char c : host) {
      if (!IsHostNameChar(c)) Fail(text, "has a host with " + Quoted({&c, 1}) + " in it");
    }
    bool dotted_digits = true;
    for (char c : host)
      dotted_digits = dotted_digits && (c == '.' || std::isdigit(static_cast<unsigned char>(c)));
    in_addr v4{};
    if (dotted_digits && !ParseIpv4(host, &v4))
      Fail(text, "has '" + host + "', not an IPv4 address");
  }
  if (rest.empty() || rest.front() != ':') Fail(text, "has no ':PORT' after the host");
  const std::string_view port_text = rest.substr(1);
  if (port_text.empty()) Fail(text, "has no port after ':'");
  if (port_text.size() > 5)
    Fail(text, "has port " + Quoted(port_text) + ", not a number from 0 to 65535");
  int port = 0;
  for (char c : port_text) {
    if (!std::isdigit(static_cast<unsigned char>(c)))
      Fail(text, "has port " + Quoted(port_text) + ", not a number from 0 to 65535");
    port = port * 10 + (c - '0');
    if (port > 65535) Fail(text, "has port " + std::string(port_text) + ", beyond 65535");
  }
  return ListenAddress(std::move(host), port);
}

bool ListenAddress::IsLoopback() const {
  if (host_ == "localhost") return true;
  in_addr v4{};
  if (ParseIpv4(host_, &v4)) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (!ParseIpv6(host_, &v6)) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;  // ::ffff:127.x.y.z
}

bool ListenAddress::IsWildcard() const {
  in_addr v4{};
  if (ParseIpv4(host_, &v4)) return v4.s_addr == INADDR_ANY;
  in6_addr v6{};
  return ParseIpv6(host_, &v6) && IN6_IS_ADDR_UNSPECIFIED(&v6);
}

std::string ListenAddress::ToString() const {
  if (empty()) return "";
  const std::string port = std::to_string(port_);
  return is_ipv6() ? "[" + host_ + "]:" + port : host_ + ":" + port;
}

ListenAddress ListenAddress::WithPort(int port) const { return ListenAddress(host_, port); }

}  // namespace vlmgraph::server
