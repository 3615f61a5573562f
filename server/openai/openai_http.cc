#include "server/openai/openai_http.h"

#include <algorithm>
#include <atomic>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include "base/log.h"
#include "base/thread_name.h"
#include "server/core/generation.h"
#include "server/core/status.h"
#include "server/core/text_stream.h"
#include "server/openai/choices.h"
#include "server/openai/http_text.h"
#include "server/openai/requests.h"
#include "server/openai/responses.h"

namespace vlmgraph::server {
namespace {

using namespace openai;  // NOLINT: this file is the protocol's HTTP side
namespace net = boost::asio;

// Routes, for the metric's endpoint label and for 405 (method) vs 404 (path).
enum class Endpoint {
  kHealth,
  kModels,
  kModel,
  kChat,
  kCompletions,
  kTokenize,
  kDetokenize,
  kRollback
};
struct Route {
  const char* path;
  const char* method;
  Endpoint endpoint;
};
constexpr Route kRoutes[] = {
    {"/health", "GET", Endpoint::kHealth},
    {"/v1/models", "GET", Endpoint::kModels},
    {"/v1/chat/completions", "POST", Endpoint::kChat},
    {"/v1/completions", "POST", Endpoint::kCompletions},
    {"/tokenize", "POST", Endpoint::kTokenize},
    {"/detokenize", "POST", Endpoint::kDetokenize},
    {"/v1/admin/rollback", "POST", Endpoint::kRollback},
};
constexpr const char* kModelPath = "/v1/models/{model}";
constexpr const char* kModelPrefix = "/v1/models/";

// The route of `path` whatever the method; nullopt for an unknown path.
std::optional<Route> FindRoute(const std::string& path) {
  for (const Route& r : kRoutes) {
    if (path == r.path) return r;
  }
  if (path.rfind(kModelPrefix, 0) == 0 && path.size() > std::string(kModelPrefix).size())
    return Route{kModelPath, "GET", Endpoint::kModel};
  return std::nullopt;
}

std::string EndpointLabel(const std::string& path) {
  const std::optional<Route> route = FindRoute(path);
  return route ? route->path : "other";  // bounded label values: unknown paths share one
}

}  // namespace

int64_t MaxHttpBodyBytes(const ServerConfig::Limits& limits) {
  return (limits.max_request_bytes + 2) / 3 * 4;
}

struct OpenAiHttpServer::Impl {
  Impl(const ServerConfig& config, EngineRouter* router, Metrics* metrics, const TextModel* text,
       const ApiKeys* keys, WeightsPublisher* publisher);

  // One completion request over HTTP (its choices: n per prompt), from its submission to its
  // last byte. Lives while the engine or the connection may still call it; its lifetime is what
  // Shutdown's drain counts.
  struct Generation : std::enable_shared_from_this<Generation> {
    Generation(Impl* owner, std::shared_ptr<HttpExchange> exchange,
               std::vector<PreparedGeneration> prompts, bool chat);
    ~Generation();
    void Start(std::vector<ValidatedRequest> requests);  // one per choice
    void ScheduleDrain();
    void Drain();
    void Fail(std::exception_ptr error);
    void CancelAll();  // strand

    Impl* const owner;
    const std::shared_ptr<HttpExchange> exchange;
    const std::vector<PreparedGeneration> prompts;
    const bool chat;
    const bool stream;
    openai::ResponseChoices out;                     // strand
    std::vector<std::unique_ptr<TextStream>> texts;  // one per choice
    net::strand<net::thread_pool::executor_type> strand;
    std::vector<std::unique_ptr<GenerationSession>> sessions;  // strand; null once finished
    std::atomic<bool> drain_scheduled{false};
    bool ended = false;  // strand
    // Itself while the generation runs (Start to the end of Drain or Fail): nothing else holds a
    // generation that waits for the engine.
    std::shared_ptr<Generation> self;
  };

