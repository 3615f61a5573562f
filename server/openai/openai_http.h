// server/openai/openai_http.h: the OpenAI-compatible HTTP API on its own address
// (server.http_address), served by the event-driven HTTP front (server/http/http_server.h:
// Boost.Beast). Requests run through the same validation, router (server/core/engine_router.h),
// limits and metrics as gRPC Generate (GenerationSession, server/core/generation.h); the JSON side
// (formats, accepted fields, their sources) is server/openai/requests.h.
//
//   OpenAiHttpServer http(config, &router, &metrics, text_model.get());   // listening
//   http.address();          // "127.0.0.1:8000" (resolves port 0)
//   ...                       // SIGTERM:
//   router.StopAccepting(); http.StopAccepting();      // new requests: 503
//   http.Shutdown(config.shutdown_timeout_seconds);    // drain, cancel the rest, stop
//
//   curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
//     -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'
//
// Endpoints (every one but /health needs `Authorization: Bearer <key>` when keys are configured,
// server/core/auth.h: the inference scope, the publish scope for /v1/admin/rollback):
//   GET  /health               200 while at least one engine serves, 503 once shutting down or
//                              when no engine can serve (vLLM's; a device fault stops every
//                              engine, Note [Device faults]); the body lists every engine:
//                              {"status": "serving" | "degraded", "engines": [{"device":
//                              "cuda:0", "gpu": "0", "healthy": true, "running": 3, "waiting":
//                              0}, ...]} ("error": the device error of a failed engine); a 503
//                              body is OpenAI's error body with the same "engines" list
//   GET  /v1/models            the one model, served_model_name; GET /v1/models/{model} too
//   POST /v1/chat/completions  text and image_url (data: URL) content parts; stream: true -> SSE;
//                              n choices, logprobs (server/openai/choices.h)
//   POST /v1/completions       a prompt string or token ids, or a batch of them; stream: true ->
//                              SSE; n choices, logprobs, echo (server/openai/choices.h)
//   POST /tokenize             vLLM's: {"prompt"} or {"messages"} -> {"tokens", "count", ...}
//   POST /detokenize           vLLM's: {"tokens"} -> {"prompt"}
//   POST /v1/admin/rollback    the weights served before the last publish (key with the publish
//                              scope; Note [Rollback], server/train/weights_publisher.h) ->
//                              {"object": "rollback", "tensors", "bytes", "seconds"}; 400 with
//                              nothing to roll back
// A known path with another method answers 405, any other path 404, both with OpenAI's error body.
//
// Note [Limits before work]: everything that can be decided from the request head is decided
// before one byte of the body is read: the route (404, 405), the API key (401, 403: an
// unauthenticated client cannot make the server read, buffer or parse a body), the Content-Type
// (415 unless application/json, so a web page cannot post to the API from a browser without a
// CORS preflight), a Content-Length over MaxHttpBodyBytes (413), shutting down (503). Then the
// body is read within http.request_body_timeout_seconds, and parsed, tokenized and decoded on
// one of http.workers threads; at most batching.max_queue_size requests wait for a worker (429).
//
// Errors (OpenAI's {"error": {"message", "type", "param", "code"}}; the mapping from the
// server's exceptions is openai::ErrorFromException, the one place that maps them):
//   400 invalid_request_error  malformed JSON or HTTP, missing or bad fields, bad base64, a remote
//                              image URL, n or top_logprobs out of range, a prompt longer
//                              than the context
//                              (code context_length_exceeded), no tokenizer loaded
//   401 authentication_error   missing or wrong API key (code invalid_api_key)
//   403 permission_error       the key lacks the inference scope
//   404                        unknown model (code model_not_found) or path
//   408                        the request head or body did not arrive in time
//   413                        body over MaxHttpBodyBytes(limits)
//   414, 431                   request line or head over 64 KiB
//   415                        Content-Type is not application/json
//   429 rate_limit_error       the scheduler's queue or the workers' queue is full
//   503 server_error           shutting down; no engine serves, or the request's engine's GPU
//                              failed (Note [Device faults], server/core/scheduler.h); too many
//                              connections (http.max_connections*)
//   500 server_error           a server bug (logged as an error)
// An error after a stream has started (its 200 is sent) arrives as one more event,
// `data: {"error": {...}}`, followed by `data: [DONE]` (as vLLM).
//
// Cancellation: a client that closes its connection cancels its generation at once, streaming or
// not (the front keeps reading the connection while the response is pending).
//
// Graceful shutdown (Note [Graceful shutdown], server/grpc/grpc_server.h): StopAccepting turns
// /health to 503 and refuses new requests with 503; Shutdown(timeout) lets requests in flight run
// until `timeout` seconds after StopAccepting, then cancels the rest (streams end with a 503 error
// event, other requests answer 503), closes every connection and joins the front's threads.
//
// Metrics: vlmgraph_http_requests_total{endpoint, status} and
// vlmgraph_http_request_duration_seconds{endpoint} for every request (docs/metrics.md); generations
// also record time to first token, inter-token latency and generated tokens as gRPC does.
//
// Threads: http.io_threads serve the connections, http.workers prepare requests, and
// server.stream_threads turn engine tokens into response chunks (IoThreads, StreamThreads in
// server/config/config.h); nothing blocks on a client.
// Thread rules: construct, StopAccepting, Shutdown and destroy from the main thread; the rest runs
// on those threads and only uses thread-safe objects (EngineRouter, Engine::Validate, Metrics, the
// immutable TextModel). Errors: the constructor throws std::runtime_error naming
// server.http_address when it cannot listen, ServerConfigError when the TLS files do not load.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "server/config/config.h"
#include "server/core/auth.h"
#include "server/core/engine_router.h"
#include "server/core/metrics.h"
#include "server/core/scheduler.h"
#include "server/core/text_prompt.h"
#include "server/http/http_server.h"
#include "server/train/weights_publisher.h"

namespace vlmgraph::server {

// The largest request body accepted: limits.max_request_bytes grown by base64's 4/3 (images come
// inline as base64 in JSON), so a request that fits gRPC fits HTTP. Larger bodies get 413.
int64_t MaxHttpBodyBytes(const ServerConfig::Limits& limits);

class OpenAiHttpServer {
 public:
  // Listens on config.server.http_address (port 0: any free port) and serves. `router`'s engines
  // must be started (the first answers Validate and max_context); `metrics` may be null (tests);
  // `text` may be null (no tokenizer: the text endpoints answer 400 saying so); `keys` may be null
  // (no API keys; otherwise every endpoint but /health needs a key with the inference scope: 401
  // without a valid one, 403 without the scope). TLS when config.tls.cert_file is set
  // (ServerConfigError when the files do not load). All must outlive this.
  // `publisher` may be null (no /v1/admin/rollback: 404).
  OpenAiHttpServer(const ServerConfig& config, EngineRouter* router, Metrics* metrics,
                   const TextModel* text, const ApiKeys* keys = nullptr,
                   WeightsPublisher* publisher = nullptr);
  ~OpenAiHttpServer();  // Shutdown(0) unless done
  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  // The bound port (resolves port 0) and "host:port" with it.
  int port() const;
  std::string address() const;

  // New requests get 503 and /health turns 503; requests in flight continue. Idempotent.
  void StopAccepting();
  // Requests being handled now.
  int64_t in_flight() const;
  // The front's counters (connections, refusals, deadlines).
  HttpServerStats stats() const;
  // StopAccepting, waits until `timeout_seconds` after the first StopAccepting for requests in
  // flight, cancels the rest, stops listening and joins the workers. Idempotent.
  void Shutdown(double timeout_seconds);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace vlmgraph::server
