// engine/evaluator.h: the loss of a model over a validation set, forward only (no gradient, no
// weight or optimizer change), on one rank or summed over the ranks of a data-parallel group.
//
//   EvalOptions o;  o.device = trainer.options().device;  o.micro_batch_size = 8;
//   o.data_parallel = group;                               // or null: one rank
//   EvalLoss e = EvaluateLoss(trainer.model(), my_shard_of_the_validation_set, o);
//   std::printf("eval_loss %.4f over %lld tokens\n", e.loss, (long long)e.target_tokens);
//
// Formula: loss = sum over every counted target (targets != -100) of every example of every rank
// of the cross entropy (logsumexp(logits) - logits[target], float32 from the logits in the model's
// dtype, LanguageModelImpl::CrossEntropySum) / the number of counted targets. It is the mean per
// target token of the whole set (as lm-evaluation-harness and nanoGPT's estimate_loss reduce a
// fixed set), so it does not depend on the micro-batch size or on how the set is sharded over the
// ranks: 2 ranks with a shard each give the loss 1 rank gives on the whole set. (A training
// step's loss is a mean per micro-batch, nanoVLM's reduction: it weighs examples in short
// micro-batches more, which a held-out curve should not.)
//
// Work: the examples in order, in micro-batches of at most micro_batch_size, each right-padded to
// its longest example (padding has no target, and attention is causal, so real tokens get the
// logits of an unpadded run); eager, under NoGradGuard: activations are freed as the forward
// goes. The caller passes the model whose weights it wants scored: with a Trainer, its model()
// (call Trainer::GatherOptimizerState on every rank first when the optimizer is sharded).
//
// Data parallel: every rank of the group must call EvaluateLoss at the same point with its own
// shard (any sizes, empty included): one all-reduce (SUM) of {loss sum, targets, examples} in
// float64 on the model's device, inside the group's step watchdog (a peer that died ends the call
// with EngineError(kUnavailable), or the process as a hung training step does).
//
// Thread rules: the thread that drives the model (and the group). Errors:
// EngineError(kInvalidArgument) for an example whose ids, targets or tiles do not fit the model
// (naming the example's index); EngineError(kUnavailable) for a lost peer.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "engine/data_parallel.h"
#include "engine/trainer.h"
#include "model/vision_language_model.h"

namespace vlmgraph {

struct EvalOptions {
  at::Device device = at::kCPU;  // the model's device
  int64_t micro_batch_size = 8;  // examples per forward, >= 1
  // Null or a group of one: this rank's sums are the result.
  std::shared_ptr<DataParallelGroup> data_parallel;
};

struct EvalLoss {
  // Mean cross entropy per counted target over every rank's examples (NaN when none has a target).
  double loss = 0;
  double loss_sum = 0;        // summed cross entropy, every rank
  int64_t target_tokens = 0;  // counted targets, every rank
  int64_t examples = 0;       // examples, every rank
  double seconds = 0;         // this rank's wall time, the all-reduce included
};

EvalLoss EvaluateLoss(VisionLanguageModel& model, const std::vector<TrainExample>& examples,
                      const EvalOptions& options);

// The same over `count` examples made on demand, one micro-batch at a time, so a large set never
// sits in memory whole: example(i) for i in [0, count), in order, on the calling thread (its
// exceptions pass through). Tiles may be float32 or the model's dtype.
EvalLoss EvaluateLoss(VisionLanguageModel& model, int64_t count,
                      const std::function<TrainExample(int64_t index)>& example,
                      const EvalOptions& options);

}  // namespace vlmgraph
