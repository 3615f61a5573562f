// model/vision_encoder.h: nanoVLM's SigLIP-style vision transformer (upstream
// `models/vision_transformer.py`): patch-embedding conv + learned position embedding, pre-LN
// blocks with fused qkv attention and a GELU(tanh) MLP, final LayerNorm, no CLS token.
//
//   vlmgraph::VisionEncoder vit(cfg);
//   at::Tensor patches = vit->forward(tiles);   // (N, 3, S, S) -> (N, P, vit_hidden_dim)
//
// Parameter names match upstream's state_dict under the `vision_encoder.` prefix. Thread rules: a
// module is not thread-safe; one thread (the engine's GPU thread) calls it at a time.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include "model/config.h"
#include "model/layers.h"

namespace vlmgraph {

// Conv2d(3, C, kernel=stride=patch) then + position_embedding (1, P, C).
class ViTPatchEmbeddingsImpl : public torch::nn::Module {
 public:
  explicit ViTPatchEmbeddingsImpl(const VlmConfig& cfg);
  // x: (N, 3, S, S) float in [0, 1] -> (N, P, C) with P = (S / patch)^2.
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Conv2d conv{nullptr};
  at::Tensor position_embedding;  // (1, P, C)
};
TORCH_MODULE(ViTPatchEmbeddings);

// Multi-head self-attention with a fused qkv projection, no mask (every patch sees every patch).
class ViTAttentionImpl : public torch::nn::Module {
 public:
  explicit ViTAttentionImpl(const VlmConfig& cfg);
  at::Tensor forward(const at::Tensor& x);  // (N, P, C) -> (N, P, C)

  int64_t n_heads, head_dim;
  Dense qkv_proj{nullptr}, out_proj{nullptr};
};
TORCH_MODULE(ViTAttention);

// fc1 -> GELU(approximate="tanh") -> fc2.
class ViTMlpImpl : public torch::nn::Module {
 public:
  explicit ViTMlpImpl(const VlmConfig& cfg);
  at::Tensor forward(const at::Tensor& x);

  Dense fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ViTMlp);

// x = x + attn(ln1(x)); x = x + mlp(ln2(x)).
class ViTBlockImpl : public torch::nn::Module {
 public:
  explicit ViTBlockImpl(const VlmConfig& cfg);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ViTAttention attn{nullptr};
  ViTMlp mlp{nullptr};
};
TORCH_MODULE(ViTBlock);

class VisionEncoderImpl : public torch::nn::Module {
 public:
  explicit VisionEncoderImpl(const VlmConfig& cfg);
  // tiles: (N, 3, vit_img_size, vit_img_size), values in [0, 1], the model's dtype.
  // Returns (N, P, vit_hidden_dim), P = (vit_img_size / vit_patch_size)^2, after the final norm.
  at::Tensor forward(const at::Tensor& tiles);

  ViTPatchEmbeddings patch_embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm layer_norm{nullptr};
  // Training: keep only each block's input and recompute the block in the backward pass
  // (model/recompute.h). Same values and gradients, less activation memory, one more forward.
  bool recompute_blocks = false;
};
TORCH_MODULE(VisionEncoder);

}  // namespace vlmgraph
