// model/language_model.h: nanoVLM's Llama-style decoder (upstream `models/language_model.py`):
// token embedding, blocks of RMSNorm -> grouped-query attention with RoPE -> residual, RMSNorm ->
// SwiGLU MLP -> residual, a final RMSNorm, and an LM head tied to the embedding when
// `lm_tie_weights`.
//
// Three ways to run it, all returning final-normed hidden states (apply `Logits` for the head):
//   Forward(x[, before_block])          full causal pass, no cache (training, scoring, reference)
//   Prefill(x, &cache, slots)           same, and writes each row's keys/values into cache rows
//   Decode(x, &cache, positions, L)     one new token per row over cache rows [0, B), attending to
//                                       cache positions [0, L) that are <= the row's position
//
// Shapes: x (B, T, H) in the model dtype; positions (B) int64; slots (B) int64; H = lm_hidden_dim.
// Formulas: RMSNorm x * rsqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019; upstream RMSNorm);
// RoPE with rotate_half and inv_freq = 1 / base^(2i/d) (Su et al. 2021; upstream RotaryEmbedding);
// attention softmax(q k^T / sqrt(d)) v with kv head j serving query heads [j*g, (j+1)*g).
// Positions must stay below `lm_max_position_embeddings`: upstream rescales RoPE beyond it by the
// batch's longest sequence, which makes one sequence's result depend on its batch neighbours, so
// callers reject longer sequences instead.
//
// Thread rules: not thread-safe; one thread calls it at a time. Every op is a device op with no
// host synchronisation, so Prefill and Decode can be captured into CUDA graphs.
#pragma once

#include <functional>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include "model/config.h"
#include "model/fused_ops.h"
#include "model/kv_cache.h"
#include "model/layers.h"

namespace vlmgraph {

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  // Computed in float32 and cast back (identical to upstream in float32; steadier in bf16). In
  // training mode on CUDA: ops::RmsNormDifferentiable (the same formula in one kernel forward and
  // two backward).
  at::Tensor forward(const at::Tensor& x);

  double eps;
  at::Tensor weight;  // (dim)
};
TORCH_MODULE(RMSNorm);

class RotaryEmbeddingImpl : public torch::nn::Module {
 public:
  explicit RotaryEmbeddingImpl(const VlmConfig& cfg);
  // positions: (B, T) int64 -> cos, sin each (B, T, head_dim) float32, times lm_attn_scaling.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& positions);

  double attention_scaling;
  at::Tensor inv_freq;  // (head_dim / 2) float32 buffer, stored in upstream checkpoints
};
TORCH_MODULE(RotaryEmbedding);

// q, k: (B, heads, T, D); cos, sin: (B, T, D). Returns (q * cos + rotate_half(q) * sin, same for
// k). (GroupedQueryAttention in training mode on CUDA takes ops::RotaryDifferentiable instead:
// the same results in one kernel each way.)
std::pair<at::Tensor, at::Tensor> ApplyRotary(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& cos, const at::Tensor& sin);

// How one decoder pass uses the KV cache.
struct AttentionContext {
  enum class Mode { kNoCache, kPrefill, kDecode };
  Mode mode = Mode::kNoCache;
  KVCache* cache = nullptr;
  at::Tensor slots;      // kPrefill: (B) int64, the cache row each batch row writes
  at::Tensor positions;  // kDecode: (B) int64, position of the new token (its row's length so far)
  int64_t kv_len = 0;    // kDecode: attend over cache positions [0, kv_len); > every position
  at::Tensor key_mask;   // kDecode: (B, 1, 1, kv_len) bool, true where a key may be attended
};

class GroupedQueryAttentionImpl : public torch::nn::Module {
 public:
  explicit GroupedQueryAttentionImpl(const VlmConfig& cfg);
  // x: (B, T, H); cos/sin: (B, T, D); layer: index into the cache's per-block tensors.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const AttentionContext& ctx, int64_t layer);

  // Inference fast path (CUDA kernels, fused weights, no autograd); same formula, fewer kernels.
  // qkv: (B, T, (n_heads + 2 n_kv) D), the fused projection of the normalised input (unrotated);
  // returns the attention output (B, T, n_heads D) before out_proj.
  at::Tensor ForwardFused(const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling,
                          const AttentionContext& ctx, int64_t layer);
  // Decode (one token per row) without the attention's last step: qkv (B, (n_heads + 2 n_kv) D);
  // the partial softmax states that ops::AttentionCombineLinear turns into out_proj's output.
  ops::DecodeAttentionPartials DecodePartials(const at::Tensor& qkv, const at::Tensor& inv_freq,
                                              double scaling, const AttentionContext& ctx,
                                              int64_t layer);

