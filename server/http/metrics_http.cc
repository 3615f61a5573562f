#include "server/http/metrics_http.h"

#include <stdexcept>

#include "server/http/http_server.h"

namespace vlmgraph::server {

MetricsHttpServer::MetricsHttpServer(const ListenAddress& address,
                                     std::function<std::string()> render) {
  HttpServerOptions o;
  o.address = address;
  o.io_threads = 1;
  o.thread_name = "vlmg-metrics";
  o.max_connections = 1024;
  o.max_connections_per_client = 64;
  HttpHandlers h;
  h.on_head = [](const HttpRequest& head) {
    if (head.path != "/metrics")
      return HeadVerdict::Refuse(404, "text/plain", "not found: only /metrics\n");
    if (head.method != "GET") {
      return HeadVerdict::Refuse(405, "text/plain", "use GET /metrics\n", {{"Allow", "GET"}});
    }
    return HeadVerdict::Accept(0);
  };
  h.on_request = [render = std::move(render)](std::shared_ptr<HttpExchange> x) {
    x->Respond(200, "text/plain; version=0.0.4; charset=utf-8", render());
  };
  try {
    server_ = std::make_unique<HttpServer>(o, h);
  } catch (const std::exception& e) {
    throw std::runtime_error("server.metrics_address: " + std::string(e.what()));
  }
}

MetricsHttpServer::~MetricsHttpServer() = default;

int MetricsHttpServer::port() const { return server_->port(); }

}  // namespace vlmgraph::server
