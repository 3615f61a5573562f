// server/eager_trainer.h: a TrainBackend running eager LibTorch on the engine's model.
//
// AdamW with one parameter group per trained part (vision_encoder, MP, decoder; upstream
// nanoVLM's train.py uses separate learning rates for the backbones and the projector), global
// gradient-norm clipping (torch::nn::utils::clip_grad_norm_), loss from
// VisionLanguageModelImpl::Forward with targets (mean cross entropy, -100 ignored).
//
// Batches are right-padded to the smallest train bucket (pad positions and pad rows get target
// -100, so the loss and gradients equal the unpadded batch's: causal attention never lets a real
// token see the right padding). Construction turns requires_grad on for the trained parts;
// destruction turns it off again and returns the model to eval mode, as the Engine keeps it.
//
// Thread rules and errors: as TrainBackend (server/train_session.h).
#pragma once

#include <memory>

#include "engine/engine.h"
#include "server/train_session.h"

namespace vlmgraph::server {

// `observer` (may be null) receives OnStep / OnTokens for region train.
std::unique_ptr<TrainBackend> MakeEagerTrainer(Engine& engine, const TrainOptions& options,
                                               EngineObserver* observer);

}  // namespace vlmgraph::server
