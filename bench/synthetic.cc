// bench/synthetic.cc: see synthetic.h.
#include "bench/synthetic.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace vlmgraph {

std::vector<TrainExample> SyntheticTrainBatch(const VlmConfig& cfg, int64_t batch, int64_t seq,
                                              int64_t tiles) {
  std::vector<TrainExample> out;
  for (int64_t i = 0; i < batch; ++i) {
    TrainExample e;
    for (int64_t t = 0; t < tiles * cfg.mp_image_token_length && t < seq; ++t)
      e.input_ids.push_back(cfg.image_token_id);
    const int64_t n_tiles = static_cast<int64_t>(e.input_ids.size()) / cfg.mp_image_token_length;
    e.input_ids.resize(n_tiles * cfg.mp_image_token_length);
    while (static_cast<int64_t>(e.input_ids.size()) < seq)
      e.input_ids.push_back(1 + (e.input_ids.size() * 31 + i) % (cfg.lm_base_vocab_size - 1));
    e.targets.assign(e.input_ids.size(), -100);
    for (size_t t = n_tiles * cfg.mp_image_token_length; t + 1 < e.input_ids.size(); ++t)
      e.targets[t] = e.input_ids[t + 1];
    if (n_tiles > 0) e.tiles = at::rand({n_tiles, 3, cfg.vit_img_size, cfg.vit_img_size});
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<int64_t> SyntheticPromptLengths(int64_t n, double median, double sigma,
                                            int64_t max_len) {
  std::mt19937_64 rng(12345);
  std::normal_distribution<double> normal(std::log(std::max(1.0, median)), sigma);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(
        std::clamp<int64_t>(static_cast<int64_t>(std::llround(std::exp(normal(rng)))), 1, max_len));
  }
  return out;
}

}  // namespace vlmgraph
