#include "server/openai_http.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include "model/log.h"
#include "server/generation.h"
#include "server/openai_protocol.h"
#include "server/status.h"
#include "server/text_stream.h"

namespace vlmgraph::server {
namespace {

using namespace openai;  // NOLINT: this file is the protocol's HTTP side

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The request a worker thread is serving. cpp-httplib runs a request's pre-routing handler, its
// handler, its content provider (streams) and the logger on one worker thread, one request at a
// time, so the logger reads what the earlier stages left here.
struct WorkerRequest {
  Clock::time_point accepted{};  // pre-routing: the request line and headers are read
  int final_status = 0;          // a stream's outcome (0: the response's status)
};
thread_local WorkerRequest t_request;

// Routes, for the metric's endpoint label and for 405 (method) vs 404 (path).
struct Route {
  const char* path;
  const char* method;
};
constexpr Route kRoutes[] = {
    {"/health", "GET"},          {"/v1/models", "GET"}, {"/v1/chat/completions", "POST"},
    {"/v1/completions", "POST"}, {"/tokenize", "POST"}, {"/detokenize", "POST"},
};
constexpr const char* kModelPath = "/v1/models/{model}";

std::string EndpointLabel(const std::string& path) {
  for (const Route& r : kRoutes) {
    if (path == r.path) return r.path;
  }
  if (path.rfind("/v1/models/", 0) == 0) return kModelPath;
  return "other";  // bounded label values: unknown paths share one
}

const Route* FindRoute(const std::string& path) {
  for (const Route& r : kRoutes) {
    if (path == r.path) return &r;
  }
  return nullptr;
}

// "host:port" -> (host for bind, port); "[::1]:80" -> ("::1", 80).
std::pair<std::string, int> SplitAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? "" : address.substr(0, colon);
  const std::string port_text = colon == std::string::npos ? address : address.substr(colon + 1);
  if (host.empty()) host = "0.0.0.0";
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  try {
    return {host, std::stoi(port_text)};
  } catch (const std::exception&) {
    throw std::runtime_error("server.http_address: " + address + ": the port is not a number");
  }
}

// Counts requests in flight for Shutdown's drain; a stream's token lives until its last byte.
class InFlight {
 public:
  InFlight(std::mutex* mu, std::condition_variable* cv, int64_t* count)
      : mu_(mu), cv_(cv), count_(count) {
    std::lock_guard<std::mutex> lock(*mu_);
    ++*count_;
  }
  ~InFlight() {
    {
      std::lock_guard<std::mutex> lock(*mu_);
      --*count_;
    }
    cv_->notify_all();
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  std::mutex* mu_;
  std::condition_variable* cv_;
  int64_t* count_;
};

}  // namespace

int64_t MaxHttpBodyBytes(const ServerConfig::Limits& limits) {
  return (limits.max_request_bytes + 2) / 3 * 4;
}

struct OpenAiHttpServer::Impl {
  Impl(const ServerConfig& config, Scheduler* scheduler, Metrics* metrics, const TextModel* text,
       const ApiKeys* keys);

  // --- handlers (worker threads) ---
  using Body =
      std::function<void(const httplib::Request&, httplib::Response&, std::shared_ptr<InFlight>)>;
  httplib::Server::Handler Wrap(bool needs_auth, Body body);
  void CheckAuth(const httplib::Request& req) const;
  const TextModel& RequireText() const;
  void SendError(const httplib::Request& req, httplib::Response& res, const ErrorInfo& e) const;
  void Generate(const httplib::Request& req, httplib::Response& res, PreparedGeneration g,
                bool chat, std::shared_ptr<InFlight> in_flight);
  // Errors of a cancelled generation read as "shutting down" when Shutdown cancelled it.
  ErrorInfo ErrorOf(std::exception_ptr error) const;

  void HandleHealth(const httplib::Request& req, httplib::Response& res);
  void HandleChat(const httplib::Request& req, httplib::Response& res,
                  std::shared_ptr<InFlight> in_flight);
  void HandleCompletion(const httplib::Request& req, httplib::Response& res,
                        std::shared_ptr<InFlight> in_flight);

  const ServerConfig config;
  Scheduler* const scheduler;
  Metrics* const metrics;
  const TextModel* const text;
  const ApiKeys* const keys;  // may be null: no keys
  const RequestContext ctx;
  const int64_t created;  // Unix seconds: /v1/models' "created"

  std::atomic<bool> accepting{true};
  std::atomic<bool> cancel_all{false};
  std::mutex mu;
  std::condition_variable cv;
  int64_t in_flight = 0;  // mu
  Clock::time_point drain_start{};
  bool stopped = false;

