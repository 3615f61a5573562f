#include "server/metrics_http.h"

#include <httplib.h>
#include <sys/socket.h>

#include <stdexcept>

namespace vlmgraph::server {

struct MetricsHttpServer::Impl {
  httplib::Server server;
};

MetricsHttpServer::MetricsHttpServer(const std::string& address,
                                     std::function<std::string()> render)
    : impl_(std::make_unique<Impl>()) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? "" : address.substr(0, colon);
  const std::string port_text = colon == std::string::npos ? address : address.substr(colon + 1);
  if (host.empty()) host = "0.0.0.0";
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  int port = 0;
  try {
    port = std::stoi(port_text);
  } catch (const std::exception&) {
    throw std::runtime_error("server.metrics_address: " + address + ": the port is not a number");
  }
  httplib::Server& s = impl_->server;
  s.Get("/metrics", [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
    res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  s.set_keep_alive_max_count(1);
  // SO_REUSEADDR only: a second server on the same port must fail, not share it.
  s.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  port_ = port == 0 ? s.bind_to_any_port(host) : (s.bind_to_port(host, port) ? port : -1);
  if (port_ <= 0) throw std::runtime_error("server.metrics_address: cannot listen on " + address);
  thread_ = std::thread([this] { impl_->server.listen_after_bind(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  impl_->server.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace vlmgraph::server
