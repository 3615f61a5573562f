// Listen addresses (server/config/listen_address.h): the one parser of server.grpc_address,
// server.metrics_address and server.http_address (good and bad forms, IPv6 brackets, the port
// range, the messages), the exposure rule's loopback test, and the three listeners (gRPC, HTTP,
// metrics) on [::1]:0. The config and flags that carry addresses: tests/server_config_test.cc.
#include <arpa/inet.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "server/config/config.h"
#include "server/config/listen_address.h"
#include "server/core/auth.h"
#include "server/core/metrics.h"
#include "server/grpc/grpc_server.h"
#include "server/http/http_server.h"
#include "vlmgraph/v1/service.grpc.pb.h"

namespace vlmgraph::server {
namespace {

// The message Parse gives for `text`, "" when it parses.
std::string ParseError(const std::string& text) {
  try {
    ListenAddress::Parse(text);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(ListenAddress, ParsesHostPortAndBracketedIpv6) {
  const ListenAddress v4 = ListenAddress::Parse("127.0.0.1:8000");
  EXPECT_EQ(v4.host(), "127.0.0.1");
  EXPECT_EQ(v4.port(), 8000);
  EXPECT_FALSE(v4.is_ipv6());
  const ListenAddress v6 = ListenAddress::Parse("[::1]:8000");
  EXPECT_EQ(v6.host(), "::1");
  EXPECT_EQ(v6.port(), 8000);
  EXPECT_TRUE(v6.is_ipv6());
  EXPECT_EQ(v6.ToString(), "[::1]:8000");
  EXPECT_EQ(ListenAddress::Parse("0.0.0.0:0").port(), 0);
  EXPECT_EQ(ListenAddress::Parse("[::]:65535").port(), 65535);
  EXPECT_EQ(ListenAddress::Parse("[fe80::1:2]:1").host(), "fe80::1:2");
  EXPECT_EQ(ListenAddress::Parse("localhost:50051").host(), "localhost");
  EXPECT_EQ(ListenAddress::Parse("vlmgraph-0.svc_a.example:9464").host(),
            "vlmgraph-0.svc_a.example");
  for (const char* text : {"127.0.0.1:0", "[::1]:8000", "[::]:0", "localhost:1", "10.1.2.3:443"}) {
    EXPECT_EQ(ListenAddress::Parse(text).ToString(), text);
    EXPECT_EQ(ListenAddress::Parse(ListenAddress::Parse(text).ToString()),
              ListenAddress::Parse(text));
  }
  EXPECT_EQ(ListenAddress::Parse("[::1]:0").WithPort(41234).ToString(), "[::1]:41234");
  EXPECT_TRUE(ListenAddress().empty());
  EXPECT_EQ(ListenAddress().ToString(), "");
}

TEST(ListenAddress, RefusesMalformedFormsSayingWhatToWrite) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "is empty"},
      {"localhost", "has no port"},
      {"localhost:", "has no port after ':'"},
      {":8000", "has no host"},
      {"*:8000", "'*'"},
      {"::1:8000", "write [::1]:8000"},
      {"fe80::1", "write [fe80::1]:PORT"},
      {"a:b:8000", "more than one ':'"},
      {"[::1:8000", "lacks the ']'"},
      {"[]:8000", "not an IPv6 address"},
      {"[zz::1]:8000", "not an IPv6 address"},
      {"[127.0.0.1]:8000", "IPv4 address in brackets"},
      {"[::1]", "has no ':PORT'"},
      {"[::1]8000", "has no ':PORT'"},
      {"host:http", "not a number from 0 to 65535"},
      {"host:70000", "beyond 65535"},
      {"host:65536", "beyond 65535"},
      {"host:-1", "not a number"},
      {"host:+80", "not a number"},
      {"host:000080", "not a number"},
      {"host:80 ", "not a number"},
      {" host:80", "with ' '"},
      {"ho/st:80", "with '/'"},
      {"999.1.1.1:80", "not an IPv4 address"},
      {"1.2.3:80", "not an IPv4 address"},
  };
  for (const auto& [text, says] : cases) {
    const std::string message = ParseError(text);
    EXPECT_NE(message, "") << "'" << text << "' parsed";
    EXPECT_NE(message.find(says), std::string::npos) << text << " -> " << message;
    // Every message quotes the text and gives the forms to write.
    EXPECT_NE(message.find("'" + text + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("write HOST:PORT or [IPV6]:PORT"), std::string::npos) << message;
  }
  // A byte outside printable ASCII is written as \xNN (inet_pton would stop at a NUL).
  EXPECT_EQ(
      ParseError(std::string("[::1\0x]:80", 10))
          .rfind("'[::1\\x00x]:80' has '::1\\x00x' in brackets, which is not an IPv6 address", 0),
      0u)
      << ParseError(std::string("[::1\0x]:80", 10));
  EXPECT_NE(ParseError("h\tost:80").find("'h\\x09ost:80' has a host with '\\x09' in it"),
            std::string::npos);
}

TEST(ListenAddress, LoopbackIs127Slash8AndColonColon1) {
  for (const char* text : {"127.0.0.1:1", "127.255.3.4:1", "[::1]:1", "[0:0:0:0:0:0:0:1]:1",
                           "[::ffff:127.0.0.1]:1", "localhost:1"}) {
    EXPECT_TRUE(ListenAddress::Parse(text).IsLoopback()) << text;
  }
  for (const char* text : {"0.0.0.0:1", "[::]:1", "10.0.0.1:1", "128.0.0.1:1", "[::2]:1",
                           "[::ffff:10.0.0.1]:1", "example.com:1", "localhost.example:1"}) {
    EXPECT_FALSE(ListenAddress::Parse(text).IsLoopback()) << text;
  }
  EXPECT_TRUE(ListenAddress::Parse("0.0.0.0:1").IsWildcard());
  EXPECT_TRUE(ListenAddress::Parse("[::]:1").IsWildcard());
  EXPECT_FALSE(ListenAddress::Parse("[::1]:1").IsWildcard());
}

TEST(ListenAddress, ExposureRuleTreatsEveryLoopbackAlike) {
  ServerConfig c = FillDefaults(RawConfig{});
  const ApiKeys no_keys;
  for (const char* grpc : {"127.0.0.1:0", "127.8.9.10:0", "[::1]:0", "localhost:0"}) {
    for (const char* http : {"", "[::1]:0", "127.0.0.2:0"}) {
      c.server.grpc_address = ListenAddress::Parse(grpc);
      c.server.http_address = *http ? ListenAddress::Parse(http) : ListenAddress();
      EXPECT_NO_THROW(CheckExposure(c, no_keys)) << grpc << " " << http;
    }
  }
  c.server.grpc_address = ListenAddress::Parse("[::1]:0");
  for (const char* open : {"[::]:0", "0.0.0.0:0", "[2001:db8::1]:0", "example.com:0"}) {
    c.server.http_address = ListenAddress::Parse(open);
    try {
      CheckExposure(c, no_keys);
      ADD_FAILURE() << open << " was allowed without keys";
    } catch (const ServerConfigError& e) {
      EXPECT_EQ(e.key_path(), "server.http_address");
      EXPECT_NE(std::string(e.what()).find("listens on " + std::string(open)), std::string::npos)
          << e.what();
    }
  }
}

// Whether this machine can bind ::1 (containers without IPv6 cannot).
bool HasIpv6Loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// One HTTP/1.1 GET to [::1]:port; the status line ("" when it cannot connect).
std::string GetOverIpv6(int port, const std::string& path) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  timeval timeout{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  a.sin6_port = htons(static_cast<uint16_t>(port));
  std::string reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string request =
        "GET " + path + " HTTP/1.1\r\nHost: [::1]\r\nConnection: close\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0;) reply.append(buffer, n);
    }
  }
  ::close(fd);
  return reply.substr(0, reply.find("\r\n"));
}

