// model/modality_projector.h: nanoVLM's modality projector (upstream
// `models/modality_projector.py`): pixel shuffle of the ViT patch grid by `mp_pixel_shuffle_factor`
// then a bias-free linear map into the language model's hidden size.
//
// clang-format off
//   at::Tensor patches = vit->forward(tiles);  // (N, P, Cv)
//   at::Tensor img = mp->forward(patches);     // (N, P / f^2, lm_hidden_dim)
// clang-format on
#pragma once

#include <torch/nn/module.h>

#include "model/config.h"
#include "model/layers.h"

namespace vlmgraph {

// Pixel shuffle (space-to-depth) as upstream defines it: (N, P, C) with P = s*s ->
// view (N, s, s, C) -> (N, s/f, f, s/f, f, C) -> permute (0,1,3,2,4,5) -> (N, (s/f)^2, C*f*f).
at::Tensor PixelShuffle(const at::Tensor& x, int64_t factor);

class ModalityProjectorImpl : public torch::nn::Module {
 public:
  explicit ModalityProjectorImpl(const VlmConfig& cfg);
  // (N, P, vit_hidden_dim) -> (N, mp_image_token_length, lm_hidden_dim)
  at::Tensor forward(const at::Tensor& x);

  int64_t factor;
  Dense proj{nullptr};
};
TORCH_MODULE(ModalityProjector);

}  // namespace vlmgraph
