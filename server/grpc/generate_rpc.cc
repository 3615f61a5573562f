// server/grpc/generate_rpc.cc: the Generate RPC on gRPC's callback API, one GenerateCall per stream
// (Note [Generate on the callback API] in server/grpc/service.h).
#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/log.h"
#include "base/thread_name.h"
#include "server/core/drain_batches.h"
#include "server/core/generation.h"
#include "server/core/status.h"
#include "server/core/text_stream.h"
#include "server/grpc/convert.h"
#include "server/grpc/service.h"

namespace vlmgraph::server {
namespace {

namespace net = boost::asio;

v1::FinishReason ToProto(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStopToken:
      return v1::FINISH_REASON_STOP_TOKEN;
    case FinishReason::kContextFull:
      return v1::FINISH_REASON_CONTEXT_FULL;
    default:
      return v1::FINISH_REASON_UNSPECIFIED;
  }
}

void ToProto(const TokenLogprob& in, v1::TokenLogprob* out) {
  out->set_logprob(in.logprob);
  for (const auto& [id, logprob] : in.top) {
    v1::TopLogprob* top = out->add_top();
    top->set_token_id(id);
    top->set_logprob(logprob);
  }
}

}  // namespace

struct VlmGraphService::GenerateThreads {
  explicit GenerateThreads(int stream_threads)
      : drains(&streams, stream_threads), streams(static_cast<size_t>(stream_threads)) {}
  // Before the pools: destroyed after them (Note [Batched drains]).
  DrainBatches<GenerateCall> drains;
  net::thread_pool prepare{kPrepareThreads};
  net::thread_pool streams;
  std::atomic<int64_t> queued{0};  // calls waiting for a prepare thread
};

std::shared_ptr<VlmGraphService::GenerateThreads> VlmGraphService::StartGenerateThreads(
    int stream_threads) {
  return std::make_shared<GenerateThreads>(stream_threads);
}

// One Generate stream. gRPC holds it through self_ from Generate to OnDone; posted work holds it
// through a shared_ptr, the GPU thread's notification through a weak_ptr. Everything below the
// mutex is touched under it only, and nothing touches the gRPC call once it ended (Finish called):
// then OnDone may free the context and the request.
class VlmGraphService::GenerateCall final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                                            public std::enable_shared_from_this<GenerateCall> {
 public:
  GenerateCall(VlmGraphService* service, grpc::CallbackServerContext* context,
               const v1::GenerateRequest* request)
      : service_(service),
        context_(context),
        request_(request),
        accepted_(Clock::now()),
        count_(std::in_place, &service->in_flight_) {}

