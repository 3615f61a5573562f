// The event-driven HTTP front (server/http/http_server.h) against raw sockets: deadlines for slow
// clients, connection limits, decisions from the head before any body byte, client-gone
// detection, streams, pipelining, and a bounded number of threads for many connections.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/http/http_server.h"

namespace vlmgraph::server {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A blocking loopback client socket, optionally bound to another 127.0.0.0/8 source address.
class Client {
 public:
  explicit Client(int port, const char* source = nullptr) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (source) {
      sockaddr_in local{};
      local.sin_family = AF_INET;
      inet_pton(AF_INET, source, &local.sin_addr);
      ::bind(fd_, reinterpret_cast<sockaddr*>(&local), sizeof(local));
    }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~Client() { Close(); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  bool connected() const { return connected_; }
  bool Send(const std::string& data) {
    size_t sent = 0;
    while (sent < data.size()) {
      const ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }
  // Reads until `until` appears in what was read, the peer closes, or `timeout` passes.
  std::string ReadUntil(const std::string& until, milliseconds timeout = milliseconds(5000)) {
    const auto deadline = Clock::now() + timeout;
    while (buffer_.find(until) == std::string::npos) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) break;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) break;
      char chunk[4096];
      const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      buffer_.append(chunk, static_cast<size_t>(n));
    }
    return buffer_;
  }
  // True when the peer closed within `timeout` (what arrived before is kept).
  bool WaitClosed(milliseconds timeout) {
    ReadUntil(std::string(1, '\0') + "never", timeout);
    return closed_;
  }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  std::string& buffer() { return buffer_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
  std::string buffer_;
};

int ProcessThreads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

std::string Get(const std::string& path, const std::string& extra = "") {
  return "GET " + path + " HTTP/1.1\r\nHost: t\r\n" + extra + "\r\n";
}

// A front with a /ok route, a /slow route (answers after `slow_ms`), a /stream route, a /held
// route that answers only when told, a /secret route that needs `Authorization: Bearer k`, and
// bodies up to 1 KiB on POST /echo.
struct Fixture {
  explicit Fixture(HttpServerOptions o = Options()) {
    HttpHandlers h;
    h.on_head = [this](const HttpRequest& head) {
      ++heads;
      if (head.path == "/secret" && head.Header("authorization") != "Bearer k") {
        return HeadVerdict::Refuse(401, "text/plain", "no key");
      }
      return HeadVerdict::Accept(head.method == "POST" ? 1024 : 0);
    };
    h.on_request = [this](std::shared_ptr<HttpExchange> x) {
      ++bodies;
      const std::string path = x->request().path;
      if (path == "/stream") {
        x->StartStream(200, "text/event-stream");
        std::lock_guard<std::mutex> lock(mu);
        writers.emplace_back([x] {
          for (int i = 0; i < 3; ++i) x->Write("data: " + std::to_string(i) + "\n\n");
          x->EndStream();
        });
      } else if (path == "/held") {
        std::lock_guard<std::mutex> lock(mu);
        held = x;
        x->OnClientGone([this] { ++gone; });
      } else if (path == "/echo") {
        x->Respond(200, "text/plain", x->request().body);
      } else {
        x->Respond(200, "text/plain", "ok " + path);
      }
    };
    h.on_complete = [this](const HttpRequest&, int status, double) {
      std::lock_guard<std::mutex> lock(mu);
      statuses.push_back(status);
    };
    server = std::make_unique<HttpServer>(o, h);
  }
  static HttpServerOptions Options() {
    HttpServerOptions o;
    o.address = ListenAddress::Parse("127.0.0.1:0");
    o.io_threads = 2;
    o.request_head_timeout_seconds = 0.5;
    o.request_body_timeout_seconds = 0.5;
    o.idle_timeout_seconds = 1.0;
    return o;
  }
  ~Fixture() {
    for (std::thread& t : writers) t.join();
    held.reset();
    server.reset();
  }
  int port() const { return server->port(); }

  std::atomic<int> heads{0}, bodies{0}, gone{0};
  std::mutex mu;
  std::shared_ptr<HttpExchange> held;
  std::vector<int> statuses;
  std::vector<std::thread> writers;
  std::unique_ptr<HttpServer> server;
};

TEST(HttpServer, AnswersAndKeepsTheConnectionAlive) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send(Get("/a")));
  EXPECT_NE(c.ReadUntil("ok /a").find("HTTP/1.1 200"), std::string::npos);
  c.buffer().clear();
  ASSERT_TRUE(c.Send(Get("/b")));
  EXPECT_NE(c.ReadUntil("ok /b").find("ok /b"), std::string::npos);
}

