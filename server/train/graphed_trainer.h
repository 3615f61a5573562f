// server/train/graphed_trainer.h: the Train RPC's backend, on the engine's Trainer
// (engine/trainer.h).
//
// Each step runs vlmgraph::Trainer, one micro-batch per piece (a batch wider than the largest
// train bucket is split into micro-batches that fit it). With the PAD policy each micro-batch is
// padded to a train bucket whose forward + backward is replayed from a CUDA graph (captured up
// front), then a captured clip + fused AdamW step; with EXACT each runs at its own shape, eagerly.
// CPU or graphs off run the same code eagerly. The Trainer keeps float32 master weights of its own
// (bf16 working weights beside them when the server's dtype is bfloat16 on CUDA), copied from the
// serving model (or from TrainJobOptions::resume_from, with its AdamW state and step count) when
// the job starts. weights() are the masters of the trained parameters, which
// WeightsPublisher::Publish (server/train/weights_publisher.h) copies into the serving model in
// place (same tensors, so inference graphs stay valid) when the publish gate accepts them; nothing
// else changes what clients are served. Save() writes the master weights (nanoVLM config.json +
// model.safetensors) and optimizer.safetensors, and refuses weights with NaN or inf elements.
//
//   std::unique_ptr<TrainBackend> job = MakeTrainBackend(engine, options, &metrics);  // GPU thread
//
// Thread rules and errors: as TrainBackend (server/train/train_session.h); bad examples throw
// EngineError(kInvalidArgument), an example longer than every bucket with oversize reject
// ServerError;
// MakeTrainBackend: INVALID_ARGUMENT for a resume_from checkpoint that does not load or match.
#pragma once

#include <memory>

#include "engine/engine.h"
#include "server/train/train_session.h"

namespace vlmgraph::server {

// The compute dtype of a Train job on `engine`: bf16 working weights + float32 masters on the GPU
// (the engine's dtype), float32 on the CPU, where bf16 is no faster.
at::ScalarType TrainComputeDtype(const EngineOptions& engine);

// `observer` (may be null) receives OnStep, OnTokens (and OnCapture) for region train.
std::unique_ptr<TrainBackend> MakeTrainBackend(Engine& engine, const TrainJobOptions& options,
                                               EngineObserver* observer);

}  // namespace vlmgraph::server
