// model/layers.h: the dense layers of nanoVLM's modules, created already holding the values that
// upstream's _init_weights leaves in them: weight ~ N(0, 0.02), bias 0 (Linear and Embedding in
// upstream's vision_transformer.py, language_model.py, modality_projector.py). Under a
// SkipWeightInit (model/weight_init.h) they are left uninitialised for a caller that overwrites
// them. torch::nn::Linear and torch::nn::Embedding would first draw their own defaults (Kaiming
// uniform, N(0, 1)) serially on the CPU, which took ~2.5 s for nanovlm-460m before every weight was
// drawn again or loaded from a checkpoint.
//
// Parameters are registered as "weight" and "bias", so checkpoints and optimizers see the same
// names as with torch::nn::Linear. Thread rules: as torch::nn modules.
#pragma once

#include <ATen/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace vlmgraph {

// y = x W^T + b; x (..., in) -> (..., out), computed as torch::nn::Linear computes it.
class DenseImpl : public torch::nn::Module {
 public:
  DenseImpl(int64_t in_features, int64_t out_features, bool bias);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;  // (out, in)
  at::Tensor bias;    // (out), undefined without bias
};
TORCH_MODULE(Dense);

// Row lookup: ids (...) int64 -> (..., dim).
class EmbeddingTableImpl : public torch::nn::Module {
 public:
  EmbeddingTableImpl(int64_t rows, int64_t dim);
  at::Tensor forward(const at::Tensor& ids);

  at::Tensor weight;  // (rows, dim)
};
TORCH_MODULE(EmbeddingTable);

}  // namespace vlmgraph
