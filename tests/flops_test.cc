// TrainFlopsPerStep (model/flops.h) against the model it describes: each term's parameter count
// is the number of matmul weights the module really holds, and the formula's totals for
// nanovlm-460m are the figures docs/benchmarks.md and the training-throughput work quote.
#include <gtest/gtest.h>

#include <string>

#include "model/flops.h"
#include "model/vision_language_model.h"

namespace vlmgraph {
namespace {

// Matmul weights (dim >= 2: linear and conv kernels, the embedding) of parameters whose name
// starts with `prefix`, without the ViT's position embedding (an addition, not a matmul).
double MatmulWeights(VisionLanguageModel& m, const std::string& prefix) {
  double n = 0;
  for (const auto& p : m->named_parameters()) {
    if (p.key().rfind(prefix, 0) != 0 || p.value().dim() < 2) continue;
    if (p.key().find("position_embedding") != std::string::npos) continue;
    n += static_cast<double>(p.value().numel());
  }
  return n;
}

TEST(TrainFlops, EachTermCountsTheModulesMatmulWeights) {
  for (bool tied : {true, false}) {
    VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
    cfg.lm_tie_weights = tied;
    VisionLanguageModel m(cfg);
    const int64_t batch = 3, seq = 40, tiles = 5;
    const TrainStepFlops f = TrainFlopsPerStep(cfg, batch, seq, tiles);
    const double lm_tokens = batch * seq;
    EXPECT_DOUBLE_EQ(f.vision_encoder / (6.0 * tiles * cfg.vit_num_patches()),
                     MatmulWeights(m, "vision_encoder."));
    EXPECT_DOUBLE_EQ(f.projector / (6.0 * tiles * cfg.mp_image_token_length), MatmulWeights(m, "MP."));
    EXPECT_DOUBLE_EQ(f.decoder / (6.0 * lm_tokens), MatmulWeights(m, "decoder.blocks."));
    EXPECT_DOUBLE_EQ(f.lm_head / (6.0 * lm_tokens),
                     MatmulWeights(m, tied ? "decoder.token_embedding." : "decoder.head."));
    const double attention = 12.0 * cfg.vit_n_blocks * cfg.vit_hidden_dim * cfg.vit_num_patches() *
                                 tiles * cfg.vit_num_patches() +
                             12.0 * cfg.lm_n_blocks * cfg.lm_hidden_dim * seq * lm_tokens;
    EXPECT_DOUBLE_EQ(f.attention, attention);
    EXPECT_DOUBLE_EQ(f.total(),
                     f.vision_encoder + f.projector + f.decoder + f.lm_head + f.attention);
  }
}

TEST(TrainFlops, Nanovlm460mAtTheBenchmarkedShapes) {
  const VlmConfig cfg = VlmConfig::Preset("nanovlm-460m");
  // One 512 px tile per example.
  EXPECT_NEAR(TrainFlopsPerStep(cfg, 16, 1024, 16).total() / 1e12, 52.09, 0.01);
  EXPECT_NEAR(TrainFlopsPerStep(cfg, 2, 4096, 2).total() / 1e12, 31.45, 0.01);
  EXPECT_NEAR(TrainFlopsPerStep(cfg, 8, 1024, 8).total() / 1e12, 26.04, 0.01);
  // No image: the vision encoder and the projector count nothing.
  const TrainStepFlops text = TrainFlopsPerStep(cfg, 8, 1024, 0);
  EXPECT_EQ(text.vision_encoder, 0);
  EXPECT_EQ(text.projector, 0);
  EXPECT_GT(text.decoder, 0);
}

TEST(TrainFlops, RefusesEmptyShapes) {
  const VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
  EXPECT_THROW(TrainFlopsPerStep(cfg, 0, 16, 0), std::invalid_argument);
  EXPECT_THROW(TrainFlopsPerStep(cfg, 1, 0, 0), std::invalid_argument);
  EXPECT_THROW(TrainFlopsPerStep(cfg, 1, 16, -1), std::invalid_argument);
}

TEST(TrainFlops, PeakFromTheDeviceName) {
  EXPECT_EQ(PeakBf16Tflops("NVIDIA H100 80GB HBM3"), 989.4);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA H100 PCIe"), 756);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA H100 NVL"), 835);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA H200"), 989.4);
  EXPECT_EQ(PeakBf16Tflops("NVIDIA A100-SXM4-80GB"), 312);
  EXPECT_EQ(PeakBf16Tflops("cpu"), 0);  // unknown: no MFU
}

}  // namespace
}  // namespace vlmgraph
