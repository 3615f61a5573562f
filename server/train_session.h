// server/train_session.h: the interface the Train RPC drives, and its settings.
//
// A TrainBackend is one training job started from the serving model's weights: Step() takes a
// checked batch (server/convert.h), runs forward + backward + optimizer on the job's own copy of
// the weights and reports the step; Save() writes a nanoVLM checkpoint; Publish() copies the job's
// weights into the serving model (the only way training changes what clients are served).
// MakeTrainBackend (server/graphed_trainer.h) implements it on engine/Trainer.
//
// clang-format off
//   std::unique_ptr<TrainBackend> job = MakeTrainBackend(engine, options, &metrics);  // GPU thread
//   TrainStepResult s = job->Step(batch);                                             // GPU thread
//   job->Save("/srv/checkpoints/run1");                                               // GPU thread
//   job->Publish();                                                                   // GPU thread
// clang-format on
//
// Thread rules: create, use and destroy a backend on the GPU thread only (it touches the
// engine's model). Errors: ServerError INVALID_ARGUMENT for batches no bucket accepts (oversize
// policy reject); FAILED_PRECONDITION from Save / Publish when a weight is not finite; torch
// errors propagate (the RPC guard maps them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/bucket.h"
#include "engine/step_runner.h"
#include "engine/trainer.h"
#include "server/convert.h"

namespace vlmgraph::server {

enum class TrainPadding { kPadToBucket, kExact };

// A Train job's settings as the RPC gives them (v1::TrainConfig); MakeTrainBackend turns them into
// the trainer's vlmgraph::TrainOptions (engine/trainer.h) and the engine's buckets and dtype.
struct TrainJobOptions {
  // Learning rate per part; 0 freezes the part (upstream nanoVLM: lr_backbones, lr_mp).
  double language_learning_rate = 5e-5;
  double vision_learning_rate = 5e-5;
  double projector_learning_rate = 5.12e-3;
  bool train_language = true, train_vision = true, train_projector = true;
  double weight_decay = 0.01;  // torch.optim.AdamW defaults
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_grad_norm = 1.0;         // 0 = no clipping
  int64_t max_tiles_per_example = 1;  // sizes the graphed step's tile buffer
  TrainPadding padding = TrainPadding::kPadToBucket;
  bool recompute_vision = false, recompute_language = false;  // activation recomputation
  // Absolute checkpoint directory (weights + optimizer.safetensors) to start from; "" = the
  // serving model's weights, fresh AdamW state.
  std::string resume_from;
};

class TrainBackend {
 public:
  virtual ~TrainBackend() = default;
  // One optimizer step over `batch` (checked by ToTrainBatch); the step as engine/Trainer reports
  // it.
  virtual TrainStepResult Step(const std::vector<TrainExample>& batch) = 0;
  virtual void Save(const std::string& directory) = 0;
  virtual void Publish() = 0;
  virtual int64_t steps() const = 0;
};

}  // namespace vlmgraph::server
