// engine/engine_types.h: requests, results, errors and statistics of the engine's public API.
//
// Errors: engine calls throw `EngineError` with a `code` whose meaning follows gRPC's status codes;
// the server converts it to a grpc::Status in one place. Messages say what to change.
#pragma once

#include <ATen/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/bucket.h"

namespace vlmgraph {

// A generation that does not fit the longest context (EngineError::context_overflow): the numbers
// a protocol needs to say so in its own words.
struct ContextOverflow {
  int64_t prompt_tokens = 0;
  int64_t max_new_tokens = 0;  // 0: the prompt alone leaves no room for a new token
  int64_t max_context = 0;     // the longest context bucket, tokens
};

class EngineError : public std::runtime_error {
 public:
  enum class Code {
    kInvalidArgument,
    kResourceExhausted,
    kFailedPrecondition,
    kUnavailable,
    kInternal
  };
  EngineError(Code code, const std::string& message) : std::runtime_error(message), code_(code) {}
  // An invalid request or option (kInvalidArgument); `message` says what to change.
  static EngineError InvalidArgument(const std::string& message) {
    return EngineError(Code::kInvalidArgument, message);
  }
  // An invalid request (kInvalidArgument) about one of its fields: `message` starts with `field`.
  EngineError(std::string field, const std::string& message,
              std::optional<ContextOverflow> overflow = std::nullopt)
      : std::runtime_error(message),
        code_(Code::kInvalidArgument),
        field_(std::move(field)),
        overflow_(overflow) {}
  Code code() const { return code_; }
  // The request field at fault as the engine's request types spell it, which is also the gRPC
  // API's field path: "input_ids", "tiles", "sampling.max_new_tokens", "sampling.temperature",
  // "sampling.top_p", "sampling.top_k", "sampling.stop_token_ids", "logprobs.top",
  // "logprobs.prompt_top", "target_ids", "logits_positions"; "" when the error is about no one
  // field. what() starts with it. Other protocols translate it to their own names
  // (server/openai/requests.h).
  const std::string& field() const { return field_; }
  // Set when a generation does not fit the longest context (field input_ids or
  // sampling.max_new_tokens).
  const std::optional<ContextOverflow>& context_overflow() const { return overflow_; }

