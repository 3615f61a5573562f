// server/grpc/service.h: the vlmgraph.v1.VlmGraph gRPC service (proto/vlmgraph/v1/service.proto).
//
// Generate runs on gRPC's callback API; GetModelInfo, Forward, Train and RollbackWeights on its
// synchronous API. Requests go to the Scheduler's GPU thread of the engine the router picks
// (server/core/engine_router.h: Generate and Forward go to the least-loaded engine; a Train job
// runs on every serving engine, server/train/train_ranks.h, and publishing changes every engine).
// Every call ends in FinishRpc, the one place where exceptions become grpc::Status, where a
// cancelled call is told apart from one cut by its deadline or by the shutdown, and where
// vlmgraph_requests_total / request_duration_seconds are recorded and failures logged; synchronous
// handlers reach it through RpcGuard.
//
//   VlmGraphService service(&router, &metrics, config, text_model.get());
//   builder.RegisterService(&service);
//
// Note [Generate on the callback API]: a Generate stream holds no thread while it waits for its
// tokens (as the HTTP front's streams, server/openai/openai_http.h), so many streams per GPU cost
// memory, not threads. One stream, a GenerateCall (server/grpc/generate_rpc.cc), goes through:
//   1. gRPC's callback thread (Generate): checks the API key (inference scope) and queues the
//      request for a prepare thread; more than batching.max_queue_size requests waiting for one
//      -> RESOURCE_EXHAUSTED. Nothing that can block long runs on gRPC's callback threads.
//   2. one of kPrepareThreads threads: ToEngineRequest (tokenizer, chat template; images decode
//      on server/core/image_workers.h's threads) and Engine::Validate, then a GenerationSession
//      submits it to the router (server/core/generation.h).
//   3. the GPU thread notifies the session (on_update); that only posts a drain to one of
//      server.stream_threads threads, which takes the new tokens (detokenizing, stop strings) into the
//      call's pending chunk.
//   4. at most one write is outstanding per stream (StartWrite ... OnWriteDone): tokens that
//      arrive meanwhile are coalesced into the pending chunk (ids and text concatenated), so a
//      client that reads slowly gets fewer, larger chunks and holds at most its own remaining
//      tokens (max_new_tokens) in server memory. After the last chunk comes the GenerateSummary,
//      then Finish(OK).
//   5. a client cancel, a passed deadline or the shutdown's cancel (OnCancel), a failed write or
//      a failed generation ends the call at once: the session is destroyed (its sequence is
//      cancelled in the engine), FinishRpc classifies and records the status, Finish sends it.
//      OnDone releases the call. The call is shared: the GPU thread's notification holds only a
//      weak_ptr, posted drains a shared_ptr, and everything that touches the call's state, its
//      session or the gRPC call takes the call's mutex and does nothing once it ended.
//
// Thread rules: handlers are called concurrently by gRPC; the service only touches the engines
// through their schedulers (plus Engine::Validate and accessors, which are thread-safe).
// Synchronous handlers block their own thread; callback reactions never block. The service must
// outlive the gRPC server's Shutdown (which waits for every call's OnDone) and be destroyed after
// the router's GPU threads stopped (main.cc's order), since its threads run the streams' drains.
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <limits>
#include <memory>

#include "engine/engine.h"
#include "server/config/config.h"
#include "server/core/auth.h"
#include "server/core/engine_router.h"
#include "server/core/generation.h"
#include "server/core/metrics.h"
#include "server/core/scheduler.h"
#include "server/core/text_prompt.h"
#include "server/train/train_slot.h"
#include "server/train/weights_publisher.h"
#include "vlmgraph/v1/service.grpc.pb.h"