  std::unique_ptr<httplib::Server> server;  // an httplib::SSLServer with tls.cert_file
  std::string host;                         // as configured, for address()
  int port = 0;
  std::thread thread;
};

OpenAiHttpServer::Impl::Impl(const ServerConfig& config_in, Scheduler* scheduler_in,
                             Metrics* metrics_in, const TextModel* text_in, const ApiKeys* keys_in)
    : config(config_in),
      scheduler(scheduler_in),
      metrics(metrics_in),
      text(text_in),
      keys(keys_in),
      ctx{config_in.served_model_name, config_in.limits},
      created(std::chrono::duration_cast<std::chrono::seconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count()) {}

httplib::Server::Handler OpenAiHttpServer::Impl::Wrap(bool needs_auth, Body body) {
  return [this, needs_auth, body = std::move(body)](const httplib::Request& req,
                                                    httplib::Response& res) {
    auto token = std::make_shared<InFlight>(&mu, &cv, &in_flight);
    try {
      if (!accepting.load()) {
        throw ServerError(grpc::StatusCode::UNAVAILABLE,
                          "the server is shutting down; retry on another replica");
      }
      if (needs_auth) CheckAuth(req);
      body(req, res, std::move(token));
    } catch (...) {
      SendError(req, res, ErrorOf(std::current_exception()));
    }
  };
}

void OpenAiHttpServer::Impl::CheckAuth(const httplib::Request& req) const {
  if (keys == nullptr || !keys->enabled()) return;
  try {
    keys->Authorize(req.get_header_value("Authorization"), Scope::kInference, req.path);
  } catch (const ServerError& refused) {
    ErrorInfo e;
    const bool forbidden = refused.code() == grpc::StatusCode::PERMISSION_DENIED;
    e.http_status = forbidden ? 403 : 401;
    e.type = forbidden ? "permission_error" : "authentication_error";
    e.code = forbidden ? "insufficient_scope" : "invalid_api_key";
    e.message = refused.what();
    throw ApiError(std::move(e));
  }
}

const TextModel& OpenAiHttpServer::Impl::RequireText() const {
  if (!text) {
    throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                      "this server has no tokenizer, so it cannot take text: model " +
                          config.model +
                          " has no tokenizer.json. Restart it with --tokenizer "
                          "<tokenizer.json> (config key `tokenizer`), or send token ids over gRPC");
  }
  return *text;
}

ErrorInfo OpenAiHttpServer::Impl::ErrorOf(std::exception_ptr error) const {
  ErrorInfo e = ErrorFromException(error);
  if (e.http_status == kClientClosedRequest && cancel_all.load()) {
    e = ErrorFromException(std::make_exception_ptr(ServerError(
        grpc::StatusCode::UNAVAILABLE,
        "the server shut down before the request finished (shutdown_timeout_seconds)")));
  }
  return e;
}

void OpenAiHttpServer::Impl::SendError(const httplib::Request& req, httplib::Response& res,
                                       const ErrorInfo& e) const {
  res.status = e.http_status;
  if (e.http_status == 401) res.set_header("WWW-Authenticate", "Bearer");
  res.set_content(Dump(ErrorJson(e)), "application/json");
  const bool server_fault = e.http_status >= 500 && e.http_status != 503;
  Log(server_fault ? LogLevel::kError : LogLevel::kDebug,
      "HTTP " + LogSafe(req.method, 16) + " " + LogSafe(req.path) + " from " + req.remote_addr +
          " -> " + std::to_string(e.http_status) + ": " + LogSafe(e.message, 512));
}

