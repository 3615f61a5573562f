#include "model/flops.h"

#include <stdexcept>

namespace vlmgraph {

TrainStepFlops TrainFlopsPerStep(const VlmConfig& cfg, int64_t batch, int64_t seq, int64_t tiles) {
  if (batch <= 0 || seq <= 0 || tiles < 0)
    throw std::invalid_argument("TrainFlopsPerStep: batch and seq must be positive, tiles >= 0");
  auto d = [](int64_t v) { return static_cast<double>(v); };
  const double vd = d(cfg.vit_hidden_dim), lm = d(cfg.lm_hidden_dim);
  const double patches = d(cfg.vit_num_patches());
  const double vit_tokens = d(tiles) * patches;
  const double lm_tokens = d(batch) * d(seq);
  const double vit_params =
      d(cfg.vit_n_blocks) * (4 * vd * vd + 2 * vd * d(cfg.vit_inter_dim)) +
      3 * d(cfg.vit_patch_size) * d(cfg.vit_patch_size) * vd;
  const double shuffle = d(cfg.mp_pixel_shuffle_factor);
  const double projector_params = vd * shuffle * shuffle * lm;
  const double image_tokens = d(tiles) * d(cfg.mp_image_token_length);
  const double hd = d(cfg.lm_head_dim());
  const double block_params = 2 * lm * d(cfg.lm_n_heads) * hd + 2 * lm * d(cfg.lm_n_kv_heads) * hd +
                              3 * lm * d(cfg.lm_inter_dim);
  TrainStepFlops f;
  f.vision_encoder = 6 * vit_params * vit_tokens;
  f.projector = 6 * projector_params * image_tokens;
  f.decoder = 6 * d(cfg.lm_n_blocks) * block_params * lm_tokens;
  f.lm_head = 6 * lm * d(cfg.lm_vocab_size) * lm_tokens;
  f.attention = 12 * d(cfg.vit_n_blocks) * vd * patches * vit_tokens +
                12 * d(cfg.lm_n_blocks) * lm * d(seq) * lm_tokens;
  return f;
}

double PeakBf16Tflops(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("H100") && has("PCIe")) return 756;
  if (has("H100") && has("NVL")) return 835;
  if (has("H100") || has("H200")) return 989.4;
  if (has("A100")) return 312;
  return 0;
}

}  // namespace vlmgraph
