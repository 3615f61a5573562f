// server/grpc/grpc_server.h: the gRPC server process part: listening port, the VlmGraph service,
// the standard grpc.health.v1.Health service and server reflection (so grpcurl works).
//
//   GrpcServer server(config, &service);        // binds and starts; throws on a bad address
//   server.SetServing(true);                     // health: SERVING
//   ...
//   server.SetServing(false);                    // draining: NOT_SERVING, still listening
//   server.Shutdown(5.0);                        // stop listening, wait, cancel what is left
//
// Note [Graceful shutdown] (server/main.cc): on SIGTERM main() turns health NOT_SERVING and stops
// the scheduler accepting new work while the port stays open, so probes and load balancers see
// NOT_SERVING; calls in flight (Train streams included) run until none is left or
// shutdown_timeout_seconds pass. Then Shutdown(time left) closes the port, and gRPC cancels the
// rest: a Generate stream ends at its OnCancel (Note [Generate on the callback API],
// server/grpc/service.h), a synchronous handler when it next checks its context, and each cancels
// its sequence. Shutdown returns once every handler returned and every callback call is done; only
// then is the scheduler stopped.
//
// Thread rules: construct, Shutdown and destroy from the main thread; SetServing from any.
// Errors: the constructor throws std::runtime_error naming server.grpc_address and the reason when
// it cannot bind, also when another process holds the address (SO_REUSEPORT is off, so a second
// server never shares a port with the first).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "server/config/config.h"

namespace vlmgraph::server {

class GrpcServer {
 public:
  GrpcServer(const ServerConfig& config, grpc::Service* service);
  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  // The bound port (resolves port 0) and the address with it: "127.0.0.1:50051", "[::1]:50051".
  int port() const { return port_; }
  std::string address() const;

  void SetServing(bool serving);
  // Stops accepting calls, waits up to `timeout_seconds` for running calls, cancels the rest and
  // waits for their handlers to return (callback calls: for their OnDone). Idempotent.
  void Shutdown(double timeout_seconds);

  static constexpr const char* kServiceName = "vlmgraph.v1.VlmGraph";

 private:
  ListenAddress address_;  // as configured (port 0 = any)
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  bool shut_down_ = false;
};

}  // namespace vlmgraph::server