TEST(HttpServer, PipelinedRequestsAreAnsweredInOrder) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(c.Send(Get("/one") + Get("/two") + Get("/three")));
  const std::string got = c.ReadUntil("ok /three");
  const size_t one = got.find("ok /one"), two = got.find("ok /two"), three = got.find("ok /three");
  ASSERT_NE(three, std::string::npos) << got;
  EXPECT_LT(one, two);
  EXPECT_LT(two, three);
}

TEST(HttpServer, ASlowHeadIsCutAtItsDeadlineWhileOthersAreServed) {
  Fixture f;
  Client slow(f.port());
  const std::string head = Get("/slow-client");
  const auto t0 = Clock::now();
  bool closed = false;
  // One byte every 50 ms: without a deadline for the whole head this would take 1.5 s.
  for (size_t i = 0; i < head.size() && !closed; ++i) {
    if (!slow.Send(head.substr(i, 1))) closed = true;
    Client other(f.port());
    ASSERT_TRUE(other.Send(Get("/quick")));
    EXPECT_NE(other.ReadUntil("ok /quick", milliseconds(1000)).find("ok /quick"),
              std::string::npos);
    std::this_thread::sleep_for(milliseconds(50));
    if (std::chrono::duration<double>(Clock::now() - t0).count() > 0.9) break;
  }
  const std::string got = slow.ReadUntil("\r\n\r\n", milliseconds(2000));
  EXPECT_NE(got.find("HTTP/1.1 408"), std::string::npos) << got;
  // Closed after a short lingering close (the server drops what still arrives for 2 s).
  EXPECT_TRUE(slow.WaitClosed(milliseconds(4000)));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 4.5);
  EXPECT_GE(f.server->stats().timed_out_requests, 1);
}

TEST(HttpServer, ASlowBodyIsCutAtItsDeadline) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nabc"));
  const std::string got = c.ReadUntil("\r\n\r\n", milliseconds(3000));
  EXPECT_NE(got.find("HTTP/1.1 408"), std::string::npos) << got;
  EXPECT_EQ(f.bodies.load(), 0);
}

TEST(HttpServer, AnIdleConnectionIsClosed) {
  Fixture f;
  Client c(f.port());
  const auto t0 = Clock::now();
  EXPECT_TRUE(c.WaitClosed(milliseconds(4000)));
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GT(waited, 0.8);
  EXPECT_LT(waited, 3.0);
}