  int64_t n_heads, n_kv_heads, head_dim;
  Dense q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  // ((n_heads + 2 n_kv) D, H): q, k, v weights stacked; the three weights are views into it once
  // LanguageModel::FuseWeights ran, so checkpoints and optimizers still see upstream's names.
  at::Tensor w_qkv;
};
TORCH_MODULE(GroupedQueryAttention);

// down(silu(gate(x)) * up(x)) (Shazeer 2020, "GLU Variants Improve Transformer").
class SwiGluMlpImpl : public torch::nn::Module {
 public:
  explicit SwiGluMlpImpl(const VlmConfig& cfg);
  at::Tensor forward(const at::Tensor& x);

  Dense gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  at::Tensor w_gate_up;  // (2I, H): gate and up weights stacked (views into it after FuseWeights)
};
TORCH_MODULE(SwiGluMlp);

class DecoderBlockImpl : public torch::nn::Module {
 public:
  explicit DecoderBlockImpl(const VlmConfig& cfg);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const AttentionContext& ctx, int64_t layer);

  SwiGluMlp mlp{nullptr};
  GroupedQueryAttention attn{nullptr};
  RMSNorm norm1{nullptr}, norm2{nullptr};

  // x + attn(norm1(x)), then + mlp(norm2(.)), with fused kernels: the norms inside the qkv and
  // gate/up GEMVs, SiLU-mul inside the down GEMV and the residual adds folded into the output
  // projections (GEMV epilogue, or cuBLAS adding into the residual in place) — 5 kernels per
  // block at decode. Inference only. overwrite_x: x (contiguous) is the caller's own residual
  // stream, which the out projection may add into in place (the block's own sums always are).
  at::Tensor ForwardFused(const at::Tensor& x, const at::Tensor& inv_freq, double scaling,
                          const AttentionContext& ctx, int64_t layer, bool overwrite_x);
};
TORCH_MODULE(DecoderBlock);

class LanguageModelImpl : public torch::nn::Module {
 public:
  explicit LanguageModelImpl(const VlmConfig& cfg);

  // Called with i before block i runs, and with blocks->size() before the final norm: a caller's
  // point to order its own work against the pass (the trainer makes the device wait there for
  // weights still in flight; Note [Weights broadcast in the forward] in
  // engine/trainer_optimizer.cc).
  using BlockHook = std::function<void(int64_t block)>;
  at::Tensor Forward(const at::Tensor& x, const BlockHook& before_block = nullptr);
  // Writes rows' keys/values for positions [0, T) into cache rows `slots` (B) int64.
  at::Tensor Prefill(const at::Tensor& x, KVCache* cache, const at::Tensor& slots);
  // x: (B, 1, H) with B <= cache->rows(); positions (B) int64; kv_len > max(positions).
  at::Tensor Decode(const at::Tensor& x, KVCache* cache, const at::Tensor& positions,
                    int64_t kv_len);

  // The LM head: hidden (..., H) -> logits (..., V). Uses token_embedding.weight when tied.
  at::Tensor Logits(const at::Tensor& hidden);
  // The head's weight, (V, H): token_embedding.weight when tied, else head.weight.
  at::Tensor HeadWeight() const;
  // Summed cross entropy of Logits(hidden) against targets, a float32 scalar: sum over positions
  // with a counted target of logsumexp(logits) - logits[target], computed in float32 from the
  // logits in the model's dtype (upstream nanoVLM: F.cross_entropy(ignore_index=-100) with
  // reduction sum). hidden (..., H), targets (...) int64; a target equal to ignore_index counts
  // 0. On CUDA through ops::LinearCrossEntropy (no float32 logits, one kernel each way; it needs
  // targets in [0, V) or ignore_index, which the trainer checks), elsewhere ATen's ops.
  at::Tensor CrossEntropySum(const at::Tensor& hidden, const at::Tensor& targets,
                             int64_t ignore_index);

  // Stacks each block's q/k/v and gate/up weights into one tensor and makes the original
  // parameters views of it, enabling the fused inference path (model/fused_ops.h) on CUDA.
  // Call after moving the model to its device and dtype (moving again undoes it). Idempotent.
  void FuseWeights();
  // True when the fused path runs for `x`: weights fused, CUDA kernels built and applicable,
  // autograd off.
  bool UsesFusedPath(const at::Tensor& x) const;

  VlmConfig cfg;
  EmbeddingTable token_embedding{nullptr};
  RotaryEmbedding rotary_embd{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  RMSNorm norm{nullptr};
  Dense head{nullptr};  // registered only when !lm_tie_weights
  // Training: keep only each block's input and recompute the block in the backward pass
  // (model/recompute.h). Same values and gradients, less activation memory, one more forward.
  bool recompute_blocks = false;

 private:
  at::Tensor Run(const at::Tensor& x, const at::Tensor& positions, const AttentionContext& ctx,
                 const BlockHook& before_block = nullptr);
};
TORCH_MODULE(LanguageModel);

}  // namespace vlmgraph
