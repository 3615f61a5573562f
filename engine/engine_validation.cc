// Engine's request checks (engine/engine.h: Validate, ValidateTokens): any thread, they read only
// the immutable configuration. Each refusal is an EngineError naming the field and saying what to
// change.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "model/prompt_check.h"

namespace vlmgraph {

void Engine::ValidateTokens(const std::vector<int64_t>& ids, const at::Tensor& tiles) const {
  const VlmConfig& cfg = model_->cfg;
  if (std::string error = CheckTiles(cfg, tiles, "tiles"); !error.empty())
    throw EngineError("tiles", error);
  std::string error = CheckPromptIds(cfg, ids.data(), ids.size(), TileCount(tiles), "input_ids");
  if (!error.empty()) throw EngineError("input_ids", error);
  if (TileCount(tiles) > options_.max_tiles_per_request) {
    throw EngineError("tiles", "tiles: request has " + std::to_string(TileCount(tiles)) +
                                   " image tiles; at most " +
                                   std::to_string(options_.max_tiles_per_request) + " are allowed");
  }
  const int64_t len = static_cast<int64_t>(ids.size());
  if (len > options_.buckets.max_seq() && options_.buckets.oversize == OversizePolicy::kReject) {
    throw EngineError("input_ids", "input_ids: prompt of " + std::to_string(len) +
                                       " tokens is longer than the largest prefill bucket (" +
                                       std::to_string(options_.buckets.max_seq()) +
                                       "); shorten it or add a larger buckets.seq_lens entry");
  }
}

ValidatedRequest Engine::Validate(GenerateRequest request) const {
  const auto& s = request.sampling;
  const int64_t len = static_cast<int64_t>(request.input_ids.size());
  const std::string max_new = "sampling.max_new_tokens";
  if (len >= max_context()) {  // the prompt alone leaves no room for a new token
    throw EngineError("input_ids",
                      "input_ids: prompt of " + std::to_string(len) +
                          " tokens leaves no room for a new token in the longest context bucket (" +
                          std::to_string(max_context()) + " tokens); shorten it by at least " +
                          std::to_string(len - max_context() + 1) +
                          (len == max_context() ? " token" : " tokens") +
                          " or raise buckets.context_lens",
                      ContextOverflow{len, 0, max_context()});
  }
  ValidateTokens(request.input_ids, request.tiles);
  if (s.max_new_tokens < 1) {
    throw EngineError(max_new, max_new + ": must be >= 1, got " + std::to_string(s.max_new_tokens));
  }
  const int64_t limit = options_.max_new_tokens_limit;
  if (limit > 0 && s.max_new_tokens > limit) {
    throw EngineError(max_new, max_new + ": " + std::to_string(s.max_new_tokens) +
                                   " exceeds this server's limit of " + std::to_string(limit) +
                                   " (limits.max_new_tokens)");
  }
  if (len + s.max_new_tokens > max_context()) {
    throw EngineError(max_new,
                      max_new + ": prompt (" + std::to_string(len) + " tokens) + max_new_tokens (" +
                          std::to_string(s.max_new_tokens) +
                          ") exceeds the longest context bucket (" + std::to_string(max_context()) +
                          " tokens); lower max_new_tokens to at most " +
                          std::to_string(max_context() - len) + " or raise buckets.context_lens",
                      ContextOverflow{len, s.max_new_tokens, max_context()});
  }
  if (!s.greedy) {
    if (!(s.temperature > 0) || !std::isfinite(s.temperature)) {
      throw EngineError("sampling.temperature", "sampling.temperature: must be > 0 when sampling");
    }
    if (!(s.top_p > 0 && s.top_p <= 1))
      throw EngineError("sampling.top_p", "sampling.top_p: must lie in (0, 1]");
    if (s.top_k < 0)
      throw EngineError("sampling.top_k", "sampling.top_k: must be >= 0 (0 disables it)");
  }
  for (const auto& [field, top] :
       {std::pair<const char*, int64_t>{"logprobs.top", request.logprobs.top},
        {"logprobs.prompt_top", request.logprobs.prompt_top}}) {
    if (top < 0 || top > kMaxTopLogprobs) {
      throw EngineError(field, std::string(field) + ": must lie in [0, " +
                                   std::to_string(kMaxTopLogprobs) + "], got " +
                                   std::to_string(top));
    }
  }
  // No index in the message: a protocol may add default stop ids to the client's.
  for (int64_t t : s.stop_token_ids) {
    if (t < 0 || t >= model_->cfg.lm_vocab_size) {
      throw EngineError("sampling.stop_token_ids",
                        "sampling.stop_token_ids: stop token id " + std::to_string(t) +
                            " is outside the vocabulary [0, " +
                            std::to_string(model_->cfg.lm_vocab_size) + ")");
    }
  }
  return ValidatedRequest(std::move(request));
}

ValidatedForward Engine::Validate(ForwardRequest request) const {
  const int64_t len = static_cast<int64_t>(request.input_ids.size());
  if (len > max_context()) {
    throw EngineError("input_ids", "input_ids: " + std::to_string(len) +
                                       " tokens exceed the longest context bucket (" +
                                       std::to_string(max_context()) +
                                       " tokens, buckets.context_lens)");
  }
  ValidateTokens(request.input_ids, request.tiles);
  if (!request.target_ids.empty()) {
    const std::string error =
        CheckTargetIds(model_->cfg, request.target_ids, request.input_ids.size(), "target_ids");
    if (!error.empty()) throw EngineError("target_ids", error);
  }
  for (size_t i = 0; i < request.logits_positions.size(); ++i) {
    const int64_t p = request.logits_positions[i];
    if (p < 0 || p >= len) {
      throw EngineError("logits_positions", "logits_positions[" + std::to_string(i) +
                                                "]: logits position " + std::to_string(p) +
                                                " is outside [0, " + std::to_string(len) + ")");
    }
  }
  return ValidatedForward(std::move(request));
}

}  // namespace vlmgraph
