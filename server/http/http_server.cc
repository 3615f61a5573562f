#include "server/http/http_server.h"

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <chrono>
#include <deque>
#include <limits>
#include <map>
#include <stdexcept>
#include <thread>

#include "base/log.h"
#include "base/thread_name.h"
#include "server/config/config.h"
#include "server/http/http_connection.h"

namespace vlmgraph::server {
namespace {

namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
namespace beast = boost::beast;
using tcp = net::ip::tcp;
using http_detail::EqualsIgnoreCase;
using http_detail::MonotonicSeconds;

// The canned answer to a connection over the limits, written without waiting (a new socket's
// send buffer is empty).
constexpr char kTooManyConnections[] =
    "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 60\r\n"
    "Connection: close\r\nRetry-After: 1\r\n\r\n"
    "too many connections from this client or in all; retry later";
static_assert(sizeof("too many connections from this client or in all; retry later") - 1 == 60);

}  // namespace

std::string HttpRequest::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (EqualsIgnoreCase(k, name)) return v;
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// HttpExchange

HttpExchange::HttpExchange(std::shared_ptr<HttpConnectionBase> connection, HttpRequest request,
                           double started_monotonic_seconds, std::shared_ptr<void> body_reservation)
    : connection_(std::move(connection)),
      request_(std::move(request)),
      started_(started_monotonic_seconds),
      body_reservation_(std::move(body_reservation)) {}

HttpExchange::~HttpExchange() = default;

double HttpExchange::seconds() const { return MonotonicSeconds() - started_; }

void HttpExchange::Respond(int status, std::string content_type, std::string body,
                           HttpHeaders headers) {
  auto c = connection_;
  c->Post([c, x = shared_from_this(), status, ct = std::move(content_type), b = std::move(body),
           h = std::move(headers)]() mutable {
    c->DoRespond(x.get(), status, std::move(ct), std::move(b), std::move(h));
  });
}

void HttpExchange::StartStream(int status, std::string content_type, HttpHeaders headers) {
  auto c = connection_;
  c->Post([c, x = shared_from_this(), status, ct = std::move(content_type),
           h = std::move(headers)]() mutable {
    c->DoStartStream(x.get(), status, std::move(ct), std::move(h));
  });
}

bool HttpExchange::Write(std::string data) {
  if (client_gone()) return false;
  const int64_t bytes = static_cast<int64_t>(data.size());
  auto c = connection_;
  const int64_t pending = c->pending_write_bytes += bytes;
  if (c->max_pending_write_bytes > 0 && pending > c->max_pending_write_bytes) {
    // The client reads slower than the stream is written: close rather than buffer without end.
    c->pending_write_bytes -= bytes;
    c->Post([c] { c->DoClose(); });
    return false;
  }
  c->Post([c, x = shared_from_this(), d = std::move(data)]() mutable {
    c->DoWrite(x.get(), std::move(d));
  });
  return true;
}

void HttpExchange::EndStream() {
  auto c = connection_;
  c->Post([c, x = shared_from_this()] { c->DoEndStream(x.get()); });
}

void HttpExchange::SetReportedStatus(int status) { connection_->reported_status = status; }

bool HttpExchange::client_gone() const {
  std::lock_guard<std::mutex> lock(mu_);
  return gone_;
}

void HttpExchange::OnClientGone(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!gone_) {
      on_gone_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

void HttpExchange::MarkGone() {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (gone_) return;
    gone_ = true;
    callbacks.swap(on_gone_);
  }
  for (auto& fn : callbacks) fn();
}

// ---------------------------------------------------------------------------------------------
// HttpServer

bool HttpServerImpl::ReserveBody(int64_t bytes, std::shared_ptr<void>* token) {
  token->reset();
  const int64_t limit = options.max_body_bytes_in_flight;
  if (bytes <= 0 || limit <= 0) return true;
  int64_t now = body_bytes.load();
  do {
    if (now + bytes > limit) return false;
  } while (!body_bytes.compare_exchange_weak(now, now + bytes));
  // A null pointer with a deleter: the deleter still runs when the last copy goes.
  *token = std::shared_ptr<void>(nullptr,
                                 [self = shared_from_this(), bytes](void*) { self->body_bytes -= bytes; });
  return true;
}

bool HttpServerImpl::Register(const std::string& ip) {
  std::lock_guard<std::mutex> lock(mu);
  if (options.max_connections > 0 && open >= options.max_connections) return false;
  int64_t& mine = per_client[ip];
  if (options.max_connections_per_client > 0 && mine >= options.max_connections_per_client) {
    if (mine == 0) per_client.erase(ip);
    return false;
  }
  ++mine;
  ++open;
  return true;
}

void HttpServerImpl::Unregister(const std::string& ip) {
  std::lock_guard<std::mutex> lock(mu);
  --open;
  auto it = per_client.find(ip);
  if (it != per_client.end() && --it->second <= 0) per_client.erase(it);
}

void HttpServerImpl::Track(const std::shared_ptr<HttpConnectionBase>& c) {
  std::lock_guard<std::mutex> lock(mu);
  if (connections.size() > 64 && connections.size() > 2 * static_cast<size_t>(open)) {
    connections.erase(std::remove_if(connections.begin(), connections.end(),
                                     [](const auto& w) { return w.expired(); }),
                      connections.end());
  }
  connections.push_back(c);
}

void HttpServerImpl::Accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) {
      beast::error_code ignored;
      const auto endpoint = socket.remote_endpoint(ignored);
      std::string ip = ignored ? std::string("unknown") : endpoint.address().to_string();
      if (!Register(ip)) {
        ++refused;
        socket.non_blocking(true, ignored);
        socket.write_some(net::buffer(kTooManyConnections, sizeof(kTooManyConnections) - 1),
                          ignored);
        socket.shutdown(tcp::socket::shutdown_both, ignored);
        socket.close(ignored);
      } else {
        socket.set_option(tcp::no_delay(true), ignored);  // each stream event leaves at once
        StartHttpConnection(shared_from_this(), std::move(socket), std::move(ip));
      }
    } else if (ec == net::error::no_descriptors) {
      LogWarn("HTTP: out of file descriptors; accepting again in 100 ms");
      auto timer = std::make_shared<net::steady_timer>(ioc, std::chrono::milliseconds(100));
      timer->async_wait([this, timer](beast::error_code) { Accept(); });
      return;
    }
    Accept();
  });
}

