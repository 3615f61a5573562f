// model/prompt_check.h: the checks every entry point (model, engine, trainer, server) applies to a
// prompt before the model sees it, in one place so their rules and messages never drift apart.
//
//   std::string err = CheckPromptIds(cfg, ids.data(), ids.size(), num_tiles, "input_ids");
//   if (!err.empty()) throw std::invalid_argument(err);
//
// Each returns an empty string when the input is valid, otherwise a message that starts with
// `field` and says what to change. Callers choose the error type (std::invalid_argument,
// EngineError, a gRPC status). Thread rules: pure functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace vlmgraph {

// Non-empty; every id in [0, lm_vocab_size); exactly num_tiles * mp_image_token_length ids equal
// to image_token_id (each tile's embeddings replace that many image tokens, in order).
std::string CheckPromptIds(const VlmConfig& cfg, const int64_t* ids, size_t n, int64_t num_tiles,
                           const std::string& field);

// One target per input id, each -100 (no loss) or inside the vocabulary.
std::string CheckTargetIds(const VlmConfig& cfg, const std::vector<int64_t>& targets,
                           size_t n_inputs, const std::string& field);

// Undefined/empty, or (N, 3, vit_img_size, vit_img_size).
std::string CheckTiles(const VlmConfig& cfg, const at::Tensor& tiles, const std::string& field);

// Tiles in `tiles` (0 when undefined or empty).
inline int64_t TileCount(const at::Tensor& tiles) {
  return tiles.defined() && tiles.numel() > 0 ? tiles.size(0) : 0;
}

}  // namespace vlmgraph
