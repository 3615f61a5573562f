#include "model/prompt_check.h"

#include <sstream>

namespace vlmgraph {

std::string CheckPromptIds(const VlmConfig& cfg, const int64_t* ids, size_t n, int64_t num_tiles,
                           const std::string& field) {
  if (n == 0) return field + " is empty; send at least one token id";
  int64_t image_tokens = 0;
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= cfg.lm_vocab_size) {
      return field + "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
             " is outside the vocabulary [0, " + std::to_string(cfg.lm_vocab_size) + ")";
    }
    image_tokens += ids[i] == cfg.image_token_id;
  }
  const int64_t expected = num_tiles * cfg.mp_image_token_length;
  if (image_tokens != expected) {
    return field + ": has " + std::to_string(image_tokens) + " image tokens (id " +
           std::to_string(cfg.image_token_id) + ") but " + std::to_string(num_tiles) +
           " image tile(s) give " + std::to_string(expected) + " embeddings (" +
           std::to_string(cfg.mp_image_token_length) + " per tile); the prompt must hold exactly " +
           std::to_string(expected) + " image tokens";
  }
  return "";
}

std::string CheckTargetIds(const VlmConfig& cfg, const std::vector<int64_t>& targets,
                           size_t n_inputs, const std::string& field) {
  if (targets.size() != n_inputs) {
    return field + ": has " + std::to_string(targets.size()) +
           " entries; it needs one per input id (" + std::to_string(n_inputs) +
           "), -100 where no loss is wanted";
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] != -100 && (targets[i] < 0 || targets[i] >= cfg.lm_vocab_size)) {
      return field + "[" + std::to_string(i) + "] = " + std::to_string(targets[i]) +
             " is outside the vocabulary (use -100 to ignore a position)";
    }
  }
  return "";
}

std::string CheckTiles(const VlmConfig& cfg, const at::Tensor& tiles, const std::string& field) {
  if (TileCount(tiles) == 0) return "";
  if (tiles.dim() != 4 || tiles.size(1) != 3 || tiles.size(2) != cfg.vit_img_size ||
      tiles.size(3) != cfg.vit_img_size) {
    std::ostringstream o;
    o << field << ": image tiles must be (N, 3, " << cfg.vit_img_size << ", " << cfg.vit_img_size
      << "), got " << tiles.sizes();
    return o.str();
  }
  return "";
}

}  // namespace vlmgraph