TEST(HttpServer, TheHeadDecidesBeforeAnyBodyByteIsRead) {
  Fixture f;
  // A 200 MB body announced without a key: refused from the head, nothing of the body needed.
  Client c(f.port());
  ASSERT_TRUE(c.Send("POST /secret HTTP/1.1\r\nHost: t\r\nContent-Length: 200000000\r\n\r\n"));
  const std::string got = c.ReadUntil("no key", milliseconds(2000));
  EXPECT_NE(got.find("HTTP/1.1 401"), std::string::npos) << got;
  EXPECT_NE(got.find("Connection: close"), std::string::npos) << got;
  // Over the endpoint's body limit by Content-Length: 413 before reading.
  Client big(f.port());
  ASSERT_TRUE(big.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n"));
  EXPECT_NE(big.ReadUntil("\r\n\r\n", milliseconds(2000)).find("HTTP/1.1 413"), std::string::npos);
  EXPECT_EQ(f.bodies.load(), 0);
  // A chunked body that grows past the limit: 413 as it arrives.
  Client chunked(f.port());
  ASSERT_TRUE(chunked.Send("POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" +
                           std::string("800\r\n") + std::string(0x800, 'x') + "\r\n"));
  EXPECT_NE(chunked.ReadUntil("\r\n\r\n", milliseconds(2000)).find("HTTP/1.1 413"),
            std::string::npos);
  EXPECT_EQ(f.bodies.load(), 0);
}

// Note [Body budget]: bodies of every connection together stay within max_body_bytes_in_flight.
// Each accepted head reserves its Content-Length (a chunked body: the endpoint's 1 KiB) before a
// byte of it is read, until its exchange is done; a head that does not fit gets 503 with
// Retry-After and its body is never read. The budget comes back when the exchange ends.
TEST(HttpServer, BodiesOfAllConnectionsShareOneBudget) {
  HttpServerOptions o = Fixture::Options();
  o.request_body_timeout_seconds = 5;
  o.max_body_bytes_in_flight = 1500;
  Fixture f(o);
  // Two slow bodies of 700 bytes each (the head and 10 bytes sent): 1400 reserved.
  Client a(f.port()), b(f.port());
  ASSERT_TRUE(a.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 700\r\n\r\n" +
                     std::string(10, 'a')));
  ASSERT_TRUE(b.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 700\r\n\r\n" +
                     std::string(10, 'b')));
  for (int i = 0; i < 400 && f.server->stats().body_bytes_in_flight < 1400; ++i)
    std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(f.server->stats().body_bytes_in_flight, 1400);
  // A third body of 200 bytes does not fit, nor a chunked one (it reserves the endpoint's 1 KiB):
  // 503, Retry-After, the connection closed; no handler saw them.
  Client c(f.port());
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 200\r\n\r\n"));
  std::string got = c.ReadUntil("bytes", milliseconds(2000));
  EXPECT_NE(got.find("HTTP/1.1 503"), std::string::npos) << got;
  EXPECT_NE(got.find("Retry-After: 1"), std::string::npos) << got;
  EXPECT_NE(got.find("http.max_body_bytes_in_flight = 1500; this body: 200 bytes"),
            std::string::npos)
      << got;
  EXPECT_TRUE(c.WaitClosed(milliseconds(3000)));
  Client chunked(f.port());
  ASSERT_TRUE(chunked.Send("POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"));
  EXPECT_NE(chunked.ReadUntil("\r\n\r\n", milliseconds(2000)).find("HTTP/1.1 503"),
            std::string::npos);
  // A GET has no body and passes.
  Client get(f.port());
  ASSERT_TRUE(get.Send(Get("/ok")));
  EXPECT_NE(get.ReadUntil("ok /ok").find("200 OK"), std::string::npos);
  EXPECT_EQ(f.server->stats().refused_bodies, 2);
  EXPECT_EQ(f.bodies.load(), 1);  // the GET
  // The first body completes and is answered: its 700 bytes come back to the budget, and a body
  // of 200 bytes fits now.
  ASSERT_TRUE(a.Send(std::string(690, 'a')));
  EXPECT_NE(a.ReadUntil(std::string(700, 'a'), milliseconds(3000)).find("200 OK"),
            std::string::npos);
  for (int i = 0; i < 400 && f.server->stats().body_bytes_in_flight > 700; ++i)
    std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(f.server->stats().body_bytes_in_flight, 700);
  Client d(f.port());
  ASSERT_TRUE(d.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 200\r\n\r\n" +
                     std::string(200, 'd')));
  EXPECT_NE(d.ReadUntil(std::string(200, 'd'), milliseconds(3000)).find("200 OK"),
            std::string::npos);
  b.Close();
  for (int i = 0; i < 400 && f.server->stats().body_bytes_in_flight > 0; ++i)
    std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(f.server->stats().body_bytes_in_flight, 0);  // a client gone mid-body gives it back
}

TEST(HttpServer, ExpectContinueIsAnsweredAfterTheHeadIsAccepted) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(
      c.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"));
  EXPECT_NE(c.ReadUntil("100 Continue\r\n\r\n").find("HTTP/1.1 100 Continue"), std::string::npos);
  ASSERT_TRUE(c.Send("hello"));
  EXPECT_NE(c.ReadUntil("hello").find("200 OK"), std::string::npos);
}