 private:
  Code code_;
  std::string field_;
  std::optional<ContextOverflow> overflow_;
};

// How to pick each new token. Upstream nanoVLM's generate: greedy argmax, or top-k then top-p
// (nucleus) filtering of the logits followed by sampling from softmax(filtered / temperature).
struct SamplingParams {
  int64_t max_new_tokens = 16;  // >= 1, <= EngineOptions::max_new_tokens_limit when set
  bool greedy = true;
  double temperature = 1.0;             // > 0, used when !greedy
  int64_t top_k = 0;                    // 0 = off
  double top_p = 1.0;                   // in (0, 1]; 1 = off
  uint64_t seed = 0;                    // per-request RNG seed (sampling only)
  std::vector<int64_t> stop_token_ids;  // generation ends after emitting one of these
};

// The most alternatives a request may ask for at one position (OpenAI's top_logprobs limit, and
// vLLM's default max_logprobs).
inline constexpr int64_t kMaxTopLogprobs = 20;

// Log-probabilities a generation asks for (the OpenAI API's logprobs, top_logprobs and echo).
// Every value is log_softmax over the model's whole vocabulary of its raw logits, in float32:
// before temperature, top-k and top-p, as vLLM returns them by default. Requests that ask for none
// cost nothing: their decode steps run as they would without this (Note [Logprobs off the graph]
// in engine/logprobs.h).
struct LogprobsParams {
  bool tokens = false;     // each new token's logprob (TokenEvent::logprob)
  int64_t top = 0;         // with `tokens`: the `top` most likely tokens too, 0..kMaxTopLogprobs
  bool prompt = false;     // each prompt token's logprob from the second on (echo)
  int64_t prompt_top = 0;  // with `prompt`: the most likely tokens at each, 0..kMaxTopLogprobs
  bool any() const { return tokens || prompt; }
};

// One position's log-probabilities: the token's own, and the most likely tokens there.
struct TokenLogprob {
  float logprob = 0;                           // of the token at this position, natural log
  std::vector<std::pair<int64_t, float>> top;  // (token id, logprob), most likely first
};

struct GenerateRequest {
  std::vector<int64_t> input_ids;  // prompt, with mp_image_token_length image tokens per tile
  at::Tensor tiles;                // (N, 3, S, S) float32 in [0, 1], CPU; undefined for text only
  SamplingParams sampling;
  LogprobsParams logprobs;
};

enum class FinishReason { kNone, kLength, kStopToken, kContextFull, kCancelled };
const char* FinishReasonName(FinishReason r);

using SequenceId = int64_t;

// One new token of one sequence, produced by Admit (the first token) or Step.
struct TokenEvent {
  SequenceId id = -1;
  int64_t token = -1;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  // The token's log-probabilities, when its request asked (LogprobsParams::tokens).
  std::optional<TokenLogprob> logprob;
  // On a sequence's first event, when its request asked (LogprobsParams::prompt): one entry per
  // prompt token from the second on, prompt length - 1 in all (the first token has none).
  std::shared_ptr<const std::vector<TokenLogprob>> prompt_logprobs;
};

struct ForwardRequest {
  std::vector<int64_t> input_ids;
  at::Tensor tiles;                 // as in GenerateRequest
  std::vector<int64_t> target_ids;  // same length as input_ids, -100 = ignored; empty = no loss
  std::vector<int64_t> logits_positions;  // positions whose full logits to return
};

struct ForwardResult {
  double loss = 0.0;                       // mean cross entropy over targets != -100
  int64_t loss_tokens = 0;                 // targets that counted
  std::vector<std::vector<float>> logits;  // one (vocab) row per requested position
  BucketKey bucket;                        // prefill bucket used
  bool graphed = false;
};

// Receives every measured event; the server's Metrics implements it. Called on the engine's thread
// (the GPU thread); implementations must be cheap and must not call back into the engine.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void OnCapture(const BucketKey& key, double seconds) {}
  // One region run: graph replay (graphed) or eager, host wall time including the device work.
  virtual void OnStep(const BucketKey& key, bool graphed, double seconds) {}
  virtual void OnEagerFallback(Region region, const std::string& reason) {}
  // Tokens a region processed: `real` from requests, `padded` the bucket's total.
  virtual void OnTokens(Region region, int64_t real, int64_t padded) {}
  virtual void OnBatch(Region region, int64_t real_batch) {}
};

// Counters kept by the engine itself (tests, diagnose). Thread-safe to read through Snapshot().
struct EngineCounters {
  std::map<std::string, int64_t> captures;  // "region/bucket" -> count
  std::map<std::string, int64_t> replays;   // "region/bucket" -> count
  // "region/bucket" -> count (CPU, capture off); shapes with no bucket count as "region/exact".
  std::map<std::string, int64_t> eager_runs;
  int64_t eager_fallbacks = 0;    // shapes with no bucket that ran eagerly
  int64_t rejected_oversize = 0;  // shapes with no bucket that were rejected
  int64_t real_tokens = 0, padded_tokens = 0;
  double capture_seconds_total = 0;
  // Per captured bucket ("region/bucket"): capture wall time and how much the shared graph pool
  // grew with it (0 when an earlier, larger capture's blocks were reused).
  std::map<std::string, double> capture_seconds;
  std::map<std::string, int64_t> capture_pool_growth_bytes;
  // Host time of decode steps before the device work is waited for: choosing the bucket, filling
  // and copying the inputs, launching the replay (the analogue of torch.compile's guard checks).
  double decode_dispatch_seconds_total = 0;
  int64_t decode_steps = 0;
  int64_t TotalCaptures() const;
  int64_t TotalReplays() const;
};

struct MemoryStats {
  int64_t allocated_bytes = 0;   // device memory held by live tensors (CUDA caching allocator)
  int64_t reserved_bytes = 0;    // device memory reserved by the caching allocator
  int64_t graph_pool_bytes = 0;  // reserved by the shared CUDA graph pool
  int64_t kv_cache_bytes = 0;
  // KV pages sequences can hold (the scratch page not counted) and those they hold now.
  int64_t kv_cache_pages = 0;
  int64_t kv_cache_pages_used = 0;
  int64_t kv_cache_page_size = 0;    // tokens per page
  int64_t peak_allocated_bytes = 0;  // since start (or the last ResetPeakDeviceMemory)
  int64_t peak_reserved_bytes = 0;
};

}  // namespace vlmgraph
