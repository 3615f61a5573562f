// server/train/train_session.h: the interface the Train RPC drives, and its settings.
//
// A TrainBackend is one training job started from the serving model's weights: a step takes a
// checked batch (server/grpc/convert.h), runs forward + backward + optimizer on the job's own copy
// of the weights and reports the step; Save() writes a nanoVLM checkpoint; weights() are the job's
// current weights, which only WeightsPublisher::Publish (server/train/weights_publisher.h, through
// the publish gate) copies into the serving model: the only way training changes what clients are
// served. MakeTrainBackend (server/train/graphed_trainer.h) implements it on engine/Trainer. A step
// runs in pieces, one micro-batch each (engine/trainer.h, Note [Micro-batches]), so the GPU thread
// decodes between them (server/core/scheduler.h, Note [Interleaving bound]).
//
// clang-format off
//   std::unique_ptr<TrainBackend> job = MakeTrainBackend(engine, options, &metrics);  // GPU thread
//   job->BeginStep(batch);                                                            // GPU thread
//   while (!job->RunNextMicroBatch()) { /* a decode step */ }                         // GPU thread
//   TrainStepResult s = job->StepResult();                                            // GPU thread
//   job->Save("/srv/checkpoints/run1");                                               // GPU thread
//   publisher.Publish(engine, job->weights());                                        // GPU thread
// clang-format on
//
// Thread rules: create, use and destroy a backend on the GPU thread only (it touches the
// engine's model). Errors: ServerError INVALID_ARGUMENT for batches no bucket accepts (oversize
// policy reject); EngineError kInvalidArgument for a batch no trained parameter can learn from;
// FAILED_PRECONDITION from Save when a weight is not finite; torch errors propagate (the RPC
// guard maps them).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/bucket.h"
#include "engine/step_runner.h"
#include "engine/trainer.h"

namespace vlmgraph::server {

// A Train job's settings as the RPC gives them (v1::TrainConfig): the trainer's own
// vlmgraph::TrainOptions (engine/trainer.h) plus where the job starts. MakeTrainBackend sets what
// comes from the serving engine (device, dtype, buckets, CUDA graphs, the observer) and checks
// max_tiles_per_example against the server's limit. A part whose learning rate is 0 is frozen
// (Note [Learning rates] in engine/learning_rates.h).
struct TrainJobOptions {
  // The trainer's defaults (learning rates: upstream nanoVLM's, engine/learning_rates.h; AdamW as
  // torch.optim.AdamW) with upstream's max_grad_norm 1 (models/config.py, TrainConfig).
  static vlmgraph::TrainOptions Defaults() {
    vlmgraph::TrainOptions t;
    t.max_grad_norm = 1.0;
    return t;
  }
  vlmgraph::TrainOptions trainer = Defaults();
  // Absolute checkpoint directory (weights + optimizer.safetensors) to start from; "" = the
  // serving model's weights, fresh AdamW state.
  std::string resume_from;
};

class TrainBackend {
 public:
  virtual ~TrainBackend() = default;
  // One optimizer step over `batch` (checked by ToTrainBatch) in pieces, as engine/Trainer's
  // BeginStep, RunNextMicroBatch (true after the last micro-batch and the optimizer) and
  // StepResult (the step as the Trainer reports it). A piece that throws abandons the step.
  virtual void BeginStep(std::vector<TrainExample> batch) = 0;
  virtual bool RunNextMicroBatch() = 0;
  virtual TrainStepResult StepResult() = 0;
  // The whole step at once (no other work between its micro-batches).
  TrainStepResult Step(std::vector<TrainExample> batch) {
    BeginStep(std::move(batch));
    while (!RunNextMicroBatch()) {
    }
    return StepResult();
  }
  virtual void Save(const std::string& directory) = 0;
  // A rank of several with the sharded optimizer (Trainer::GatherOptimizerState): every rank must
  // call it, at once, before Save or a read of weights(). A no-op otherwise.
  virtual void GatherOptimizerState() {}
  // Bytes Save writes, at most (Trainer::checkpoint_bytes).
  virtual int64_t checkpoint_bytes() const = 0;
  // (name, float32 master) of every trained parameter, named as the serving model's
  // named_parameters(), on the engine's device; updated in place by Step().
  virtual const std::vector<std::pair<std::string, at::Tensor>>& weights() const = 0;
  virtual int64_t steps() const = 0;
};

}  // namespace vlmgraph::server
