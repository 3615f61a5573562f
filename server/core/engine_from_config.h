// server/core/engine_from_config.h: a ServerConfig -> the model and the Engine that serves it.
//
// Used by vlmgraph-server and by vlmgraph-generate (the direct, no-gRPC reference tool), so both
// build the same weights from the same config: a preset model is initialised after
// at::manual_seed(config.seed), a checkpoint directory is loaded with LoadModel.
//
//   std::unique_ptr<Engine> engine = BuildEngine(config);   // not warmed up yet
//
// Errors: ServerConfigError naming the key ("device", "model") for what the config got wrong
// (no CUDA device, unreadable checkpoint); EngineError from the engine's own checks.
// Thread rules: call from the thread that will drive the engine (or before starting it).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/config/config.h"

namespace vlmgraph::server {

EngineOptions ToEngineOptions(const ServerConfig& config);

// The devices of the engines to serve on (config keys device and data_parallel_size): "cuda:2",
// "cuda:3" for device cuda:2 and data_parallel_size 2; every CUDA device from `device` on for 0;
// "cpu" N times on the CPU. Throws ServerConfigError naming data_parallel_size when the devices
// do not exist (the message gives the machine's count).
std::vector<std::string> ServingDevices(const ServerConfig& config);

// The configured model's config (a preset's, or the checkpoint's: LoadModelConfig), without its
// weights: cheap, for checks before the engine is built.
VlmConfig BuildModelConfig(const ServerConfig& config);

// The configured model on the CPU in float32: a preset initialised after at::manual_seed(seed),
// or a checkpoint directory.
VisionLanguageModel BuildModel(const ServerConfig& config);

std::unique_ptr<Engine> BuildEngine(const ServerConfig& config);

}  // namespace vlmgraph::server
