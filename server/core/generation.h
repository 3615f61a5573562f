// server/core/generation.h: one accepted generation request, from submission to its last token, for
// every API (gRPC Generate, OpenAI chat and text completions). The transports differ only in how
// they write a delta.
//
// The request is validated (Engine::Validate makes a ValidatedRequest) and goes to the engine the
// router picks (Note [Data-parallel routing], server/core/engine_router.h). Deltas come in order;
// each carries the new token ids and, with a TextStream, their new text (stop strings already
// applied: the text ends before a stop string, and the generation is cancelled in the engine when
// one matches). Records time to first token, inter-token latency and generated tokens in `metrics`.
//
// GenerationSession has no thread of its own: event-driven transports (the HTTP front,
// server/openai/openai_http.cc; gRPC's callback API, server/grpc/generate_rpc.cc) drive it. It
// submits at construction, calls `on_update` (from the GPU thread; it must only post work) whenever
// something arrived, and Take() turns what arrived into deltas without blocking:
//
//   auto session = std::make_shared<GenerationSession>(router, metrics, std::move(request),
//                                                      accepted, text, [=] { post(drain); });
//   // drain, on the transport's thread:
//   GenerationSession::Taken t = session->Take();
//   for (const GenerationDelta& d : t.deltas) write(d);
//   if (t.finished) { ... t.outcome or t.error ... }
//
// Errors: the constructor throws what the router and scheduler throw (RESOURCE_EXHAUSTED,
// UNAVAILABLE: no engine serves, or the engine's device failed); Taken::error carries what the
// engine reported for the request, or CANCELLED after Cancel().
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/engine_types.h"
#include "server/core/engine_router.h"
#include "server/core/metrics.h"
#include "server/core/scheduler.h"
#include "server/core/text_stream.h"

namespace vlmgraph::server {

struct GenerationDelta {
  std::vector<int64_t> token_ids;  // new since the previous delta; empty only in the last delta,
                                   // which carries text held back until the end
  std::string text;                // their text (empty without a TextStream, or held back)
  // One per token id when the request asked for logprobs (LogprobsParams::tokens), else empty.
  std::vector<TokenLogprob> logprobs;
  // In the first delta when the request asked for the prompt's (LogprobsParams::prompt): one per
  // prompt token from the second on. Else null.
  std::shared_ptr<const std::vector<TokenLogprob>> prompt_logprobs;
};

struct GenerationOutcome {
  // kLength (max_new_tokens), kStopToken (a stop token, or a stop string when
  // stop_string_matched), kContextFull.
  FinishReason reason = FinishReason::kNone;
  bool stop_string_matched = false;
  int64_t generated_tokens = 0;
  double queue_seconds = 0;                // acceptance -> prefill start
  double time_to_first_token_seconds = 0;  // acceptance -> first delta written
  double total_seconds = 0;                // acceptance -> end
};

class GenerationSession {
 public:
  // Queues the request on the engine `router` picks (throws what EngineRouter::SubmitGenerate
  // throws: RESOURCE_EXHAUSTED, UNAVAILABLE). `text` may be null and must outlive the session;
  // `on_update` may be empty.
  GenerationSession(EngineRouter& router, Metrics* metrics, ValidatedRequest request,
                    Clock::time_point accepted, TextStream* text, std::function<void()> on_update);
  // Cancels the sequence in the engine unless it finished.
  ~GenerationSession();
  GenerationSession(const GenerationSession&) = delete;
  GenerationSession& operator=(const GenerationSession&) = delete;

  struct Taken {
    std::vector<GenerationDelta> deltas;  // in order; time to first token and inter-token
                                          // latency are recorded as they are taken
    bool finished = false;                // nothing more will come
    GenerationOutcome outcome;            // when finished without error
    std::exception_ptr error;             // when finished with an error
  };
  // What arrived since the last call; waits up to `timeout` for something (0: never blocks). One
  // thread at a time; after `finished` it returns finished again with nothing new.
  Taken Take(std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Ends the generation with CANCELLED (the engine's sequence is freed). Any thread.
  void Cancel();
  bool finished() const { return finished_; }

 private:
  void Record(const GenerationDelta& delta);

  Scheduler* scheduler_ = nullptr;  // the engine's, picked by the router
  Metrics* const metrics_;
  TextStream* const text_;
  const Clock::time_point accepted_;
  std::shared_ptr<GenerationStream> stream_;
  GenerationOutcome out_;
  Clock::time_point last_delta_;
  std::atomic<bool> finished_{false};
  bool engine_done_ = false;  // the engine ended the sequence (no cancel needed)
};

}  // namespace vlmgraph::server