TEST(ListenAddress, EveryListenerServesOnIpv6Loopback) {
  if (!HasIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback on this machine";
  ServerConfig config = FillDefaults(RawConfig{});
  for (ListenAddress* a :
       {&config.server.grpc_address, &config.server.metrics_address, &config.server.http_address}) {
    *a = ListenAddress::Parse("[::1]:0");
  }

  // gRPC: a call reaches the service (its methods are unimplemented) over ::1.
  v1::VlmGraph::Service unimplemented;
  GrpcServer grpc_server(config, &unimplemented);
  EXPECT_GT(grpc_server.port(), 0);
  EXPECT_EQ(grpc_server.address(), "[::1]:" + std::to_string(grpc_server.port()));
  auto stub = v1::VlmGraph::NewStub(
      grpc::CreateChannel(grpc_server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetModelInfoRequest request;
  v1::ModelInfo response;
  EXPECT_EQ(stub->GetModelInfo(&ctx, request, &response).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  grpc_server.Shutdown(0);

  // Metrics: /metrics over ::1.
  Metrics metrics(config.server.metrics_address);
  ASSERT_GT(metrics.port(), 0);
  EXPECT_EQ(GetOverIpv6(metrics.port(), "/metrics"), "HTTP/1.1 200 OK");

  // HTTP: the front the OpenAI API runs on, with the configured address.
  HttpServerOptions options;
  options.address = config.server.http_address;
  HttpHandlers handlers;
  handlers.on_head = [](const HttpRequest&) { return HeadVerdict::Accept(0); };
  handlers.on_request = [](std::shared_ptr<HttpExchange> x) {
    x->Respond(200, "text/plain", "ok");
  };
  HttpServer http(options, handlers);
  ASSERT_GT(http.port(), 0);
  EXPECT_EQ(GetOverIpv6(http.port(), "/health"), "HTTP/1.1 200 OK");
  http.Stop();
}

}  // namespace
}  // namespace vlmgraph::server
