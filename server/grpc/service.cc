#include "server/grpc/service.h"

#include <exception>

#include "base/log.h"
#include "server/core/generation.h"
#include "server/core/status.h"
#include "server/grpc/convert.h"

namespace vlmgraph::server {

VlmGraphService::VlmGraphService(EngineRouter* router, Metrics* metrics, const ServerConfig& config,
                                 const TextModel* text, const ApiKeys* keys,
                                 WeightsPublisher* publisher)
    : router_(router),
      engine_(&router->engine()),
      metrics_(metrics),
      config_(config),
      text_(text),
      keys_(keys),
      publisher_(publisher),
      generate_threads_(StartGenerateThreads(StreamThreads(config, router->size()))) {}

void VlmGraphService::SetShutdownDeadline(Clock::time_point deadline) {
  shutdown_deadline_ns_.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count());
}

void VlmGraphService::Authorize(const grpc::ServerContextBase* context, Scope scope,
                                const char* rpc) const {
  if (keys_ == nullptr || !keys_->enabled()) return;
  const auto& metadata = context->client_metadata();
  const auto it = metadata.find("authorization");
  const std::string_view value = it == metadata.end()
                                     ? std::string_view()
                                     : std::string_view(it->second.data(), it->second.size());
  keys_->Authorize(value, scope, rpc);
}

grpc::Status VlmGraphService::FinishRpc(const char* rpc, const grpc::ServerContextBase& context,
                                        Clock::time_point accepted, std::exception_ptr error) {
  grpc::Status status = error ? StatusFromException(error) : grpc::Status::OK;
  // A call the server itself cancelled keeps its reason (UNAVAILABLE at shutdown,
  // DEADLINE_EXCEEDED for an idle Train stream); one cancelled after the drain ended was cut by
  // the shutdown deadline (gRPC cancels what still runs then), not by its client.
  if (!status.ok() && context.IsCancelled() &&
      status.error_code() != grpc::StatusCode::UNAVAILABLE &&
      status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
    const bool expired = context.deadline() <= std::chrono::system_clock::now();
    const bool shut_down =
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
            .count() >= shutdown_deadline_ns_.load();
    if (shut_down) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            "cut by the shutdown deadline: the server is shutting down and "
                            "shutdown_timeout_seconds (" +
                                LogFormat("%g", config_.shutdown_timeout_seconds) +
                                " s) passed; retry on a running server");
    } else {
      status =
          grpc::Status(expired ? grpc::StatusCode::DEADLINE_EXCEEDED : grpc::StatusCode::CANCELLED,
                       expired ? "deadline exceeded" : "cancelled by the client");
    }
  }
  const double seconds = SecondsSince(accepted);
  if (metrics_) metrics_->ObserveRequest(rpc, status.error_code(), seconds);
  if (!status.ok()) {
    const bool server_fault = status.error_code() == grpc::StatusCode::INTERNAL;
    Log(server_fault ? LogLevel::kError : LogLevel::kDebug,
        std::string(rpc) + " from " + context.peer() + " -> " +
            StatusCodeName(status.error_code()) + ": " +
            LogSafe(status.error_message(), /*max_bytes=*/1024));  // it may echo client text
  }
  return status;
}

grpc::Status VlmGraphService::RpcGuard(const char* rpc, Scope scope, grpc::ServerContext* context,
                                       Clock::time_point accepted,
                                       const std::function<void()>& body) {
  const CallCount count(&in_flight_);
  std::exception_ptr error;
  try {
    Authorize(context, scope, rpc);
    body();
  } catch (...) {
    error = std::current_exception();
  }
  return FinishRpc(rpc, *context, accepted, error);
}