namespace vlmgraph::server {

class VlmGraphService final
    : public v1::VlmGraph::WithCallbackMethod_Generate<v1::VlmGraph::Service> {
 public:
  // Threads that convert and validate Generate requests (Note [Generate on the callback API]).
  static constexpr int kPrepareThreads = 4;
  // Threads that turn engine tokens into Generate chunks: server.stream_threads (StreamThreads in
  // server/config/config.h), as the HTTP front's stream threads.

  // `text` (tokenizer and chat format) may be null: then prompts must be token ids. `keys` (may
  // be null = no keys) decides who may call what (server/core/auth.h): GetModelInfo, Generate and
  // Forward need the inference scope, Train the train scope, a Train job's publish (its publish
  // request or publish_on_end) and RollbackWeights the publish scope. `publisher` (may be null:
  // publishing and rollback then answer FAILED_PRECONDITION) changes the served weights
  // (server/train/weights_publisher.h). `router`'s engines must be started. None is owned; each
  // must outlive the service.
  VlmGraphService(EngineRouter* router, Metrics* metrics, const ServerConfig& config,
                  const TextModel* text = nullptr, const ApiKeys* keys = nullptr,
                  WeightsPublisher* publisher = nullptr);

  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;
  // A callback-API stream (Note [Generate on the callback API]); gRPC owns the reactor until its
  // OnDone.
  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::Status Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                       v1::ForwardResponse* response) override;
  grpc::Status Train(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::TrainResponse, v1::TrainRequest>* stream) override;
  grpc::Status RollbackWeights(grpc::ServerContext* context,
                               const v1::RollbackWeightsRequest* request,
                               v1::RollbackWeightsResponse* response) override;

  // Generate, Forward, Train and RollbackWeights calls running now, from their acceptance to
  // their status (main waits for 0 while draining).
  int64_t in_flight() const { return in_flight_.load(); }

  // Note [Graceful shutdown]: main says when the drain ends. A call cancelled from then on was cut
  // by the shutdown deadline, not by its client: it is recorded and logged as UNAVAILABLE "cut by
  // the shutdown deadline". Any thread.
  void SetShutdownDeadline(Clock::time_point deadline);

 private:
  class GenerateCall;      // server/grpc/generate_rpc.cc
  struct GenerateThreads;  // the prepare and stream threads (server/grpc/generate_rpc.cc)
  static std::shared_ptr<GenerateThreads> StartGenerateThreads(int stream_threads);

  // The end of every counted call (synchronous or callback), called once, before its status is
  // sent, while `context` is valid: `error` (null = OK) becomes its status (StatusFromException);
  // a call gRPC cancelled whose error is not the server's own UNAVAILABLE or DEADLINE_EXCEEDED
  // is reported as cut by the shutdown deadline (UNAVAILABLE), by its deadline
  // (DEADLINE_EXCEEDED) or cancelled by the client (CANCELLED); records the request metrics,
  // logs failures (INTERNAL as errors, the rest at debug level). Any thread.
  grpc::Status FinishRpc(const char* rpc, const grpc::ServerContextBase& context,
                         Clock::time_point accepted, std::exception_ptr error);
  // A synchronous handler's body: counts the call in in_flight(), checks the caller's API key for
  // `scope`, runs `body` and ends with FinishRpc of what it threw.
  grpc::Status RpcGuard(const char* rpc, Scope scope, grpc::ServerContext* context,
                        Clock::time_point accepted, const std::function<void()>& body);
  // Throws ServerError UNAUTHENTICATED / PERMISSION_DENIED unless the call's `authorization`
  // metadata holds a key with `scope` (no keys configured: everyone may).
  void Authorize(const grpc::ServerContextBase* context, Scope scope, const char* rpc) const;
  void RunForward(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                  Clock::time_point accepted);
  void RunTrain(grpc::ServerContext* context,
                grpc::ServerReaderWriter<v1::TrainResponse, v1::TrainRequest>* stream);

  EngineRouter* router_;
  Engine* engine_;  // the first engine: Validate and the model's accessors
  Metrics* metrics_;
  const ServerConfig config_;
  const TextModel* text_;
  const ApiKeys* keys_;
  TrainSlot train_slot_;  // one Train job at a time (server/grpc/train_rpc.cc)
  WeightsPublisher* publisher_;
  // One call counted in in_flight() for as long as it lives: from acceptance until its status.
  class CallCount {
   public:
    explicit CallCount(std::atomic<int64_t>* count) : count_(count) { ++*count_; }
    ~CallCount() { --*count_; }
    CallCount(const CallCount&) = delete;
    CallCount& operator=(const CallCount&) = delete;

   private:
    std::atomic<int64_t>* count_;
  };
  std::atomic<int64_t> in_flight_{0};
  // SetShutdownDeadline's time point, nanoseconds since the clock's epoch; max = none.
  std::atomic<int64_t> shutdown_deadline_ns_{std::numeric_limits<int64_t>::max()};
  // Last: its threads are joined first, when the service is destroyed.
  const std::shared_ptr<GenerateThreads> generate_threads_;
};

}  // namespace vlmgraph::server
