// server/metrics_http.h: the HTTP endpoint that serves /metrics (Prometheus text format).
//
// Note [Own metrics endpoint]: prometheus-cpp's pull Exposer runs on civetweb, whose Debian build
// starts its worker threads with a fixed 100 KiB stack; with LibTorch's CUDA libraries loaded the
// static TLS no longer fits and pthread_create fails ("Cannot create threads"). This endpoint is
// a minimal HTTP/1.1 responder on one thread with a normal stack: GET or HEAD /metrics -> 200 with
// the exposition, anything else -> 404 or 405, then the connection closes (Prometheus handles
// that). One request at a time is plenty for scrapes.
//
//   MetricsHttpServer http("127.0.0.1:9464", [&] { return metrics.Render(); });
//   http.port();   // the bound port (resolves port 0)
//
// Thread rules: construct and destroy on one thread; `render` is called on the endpoint's thread.
// Errors: the constructor throws std::runtime_error naming the address when it cannot listen.
#pragma once

#include <atomic>
#include <functional>
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
  void Serve();
  void Handle(int fd);

  std::function<std::string()> render_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace vlmgraph::server