  HeadVerdict OnHead(const HttpRequest& head);
  void OnRequest(std::shared_ptr<HttpExchange> exchange);
  void OnComplete(const HttpRequest& request, int status, double seconds);

  // On a worker thread.
  void Handle(const std::shared_ptr<HttpExchange>& x, Endpoint endpoint);
  void StartGeneration(const std::shared_ptr<HttpExchange>& x,
                       std::vector<PreparedGeneration> prompts, bool chat);

  void Authorize(const HttpRequest& head, Scope scope) const;  // throws ApiError 401 / 403
  const TextModel& RequireText() const;
  ErrorInfo ErrorOf(std::exception_ptr error) const;
  void SendError(HttpExchange& x, const ErrorInfo& e) const;
  HeadVerdict RefuseHead(const HttpRequest& head, const ErrorInfo& e) const;
  void LogRefusal(const HttpRequest& r, const ErrorInfo& e) const;

  void Register(Generation* g);
  void Unregister(Generation* g);

  const ServerConfig config;
  EngineRouter* const router;
  Metrics* const metrics;
  const TextModel* const text;
  const ApiKeys* const keys;          // may be null: no keys
  WeightsPublisher* const publisher;  // may be null: no rollback endpoint
  const RequestContext ctx;
  const int64_t created;  // Unix seconds: /v1/models' "created"
  const int64_t max_body_bytes;

  std::atomic<bool> accepting{true};
  std::atomic<bool> cancel_all{false};
  mutable std::mutex mu;
  std::condition_variable cv;
  int64_t in_flight = 0;                                  // mu: requests after their head
  std::map<Generation*, std::weak_ptr<Generation>> live;  // mu
  Clock::time_point drain_start{};
  bool stopped = false;
  std::atomic<int64_t> queued_work{0};  // bodies waiting for a worker