grpc::Status VlmGraphService::GetModelInfo(grpc::ServerContext* context,
                                           const v1::GetModelInfoRequest*, v1::ModelInfo* info) {
  try {
    Authorize(context, Scope::kInference, "GetModelInfo");
  } catch (...) {
    return StatusFromException(std::current_exception());
  }
  const VlmConfig& m = engine_->model_config();
  const EngineOptions& o = engine_->options();
  const BucketSpec& b = o.buckets;
  info->set_model(config_.model);
  info->set_served_model_name(config_.served_model_name);
  info->set_dtype(config_.dtype);
  info->set_device(o.device.str());
  info->set_cuda_graphs(engine_->graphs_enabled());
  info->set_vocab_size(m.lm_vocab_size);
  info->set_image_token_id(m.image_token_id);
  info->set_mp_image_token_length(m.mp_image_token_length);
  info->set_vit_img_size(m.vit_img_size);
  info->set_max_img_size(m.max_img_size);
  info->set_resize_to_max_side_len(m.resize_to_max_side_len);
  info->set_max_tiles_per_request(o.max_tiles_per_request);
  info->set_max_context(engine_->max_context());
  for (int64_t v : b.batch_sizes) info->add_batch_sizes(v);
  for (int64_t v : b.seq_lens) info->add_seq_lens(v);
  for (int64_t v : b.context_lens) info->add_context_lens(v);
  for (int64_t v : b.tile_counts) info->add_tile_counts(v);
  for (int64_t v : b.train_batch_sizes) info->add_train_batch_sizes(v);
  for (int64_t v : b.train_seq_lens) info->add_train_seq_lens(v);
  info->set_oversize(b.oversize == OversizePolicy::kReject ? "reject" : "eager");
  const auto& l = config_.limits;
  info->set_max_new_tokens_limit(l.max_new_tokens);
  info->set_default_max_new_tokens(l.default_max_new_tokens);
  info->set_max_images_per_request(l.max_images_per_request);
  info->set_max_image_bytes(l.max_image_bytes);
  info->set_max_image_pixels(l.max_image_pixels);
  const std::vector<int64_t>& stops = config_.model_stop_token_ids.empty() && text_
                                          ? text_->default_stop_token_ids()
                                          : config_.model_stop_token_ids;
  for (int64_t v : stops) info->add_suggested_stop_token_ids(v);
  if (text_) {
    info->set_tokenizer(text_->tokenizer_path());
    info->set_chat_format(text_->chat_format().name());
  }
  return grpc::Status::OK;
}

grpc::Status VlmGraphService::Forward(grpc::ServerContext* context,
                                      const v1::ForwardRequest* request,
                                      v1::ForwardResponse* response) {
  const auto accepted = Clock::now();
  return RpcGuard("Forward", Scope::kInference, context, accepted,
                  [&] { RunForward(*request, response, accepted); });
}

void VlmGraphService::RunForward(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                                 Clock::time_point accepted) {
  // The one validation (thread-safe): prompt, targets, logits positions.
  const ValidatedForward req =
      engine_->Validate(ToEngineRequest(request, engine_->model_config(), config_.limits, text_));
  ForwardResult result;
  double queue_seconds = 0;
  router_->RunOnGpuThread(
      "Forward",
      [&](Engine& engine) {
        queue_seconds = SecondsSince(accepted);
        result = engine.Forward(req);
      },
      accepted);
  response->mutable_input_ids()->Add(req->input_ids.begin(), req->input_ids.end());
  response->set_loss(result.loss);
  response->set_loss_tokens(result.loss_tokens);
  for (size_t i = 0; i < result.logits.size(); ++i) {
    v1::PositionLogits* row = response->add_logits();
    row->set_position(req->logits_positions[i]);
    row->mutable_logits()->Add(result.logits[i].begin(), result.logits[i].end());
  }
  response->set_bucket(result.bucket.Label());
  response->set_graphed(result.graphed);
  response->set_queue_seconds(queue_seconds);
  response->set_total_seconds(SecondsSince(accepted));
}

grpc::Status VlmGraphService::RollbackWeights(grpc::ServerContext* context,
                                              const v1::RollbackWeightsRequest*,
                                              v1::RollbackWeightsResponse* response) {
  const auto accepted = Clock::now();
  return RpcGuard("RollbackWeights", Scope::kPublish, context, accepted, [&] {
    if (publisher_ == nullptr) {
      throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                        "this server cannot roll back weights (no publisher is set up)");
    }
    const RollbackReport r = publisher_->Rollback("RollbackWeights", accepted);
    response->set_tensors(r.tensors);
    response->set_bytes(r.bytes);
    response->set_seconds(r.seconds);
  });
}

}  // namespace vlmgraph::server
