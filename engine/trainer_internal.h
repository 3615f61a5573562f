// engine/trainer_internal.h: what the Trainer's source files share, and nothing else includes:
// engine/trainer.cc (set-up, buffers, micro-batches, steps and their graphs),
// engine/trainer_optimizer.cc (clipping, AdamW, skipped steps and groups, the sharded optimizer)
// and engine/trainer_checkpoint.cc (checkpoint files). Thread rules and errors: engine/trainer.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

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

}  // namespace vlmgraph