void OpenAiHttpServer::Impl::HandleHealth(const httplib::Request& req, httplib::Response& res) {
  if (accepting.load()) {
    res.status = 200;
    return;
  }
  SendError(req, res,
            ErrorOf(std::make_exception_ptr(
                ServerError(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"))));
}

void OpenAiHttpServer::Impl::HandleChat(const httplib::Request& req, httplib::Response& res,
                                        std::shared_ptr<InFlight> in_flight) {
  const ChatCompletionRequest request = ParseChatCompletionRequest(req.body, ctx);
  Engine& engine = scheduler->engine();
  PreparedGeneration g = PrepareChatCompletion(request, RequireText(), engine.model_config(),
                                               config.limits, engine.max_context());
  Generate(req, res, std::move(g), /*chat=*/true, std::move(in_flight));
}

void OpenAiHttpServer::Impl::HandleCompletion(const httplib::Request& req, httplib::Response& res,
                                              std::shared_ptr<InFlight> in_flight) {
  const CompletionRequest request = ParseCompletionRequest(req.body, ctx);
  Engine& engine = scheduler->engine();
  PreparedGeneration g =
      PrepareCompletion(request, RequireText(), config.limits, engine.max_context());
  Generate(req, res, std::move(g), /*chat=*/false, std::move(in_flight));
}

void OpenAiHttpServer::Impl::Generate(const httplib::Request& req, httplib::Response& res,
                                      PreparedGeneration g, bool chat,
                                      std::shared_ptr<InFlight> in_flight) {
  // The one validation (thread-safe): ids, image tokens vs tiles, context, sampling.
  ValidatedRequest request = scheduler->engine().Validate(std::move(g.request));
  const Clock::time_point accepted =
      t_request.accepted == Clock::time_point{} ? Clock::now() : t_request.accepted;
  if (LogEnabled(LogLevel::kDebug)) {
    const int64_t tiles = request->tiles.defined() ? request->tiles.size(0) : 0;
    LogDebug("HTTP " + req.path + " from " + req.remote_addr + ": " +
             std::to_string(g.prompt_tokens) + " prompt tokens, " + std::to_string(tiles) +
             " tiles, max_tokens " + std::to_string(request->sampling.max_new_tokens) +
             (g.stream ? ", stream" : ""));
  }
  const ResponseMeta meta = NewResponseMeta(chat ? "chatcmpl" : "cmpl", ctx.served_model_name);
  auto text_stream = std::make_shared<TextStream>(&RequireText().tokenizer(), g.stop_strings);
  const auto is_cancelled = [this] { return cancel_all.load(); };

  if (!g.stream) {
    std::string out;
    const GenerationOutcome o = RunGeneration(
        *scheduler, metrics, std::move(request), accepted, text_stream.get(),
        [&out](const GenerationDelta& d) {
          out += d.text;
          return true;
        },
        is_cancelled);
    const Usage usage{g.prompt_tokens, o.generated_tokens};
    const std::string reason = FinishReasonString(o.reason);
    res.status = 200;
    res.set_content(Dump(chat ? ChatCompletionJson(meta, out, reason, usage)
                              : CompletionJson(meta, out, reason, usage)),
                    "application/json");
    return;
  }

  // Streaming: the 200 goes out before the generation is queued, so refuse a full queue here
  // (the scheduler still has the last word; a request that loses that race gets an error event).
  const int64_t depth = scheduler->QueueDepth();
  if (depth >= config.batching.max_queue_size) {
    throw ServerError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      "request queue is full (" + std::to_string(depth) +
                          " waiting, batching.max_queue_size = " +
                          std::to_string(config.batching.max_queue_size) + "); retry later");
  }
  struct StreamState {
    PreparedGeneration g;
    std::optional<ValidatedRequest> request;
    std::shared_ptr<TextStream> text;
    std::shared_ptr<InFlight> in_flight;
  };
  auto state = std::make_shared<StreamState>(
      StreamState{std::move(g), std::move(request), std::move(text_stream), std::move(in_flight)});
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // proxies: pass events on at once
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, state, meta, chat, accepted, is_cancelled](size_t, httplib::DataSink& sink) {
        const bool usage_chunks = state->g.include_usage;
        bool client_gone = false;
        auto send = [&](const std::string& event) {
          if (!client_gone && !sink.write(event.data(), event.size())) client_gone = true;
          return !client_gone;
        };
        int status = 200;
        try {
          if (chat) {
            send(SseEvent(ChatCompletionChunkJson(meta, {{"role", "assistant"}, {"content", ""}},
                                                  "", usage_chunks)));
          }
          const GenerationOutcome o = RunGeneration(
              *scheduler, metrics, std::move(*state->request), accepted, state->text.get(),
              [&](const GenerationDelta& d) {
                if (d.text.empty()) return !client_gone;  // held back: nothing to send yet
                return send(SseEvent(
                    chat ? ChatCompletionChunkJson(meta, {{"content", d.text}}, "", usage_chunks)
                         : CompletionChunkJson(meta, d.text, "", usage_chunks)));
              },
              [&] { return client_gone || is_cancelled(); });
          const std::string reason = FinishReasonString(o.reason);
          send(SseEvent(chat ? ChatCompletionChunkJson(meta, json::object(), reason, usage_chunks)
                             : CompletionChunkJson(meta, "", reason, usage_chunks)));
          if (usage_chunks) {
            send(SseEvent(UsageChunkJson(meta, chat ? "chat.completion.chunk" : "text_completion",
                                         {state->g.prompt_tokens, o.generated_tokens})));
          }
          send(kSseDone);
          if (client_gone) status = kClientClosedRequest;
        } catch (...) {
          const ErrorInfo e = client_gone ? ErrorInfo{kClientClosedRequest, "", "client went away"}
                                          : ErrorOf(std::current_exception());
          status = e.http_status;
          if (status != kClientClosedRequest) {
            const bool server_fault = status >= 500 && status != 503;
            Log(server_fault ? LogLevel::kError : LogLevel::kDebug,
                "HTTP stream " + meta.id + " -> " + std::to_string(status) + ": " +
                    LogSafe(e.message, 512));
            send(SseEvent(ErrorJson(e)));
            send(kSseDone);
          }
        }
        t_request.final_status = client_gone ? kClientClosedRequest : status;
        if (client_gone) return false;  // close the connection
        sink.done();
        return true;
      });
}

OpenAiHttpServer::OpenAiHttpServer(const ServerConfig& config, Scheduler* scheduler,
                                   Metrics* metrics, const TextModel* text, const ApiKeys* keys)
    : impl_(std::make_unique<Impl>(config, scheduler, metrics, text, keys)) {
  Impl& m = *impl_;
  if (config.tls.cert_file.empty()) {
    m.server = std::make_unique<httplib::Server>();
  } else {
    auto tls = std::make_unique<httplib::SSLServer>(
        config.tls.cert_file.c_str(), config.tls.key_file.c_str(),
        config.tls.client_ca_file.empty() ? nullptr : config.tls.client_ca_file.c_str());
    if (!tls->is_valid()) {
      throw ServerConfigError("tls.cert_file", "the HTTP API cannot use " + config.tls.cert_file +
                                                   " / " + config.tls.key_file +
                                                   " (not a matching PEM certificate and key?)");
    }
    m.server = std::move(tls);
  }
  httplib::Server& s = *m.server;
  const std::vector<int64_t>& batches = scheduler->engine().options().buckets.batch_sizes;
  const int64_t max_batch = batches.empty() ? 1 : *std::max_element(batches.begin(), batches.end());
  const size_t workers =
      static_cast<size_t>(max_batch + config.batching.max_queue_size + kSpareHttpWorkers);
  s.new_task_queue = [workers] { return new httplib::ThreadPool(workers); };
  s.set_payload_max_length(static_cast<size_t>(MaxHttpBodyBytes(config.limits)));
  s.set_tcp_nodelay(true);  // each SSE event leaves at once
  s.set_keep_alive_max_count(100);

  s.set_pre_routing_handler([](const httplib::Request&, httplib::Response&) {
    t_request = WorkerRequest{Clock::now(), 0};
    return httplib::Server::HandlerResponse::Unhandled;
  });
  s.set_logger([&m](const httplib::Request& req, const httplib::Response& res) {
    const int status = t_request.final_status != 0 ? t_request.final_status : res.status;
    const double seconds =
        t_request.accepted == Clock::time_point{} ? 0.0 : SecondsSince(t_request.accepted);
    if (m.metrics) m.metrics->ObserveHttpRequest(EndpointLabel(req.path), status, seconds);
    t_request = WorkerRequest{};
  });
  // Responses cpp-httplib makes itself (unknown path or method, body too large, unreadable
  // request) get OpenAI's error body too; those from handlers already have one.
  s.set_error_handler(httplib::Server::HandlerWithResponse(
      [&m](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        ErrorInfo e{res.status, res.status >= 500 ? "server_error" : "invalid_request_error", "",
                    "", ""};
        if (res.status == 404) {
          if (const Route* r = FindRoute(req.path)) {
            e.http_status = 405;
            res.set_header("Allow", r->method);
            e.message =
                "method " + req.method + " is not allowed on " + req.path + "; use " + r->method;
          } else {
            e.message = "Invalid URL (" + req.method + " " + req.path +
                        "): this server serves /v1/chat/completions, /v1/completions, "
                        "/v1/models, /tokenize, /detokenize and /health";
          }
        } else if (res.status == 413) {
          e.message = "the request body is larger than " +
                      std::to_string(MaxHttpBodyBytes(m.config.limits)) +
                      " bytes (limits.max_request_bytes x 4/3 for base64 images); send fewer "
                      "or smaller images";
        } else {
          e.message = "HTTP " + std::to_string(res.status) + " for " + req.method + " " + req.path;
        }
        m.SendError(req, res, e);
        return httplib::Server::HandlerResponse::Handled;
      }));
  s.set_exception_handler(
      [&m](const httplib::Request& req, httplib::Response& res, std::exception_ptr error) {
        m.SendError(req, res, m.ErrorOf(error));
      });

  s.Get("/health",
        [&m](const httplib::Request& req, httplib::Response& res) { m.HandleHealth(req, res); });
  s.Get("/v1/models", m.Wrap(true, [&m](const httplib::Request&, httplib::Response& res,
                                        std::shared_ptr<InFlight>) {
    res.set_content(Dump(ModelListJson(m.ctx.served_model_name, m.created,
                                       m.scheduler->engine().max_context())),
                    "application/json");
  }));
  s.Get("/v1/models/(.+)", m.Wrap(true, [&m](const httplib::Request& req, httplib::Response& res,
                                             std::shared_ptr<InFlight>) {
    const std::string model = req.matches[1];
    if (model != m.ctx.served_model_name) {
      throw ApiError({404, "invalid_request_error",
                      "The model `" + model + "` does not exist. This server serves `" +
                          m.ctx.served_model_name + "`.",
                      "model", "model_not_found"});
    }
    res.set_content(Dump(ModelJson(model, m.created, m.scheduler->engine().max_context())),
                    "application/json");
  }));
  s.Post("/v1/chat/completions",
         m.Wrap(true, [&m](const httplib::Request& req, httplib::Response& res,
                           std::shared_ptr<InFlight> t) { m.HandleChat(req, res, std::move(t)); }));
  s.Post("/v1/completions", m.Wrap(true, [&m](const httplib::Request& req, httplib::Response& res,
                                              std::shared_ptr<InFlight> t) {
    m.HandleCompletion(req, res, std::move(t));
  }));
  s.Post("/tokenize", m.Wrap(true, [&m](const httplib::Request& req, httplib::Response& res,
                                        std::shared_ptr<InFlight>) {
    const TokenizeRequest request = ParseTokenizeRequest(req.body, m.ctx);
    Engine& engine = m.scheduler->engine();
    const std::vector<int64_t> ids =
        TokenizeIds(request, m.RequireText(), engine.model_config(), m.config.limits);
    res.set_content(Dump(TokenizeJson(ids, engine.max_context())), "application/json");
  }));
  s.Post("/detokenize", m.Wrap(true, [&m](const httplib::Request& req, httplib::Response& res,
                                          std::shared_ptr<InFlight>) {
    const DetokenizeRequest request = ParseDetokenizeRequest(req.body, m.ctx);
    res.set_content(Dump(DetokenizeJson(DetokenizeText(request, m.RequireText()))),
                    "application/json");
  }));

  // SO_REUSEADDR only: a second server on the same port must fail, not share it.
  s.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const std::string& address = config.server.http_address;
  const auto [bind_host, port] = SplitAddress(address);
  m.host = address.substr(0, address.rfind(':'));
  m.port =
      port == 0 ? s.bind_to_any_port(bind_host) : (s.bind_to_port(bind_host, port) ? port : -1);
  if (m.port <= 0) throw std::runtime_error("server.http_address: cannot listen on " + address);
  if (metrics) {
    std::vector<std::string> endpoints;
    for (const Route& r : kRoutes) endpoints.push_back(r.path);
    metrics->InitHttpEndpoints(endpoints);
  }
  m.thread = std::thread([&s] { s.listen_after_bind(); });
  // stop() before the listen loop has started would be lost; wait for it.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!s.is_running() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

OpenAiHttpServer::~OpenAiHttpServer() { Shutdown(0); }

int OpenAiHttpServer::port() const { return impl_->port; }

int64_t OpenAiHttpServer::in_flight() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->in_flight;
}

std::string OpenAiHttpServer::address() const {
  return impl_->host + ":" + std::to_string(impl_->port);
}

void OpenAiHttpServer::StopAccepting() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->accepting.load()) return;
  impl_->accepting = false;
  impl_->drain_start = Clock::now();
}

void OpenAiHttpServer::Shutdown(double timeout_seconds) {
  Impl& m = *impl_;
  if (m.stopped) return;
  StopAccepting();
  {
    std::unique_lock<std::mutex> lock(m.mu);
    const auto deadline =
        m.drain_start + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(std::max(0.0, timeout_seconds)));
    m.cv.wait_until(lock, deadline, [&m] { return m.in_flight == 0; });
    if (m.in_flight > 0) {
      LogInfo("HTTP: cancelling " + std::to_string(m.in_flight) +
              " requests still running at the shutdown timeout");
    }
  }
  m.cancel_all = true;  // running generations end within kGenerationPollInterval
  m.server->stop();
  if (m.thread.joinable()) m.thread.join();  // after every worker has finished
  m.stopped = true;
}

}  // namespace vlmgraph::server
