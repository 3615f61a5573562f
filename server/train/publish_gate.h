// server/train/publish_gate.h: the publish gate, which scores a Train job's weights on a held-out
// set before they may replace the served weights (server/train/weights_publisher.h runs it).
//
//   PublishGate gate = PublishGate::FromConfig(config, engine, text);   // start-up, any thread
//   HeldOutScore served = gate.Score(engine);                           // GPU thread
//   ... copy the candidate into the engine's weights ...
//   HeldOutScore candidate = gate.Score(engine);                        // GPU thread
//   GateVerdict v = gate.Judge(served, candidate, MaxAbsWeight(weights));
//   if (!v.accepted()) ... restore the served weights, refuse with v.message ...
//
// Note [Publish gate]: finite weights are not healthy weights (a learning rate of 1e30 leaves
// every weight finite but near 1e26, and every answer empty). Before a job's weights are served,
// the gate checks, in order (each refusal names what it measured):
//   1. max_abs_weight: the largest |w| of the weights to publish is at most
//      train.publish_gate_max_abs_weight (0 = no bound);
//   2. non_finite: the candidate's held-out loss and its next-token logits at the end of every
//      held-out prompt are finite;
//   3. collapse: the candidate's greedy next token is not a stop token on every prompt while the
//      served model's is not (an answer that ends before it starts: an empty chat reply). Needs
//      stop tokens (model_stop_token_ids or the tokenizer's); without them it is not checked;
//   4. loss_increase: the candidate's held-out loss (mean cross entropy over every next token of
//      the held-out prompts, nats per token) is at most the served weights' loss +
//      train.publish_gate_max_loss_increase. A served loss that is not finite does not bound it.
// The held-out set is train.publish_gate_prompts_file, one prompt per line, or built-in prompts:
// for a model with a tokenizer, each line is a user message rendered with the model's chat
// template and generation prompt (the built-in ones: four short questions); for a model without
// one, each line is token ids separated by spaces or commas (built-in: four fixed 16-token
// sequences). The built-in token sequences check rules 2 and 3 only, not rule 4: arbitrary tokens
// are no held-out set of any task, and training on any data moves their loss (measured on
// nanovlm-tiny from its random weights: the digits example's 300 steps raise it from 6.99 to 13.3
// nats, a job of learning rate 1 to 12.0, while weights near 1e30 score 6.97). Rule 4 needs
// prompts of the served model's domain: chat prompts, or the operator's file.
// The candidate is scored as it would be served: copied into the engine's weights and run through
// Engine::Forward (the same buckets, dtype and kernels as a Forward request), between decode
// steps, on the GPU thread; no client request sees it unless it is accepted.
//
// Thread rules: a PublishGate is immutable after FromConfig; Score runs on the GPU thread (it
// drives the engine); Judge and the accessors are safe from any thread.
// Errors: FromConfig throws ServerConfigError naming train.publish_gate_prompts_file (unreadable
// file, a line that is not a valid prompt for this model or does not fit the engine); a built-in
// prompt the engine refuses (buckets.oversize reject with short prefill buckets) is left out with
// a warning. Score propagates engine errors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/config/config.h"
#include "server/core/text_prompt.h"

namespace vlmgraph::server {

// The gate's settings (the train.publish_gate* keys).
struct PublishGateOptions {
  bool enabled = true;
  double max_loss_increase = 1.0;  // nats per token over the served weights' held-out loss
  double max_abs_weight = 1000;    // 0 = no bound
};

// One scoring of the engine's current weights on the held-out prompts.
struct HeldOutScore {
  double loss = 0;                     // mean cross entropy over every scored token, nats per token
  int64_t loss_tokens = 0;             // tokens scored (each prompt's length - 1, summed)
  int64_t prompts = 0;                 // prompts scored
  int64_t prompts_ending_at_once = 0;  // prompts whose greedy next token is a stop token
  bool finite_logits = true;           // every next-token logit at every prompt's end is finite
};

// Why a publish was refused, or that it was not.
struct GateVerdict {
  // "" = accepted; else the metric label: max_abs_weight, non_finite, collapse, loss_increase.
  std::string reason;
  std::string message;  // the measurements and the rule that refused them ("" when accepted)
  bool accepted() const { return reason.empty(); }
};

class PublishGate {
 public:
  // The gate of `config` (train.publish_gate*) for `engine`'s model; `text` (may be null) is the
  // model's tokenizer and chat format.
  static PublishGate FromConfig(const ServerConfig& config, const Engine& engine,
                                const TextModel* text);

  // `prompts`: token ids of each held-out prompt (each >= 2 tokens, valid for `engine`);
  // `stop_token_ids`: the tokens that end an answer (may be empty); `bound_loss`: whether rule 4
  // applies (false for prompts of no particular domain).
  PublishGate(const Engine& engine, const std::vector<std::vector<int64_t>>& prompts,
              std::vector<int64_t> stop_token_ids, PublishGateOptions options,
              bool bound_loss = true);

  // Scores the weights the engine serves now (GPU thread).
  HeldOutScore Score(Engine& engine) const;

  // The rules of Note [Publish gate] on scores of the served and the candidate weights and the
  // candidate's largest |weight|.
  GateVerdict Judge(const HeldOutScore& served, const HeldOutScore& candidate,
                    double candidate_max_abs_weight) const;

  const PublishGateOptions& options() const { return options_; }
  int64_t prompts() const { return static_cast<int64_t>(prompts_.size()); }
  bool bounds_loss() const { return bound_loss_; }  // rule 4 applies

 private:
  std::vector<ValidatedForward> prompts_;
  std::vector<int64_t> stop_token_ids_;
  PublishGateOptions options_;
  bool bound_loss_;
};

}  // namespace vlmgraph::server
