#include "model/modality_projector.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <cmath>


namespace vlmgraph {

at::Tensor PixelShuffle(const at::Tensor& x, int64_t factor) {
  const int64_t n = x.size(0), p = x.size(1), c = x.size(2);
  const auto side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(p))));
  TORCH_CHECK(side * side == p, "pixel shuffle needs a square patch grid, got ", p, " patches");
  TORCH_CHECK(side % factor == 0, "pixel shuffle factor ", factor, " must divide the grid side ",
              side);
  const int64_t out = side / factor;
  return x.reshape({n, out, factor, out, factor, c})
      .permute({0, 1, 3, 2, 4, 5})
      .reshape({n, out * out, c * factor * factor});
}

ModalityProjectorImpl::ModalityProjectorImpl(const VlmConfig& cfg)
    : factor(cfg.mp_pixel_shuffle_factor) {
  // Upstream ModalityProjector._init_weights: N(0, 0.02), no bias (Dense starts so).
  proj = register_module(
      "proj", Dense(cfg.vit_hidden_dim * factor * factor, cfg.lm_hidden_dim, /*bias=*/false));
}

at::Tensor ModalityProjectorImpl::forward(const at::Tensor& x) {
  return proj->forward(PixelShuffle(x, factor));
}

}  // namespace vlmgraph
