// server/metrics_http.h: the HTTP endpoint that serves /metrics (Prometheus text format), on
// cpp-httplib (Debian's libcpp-httplib-dev).
//
// Note [Own metrics endpoint]: prometheus-cpp's pull Exposer runs on civetweb, whose Debian build
// starts its worker threads with a fixed 100 KiB stack; with LibTorch's CUDA libraries loaded the
// static TLS no longer fits and pthread_create fails ("Cannot create threads"). cpp-httplib's
// workers are ordinary std::threads. GET (and HEAD) /metrics -> 200 with the exposition; any other
// path -> 404. Each connection carries one request (scrapers reconnect).
//
//   MetricsHttpServer http("127.0.0.1:9464", [&] { return metrics.Render(); });
//   http.port();   // the bound port (resolves port 0)
//
// Thread rules: construct and destroy on one thread; `render` is called on the endpoint's worker
// threads and must be thread-safe. Errors: the constructor throws std::runtime_error naming the
// address when it cannot listen.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace vlmgraph::server {

class MetricsHttpServer {
 public:
  MetricsHttpServer(const std::string& address, std::function<std::string()> render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  std::thread thread_;
};

}  // namespace vlmgraph::server
