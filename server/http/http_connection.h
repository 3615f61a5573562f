// server/http/http_connection.h: internal to server/http (http_server.cc, http_connection.cc):
// the server's shared state (HttpServerImpl), the connection interface that HttpExchange calls
// (HttpConnectionBase), the start of one accepted connection, and the helpers both files use.
// Thread rules and errors: server/http/http_server.h.
#pragma once

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "server/http/http_server.h"

namespace vlmgraph::server {

namespace http_detail {

// Seconds on the steady clock (its epoch is arbitrary: only differences mean anything).
inline double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  }
  return true;
}

}  // namespace http_detail

// The connection as HttpExchange and HttpServerImpl see it (http_connection.cc: one per accepted
// socket, every handler on its strand).
class HttpConnectionBase : public std::enable_shared_from_this<HttpConnectionBase> {
 public:
  virtual ~HttpConnectionBase() = default;
  virtual void Post(std::function<void()> fn) = 0;
  virtual void DoRespond(HttpExchange* x, int status, std::string content_type, std::string body,
                         HttpHeaders headers) = 0;
  virtual void DoStartStream(HttpExchange* x, int status, std::string content_type,
                             HttpHeaders headers) = 0;
  virtual void DoWrite(HttpExchange* x, std::string data) = 0;
  virtual void DoEndStream(HttpExchange* x) = 0;
  virtual void DoClose() = 0;
  std::atomic<int64_t> pending_write_bytes{0};
  int64_t max_pending_write_bytes = 0;  // 0: no limit
  std::atomic<int> reported_status{0};
};

struct HttpServerImpl : std::enable_shared_from_this<HttpServerImpl> {
  HttpServerImpl(HttpServerOptions options_in, HttpHandlers handlers_in)
      : options(std::move(options_in)), handlers(std::move(handlers_in)), acceptor(ioc) {}

  void Accept();
  // Note [Body budget]: reserves `bytes` of max_body_bytes_in_flight; false when they do not
  // fit, else *token gives them back when its last copy is destroyed.
  bool ReserveBody(int64_t bytes, std::shared_ptr<void>* token);
  bool Register(const std::string& ip);  // false: over a limit
  void Unregister(const std::string& ip);
  void Track(const std::shared_ptr<HttpConnectionBase>& c);

  const HttpServerOptions options;
  const HttpHandlers handlers;
  boost::asio::io_context ioc;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work;
  std::unique_ptr<boost::asio::ssl::context> tls;
  boost::asio::ip::tcp::acceptor acceptor;
  int port = 0;
  std::vector<std::thread> threads;
  bool stopped = false;

  mutable std::mutex mu;
  std::map<std::string, int64_t> per_client;                   // mu
  std::vector<std::weak_ptr<HttpConnectionBase>> connections;  // mu
  int64_t open = 0;                                            // mu
  std::atomic<int64_t> refused{0};
  std::atomic<int64_t> timed_out{0};
  std::atomic<int64_t> body_bytes{0};  // reserved (Note [Body budget])
  std::atomic<int64_t> refused_bodies{0};
  std::atomic<int> running_threads{0};
};

// Serves one accepted socket (over TLS when server->tls is set) until it closes: tracked by the
// server (HttpServerImpl::Track) before its first read. On the accepting strand.
void StartHttpConnection(const std::shared_ptr<HttpServerImpl>& server,
                         boost::asio::ip::tcp::socket socket, std::string ip);

}  // namespace vlmgraph::server