HttpServer::HttpServer(HttpServerOptions options, HttpHandlers handlers)
    : impl_(std::make_shared<HttpServerImpl>(std::move(options), std::move(handlers))) {
  HttpServerImpl& m = *impl_;
  const HttpServerOptions& o = m.options;
  if (!o.tls_cert_file.empty()) {
    m.tls = std::make_unique<ssl::context>(ssl::context::tls_server);
    m.tls->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                       ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 |
                       ssl::context::single_dh_use);
    try {
      m.tls->use_certificate_chain_file(o.tls_cert_file);
      m.tls->use_private_key_file(o.tls_key_file, ssl::context::pem);
      if (!o.tls_client_ca_file.empty()) {
        m.tls->load_verify_file(o.tls_client_ca_file);
        m.tls->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
      }
    } catch (const std::exception& e) {
      throw ServerConfigError("tls.cert_file", "the HTTP API cannot use " + o.tls_cert_file +
                                                   " / " + o.tls_key_file + ": " + e.what() +
                                                   " (not a matching PEM certificate and key?)");
    }
  }
  const std::string& host = o.address.host();
  const int port = o.address.port();
  const std::string address_text = o.address.ToString();
  if (o.address.empty()) throw std::runtime_error("no address to listen on");
  beast::error_code ec;
  net::ip::address bind_address;
  if (host == "localhost") {
    bind_address = net::ip::make_address("127.0.0.1");
  } else {
    bind_address = net::ip::make_address(host, ec);
    if (ec) {
      tcp::resolver resolver(m.ioc);
      auto results = resolver.resolve(host, std::to_string(port), ec);
      if (ec || results.empty()) {
        throw std::runtime_error(address_text + ": cannot resolve host " + host);
      }
      bind_address = results.begin()->endpoint().address();
    }
  }
  const tcp::endpoint endpoint(bind_address, static_cast<unsigned short>(port));
  m.acceptor.open(endpoint.protocol(), ec);
  // [::] takes IPv4 clients too, as gRPC's does.
  if (!ec && bind_address.is_v6() && bind_address.is_unspecified())
    m.acceptor.set_option(net::ip::v6_only(false), ec);
  // SO_REUSEADDR only: a second server on the same port must fail, not share it.
  if (!ec) m.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) m.acceptor.bind(endpoint, ec);
  if (!ec) m.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error("cannot listen on " + address_text + ": " + ec.message());
  m.port = m.acceptor.local_endpoint().port();
  m.work.emplace(m.ioc.get_executor());
  m.Accept();
  const int threads = std::max(1, o.io_threads);
  for (int i = 0; i < threads; ++i) {
    ++m.running_threads;
    m.threads.emplace_back([&m, name = o.thread_name] {
      NameCurrentThread(name);
      while (true) {
        try {
          m.ioc.run();
          --m.running_threads;
          return;
        } catch (const std::exception& e) {
          LogError(std::string("HTTP: an I/O handler threw: ") + e.what());
        }
      }
    });
  }
}

HttpServer::~HttpServer() { Stop(); }

int HttpServer::port() const { return impl_->port; }

HttpServerStats HttpServer::stats() const {
  HttpServerStats s;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    s.open_connections = impl_->open;
  }
  s.refused_connections = impl_->refused.load();
  s.timed_out_requests = impl_->timed_out.load();
  s.body_bytes_in_flight = impl_->body_bytes.load();
  s.refused_bodies = impl_->refused_bodies.load();
  s.io_threads = static_cast<int>(impl_->threads.size());
  return s;
}

void HttpServer::Stop() {
  HttpServerImpl& m = *impl_;
  if (m.stopped) return;
  m.stopped = true;
  net::post(m.ioc, [&m] {
    beast::error_code ignored;
    m.acceptor.close(ignored);
  });
  // Close every connection (again for any accepted meanwhile) until none is open.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    std::vector<std::shared_ptr<HttpConnectionBase>> live;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      for (auto& w : m.connections) {
        if (auto c = w.lock()) live.push_back(std::move(c));
      }
      if (m.open <= 0) break;
    }
    for (auto& c : live) c->Post([c] { c->DoClose(); });
    live.clear();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } while (std::chrono::steady_clock::now() < give_up);
  // With the acceptor and every socket closed, the threads run out of work and return.
  m.work.reset();
  const auto grace = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (m.running_threads.load() > 0 && std::chrono::steady_clock::now() < grace) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  m.ioc.stop();
  for (auto& t : m.threads) t.join();
  std::lock_guard<std::mutex> lock(m.mu);
  m.connections.clear();
}

}  // namespace vlmgraph::server
