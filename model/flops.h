// model/flops.h: model FLOPs of one training step of a nanoVLM model, for MFU (model FLOPs
// utilisation: model FLOPs per second over the device's peak).
//
// Formula: PaLM's (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
// appendix B): forward + backward of a matmul of P parameters over N tokens is 6 * P * N FLOPs,
// and self-attention adds 12 * layers * d * T per token (T the sequence length attended over:
// the whole of it, not halved for causal masks, as PaLM counts it). Applied to both towers:
//   vision encoder: the patch embedding (3 * patch^2 * d_vit) and per block the q, k, v, o
//     projections (4 * d_vit^2) and the MLP (2 * d_vit * ff_vit), over every patch of every tile
//     (vit_num_patches() per tile); attention over the tile's patches;
//   projector: (d_vit * shuffle^2) * d_lm over each image token (mp_image_token_length per tile);
//   decoder: per block q and o (2 * d * heads * head_dim), k and v (2 * d * kv_heads * head_dim)
//     and the SwiGLU MLP (3 * d * ff), over batch * seq tokens; attention over seq;
//   LM head: d * vocab over batch * seq tokens (counted whether or not it is tied to the
//     embedding: it is a matmul either way). The embedding lookup, norms, biases and the loss
//     are not counted.
// Padding tokens count as tokens (the step computes them). nanovlm-460m, one 512 px tile per
// example: 52.09 TFLOP at 16 x 1024, 31.45 at 2 x 4096, 26.04 at 8 x 1024.
#pragma once

#include <cstdint>
#include <string>

#include "model/config.h"

namespace vlmgraph {

struct TrainStepFlops {
  double vision_encoder = 0;  // its matmuls (6 P N), FLOPs
  double projector = 0;
  double decoder = 0;         // the blocks' matmuls
  double lm_head = 0;
  double attention = 0;       // 12 L d T per token, both towers
  double total() const { return vision_encoder + projector + decoder + lm_head + attention; }
};

// One optimizer step over `batch` sequences of `seq` tokens with `tiles` image tiles in all
// (tiles >= 0; batch, seq > 0, else std::invalid_argument).
TrainStepFlops TrainFlopsPerStep(const VlmConfig& cfg, int64_t batch, int64_t seq, int64_t tiles);

// A device's dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from its name as the driver
// reports it; 0 when unknown (no MFU then). NVIDIA's datasheets (half the "with sparsity"
// figure): H100 SXM5 989.4, H100 NVL 835, H100 PCIe 756, H200 989.4, A100 312.
double PeakBf16Tflops(const std::string& device_name);

}  // namespace vlmgraph