  // On gRPC's callback thread, before gRPC has the reactor: the API key, then the request goes to
  // a prepare thread (or the call ends with the refusal).
  void Start(std::shared_ptr<GenerateCall> self) {
    std::lock_guard<std::mutex> lock(mu_);
    self_ = std::move(self);
    try {
      service_->Authorize(context_, Scope::kInference, "Generate");
      GenerateThreads& threads = *service_->generate_threads_;
      const int64_t limit = service_->config_.batching.max_queue_size;
      if (threads.queued.load() >= limit) {
        throw ServerError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "too many Generate requests are waiting to be prepared "
                          "(batching.max_queue_size = " +
                              std::to_string(limit) + "); retry later");
      }
      ++threads.queued;
      net::post(threads.prepare, [s = shared_from_this()] { s->Prepare(); });
    } catch (...) {
      EndLocked(std::current_exception());
    }
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    write_outstanding_ = false;
    if (ended_) return;
    if (!ok) {
      return EndLocked(std::make_exception_ptr(
          ServerError(grpc::StatusCode::CANCELLED, "client went away mid-stream")));
    }
    PumpLocked();
  }

  // The client cancelled, its deadline passed, or the server's Shutdown cancelled the call.
  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return;
    // A prepare thread reads the request now: it ends the call when it is done with it.
    if (phase_ == Phase::kPreparing) {
      cancel_wanted_ = true;
      return;
    }
    EndLocked(std::make_exception_ptr(
        ServerError(grpc::StatusCode::CANCELLED, "cancelled by the client")));
  }

  void OnDone() override {
    std::shared_ptr<GenerateCall> keep;  // may be the last reference: released after the lock
    std::lock_guard<std::mutex> lock(mu_);
    keep = std::move(self_);
  }

 private:
  friend class DrainBatches<GenerateCall>;  // calls Drain
  enum class Phase { kQueued, kPreparing, kRunning };

  // Any thread (the GPU thread's on_update): at most one drain waits to run, in a batch of the
  // stream threads (Note [Batched drains]).
  void ScheduleDrain() {
    if (drain_scheduled_.exchange(true)) return;
    service_->generate_threads_->drains.Schedule(shared_from_this());
  }

  // On a prepare thread: convert and validate (the one validation, thread-safe: ids, image tokens
  // vs tiles, context, sampling), then submit.
  void Prepare() {
    NameThreadOnce("vlmg-grpc-prep");
    --service_->generate_threads_->queued;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return;  // cancelled while queued
      phase_ = Phase::kPreparing;
    }
    std::exception_ptr error;
    try {
      Engine& engine = *service_->engine_;
      ValidatedRequest request = engine.Validate(ToEngineRequest(
          *request_, engine.model_config(), service_->config_.limits, service_->text_));
      const int64_t prompt_tokens = static_cast<int64_t>(request->input_ids.size());
      const int64_t tiles = request->tiles.defined() ? request->tiles.size(0) : 0;
      if (LogEnabled(LogLevel::kDebug)) {
        LogDebug("Generate " + LogSafe(request_->request_id()) + " from " + context_->peer() +
                 ": " + std::to_string(prompt_tokens) + " prompt tokens, " + std::to_string(tiles) +
                 " tiles, max_new_tokens " + std::to_string(request->sampling.max_new_tokens));
      }
      std::unique_ptr<TextStream> text;
      if (service_->text_) {
        const auto& stop = request_->sampling().stop();
        text = std::make_unique<TextStream>(&service_->text_->tokenizer(),
                                            std::vector<std::string>(stop.begin(), stop.end()));
      }
      std::lock_guard<std::mutex> lock(mu_);
      prompt_tokens_ = prompt_tokens;
      tiles_ = tiles;
      text_ = std::move(text);
      if (cancel_wanted_) {
        error = std::make_exception_ptr(
            ServerError(grpc::StatusCode::CANCELLED, "cancelled by the client"));
      } else {
        // The GPU thread only posts a drain; the call may have ended by the time it runs.
        auto on_update = [weak = weak_from_this()] {
          if (auto s = weak.lock()) s->ScheduleDrain();
        };
        session_ = std::make_unique<GenerationSession>(*service_->router_, service_->metrics_,
                                                       std::move(request), accepted_, text_.get(),
                                                       on_update);
        phase_ = Phase::kRunning;
      }
    } catch (...) {
      error = std::current_exception();  // the lock is released by now
    }
    if (error) {
      std::lock_guard<std::mutex> lock(mu_);
      EndLocked(error);
    }
  }

  // On a stream thread (DrainBatches): what arrived goes into the pending chunk, which is written
  // unless a write is outstanding.
  void Drain() {
    NameThreadOnce("vlmg-grpc-strm");
    drain_scheduled_ = false;
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_ || !session_ || generation_done_) return;
    GenerationSession::Taken t;
    try {
      t = session_->Take();
    } catch (...) {
      t.finished = true;
      t.error = std::current_exception();
    }
    for (const GenerationDelta& d : t.deltas) {
      v1::TokenChunk* chunk = pending_.mutable_tokens();
      chunk->mutable_token_ids()->Add(d.token_ids.begin(), d.token_ids.end());
      chunk->mutable_text()->append(d.text);
      // One per token id when asked (LogprobsParams::tokens); the prompt's once, with the first.
      for (const TokenLogprob& l : d.logprobs) ToProto(l, chunk->add_logprobs());
      if (d.prompt_logprobs) {
        for (const TokenLogprob& l : *d.prompt_logprobs) ToProto(l, chunk->add_prompt_logprobs());
      }
      has_pending_ = true;
    }
    if (t.finished) {
      generation_done_ = true;
      error_ = t.error;
      outcome_ = t.outcome;
    }
    PumpLocked();
  }

  // Starts the next write if none is outstanding: the pending chunk, else (the generation done)
  // the summary, else ends the call.
  void PumpLocked() {
    if (ended_ || write_outstanding_) return;
    if (has_pending_) {
      writing_.Swap(&pending_);
      pending_.Clear();
      has_pending_ = false;
      write_outstanding_ = true;
      StartWrite(&writing_);
      return;
    }
    if (!generation_done_) return;
    if (error_) return EndLocked(error_);
    if (summary_sent_) return EndLocked(nullptr);
    const GenerationOutcome& r = outcome_;
    writing_.Clear();
    v1::GenerateSummary* s = writing_.mutable_summary();
    s->set_finish_reason(r.stop_string_matched ? v1::FINISH_REASON_STOP_STRING : ToProto(r.reason));
    s->set_prompt_tokens(prompt_tokens_);
    s->set_image_tiles(tiles_);
    s->set_generated_tokens(r.generated_tokens);
    s->set_queue_seconds(r.queue_seconds);
    s->set_time_to_first_token_seconds(r.time_to_first_token_seconds);
    s->set_total_seconds(SecondsSince(accepted_));
    summary_sent_ = true;
    write_outstanding_ = true;
    StartWrite(&writing_);
  }

  // Ends the call once: frees the engine's sequence, records and sends the status.
  void EndLocked(std::exception_ptr error) {
    ended_ = true;
    session_.reset();  // cancels the sequence in the engine unless it ended
    const grpc::Status status = service_->FinishRpc("Generate", *context_, accepted_, error);
    count_.reset();
    Finish(status);
  }

  VlmGraphService* const service_;
  grpc::CallbackServerContext* const context_;  // gRPC's until OnDone
  const v1::GenerateRequest* const request_;    // gRPC's until OnDone
  const Clock::time_point accepted_;
  std::atomic<bool> drain_scheduled_{false};

  std::mutex mu_;
  Phase phase_ = Phase::kQueued;
  bool cancel_wanted_ = false;  // OnCancel came while preparing
  bool ended_ = false;          // Finish was called
  std::optional<CallCount> count_;
  int64_t prompt_tokens_ = 0;
  int64_t tiles_ = 0;
  std::unique_ptr<TextStream> text_;            // outlives session_, which points to it
  std::unique_ptr<GenerationSession> session_;  // from submission until the call ends
  bool generation_done_ = false;                // the session finished: error_ or outcome_
  std::exception_ptr error_;
  GenerationOutcome outcome_;
  v1::GenerateResponse pending_;  // tokens taken since the last write started, coalesced
  bool has_pending_ = false;
  v1::GenerateResponse writing_;  // the outstanding write's message: unchanged until OnWriteDone
  bool write_outstanding_ = false;
  bool summary_sent_ = false;
  std::shared_ptr<GenerateCall> self_;  // gRPC's reference: Start to OnDone
};

grpc::ServerWriteReactor<v1::GenerateResponse>* VlmGraphService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  auto call = std::make_shared<GenerateCall>(this, context, request);
  call->Start(call);
  return call.get();
}

}  // namespace vlmgraph::server
