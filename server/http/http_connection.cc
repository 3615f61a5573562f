// server/http/http_connection.cc: one HTTP/1.1 connection (plain or TLS) of HttpServer, every
// handler on its strand: reads a request head and body within their deadlines, hands the request
// to the server's handlers as an HttpExchange, writes its answer or stream, keeps the connection
// alive or closes it. Internal to server/http; the rules it follows: server/http/http_server.h.
#include "server/http/http_connection.h"

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

namespace vlmgraph::server {
namespace {

namespace net = boost::asio;
namespace ssl = boost::asio::ssl;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using Strand = net::strand<net::io_context::executor_type>;
using http_detail::EqualsIgnoreCase;
using http_detail::MonotonicSeconds;

std::chrono::steady_clock::duration Duration(double seconds) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(std::max(0.0, seconds)));
}

tcp::socket& Lowest(tcp::socket& s) { return s; }
tcp::socket& Lowest(ssl::stream<tcp::socket>& s) { return s.next_layer(); }

}  // namespace

template <class Stream>
class HttpConnection final : public HttpConnectionBase {
 public:
  enum class Phase { kNone, kHandshake, kIdle, kHead, kBody, kWrite, kLinger };

  HttpConnection(std::shared_ptr<HttpServerImpl> server, Stream stream, std::string ip)
      : server_(std::move(server)),
        stream_(std::move(stream)),
        deadline_(Lowest(stream_).get_executor()),
        ip_(std::move(ip)) {
    max_pending_write_bytes = server_->options.max_pending_write_bytes;
  }

  void Start() {
    if constexpr (std::is_same_v<Stream, ssl::stream<tcp::socket>>) {
      SetDeadline(Phase::kHandshake, server_->options.request_head_timeout_seconds);
      stream_.async_handshake(ssl::stream_base::server, [self = Self()](beast::error_code ec) {
        if (ec) return self->Close();
        self->ReadNext();
      });
    } else {
      ReadNext();
    }
  }

  void Post(std::function<void()> fn) override {
    net::post(Lowest(stream_).get_executor(), std::move(fn));
  }

  void DoRespond(HttpExchange* x, int status, std::string content_type, std::string body,
                 HttpHeaders headers) override {
    if (!Current(x) || response_started_) return;
    response_started_ = true;
    reported_status = reported_status.load() != 0 ? reported_status.load() : status;
    auto res = WholeResponse(status, content_type, std::move(body), headers, keep_alive_);
    SetDeadline(Phase::kWrite, server_->options.write_timeout_seconds);
    http::async_write(stream_, *res, [self = Self(), res](beast::error_code ec, std::size_t) {
      self->CancelDeadline();
      if (ec) return self->Close();
      self->FinishExchange();
    });
  }

  void DoStartStream(HttpExchange* x, int status, std::string content_type,
                     HttpHeaders headers) override {
    if (!Current(x) || response_started_) return;
    response_started_ = true;
    streaming_ = true;
    if (reported_status.load() == 0) reported_status = status;
    auto res =
        std::make_shared<http::response<http::empty_body>>(static_cast<http::status>(status), 11);
    res->set(http::field::content_type, content_type);
    for (auto& [k, v] : headers) res->insert(k, v);
    res->keep_alive(keep_alive_);
    res->chunked(true);
    auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    writing_ = true;
    SetDeadline(Phase::kWrite, server_->options.write_timeout_seconds);
    http::async_write_header(stream_, *sr,
                             [self = Self(), res, sr](beast::error_code ec, std::size_t) {
                               self->writing_ = false;
                               self->CancelDeadline();
                               if (ec) return self->Close();
                               self->head_written_ = true;
                               self->Flush();
                             });
  }

  void DoWrite(HttpExchange* x, std::string data) override {
    if (!Current(x) || !streaming_ || end_requested_) {
      pending_write_bytes -= static_cast<int64_t>(data.size());
      return;
    }
    queue_.push_back(std::move(data));
    Flush();
  }

