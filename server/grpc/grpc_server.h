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
// Note [gRPC listener]: gRPC 1.51 (Debian's) stops its listener for good when an accept4 fails
// with anything but EAGAIN/ECONNABORTED/EINTR, out of file descriptors (EMFILE) included: it logs
// "Failed accept4: Too many open files" and never accepts again, while calls on open connections
// and the HTTP front go on, so an HTTP health check would keep a server whose gRPC is dead.
// GrpcServer routes gRPC's log into the server's (gpr_set_log_function, at its severity) and
// watches it for that line: then listener_failed() turns true and the callback given to
// OnListenerFailed runs once (main drains and exits with status 1, so the container is
// restarted). Note [Descriptor reserve] (base/descriptors.h) keeps the HTTP front from using up
// the descriptors gRPC needs; a flood of gRPC connections alone can still reach the limit.
//
// Note [Malformed requests]: a request message that protobuf cannot parse never reaches a
// handler: gRPC answers it itself, INTERNAL (unary) or UNIMPLEMENTED (Generate) with an empty
// message, and nothing logs or counts it. A server interceptor sees the call's first received
// message (null when it did not parse) and, when gRPC's own empty status goes out, replaces it
// with INVALID_ARGUMENT naming the method and its request type; the call is logged (debug, as
// other refusals) and counted in vlmgraph_requests_total{rpc, code="INVALID_ARGUMENT"}.
//
// Note [gRPC buffers]: gRPC reads a unary or server-streaming request whole before any handler
// runs, so a client without a key makes the server hold its bodies (up to
// limits.max_request_bytes each) until the handler refuses them. The transport's buffers are
// accounted in a grpc::ResourceQuota of kGrpcBufferRequests x limits.max_request_bytes (168 MiB
// by default): past it gRPC's chttp2 transport cancels streams ("Buffers full", the client sees
// RESOURCE_EXHAUSTED or UNAVAILABLE) instead of reading more, whoever sent them. What was read
// goes back to the system afterwards (Note [Heap trimming], base/heap_trim.h).
//
// Thread rules: construct, Shutdown and destroy from the main thread; SetServing from any.
// Errors: the constructor throws std::runtime_error naming server.grpc_address and the reason when
// it cannot bind, also when another process holds the address (SO_REUSEPORT is off, so a second
// server never shares a port with the first).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "server/config/config.h"
#include "server/core/metrics.h"

namespace vlmgraph::server {

class GrpcServer {
 public:
  // `metrics` (may be null) counts what Note [Malformed requests] refuses.
  GrpcServer(const ServerConfig& config, grpc::Service* service, Metrics* metrics = nullptr);
  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  // The bound port (resolves port 0) and the address with it: "127.0.0.1:50051", "[::1]:50051".
  int port() const { return port_; }
  std::string address() const;

  void SetServing(bool serving);

  // Note [gRPC listener]: `fn` runs once, on a gRPC thread, when a gRPC listener of this process
  // stopped accepting (at once if one already has). Process-wide: gRPC's log is.
  static void OnListenerFailed(std::function<void()> fn);
  static bool listener_failed();
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

// Note [gRPC buffers]: the gRPC transport's memory budget, in largest requests.
constexpr int64_t kGrpcBufferRequests = 2;

}  // namespace vlmgraph::server
