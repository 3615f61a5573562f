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
//   TrainStepStats s = job->Step(batch);                                              // GPU thread
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
#include "server/convert.h"

namespace vlmgraph::server {

enum class TrainPadding { kPadToBucket, kExact };

struct TrainOptions {
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

struct TrainStepStats {
  int64_t step = 0;  // 1-based
  double loss = 0;   // before the update
  int64_t loss_tokens = 0;
  double grad_norm = 0;      // before clipping; NaN / inf when skipped
  bool skipped = false;      // non-finite gradients: no weight or optimizer state changed
  double learning_rate = 0;  // language part's
  double seconds = 0;
  BucketKey bucket;  // region kTrain; the exact shape when no bucket was used
  RunKind mode = RunKind::kEager;
};

class TrainBackend {
 public:
  virtual ~TrainBackend() = default;
  virtual TrainStepStats Step(const std::vector<TrainExampleData>& batch) = 0;
  virtual void Save(const std::string& directory) = 0;
  virtual void Publish() = 0;
  virtual int64_t steps() const = 0;
};

}  // namespace vlmgraph::server
