// server/http/http_server.h: an event-driven HTTP/1.1 server (Boost.Beast on Boost.Asio, Debian's
// libboost-dev) for the OpenAI-compatible API (server/openai/openai_http.h). A few I/O threads
// serve every connection; no thread waits on a client, so idle, slow and streaming clients cost
// memory, not threads.
//
//   HttpServerOptions options;  options.address = ListenAddress::Parse("127.0.0.1:8000");
//   HttpHandlers handlers;
//   handlers.on_head = [](const HttpRequest& head) { return HeadVerdict::Accept(1 << 20); };
//   handlers.on_request = [](std::shared_ptr<HttpExchange> x) {      // on an I/O thread: post
//     pool.Post([x] { x->Respond(200, "application/json", "{}"); }); // heavy work elsewhere
//   };
//   HttpServer server(options, handlers);   // listening; server.port() resolves port 0
//   ...
//   server.Stop();                          // closes every connection, joins the I/O threads
//
// Note [Request deadlines] (what slowloris-style clients meet; nginx's client_header_timeout,
// client_body_timeout, keepalive_timeout and send_timeout are the same four):
//   - idle_timeout_seconds: a connection with no request in progress (before its first request
//     and between keep-alive requests) is closed when no byte arrives for this long;
//   - request_head_timeout_seconds: from the first byte of a request to the end of its head
//     (request line and headers), whatever the pace of the bytes: a client that sends one byte a
//     second is closed when the deadline passes (408 is written, then the connection closed);
//   - request_body_timeout_seconds: the whole body, likewise (408);
//   - write_timeout_seconds: each write of a response (a whole response, a stream's head, a stream
//     chunk) must complete in this long, else the connection is closed (a client that stops
//     reading a stream);
// and the limits:
//   - max_connections in all and max_connections_per_client per remote IP address (0: no limit;
//     behind a proxy every client has the proxy's address): over them a new connection gets 503
//     with Connection: close and is closed at once (nginx's limit_conn);
//   - max_head_bytes: a longer request line answers 414, longer headers 431;
//   - the body: HeadVerdict::max_body_bytes, checked against Content-Length before one byte of the
//     body is read (413), and again while a chunked body arrives;
//   - max_body_bytes_in_flight, Note [Body budget]: the bodies of all connections together. Each
//     accepted head reserves its Content-Length (a chunked body: the endpoint's max_body_bytes)
//     before one byte of its body is read, until its exchange is done; a head that does not fit
//     gets 503 with Retry-After: 1 and Connection: close (its body is never read). Without it,
//     clients with a key could make the server hold N x the per-request limit in bodies that
//     trickle in;
//   - max_pending_write_bytes: a streaming response whose client reads slower than it is written
//     and falls this far behind is closed (the exchange reports the client gone).
//
// Flow of one request (all on the connection's strand): read the head -> handlers.on_head decides
// from the head alone (authentication, route, Content-Type, Content-Length: nothing of the body is
// read before it says yes) -> `Expect: 100-continue` is answered -> the body is read ->
// handlers.on_request gets an HttpExchange -> the exchange responds (whole, or as a chunked
// stream) from any thread -> handlers.on_complete gets the final status -> the next keep-alive
// request. While the response is pending the connection keeps reading, so a client that closes
// its connection is noticed at once (HttpExchange::OnClientGone), streaming or not.
//
// Thread rules: construct and Stop from one thread; handlers run on the I/O threads and must not
// block (hand blocking work to another thread); HttpExchange's methods are safe from any thread.
// Errors: the constructor throws std::runtime_error naming `options.address` when it cannot
// listen, and ServerConfigError (tls.cert_file) when the TLS files do not load.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "server/config/listen_address.h"

namespace vlmgraph::server {

struct HttpServerOptions {
  // 127.0.0.1:8000, [::1]:8000, [::]:8000 (every address, IPv4 too); port 0: any free port.
  // A host name binds its first resolved address; localhost binds 127.0.0.1.
  ListenAddress address;
  int io_threads = 2;
  std::string thread_name = "vlmg-http-io";  // the I/O threads' name (base/thread_name.h)
  // TLS when tls_cert_file is set (PEM); tls_client_ca_file additionally requires client
  // certificates signed by that CA (mutual TLS).
  std::string tls_cert_file, tls_key_file, tls_client_ca_file;
  double idle_timeout_seconds = 60;
  double request_head_timeout_seconds = 10;
  double request_body_timeout_seconds = 60;
  double write_timeout_seconds = 30;
  int64_t max_connections = 16384;
  int64_t max_connections_per_client = 1024;  // 0: no limit
  int64_t max_body_bytes_in_flight = 0;       // 0: no limit (Note [Body budget])
  int64_t max_head_bytes = 64 * 1024;
  int64_t max_pending_write_bytes = 16 * 1024 * 1024;
  int64_t max_requests_per_connection = 10000;  // then Connection: close
};

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// A request as read: the head, and the body once on_request sees it.
struct HttpRequest {
  std::string method;                      // "GET", "POST", ...
  std::string target;                      // as sent: path and query
  std::string path;                        // target up to '?'
  HttpHeaders headers;                     // as sent, in order
  std::optional<uint64_t> content_length;  // nullopt: none (chunked or no body)
  std::string remote_address;              // the client's IP address
  std::string body;                        // empty in on_head