  net::thread_pool workers;
  net::thread_pool streams;  // server.stream_threads: StreamThreads
  std::unique_ptr<HttpServer> http;  // last: stopped first
};

OpenAiHttpServer::Impl::Impl(const ServerConfig& config_in, EngineRouter* router_in,
                             Metrics* metrics_in, const TextModel* text_in, const ApiKeys* keys_in,
                             WeightsPublisher* publisher_in)
    : config(config_in),
      router(router_in),
      metrics(metrics_in),
      text(text_in),
      keys(keys_in),
      publisher(publisher_in),
      ctx{config_in.served_model_name, config_in.limits},
      created(std::chrono::duration_cast<std::chrono::seconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count()),
      max_body_bytes(MaxHttpBodyBytes(config_in.limits)),
      workers(static_cast<size_t>(std::max<int64_t>(1, config_in.http.workers))),
      streams(static_cast<size_t>(StreamThreads(config_in, router_in->size()))) {}

// --- the head: everything decided before the body is read (Note [Limits before work]) ---------

HeadVerdict OpenAiHttpServer::Impl::OnHead(const HttpRequest& head) {
  {
    std::lock_guard<std::mutex> lock(mu);
    ++in_flight;  // balanced in OnComplete, which the front calls once per head
  }
  std::optional<Route> route = FindRoute(head.path);
  if (route && route->endpoint == Endpoint::kRollback && publisher == nullptr) route.reset();
  if (!route) {
    return RefuseHead(head,
                      {404, "invalid_request_error",
                       "Invalid URL (" + LogSafe(head.method, 16) + " " + LogSafe(head.path, 256) +
                           "): this server serves /v1/chat/completions, /v1/completions, "
                           "/v1/models, /tokenize, /detokenize and /health",
                       "", ""});
  }
  if (head.method != route->method) {
    HeadVerdict v = RefuseHead(head, {405, "invalid_request_error",
                                      "method " + LogSafe(head.method, 16) + " is not allowed on " +
                                          head.path + "; use " + route->method,
                                      "", ""});
    v.headers.emplace_back("Allow", route->method);
    return v;
  }
  if (route->endpoint == Endpoint::kHealth) return HeadVerdict::Accept(0);
  try {
    Authorize(head, route->endpoint == Endpoint::kRollback ? Scope::kPublish : Scope::kInference);
    if (!accepting.load()) {
      throw ServerError(grpc::StatusCode::UNAVAILABLE,
                        "the server is shutting down; retry on another replica");
    }
  } catch (...) {
    return RefuseHead(head, ErrorOf(std::current_exception()));
  }
  if (std::string(route->method) == "GET") return HeadVerdict::Accept(0);
  const std::string content_type = head.Header("Content-Type");
  if (!IsJsonContentType(content_type)) {
    return RefuseHead(head, {415, "invalid_request_error",
                             "Content-Type must be application/json, got " +
                                 (content_type.empty() ? std::string("none")
                                                       : "'" + LogSafe(content_type, 64) + "'") +
                                 "; send the JSON body with `Content-Type: application/json`",
                             "", ""});
  }
  if (head.content_length && *head.content_length > static_cast<uint64_t>(max_body_bytes)) {
    return RefuseHead(head, {413, "invalid_request_error",
                             "the request body has " + std::to_string(*head.content_length) +
                                 " bytes, more than " + std::to_string(max_body_bytes) +
                                 " (limits.max_request_bytes x 4/3 for base64 images); send "
                                 "fewer or smaller images",
                             "", ""});
  }
  return HeadVerdict::Accept(max_body_bytes);
}

HeadVerdict OpenAiHttpServer::Impl::RefuseHead(const HttpRequest& head, const ErrorInfo& e) const {
  LogRefusal(head, e);
  HttpHeaders headers;
  if (e.http_status == 401) headers.emplace_back("WWW-Authenticate", "Bearer");
  return HeadVerdict::Refuse(e.http_status, "application/json", Dump(ErrorJson(e)),
                             std::move(headers));
}

void OpenAiHttpServer::Impl::Authorize(const HttpRequest& head, Scope scope) const {
  if (keys == nullptr || !keys->enabled()) return;
  try {
    keys->Authorize(head.Header("Authorization"), scope, head.path);
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

void OpenAiHttpServer::Impl::OnComplete(const HttpRequest& request, int status, double seconds) {
  if (metrics) metrics->ObserveHttpRequest(EndpointLabel(request.path), status, seconds);
  {
    std::lock_guard<std::mutex> lock(mu);
    --in_flight;
  }
  cv.notify_all();
}

// --- the body ------------------------------------------------------------------------------------

void OpenAiHttpServer::Impl::OnRequest(std::shared_ptr<HttpExchange> x) {
  const std::optional<Route> route = FindRoute(x->request().path);
  const Endpoint endpoint = route ? route->endpoint : Endpoint::kHealth;
  if (endpoint == Endpoint::kHealth) {
    const std::vector<EngineState> engines = router->States();
    json list = json::array();
    int64_t serving = 0;
    for (const EngineState& e : engines) {
      serving += e.healthy ? 1 : 0;
      json entry = {{"device", e.device},
                    {"gpu", e.gpu},
                    {"healthy", e.healthy},
                    {"running", e.running},
                    {"waiting", e.waiting}};
      if (!e.error.empty()) entry["error"] = e.error;
      list.push_back(std::move(entry));
    }
    if (accepting.load() && serving > 0) {
      const bool all = serving == static_cast<int64_t>(engines.size());
      x->Respond(200, "application/json",
                 Dump({{"status", all ? "serving" : "degraded"}, {"engines", std::move(list)}}));
      return;
    }
    const ErrorInfo e = ErrorOf(std::make_exception_ptr(ServerError(
        grpc::StatusCode::UNAVAILABLE,
        accepting.load() ? "no GPU of this server can serve" : "the server is shutting down")));
    LogRefusal(x->request(), e);
    json body = ErrorJson(e);
    body["engines"] = std::move(list);
    x->Respond(e.http_status, "application/json", Dump(body));
    return;
  }
  // Everything else may parse, tokenize or decode: a worker's job. The queue before the workers
  // is bounded like the scheduler's.
  if (queued_work.load() >= config.batching.max_queue_size) {
    SendError(*x, ErrorOf(std::make_exception_ptr(ServerError(
                      grpc::StatusCode::RESOURCE_EXHAUSTED,
                      "too many requests are waiting to be prepared (batching.max_queue_size = " +
                          std::to_string(config.batching.max_queue_size) + "); retry later"))));
    return;
  }
  ++queued_work;
  net::post(workers, [this, x, endpoint] {
    NameThreadOnce("vlmg-http-work");
    --queued_work;
    if (x->client_gone()) return;
    try {
      if (cancel_all.load()) {
        throw ServerError(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
      }
      Handle(x, endpoint);
    } catch (...) {
      SendError(*x, ErrorOf(std::current_exception()));
    }
  });
}

void OpenAiHttpServer::Impl::Handle(const std::shared_ptr<HttpExchange>& x, Endpoint endpoint) {
  const std::string& body = x->request().body;
  Engine& engine = router->engine();
  switch (endpoint) {
    case Endpoint::kModels:
      x->Respond(200, "application/json",
                 Dump(ModelListJson(ctx.served_model_name, created, engine.max_context())));
      return;
    case Endpoint::kModel: {
      const std::string model =
          PercentDecodeModel(x->request().path.substr(std::string(kModelPrefix).size()));
      if (model != ctx.served_model_name) {
        throw ApiError({404, "invalid_request_error",
                        "The model `" + model + "` does not exist. This server serves `" +
                            ctx.served_model_name + "`.",
                        "model", "model_not_found"});
      }
      x->Respond(200, "application/json", Dump(ModelJson(model, created, engine.max_context())));
      return;
    }
    case Endpoint::kChat: {
      const ChatCompletionRequest request = ParseChatCompletionRequest(body, ctx);
      std::vector<PreparedGeneration> prompts;
      prompts.push_back(PrepareChatCompletion(request, RequireText(), engine.model_config(),
                                              config.limits, engine.max_context()));
      StartGeneration(x, std::move(prompts), /*chat=*/true);
      return;
    }
    case Endpoint::kCompletions: {
      const CompletionRequest request = ParseCompletionRequest(body, ctx);
      std::vector<PreparedGeneration> prompts;
      for (size_t p = 0; p < request.prompts.size(); ++p) {
        prompts.push_back(
            PrepareCompletion(request, RequireText(), config.limits, engine.max_context(), p));
      }
      StartGeneration(x, std::move(prompts), /*chat=*/false);
      return;
    }
    case Endpoint::kTokenize: {
      const TokenizeRequest request = ParseTokenizeRequest(body, ctx);
      const std::vector<int64_t> ids =
          TokenizeIds(request, RequireText(), engine.model_config(), config.limits);
      x->Respond(200, "application/json", Dump(TokenizeJson(ids, engine.max_context())));
      return;
    }
    case Endpoint::kDetokenize: {
      const DetokenizeRequest request = ParseDetokenizeRequest(body, ctx);
      x->Respond(200, "application/json",
                 Dump(DetokenizeJson(DetokenizeText(request, RequireText()))));
      return;
    }
    case Endpoint::kRollback: {
      if (!body.empty()) {
        const json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
        if (!parsed.is_object() || !parsed.empty()) {
          throw BadRequest("/v1/admin/rollback takes an empty JSON object, {}");
        }
      }
      const RollbackReport r = publisher->Rollback("/v1/admin/rollback");
      LogInfo("HTTP /v1/admin/rollback from " + x->request().remote_address + ": restored " +
              std::to_string(r.tensors) + " tensors");
      x->Respond(200, "application/json",
                 Dump({{"object", "rollback"},
                       {"tensors", r.tensors},
                       {"bytes", r.bytes},
                       {"seconds", r.seconds}}));
      return;
    }
    case Endpoint::kHealth:
      break;
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

void OpenAiHttpServer::Impl::LogRefusal(const HttpRequest& r, const ErrorInfo& e) const {
  const bool server_fault = e.http_status >= 500 && e.http_status != 503;
  if (!server_fault && !LogEnabled(LogLevel::kDebug)) return;
  Log(server_fault ? LogLevel::kError : LogLevel::kDebug,
      "HTTP " + LogSafe(r.method, 16) + " " + LogSafe(r.path) + " from " + r.remote_address +
          " -> " + std::to_string(e.http_status) + ": " + LogSafe(e.message, 512));
}

void OpenAiHttpServer::Impl::SendError(HttpExchange& x, const ErrorInfo& e) const {
  if (e.http_status == kClientClosedRequest) return;  // nobody to answer
  LogRefusal(x.request(), e);
  HttpHeaders headers;
  if (e.http_status == 401) headers.emplace_back("WWW-Authenticate", "Bearer");
  x.Respond(e.http_status, "application/json", Dump(ErrorJson(e)), std::move(headers));
}

// --- generations -------------------------------------------------------------------------------

void OpenAiHttpServer::Impl::Register(Generation* g) {
  std::lock_guard<std::mutex> lock(mu);
  live.emplace(g, g->weak_from_this());
}

void OpenAiHttpServer::Impl::Unregister(Generation* g) {
  {
    std::lock_guard<std::mutex> lock(mu);
    live.erase(g);
  }
  cv.notify_all();
}

OpenAiHttpServer::Impl::Generation::Generation(Impl* owner_in, std::shared_ptr<HttpExchange> x,
                                               std::vector<PreparedGeneration> prompts_in,
                                               bool chat_in)
    : owner(owner_in),
      exchange(std::move(x)),
      prompts(std::move(prompts_in)),
      chat(chat_in),
      stream(prompts.front().stream),
      out(chat_in, NewResponseMeta(chat_in ? "chatcmpl" : "cmpl", owner_in->ctx.served_model_name),
          &prompts, &owner_in->RequireText().tokenizer()),
      strand(net::make_strand(owner_in->streams.get_executor())) {
  for (size_t i = 0; i < out.size(); ++i) {
    texts.push_back(std::make_unique<TextStream>(&owner_in->RequireText().tokenizer(),
                                                 prompts[out.prompt_of(i)].stop_strings));
  }
}

OpenAiHttpServer::Impl::Generation::~Generation() { owner->Unregister(this); }

void OpenAiHttpServer::Impl::StartGeneration(const std::shared_ptr<HttpExchange>& x,
                                             std::vector<PreparedGeneration> prompts, bool chat) {
  // The one validation (thread-safe): ids, image tokens vs tiles, max_tokens, context, sampling,
  // logprobs; its refusal in OpenAI's words (FromEngineError). Every choice is validated before
  // any is submitted.
  std::vector<ValidatedRequest> requests;
  for (const PreparedGeneration& g : prompts) {
    for (int64_t k = 0; k < g.n; ++k) {
      try {
        requests.push_back(router->engine().Validate(ChoiceRequest(g, k)));
      } catch (const EngineError& e) {
        throw FromEngineError(e, g);
      }
    }
  }
  if (LogEnabled(LogLevel::kDebug)) {
    const PreparedGeneration& g = prompts.front();
    const int64_t tiles = g.request.tiles.defined() ? g.request.tiles.size(0) : 0;
    LogDebug("HTTP " + x->request().path + " from " + x->request().remote_address + ": " +
             std::to_string(prompts.size()) + " prompts, " + std::to_string(requests.size()) +
             " choices, " + std::to_string(g.prompt_tokens) + " prompt tokens, " +
             std::to_string(tiles) + " tiles, max_tokens " +
             std::to_string(requests.front()->sampling.max_new_tokens) +
             (g.stream ? ", stream" : ""));
  }
  auto gen = std::make_shared<Generation>(this, x, std::move(prompts), chat);
  Register(gen.get());
  gen->Start(std::move(requests));  // throws RESOURCE_EXHAUSTED / UNAVAILABLE before any byte
}

void OpenAiHttpServer::Impl::Generation::Start(std::vector<ValidatedRequest> requests) {
  const Clock::time_point accepted =
      Clock::now() - std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(exchange->seconds()));
  std::weak_ptr<Generation> weak = weak_from_this();
  // A choice refused by the queue ends the request: the sessions already made cancel their
  // sequences as they are destroyed.
  for (size_t i = 0; i < requests.size(); ++i) {
    sessions.push_back(std::make_unique<GenerationSession>(
        *owner->router, owner->metrics, std::move(requests[i]), accepted, texts[i].get(), [weak] {
          if (auto self = weak.lock()) self->ScheduleDrain();
        }));
  }
  self = shared_from_this();
  // Submitted: from here on errors go to the client through Drain.
  if (stream) {
    exchange->StartStream(200, "text/event-stream",
                          {{"Cache-Control", "no-cache"},
                           {"X-Accel-Buffering", "no"}});  // proxies: pass events on at once
    if (const std::string start = out.StreamStart(); !start.empty()) exchange->Write(start);
  }
  exchange->OnClientGone([weak] {
    if (auto s = weak.lock()) net::post(s->strand, [s] { s->CancelAll(); });
  });
  // The sessions live on the strand from now on: a notification may have come already.
  net::post(strand, [s = self] { s->Drain(); });
}

void OpenAiHttpServer::Impl::Generation::CancelAll() {
  for (auto& session : sessions) {
    if (session) session->Cancel();
  }
}

void OpenAiHttpServer::Impl::Generation::ScheduleDrain() {
  if (drain_scheduled.exchange(true)) return;
  net::post(strand, [s = shared_from_this()] { s->Drain(); });
}

void OpenAiHttpServer::Impl::Generation::Drain() {
  NameThreadOnce("vlmg-http-strm");
  drain_scheduled = false;
  if (ended || sessions.empty()) return;
  std::string events;
  for (size_t i = 0; i < sessions.size(); ++i) {
    if (!sessions[i]) continue;  // finished
    GenerationSession::Taken t;
    try {
      t = sessions[i]->Take();
      for (const GenerationDelta& d : t.deltas) events += out.OnDelta(i, d);
      if (t.finished && !t.error) events += out.OnFinish(i, t.outcome);
    } catch (...) {
      return Fail(std::current_exception());
    }
    if (!t.finished) continue;
    if (t.error) return Fail(t.error);
    sessions[i].reset();
  }
  if (stream && !events.empty()) exchange->Write(events);
  if (!out.all_finished()) return;
  ended = true;
  if (!stream) {
    exchange->Respond(200, "application/json", Dump(out.TakeBody()));
  } else {
    exchange->Write(out.StreamEnd());
    exchange->EndStream();
  }
  sessions.clear();
  self.reset();  // may destroy this generation: last
}

void OpenAiHttpServer::Impl::Generation::Fail(std::exception_ptr error) {
  ended = true;
  CancelAll();
  sessions.clear();
  const std::shared_ptr<Generation> keep = std::move(self);  // released as this returns
  if (exchange->client_gone()) return;                       // reported as 499 by the front
  const ErrorInfo e = owner->ErrorOf(error);
  if (!stream) return owner->SendError(*exchange, e);
  const bool server_fault = e.http_status >= 500 && e.http_status != 503;
  Log(server_fault ? LogLevel::kError : LogLevel::kDebug,
      "HTTP stream " + exchange->request().path + " -> " + std::to_string(e.http_status) + ": " +
          LogSafe(e.message, 512));
  exchange->SetReportedStatus(e.http_status);
  exchange->Write(SseEvent(ErrorJson(e)));
  exchange->Write(kSseDone);
  exchange->EndStream();
}

// --- OpenAiHttpServer ----------------------------------------------------------------------------

OpenAiHttpServer::OpenAiHttpServer(const ServerConfig& config, EngineRouter* router,
                                   Metrics* metrics, const TextModel* text, const ApiKeys* keys,
                                   WeightsPublisher* publisher)
    : impl_(std::make_unique<Impl>(config, router, metrics, text, keys, publisher)) {
  Impl& m = *impl_;
  HttpServerOptions o;
  o.address = config.server.http_address;
  o.io_threads = IoThreads(config, router->size());
  o.tls_cert_file = config.tls.cert_file;
  o.tls_key_file = config.tls.key_file;
  o.tls_client_ca_file = config.tls.client_ca_file;
  o.idle_timeout_seconds = config.http.idle_timeout_seconds;
  o.request_head_timeout_seconds = config.http.request_head_timeout_seconds;
  o.request_body_timeout_seconds = config.http.request_body_timeout_seconds;
  o.write_timeout_seconds = config.http.write_timeout_seconds;
  o.max_connections = config.http.max_connections;
  o.max_connections_per_client = config.http.max_connections_per_client;
  o.max_body_bytes_in_flight = config.http.max_body_bytes_in_flight;
  if (o.max_body_bytes_in_flight > 0 && o.max_body_bytes_in_flight < m.max_body_bytes) {
    throw ServerConfigError("http.max_body_bytes_in_flight",
                            "must be 0 (no limit) or at least the largest request body, " +
                                std::to_string(m.max_body_bytes) +
                                " bytes (from limits.max_images_per_request and "
                                "limits.max_image_bytes), got " +
                                std::to_string(o.max_body_bytes_in_flight));
  }
  HttpHandlers h;
  h.on_head = [&m](const HttpRequest& head) { return m.OnHead(head); };
  h.on_request = [&m](std::shared_ptr<HttpExchange> x) { m.OnRequest(std::move(x)); };
  h.on_complete = [&m](const HttpRequest& r, int status, double seconds) {
    m.OnComplete(r, status, seconds);
  };
  h.error_body = [](int status, const std::string& message) {
    ErrorInfo e{status, status >= 500 ? "server_error" : "invalid_request_error", message, "", ""};
    return std::make_pair(std::string("application/json"), Dump(ErrorJson(e)));
  };
  if (metrics) {
    std::vector<std::string> endpoints;
    for (const Route& r : kRoutes) endpoints.push_back(r.path);
    metrics->InitHttpEndpoints(endpoints);
  }
  try {
    m.http = std::make_unique<HttpServer>(o, h);
  } catch (const ServerConfigError&) {
    throw;
  } catch (const std::exception& e) {
    throw std::runtime_error("server.http_address: " + std::string(e.what()));
  }
}

OpenAiHttpServer::~OpenAiHttpServer() { Shutdown(0); }

int OpenAiHttpServer::port() const { return impl_->http->port(); }

int64_t OpenAiHttpServer::in_flight() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->in_flight;
}

HttpServerStats OpenAiHttpServer::stats() const { return impl_->http->stats(); }

std::string OpenAiHttpServer::address() const {
  return impl_->config.server.http_address.WithPort(port()).ToString();
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
  std::vector<std::shared_ptr<Impl::Generation>> running;
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
    m.cancel_all = true;  // what is cancelled from now on answers 503
    for (auto& [ptr, weak] : m.live) {
      if (auto g = weak.lock()) running.push_back(std::move(g));
    }
  }
  for (auto& g : running) net::post(g->strand, [g] { g->CancelAll(); });
  running.clear();
  {
    // Cancelled generations end within one drain; give their last bytes a moment to leave.
    std::unique_lock<std::mutex> lock(m.mu);
    m.cv.wait_for(lock, std::chrono::seconds(5), [&m] { return m.live.empty(); });
  }
  m.workers.join();
  m.streams.join();
  m.http->Stop();  // closes what is left; every exchange reports
  m.stopped = true;
}

}  // namespace vlmgraph::server