  void DoEndStream(HttpExchange* x) override {
    if (!Current(x) || !streaming_) return;
    end_requested_ = true;
    Flush();
  }

  void DoClose() override { Close(); }

 private:
  // A response with its whole body (Content-Length set), kept alive by the write that sends it.
  static std::shared_ptr<http::response<http::string_body>> WholeResponse(
      int status, const std::string& content_type, std::string body, const HttpHeaders& headers,
      bool keep_alive) {
    auto res =
        std::make_shared<http::response<http::string_body>>(static_cast<http::status>(status), 11);
    res->set(http::field::content_type, content_type);
    for (const auto& [k, v] : headers) res->insert(k, v);
    res->keep_alive(keep_alive);
    res->body() = std::move(body);
    res->prepare_payload();
    return res;
  }

  std::shared_ptr<HttpConnection> Self() {
    return std::static_pointer_cast<HttpConnection>(shared_from_this());
  }
  bool Current(HttpExchange* x) const { return !closed_ && exchange_ && exchange_.get() == x; }

  void SetDeadline(Phase phase, double seconds) {
    phase_ = phase;
    deadline_.expires_after(Duration(seconds));
    deadline_.async_wait([weak = std::weak_ptr<HttpConnectionBase>(shared_from_this()),
                          phase](beast::error_code ec) {
      if (ec) return;  // cancelled or re-armed
      if (auto self = weak.lock()) static_cast<HttpConnection*>(self.get())->OnDeadline(phase);
    });
  }
  void CancelDeadline() {
    phase_ = Phase::kNone;
    deadline_.cancel();
  }

  void OnDeadline(Phase phase) {
    if (closed_ || phase != phase_) return;
    ++server_->timed_out;
    if (phase == Phase::kHead || phase == Phase::kBody) {
      // The pending read completes with operation_aborted; its handler writes the 408.
      timed_out_ = true;
      beast::error_code ignored;
      Lowest(stream_).cancel(ignored);
      return;
    }
    Close();
  }

  // A new request: its first bytes may already be buffered (pipelining, or read while the last
  // response was pending).
  void ReadNext() {
    if (closed_) return;
    if (requests_ >= server_->options.max_requests_per_connection) return Close();
    parser_.emplace();
    parser_->header_limit(
        static_cast<std::uint32_t>(std::min<int64_t>(server_->options.max_head_bytes, UINT32_MAX)));
    // No limit while the head is read (Beast checks Content-Length against it as the head ends);
    // on_head's verdict sets it.
    parser_->body_limit((std::numeric_limits<std::uint64_t>::max)());
    timed_out_ = false;
    if (buffer_.size() > 0) return ReadHead();
    SetDeadline(Phase::kIdle, server_->options.idle_timeout_seconds);
    if (!reading_) ReadSome();
  }

  // Reads whatever arrives: the next request's first bytes, or the news that the client closed
  // (while a response is pending, this is how a vanished client is noticed).
  void ReadSome() {
    reading_ = true;
    stream_.async_read_some(
        buffer_.prepare(16 * 1024),
        [self = Self()](beast::error_code ec, std::size_t n) { self->OnReadSome(ec, n); });
  }

  void OnReadSome(beast::error_code ec, std::size_t n) {
    reading_ = false;
    if (ec) return Close();
    if (closing_) {
      buffer_.consume(buffer_.size());
      return Discard();
    }
    buffer_.commit(n);
    if (exchange_ || closed_) return;  // kept for the next request
    ReadHead();
  }

