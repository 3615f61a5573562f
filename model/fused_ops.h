// model/fused_ops.h: fused CUDA implementations of the decoder's hot-path formulas, used by the
// language model when its tensors are on a CUDA device, its projections are fused (FuseWeights),
// and autograd is off (inference). Each function computes exactly the formula of the reference
// ATen code in language_model.cc, in fewer kernels: a decode step drops from ~52 kernels per
// block to 9, which is what bounds a CUDA-graph replay once launch overhead is gone.
//
// Shapes: B batch rows, T tokens per row, H hidden, D head_dim, I inter_dim; dtypes float32 or
// bfloat16 (accumulation in float32). Thread rules: stateless; stream = current CUDA stream.
// Errors: TORCH_CHECK on shape/dtype mismatches (internal invariants: callers are the model).
#pragma once

#include <ATen/Tensor.h>

namespace vlmgraph::ops {

// True when this build has the kernels and `like` is a CUDA float32/bfloat16 tensor.
bool FusedKernelsAvailable(const at::Tensor& like);

// The decode attention kernel's limits: head_dim in {16, 32, 64, 128}, <= 16 query heads per KV
// head.
inline bool FusedDecoderSupports(int64_t head_dim, int64_t groups) {
  return (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128) && groups <= 16;
}

// x (..., H), weight (H) -> (..., H): T(x * rsqrt(mean(x^2) + eps)) * weight.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// gate_up (..., 2I) -> (..., I): silu(gate_up[..., :I]) * gate_up[..., I:].
at::Tensor SiluMul(const at::Tensor& gate_up);

struct RopeKvOutput {
  at::Tensor q;  // (B, T, n_heads, D), rotated
  at::Tensor k;  // (B, T, n_kv, D), rotated; only when requested
};
// qkv (B, T, (n_heads + 2 n_kv) D) from the fused projection. Token (b, t) has position
// positions[b] + t (positions (B) int64, or t when undefined). Rotates q and k (RoPE, rotate_half
// form with inv_freq (D/2) float32 and `scaling`) and, when cache_k is defined, writes keys and
// values into cache rows slots[b] (or b when undefined) at those positions.
RopeKvOutput RopeKvWrite(const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling,
                         const at::Tensor& positions, const at::Tensor& slots, int64_t n_heads,
                         int64_t n_kv, const at::Tensor& cache_k, const at::Tensor& cache_v,
                         bool want_k);

// q (B, n_heads * D) one token per row; cache (rows >= B, n_kv, S, D); row b attends to its cache
// row b, positions [0, positions[b]], with kv_len > positions[b]. Returns (B, n_heads * D).
at::Tensor DecodeAttention(const at::Tensor& q, const at::Tensor& cache_k,
                           const at::Tensor& cache_v, const at::Tensor& positions, int64_t kv_len,
                           int64_t n_heads);

// x (rows, k) @ weight (n, k)^T (+ residual (rows, n)): a small-batch GEMV kernel when rows <= 4
// and the shapes are 16-byte aligned (decode steps), else cuBLAS (at::linear / at::addmm).
at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& residual = {});

}  // namespace vlmgraph::ops
