#include "model/layers.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/linear.h>

#include "model/fused_ops.h"
#include "model/weight_init.h"

namespace vlmgraph {

namespace {
// N(0, 0.02): upstream's _init_weights for Linear and Embedding weights.
void InitNormal(at::Tensor& w) {
  if (WeightInitSkipped()) return;
  at::NoGradGuard no_grad;
  w.normal_(0.0, 0.02);
}
}  // namespace

DenseImpl::DenseImpl(int64_t in_features, int64_t out_features, bool with_bias) {
  weight = register_parameter("weight", at::empty({out_features, in_features}));
  InitNormal(weight);
  if (with_bias) bias = register_parameter("bias", at::zeros({out_features}));
}

// torch::nn::functional::linear, as torch::nn::Linear computes it (for inputs other than 2-D:
// matmul, then the bias added separately), so results round exactly as with torch::nn::Linear.
// That bias add is ops::BiasAdd: the same values, through a vectorised kernel on CUDA.
at::Tensor DenseImpl::forward(const at::Tensor& x) {
  if (bias.defined() && x.dim() != 2) return ops::BiasAdd(at::matmul(x, weight.t()), bias);
  return torch::nn::functional::linear(x, weight, bias);
}

EmbeddingTableImpl::EmbeddingTableImpl(int64_t rows, int64_t dim) {
  weight = register_parameter("weight", at::empty({rows, dim}));
  InitNormal(weight);
}

at::Tensor EmbeddingTableImpl::forward(const at::Tensor& ids) { return at::embedding(weight, ids); }

}  // namespace vlmgraph
