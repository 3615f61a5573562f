// server/service.h: the vlmgraph.v1.VlmGraph gRPC service (proto/vlmgraph/v1/service.proto).
//
// Handlers run on gRPC's synchronous-server threads: they convert and check requests
// (server/convert.h, Engine::Validate) on their own thread, hand the work to the Scheduler's GPU
// thread of the engine the router picks (server/engine_router.h: Generate and Forward go to the
// least-loaded engine; a Train job runs on every serving engine, server/train_ranks.h), and
// stream results back. Every handler body runs inside RpcGuard, the one place where exceptions become
// grpc::Status and where vlmgraph_requests_total / request_duration_seconds are recorded.
//
//   VlmGraphService service(&router, &metrics, config, text_model.get());
//   builder.RegisterService(&service);
//
// Thread rules: handlers are called concurrently by gRPC; the service only touches the engines
// through their schedulers (plus Engine::Validate and accessors, which are thread-safe). Cancelled
// calls and clients that vanish mid-stream are noticed within kPollInterval and their sequence is
// cancelled in the engine.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <limits>

#include "engine/engine.h"
#include "server/auth.h"
#include "server/config.h"
#include "server/engine_router.h"
#include "server/generation.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/text_prompt.h"
#include "server/train_slot.h"
#include "server/weights_publisher.h"
#include "vlmgraph/v1/service.grpc.pb.h"

namespace vlmgraph::server {

class VlmGraphService final : public v1::VlmGraph::Service {
 public:
  static constexpr std::chrono::milliseconds kPollInterval = kGenerationPollInterval;

  // `text` (tokenizer and chat format) may be null: then prompts must be token ids. `keys` (may
  // be null = no keys) decides who may call what (server/auth.h): GetModelInfo, Generate and
  // Forward need the inference scope, Train the train scope, a Train job's publish (its publish
  // request or publish_on_end) and RollbackWeights the publish scope. `publisher` (may be null:
  // publishing and rollback then answer FAILED_PRECONDITION) changes the served weights
  // (server/weights_publisher.h). `router`'s engines must be started. None is owned; each must
  // outlive the service.
  VlmGraphService(EngineRouter* router, Metrics* metrics, const ServerConfig& config,
                  const TextModel* text = nullptr,
                  const ApiKeys* keys = nullptr, WeightsPublisher* publisher = nullptr);

  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;
  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                       v1::ForwardResponse* response) override;
  grpc::Status Train(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::TrainResponse, v1::TrainRequest>* stream) override;
  grpc::Status RollbackWeights(grpc::ServerContext* context,
                               const v1::RollbackWeightsRequest* request,
                               v1::RollbackWeightsResponse* response) override;

  // Generate, Forward and Train calls running now (main waits for 0 while draining).
  int64_t in_flight() const { return in_flight_.load(); }

  // Note [Graceful shutdown]: main says when the drain ends. A call cancelled from then on was cut
  // by the shutdown deadline, not by its client: it is recorded and logged as UNAVAILABLE "cut by
  // the shutdown deadline". Any thread.
  void SetShutdownDeadline(Clock::time_point deadline);

 private:
  // Checks the caller's API key for `scope`, runs `body`; converts any exception to a status
  // (StatusFromException), reports CANCELLED when the client cancelled, records the request
  // metrics and logs failures.
  grpc::Status RpcGuard(const char* rpc, Scope scope, grpc::ServerContext* context,
                        Clock::time_point accepted, const std::function<void()>& body);
  void Authorize(grpc::ServerContext* context, Scope scope, const char* rpc) const;

  void RunGenerate(grpc::ServerContext* context, const v1::GenerateRequest& request,
                   grpc::ServerWriter<v1::GenerateResponse>* writer, Clock::time_point accepted);
  void RunForward(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                  Clock::time_point accepted);
  void RunTrain(grpc::ServerContext* context,
                grpc::ServerReaderWriter<v1::TrainResponse, v1::TrainRequest>* stream);

  EngineRouter* router_;
  Engine* engine_;        // the first engine: Validate and the model's accessors
  Scheduler* scheduler_;  // the first engine's
  Metrics* metrics_;
  const ServerConfig config_;
  const TextModel* text_;
  const ApiKeys* keys_;
  TrainSlot train_slot_;  // one Train job at a time (server/train_rpc.cc)
  WeightsPublisher* publisher_;
  std::atomic<int64_t> in_flight_{0};
  // SetShutdownDeadline's time point, nanoseconds since the clock's epoch; max = none.
  std::atomic<int64_t> shutdown_deadline_ns_{std::numeric_limits<int64_t>::max()};
};

}  // namespace vlmgraph::server