  // The first header of that name (case-insensitive), "" when absent.
  std::string Header(std::string_view name) const;
};

// What on_head decides.
struct HeadVerdict {
  bool accept = false;
  int64_t max_body_bytes = 0;  // accept: the largest body read (413 above it)
  // refuse: the response, sent with Connection: close (the body is never read).
  int status = 0;
  std::string content_type, body;
  HttpHeaders headers;

  static HeadVerdict Accept(int64_t max_body_bytes) {
    return {true, max_body_bytes, 0, "", "", {}};
  }
  static HeadVerdict Refuse(int status, std::string content_type, std::string body,
                            HttpHeaders headers = {}) {
    return {false, 0, status, std::move(content_type), std::move(body), std::move(headers)};
  }
};

class HttpConnectionBase;
struct HttpServerImpl;

// One request and its response. Respond once, or StartStream, Write..., EndStream. Every method is
// safe from any thread; once the client is gone they do nothing (Write returns false).
class HttpExchange : public std::enable_shared_from_this<HttpExchange> {
 public:
  const HttpRequest& request() const { return request_; }
  // Seconds since the first byte of the request arrived.
  double seconds() const;

  void Respond(int status, std::string content_type, std::string body, HttpHeaders headers = {});
  void StartStream(int status, std::string content_type, HttpHeaders headers = {});
  // Queues `data` as one chunk; false once the client is gone (or fell max_pending_write_bytes
  // behind, which closes the connection).
  bool Write(std::string data);
  void EndStream();
  // The status to report for this exchange in on_complete (e.g. an error inside a stream whose
  // 200 has gone out); default: the status sent.
  void SetReportedStatus(int status);

  bool client_gone() const;
  // `fn` runs once, on an I/O thread, when the connection closes before the response completes
  // (the client went away, a write timed out, the server stopped); at once if it already has.
  void OnClientGone(std::function<void()> fn);

  // Used by the connection (http_connection.cc). `body_reservation` holds the body's share of
  // max_body_bytes_in_flight until the exchange is destroyed (may be null).
  HttpExchange(std::shared_ptr<HttpConnectionBase> connection, HttpRequest request,
               double started_monotonic_seconds, std::shared_ptr<void> body_reservation = nullptr);
  ~HttpExchange();

 private:
  friend class HttpConnectionBase;
  struct HttpServerImpl;
  template <class Stream>
  friend class HttpConnection;
  void MarkGone();

  std::shared_ptr<HttpConnectionBase> connection_;
  const HttpRequest request_;
  const double started_;  // monotonic seconds
  const std::shared_ptr<void> body_reservation_;
  mutable std::mutex mu_;
  bool gone_ = false;
  std::vector<std::function<void()>> on_gone_;
};

struct HttpHandlers {
  // After the head, before the body. Required.
  std::function<HeadVerdict(const HttpRequest& head)> on_head;
  // After the body. Required. Must lead to a response on `exchange` (from any thread).
  std::function<void(std::shared_ptr<HttpExchange> exchange)> on_request;
  // Once per request that got a head, when its response is complete or the connection ended:
  // the status sent (or reported), 499 when the client went away first, 408 for a deadline;
  // `seconds` from the request's first byte. Optional.
  std::function<void(const HttpRequest& request, int status, double seconds)> on_complete;
  // The body of an error the server writes itself (400, 408, 413, 414, 431, 503): the status
  // and a message that says what to change -> (content type, body). Optional (plain text).
  std::function<std::pair<std::string, std::string>(int status, const std::string& message)>
      error_body;
};

// Counters, for metrics and tests.
struct HttpServerStats {
  int64_t open_connections = 0;
  int64_t refused_connections = 0;  // over max_connections or max_connections_per_client
  int64_t timed_out_requests = 0;   // idle, head, body or write deadline
  int64_t body_bytes_in_flight = 0;  // reserved by bodies being read or handled (Note [Body budget])
  int64_t refused_bodies = 0;        // heads refused because their body would not fit the budget
  int io_threads = 0;
};

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpHandlers handlers);
  ~HttpServer();  // Stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  HttpServerStats stats() const;
  // Stops accepting, closes every connection (exchanges report the client gone), joins the I/O
  // threads. Idempotent.
  void Stop();

 private:
  // Shared with every connection, so the I/O context outlives the last socket (an exchange may
  // be held after Stop).
  std::shared_ptr<HttpServerImpl> impl_;
};

}  // namespace vlmgraph::server
