// server/graphed_trainer.h: a TrainBackend on the engine's graphed Trainer (engine/trainer.h).
//
// Each step runs vlmgraph::Trainer: the batch is padded to a train bucket whose forward + backward
// is replayed from a CUDA graph (captured on first use), then a captured clip + fused AdamW step;
// CPU or graphs off run the same code eagerly. The Trainer keeps float32 master weights of its own;
// after every step they are copied into the serving model in place (same tensors, so inference
// graphs stay valid), so Generate and Forward see each step at once, as the Train RPC promises.
// Save() writes the master weights (nanoVLM config.json + model.safetensors) and
// optimizer.safetensors.
//
//   std::unique_ptr<TrainBackend> job = MakeGraphedTrainer(engine, options, &metrics);  // GPU
//   thread
//
// options.padding must be kPadToBucket (kExact has no graphed form: use MakeEagerTrainer).
// Thread rules and errors: as TrainBackend (server/train_session.h); bad examples throw
// EngineError(kInvalidArgument), a batch beyond every bucket with oversize reject ServerError.
#pragma once

#include <memory>

#include "engine/engine.h"
#include "server/train_session.h"

namespace vlmgraph::server {

// `observer` (may be null) receives OnStep, OnTokens (and OnCapture) for region train.
std::unique_ptr<TrainBackend> MakeGraphedTrainer(Engine& engine, const TrainOptions& options,
                                                 EngineObserver* observer);

}  // namespace vlmgraph::server
