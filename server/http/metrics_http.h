// server/http/metrics_http.h: the HTTP endpoint that serves /metrics (Prometheus text format), on
// the event-driven HTTP front (server/http/http_server.h), with its deadlines and connection
// limits.
//
// Note [Own metrics endpoint]: prometheus-cpp's pull Exposer runs on civetweb, whose Debian build
// starts its worker threads with a fixed 100 KiB stack; with LibTorch's CUDA libraries loaded the
// static TLS no longer fits and pthread_create fails ("Cannot create threads"). The front's one
// I/O thread is an ordinary std::thread. GET /metrics -> 200 with the exposition; another method
// -> 405, any other path -> 404.
//
//   MetricsHttpServer http(ListenAddress::Parse("127.0.0.1:9464"), [&] { return metrics.Render();
//   }); http.port();   // the bound port (resolves port 0)
//
// Thread rules: construct and destroy on one thread; `render` is called on the endpoint's I/O
// thread and must be thread-safe. Errors: the constructor throws std::runtime_error naming the
// address when it cannot listen.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "server/config/listen_address.h"

namespace vlmgraph::server {

class MetricsHttpServer {
 public:
  MetricsHttpServer(const ListenAddress& address, std::function<std::string()> render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const;

 private:
  std::unique_ptr<class HttpServer> server_;
};

}  // namespace vlmgraph::server