  void ReadHead() {
    started_ = MonotonicSeconds();
    SetDeadline(Phase::kHead, server_->options.request_head_timeout_seconds);
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = Self()](beast::error_code ec, std::size_t) { self->OnHead(ec); });
  }

  HttpRequest HeadOf() const {
    const auto& msg = parser_->get();
    HttpRequest r;
    r.method = std::string(msg.method_string());
    r.target = std::string(msg.target());
    r.path = r.target.substr(0, r.target.find('?'));
    for (const auto& field : msg) {
      r.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
    }
    if (auto length = parser_->content_length()) r.content_length = *length;
    r.remote_address = ip_;
    return r;
  }

  void OnHead(beast::error_code ec) {
    CancelDeadline();
    if (ec) {
      if (timed_out_) {
        return WriteErrorAndClose(408,
                                  "the request head (request line and headers) did not "
                                  "arrive within " +
                                      Seconds(server_->options.request_head_timeout_seconds) +
                                      " s of its first byte");
      }
      if (ec == http::error::header_limit) {
        const bool line = parser_->get().method_string().empty();
        return WriteErrorAndClose(line ? 414 : 431,
                                  std::string(line ? "the request line" : "the request head") +
                                      " is longer than " +
                                      std::to_string(server_->options.max_head_bytes) +
                                      " bytes; send a shorter URL and fewer or shorter headers");
      }
      if (ec == http::error::end_of_stream || ec == net::error::eof ||
          ec == net::error::operation_aborted || ec == net::error::connection_reset ||
          buffer_.size() == 0) {
        return Close();
      }
      return WriteErrorAndClose(400, "malformed HTTP request: " + ec.message());
    }
    head_ = HeadOf();
    ++requests_;
    keep_alive_ = parser_->keep_alive() && requests_ < server_->options.max_requests_per_connection;
    HeadVerdict verdict;
    head_seen_ = true;
    try {
      verdict = server_->handlers.on_head(head_);
    } catch (const std::exception& e) {
      LogError(std::string("HTTP: on_head threw: ") + e.what());
      verdict = HeadVerdict::Refuse(500, "text/plain", "internal error");
    }
    if (!verdict.accept) {
      return RefuseAndClose(verdict.status, std::move(verdict.content_type),
                            std::move(verdict.body), std::move(verdict.headers));
    }
    if (head_.content_length &&
        *head_.content_length > static_cast<uint64_t>(verdict.max_body_bytes)) {
      return WriteErrorAndClose(413, BodyTooLarge(verdict.max_body_bytes));
    }
    max_body_bytes_ = verdict.max_body_bytes;
    // Note [Body budget]: the body's bytes are reserved before one of them is read.
    const int64_t body_bytes = head_.content_length
                                   ? static_cast<int64_t>(*head_.content_length)
                                   : (parser_->chunked() ? verdict.max_body_bytes : 0);
    if (!server_->ReserveBody(body_bytes, &body_reservation_)) {
      ++server_->refused_bodies;
      const std::string message =
          "the server is reading as many request bytes as it allows at once "
          "(http.max_body_bytes_in_flight = " +
          std::to_string(server_->options.max_body_bytes_in_flight) + "; this body: " +
          std::to_string(body_bytes) + " bytes); retry in a moment";
      std::string content_type = "text/plain", body = message;
      if (server_->handlers.error_body) {
        try {
          std::tie(content_type, body) = server_->handlers.error_body(503, message);
        } catch (const std::exception&) {
        }
      }
      return RefuseAndClose(503, std::move(content_type), std::move(body), {{"Retry-After", "1"}});
    }
    parser_->body_limit(static_cast<std::uint64_t>(std::max<int64_t>(0, verdict.max_body_bytes)));
    if (parser_->is_done()) return OnBodyDone();
    SetDeadline(Phase::kBody, server_->options.request_body_timeout_seconds);
    if (EqualsIgnoreCase(head_.Header("Expect"), "100-continue")) {
      net::async_write(stream_, net::buffer(kContinue, sizeof(kContinue) - 1),
                       [self = Self()](beast::error_code ec, std::size_t) {
                         if (ec) return self->Close();
                         self->ReadBody();
                       });
      return;
    }
    ReadBody();
  }

  static constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";

  static std::string Seconds(double s) {
    std::string text = std::to_string(s);
    text.erase(text.find_last_not_of('0') + 1);
    if (!text.empty() && text.back() == '.') text.pop_back();
    return text;
  }
  static std::string BodyTooLarge(int64_t limit) {
    return "the request body is larger than " + std::to_string(limit) +
           " bytes, the largest this endpoint reads";
  }

  void ReadBody() {
    http::async_read(stream_, buffer_, *parser_,
                     [self = Self()](beast::error_code ec, std::size_t) { self->OnBody(ec); });
  }

  void OnBody(beast::error_code ec) {
    CancelDeadline();
    if (ec) {
      if (timed_out_) {
        return WriteErrorAndClose(408, "the request body did not arrive within " +
                                           Seconds(server_->options.request_body_timeout_seconds) +
                                           " s");
      }
      if (ec == http::error::body_limit) {
        return WriteErrorAndClose(413, BodyTooLarge(max_body_bytes_));
      }
      if (ec == http::error::end_of_stream || ec == net::error::eof ||
          ec == net::error::connection_reset || ec == net::error::operation_aborted) {
        Report(499);
        return Close();
      }
      return WriteErrorAndClose(400, "malformed HTTP request body: " + ec.message());
    }
    OnBodyDone();
  }

  void OnBodyDone() {
    head_.body = std::move(parser_->get().body());
    parser_.reset();
    response_started_ = streaming_ = head_written_ = end_requested_ = last_written_ = false;
    reported_status = 0;
    queue_.clear();
    exchange_ = std::make_shared<HttpExchange>(shared_from_this(), std::move(head_), started_,
                                               std::move(body_reservation_));
    head_ = HttpRequest{};
    try {
      server_->handlers.on_request(exchange_);
    } catch (const std::exception& e) {
      LogError(std::string("HTTP: on_request threw: ") + e.what());
      exchange_->Respond(500, "text/plain", "internal error");
    }
    if (!reading_ && buffer_.size() == 0 && !closed_) ReadSome();
  }

  void Flush() {
    if (closed_ || writing_ || !head_written_ || last_written_) return;
    if (queue_.empty()) {
      if (!end_requested_) return;
      last_written_ = true;
      writing_ = true;
      SetDeadline(Phase::kWrite, server_->options.write_timeout_seconds);
      net::async_write(stream_, http::make_chunk_last(),
                       [self = Self()](beast::error_code ec, std::size_t) {
                         self->writing_ = false;
                         self->CancelDeadline();
                         if (ec) return self->Close();
                         self->FinishExchange();
                       });
      return;
    }
    chunk_.clear();
    for (std::string& piece : queue_) chunk_ += piece;
    queue_.clear();
    const int64_t bytes = static_cast<int64_t>(chunk_.size());
    writing_ = true;
    SetDeadline(Phase::kWrite, server_->options.write_timeout_seconds);
    net::async_write(stream_, http::make_chunk(net::buffer(chunk_)),
                     [self = Self(), bytes](beast::error_code ec, std::size_t) {
                       self->writing_ = false;
                       self->pending_write_bytes -= bytes;
                       self->CancelDeadline();
                       if (ec) return self->Close();
                       self->Flush();
                     });
  }

  // on_complete, once for each request whose head on_head saw.
  void Report(int status) {
    if (reported_ || !head_seen_) return;
    reported_ = true;
    if (server_->handlers.on_complete) {
      const HttpRequest& r = exchange_ ? exchange_->request() : head_;
      try {
        server_->handlers.on_complete(r, status, MonotonicSeconds() - started_);
      } catch (const std::exception& e) {
        LogError(std::string("HTTP: on_complete threw: ") + e.what());
      }
    }
  }

  void FinishExchange() {
    Report(reported_status.load() != 0 ? reported_status.load() : 200);
    exchange_.reset();
    reported_ = head_seen_ = false;
    if (!keep_alive_) return LingeringClose();
    ReadNext();
  }

  // An answer from the server itself (no handler saw the body): written with Connection: close.
  void WriteErrorAndClose(int status, const std::string& message) {
    std::string content_type = "text/plain", body = message;
    if (server_->handlers.error_body) {
      try {
        std::tie(content_type, body) = server_->handlers.error_body(status, message);
      } catch (const std::exception&) {
      }
    }
    RefuseAndClose(status, std::move(content_type), std::move(body), {});
  }

  void RefuseAndClose(int status, std::string content_type, std::string body, HttpHeaders headers) {
    Report(status);
    keep_alive_ = false;
    auto res = WholeResponse(status, content_type, std::move(body), headers, false);
    response_started_ = true;
    SetDeadline(Phase::kWrite, server_->options.write_timeout_seconds);
    http::async_write(stream_, *res, [self = Self(), res](beast::error_code ec, std::size_t) {
      self->CancelDeadline();
      if (ec) return self->Close();
      self->LingeringClose();
    });
  }

  // After a response with Connection: close: stop sending, then read and drop what the client
  // still sends for a short while, so the kernel does not answer its unread bytes with a reset
  // that would destroy the response before the client reads it (nginx's lingering_close).
  void LingeringClose() {
    if (closed_) return;
    closing_ = true;
    beast::error_code ignored;
    Lowest(stream_).shutdown(tcp::socket::shutdown_send, ignored);
    SetDeadline(Phase::kLinger, kLingerSeconds);
    if (!reading_) Discard();
  }
  static constexpr double kLingerSeconds = 2.0;

  void Discard() {
    reading_ = true;
    Lowest(stream_).async_read_some(net::buffer(discard_),
                                    [self = Self()](beast::error_code ec, std::size_t) {
                                      self->reading_ = false;
                                      if (ec || self->closed_) return self->Close();
                                      self->Discard();
                                    });
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    deadline_.cancel();
    beast::error_code ignored;
    Lowest(stream_).shutdown(tcp::socket::shutdown_both, ignored);
    Lowest(stream_).close(ignored);
    if (exchange_) {
      if (!reported_) Report(499);
      exchange_->MarkGone();
      exchange_.reset();
    }
    queue_.clear();
    server_->Unregister(ip_);
  }

  const std::shared_ptr<HttpServerImpl> server_;
  Stream stream_;
  net::steady_timer deadline_;
  const std::string ip_;
  Phase phase_ = Phase::kNone;
  beast::flat_buffer buffer_{1 << 20};
  std::optional<http::request_parser<http::string_body>> parser_;
  HttpRequest head_;
  std::shared_ptr<HttpExchange> exchange_;
  double started_ = 0;
  int64_t requests_ = 0;
  int64_t max_body_bytes_ = 0;
  std::shared_ptr<void> body_reservation_;  // the current body's share of the budget
  bool keep_alive_ = true;
  bool reading_ = false;
  bool timed_out_ = false;
  bool response_started_ = false, streaming_ = false, head_written_ = false;
  bool end_requested_ = false, last_written_ = false, writing_ = false;
  bool reported_ = false;
  bool head_seen_ = false;  // on_head saw the current request
  bool closing_ = false, closed_ = false;
  std::deque<std::string> queue_;
  std::string chunk_;
  std::array<char, 64 * 1024> discard_{};
};

void StartHttpConnection(const std::shared_ptr<HttpServerImpl>& server, tcp::socket socket,
                         std::string ip) {
  if (server->tls) {
    auto conn = std::make_shared<HttpConnection<ssl::stream<tcp::socket>>>(
        server, ssl::stream<tcp::socket>(std::move(socket), *server->tls), std::move(ip));
    server->Track(conn);
    conn->Start();
  } else {
    auto conn = std::make_shared<HttpConnection<tcp::socket>>(server, std::move(socket),
                                                              std::move(ip));
    server->Track(conn);
    conn->Start();
  }
}

}  // namespace vlmgraph::server
