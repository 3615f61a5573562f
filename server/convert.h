// server/convert.h: protobuf requests -> engine requests, with the server's input checks.
//
// Runs on the RPC handler's thread, before a request is queued, so bad input is refused at once
// and image decoding runs in parallel across requests. Checks here are the ones the engine does
// not make (images, limits, unset fields); the engine's Validate() then checks ids, image-token
// counts and context length.
//
//   GenerateRequest r = ToEngineRequest(proto, model_cfg, config.limits);
//
// Errors: ServerError INVALID_ARGUMENT whose message starts with the field path
// ("images[1]: unknown image format ..."). Thread rules: pure functions.
#pragma once

#include <ATen/Tensor.h>

#include <string>
#include <vector>

#include "engine/engine_types.h"
#include "model/config.h"
#include "server/config.h"
#include "vlmgraph/v1/forward.pb.h"
#include "vlmgraph/v1/generate.pb.h"
#include "vlmgraph/v1/train.pb.h"

namespace vlmgraph::server {

using Limits = ServerConfig::Limits;

// Every image of a request -> its tiles, concatenated in order: (N, 3, S, S) float32 CPU, or an
// undefined tensor when there are no images. `field` prefixes error messages ("images").
at::Tensor ImagesToTiles(const google::protobuf::RepeatedPtrField<v1::Image>& images,
                         const VlmConfig& cfg, const Limits& limits, const std::string& field);

GenerateRequest ToEngineRequest(const v1::GenerateRequest& request, const VlmConfig& cfg,
                                const Limits& limits);
ForwardRequest ToEngineRequest(const v1::ForwardRequest& request, const VlmConfig& cfg,
                               const Limits& limits);

// One training example, checked: ids and targets in the vocabulary (targets may be -100), same
// length, image tokens matching the tiles.
struct TrainExampleData {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> target_ids;
  at::Tensor tiles;  // (N, 3, S, S) float32 CPU or undefined
};
// `max_tokens`: the longest example accepted (the engine's longest context).
std::vector<TrainExampleData> ToTrainBatch(const v1::TrainBatch& batch, const VlmConfig& cfg,
                                           const Limits& limits, int64_t max_tokens);

// Checks a prompt before any work: 1 .. max_tokens ids, each inside the vocabulary, and as many
// image tokens as the tiles give embeddings; `field` names the ids in messages. Generate gets the
// same checks from Engine::Validate; Forward and Train use this one (an over-long prompt would
// otherwise run eagerly at any size).
void CheckPrompt(const std::vector<int64_t>& ids, const at::Tensor& tiles, const VlmConfig& cfg,
                 int64_t max_tokens, const std::string& field);

// `name` relative to `root` (SaveCheckpoint.directory rules: no "..", not absolute, only
// [A-Za-z0-9._/-]) -> absolute path.
std::string ResolveCheckpointDir(const std::string& root, const std::string& name);

}  // namespace vlmgraph::server
