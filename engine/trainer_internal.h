// engine/trainer_internal.h: what the Trainer's source files share, and nothing else includes:
// engine/trainer.cc (set-up, buffers, the micro-step and optimizer graphs, warm-up),
// engine/trainer_step.cc (micro-batches and steps: begin, run, submit, wait, complete),
// engine/trainer_optimizer.cc (clipping, AdamW, skipped steps and groups, the sharded optimizer)
// and engine/trainer_checkpoint.cc (checkpoint files). Thread rules and errors: engine/trainer.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine/bucket.h"
#include "engine/device.h"
#include "engine/trainer.h"

namespace vlmgraph {

// One parameter group (LearningRates::kGroups): its trained parameters and their AdamW state.
struct Trainer::Group {
  std::string name;  // "vision", "projector" or "language" (LearningRates::kGroups)
  at::Tensor lr;     // device float32 scalar, read by the captured optimizer graph
  std::vector<std::string> names;
  // params/grads: float32 masters and gradient accumulators (the model's own parameters and
  // .grad in float32 mode); exp_avg, exp_avg_sq float32; steps device float32 scalars.
  std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq, steps;
};

namespace trainer_internal {

using Clock = std::chrono::steady_clock;

// The optimizer part's graph key (no batch or sequence shape).
inline const BucketKey kOptimizerKey{Region::kTrain, 0, 0, 0};

// A trainer that runs AdamW inside its one-micro-batch steps (Note [Optimizer inside the
// micro-step]) keeps a second graph per bucket for the micro-steps of steps with several
// micro-batches, which accumulate instead (Note [Micro-batches]). BucketKey::tiles, which region
// train does not use and Label() does not show, tells the two graphs apart.
inline BucketKey AccumulatingGraph(BucketKey bucket) {
  bucket.tiles = 1;
  return bucket;
}
inline BucketKey PlainBucket(BucketKey key) {
  key.tiles = 0;
  return key;
}

}  // namespace trainer_internal

// Static inputs of one training bucket: examples right-padded with a pad id and target -100,
// missing rows all -100, missing tiles zero (their embeddings are never selected).
struct Trainer::MicroBuffers {
  BucketKey key;
  at::Tensor ids;      // (b, s) int64
  at::Tensor targets;  // (b, s) int64
  at::Tensor tiles;    // (b * max_tiles_per_example, 3, S, S) compute dtype, or undefined
  // Tiles the current micro-batch filled (CPU eager runs encode only these).
  int64_t real_tiles = 0;
};

// A step between BeginStep and its last RunNextMicroBatch.
struct Trainer::PendingStep {
  std::vector<TrainExample> examples;
  std::vector<size_t> starts;  // micro-batch i: examples [starts[i], starts[i + 1])
  size_t next = 0;             // the micro-batch RunNextMicroBatch runs next
  bool direct = false;         // AdamW inside the one micro-step (Note [Optimizer inside ...])
  at::Tensor loss_sum;         // device float32 scalar: the sum of the scaled micro-batch losses
  std::vector<at::Tensor> optimizer_out;  // device scalars: gradient norm, found_inf
  TrainStepResult result;
  // Submit's steps (Note [Submitted steps]): completed by Wait, not by the last micro-batch.
  bool submitted = false;
  trainer_internal::Clock::time_point submitted_at;
  // FinishStep .. CompleteStep: {loss, gradient norm, found_inf} in pinned host memory, and the
  // point of the stream after the step's work and that copy.
  at::Tensor report;
  std::unique_ptr<DeviceEvent> done;
};

}  // namespace vlmgraph