TEST(HttpServer, LongRequestLinesAndHeadsAreRefused) {
  HttpServerOptions o = Fixture::Options();
  o.max_head_bytes = 1024;
  Fixture f(o);
  Client line(f.port());
  ASSERT_TRUE(line.Send("GET /" + std::string(2000, 'a') + " HTTP/1.1\r\nHost: t\r\n\r\n"));
  EXPECT_NE(line.ReadUntil("\r\n\r\n").find("HTTP/1.1 414"), std::string::npos);
  Client head(f.port());
  ASSERT_TRUE(head.Send("GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + std::string(2000, 'b') + "\r\n\r\n"));
  EXPECT_NE(head.ReadUntil("\r\n\r\n").find("HTTP/1.1 431"), std::string::npos);
  Client bad(f.port());
  ASSERT_TRUE(bad.Send("NOT HTTP AT ALL\r\n\r\n"));
  EXPECT_NE(bad.ReadUntil("\r\n\r\n").find("HTTP/1.1 400"), std::string::npos);
}

TEST(HttpServer, ConnectionsPerClientAreLimited) {
  HttpServerOptions o = Fixture::Options();
  o.max_connections_per_client = 3;
  o.idle_timeout_seconds = 10;
  Fixture f(o);
  std::vector<std::unique_ptr<Client>> mine;
  for (int i = 0; i < 3; ++i) {
    mine.push_back(std::make_unique<Client>(f.port(), "127.0.0.2"));
    ASSERT_TRUE(mine.back()->Send(Get("/x")));
    ASSERT_NE(mine.back()->ReadUntil("ok /x").find("200"), std::string::npos);
  }
  Client fourth(f.port(), "127.0.0.2");
  EXPECT_NE(fourth.ReadUntil("retry later", milliseconds(2000)).find("HTTP/1.1 503"),
            std::string::npos);
  EXPECT_GE(f.server->stats().refused_connections, 1);
  // Another client address is unaffected.
  Client other(f.port(), "127.0.0.3");
  ASSERT_TRUE(other.Send(Get("/y")));
  EXPECT_NE(other.ReadUntil("ok /y").find("200"), std::string::npos);
  // A closed connection frees its place.
  mine.front()->Close();
  std::this_thread::sleep_for(milliseconds(200));
  Client again(f.port(), "127.0.0.2");
  ASSERT_TRUE(again.Send(Get("/z")));
  EXPECT_NE(again.ReadUntil("ok /z").find("200"), std::string::npos);
}

TEST(HttpServer, AClientThatClosesIsNoticedWhileItsResponseIsPending) {
  Fixture f;
  {
    Client c(f.port());
    ASSERT_TRUE(c.Send(Get("/held")));
    for (int i = 0; i < 200 && !f.held; ++i) {
      std::this_thread::sleep_for(milliseconds(5));
      std::lock_guard<std::mutex> lock(f.mu);
      if (f.held) break;
    }
  }  // closed here, with no response
  for (int i = 0; i < 400 && f.gone.load() == 0; ++i) std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(f.gone.load(), 1);
  std::lock_guard<std::mutex> lock(f.mu);
  ASSERT_TRUE(f.held);
  EXPECT_TRUE(f.held->client_gone());
  EXPECT_FALSE(f.held->Write("late"));
  ASSERT_FALSE(f.statuses.empty());
  EXPECT_EQ(f.statuses.back(), 499);
}

TEST(HttpServer, StreamsAreChunked) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(c.Send(Get("/stream")));
  const std::string got = c.ReadUntil("0\r\n\r\n");
  EXPECT_NE(got.find("Transfer-Encoding: chunked"), std::string::npos) << got;
  const size_t d0 = got.find("data: 0"), d2 = got.find("data: 2");
  ASSERT_NE(d2, std::string::npos) << got;
  EXPECT_LT(d0, d2);
  // The connection serves the next request after the stream.
  c.buffer().clear();
  ASSERT_TRUE(c.Send(Get("/after")));
  EXPECT_NE(c.ReadUntil("ok /after").find("ok /after"), std::string::npos);
}

TEST(HttpServer, ThousandsOfIdleConnectionsNeedNoThreads) {
  HttpServerOptions o = Fixture::Options();
  o.idle_timeout_seconds = 30;
  o.request_head_timeout_seconds = 30;
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  if (files.rlim_cur < 4096 && files.rlim_max >= 4096) {
    files.rlim_cur = 4096;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  getrlimit(RLIMIT_NOFILE, &files);
  if (files.rlim_cur < 2200) GTEST_SKIP() << "needs 2,200 file descriptors, have " << files.rlim_cur;
  Fixture f(o);
  const int threads_before = ProcessThreads();
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < 1000; ++i) {
    clients.push_back(std::make_unique<Client>(f.port()));
    // Half of them start a request and stop mid-head.
    if (i % 2 == 0) clients.back()->Send("GET /partial HTTP/1.1\r\nHo");
  }
  for (int i = 0; i < 200 && f.server->stats().open_connections < 1000; ++i)
    std::this_thread::sleep_for(milliseconds(10));
  EXPECT_EQ(f.server->stats().open_connections, 1000);
  EXPECT_EQ(ProcessThreads(), threads_before);
  const auto t0 = Clock::now();
  Client probe(f.port());
  ASSERT_TRUE(probe.Send(Get("/probe")));
  EXPECT_NE(probe.ReadUntil("ok /probe").find("ok /probe"), std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
}

TEST(HttpServer, StopClosesEverythingAndReportsPendingExchangesGone) {
  Fixture f;
  Client c(f.port());
  ASSERT_TRUE(c.Send(Get("/held")));
  for (int i = 0; i < 400; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
    std::lock_guard<std::mutex> lock(f.mu);
    if (f.held) break;
  }
  f.server->Stop();
  EXPECT_EQ(f.gone.load(), 1);
  EXPECT_TRUE(c.WaitClosed(milliseconds(2000)));
  std::lock_guard<std::mutex> lock(f.mu);
  f.held.reset();
}

}  // namespace
}  // namespace vlmgraph::server
