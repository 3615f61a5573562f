// model/fused_ops.h: fused CUDA implementations of the decoder's hot-path formulas, used by the
// language model when its tensors are on a CUDA device, its projections are fused (FuseWeights),
// and autograd is off (inference). Each function computes exactly the formula of the reference
// ATen code in language_model.cc, in fewer kernels: a decode step drops from ~52 kernels per
// block to 5 (RMSNorm inside the qkv and gate/up GEMVs, RoPE and the KV-cache write inside
// attention, SiLU-mul inside the down GEMV), which is what bounds a CUDA-graph replay once launch
// overhead is gone; consecutive kernels overlap through programmatic dependent launch.
//
// Shapes: B batch rows, T tokens per row, H hidden, D head_dim, I inter_dim; dtypes float32 or
// bfloat16 (accumulation in float32). Thread rules: stateless; stream = current CUDA stream.
// Errors: TORCH_CHECK on shape/dtype mismatches (internal invariants: callers are the model).
#pragma once

#include <ATen/Tensor.h>

#include <utility>
#include <vector>

namespace vlmgraph::ops {

// True when this build has the kernels and `like` is a CUDA float32/bfloat16 tensor.
bool FusedKernelsAvailable(const at::Tensor& like);

// Programmatic dependent launch between the decode kernels (compute capability >= 9.0; on by
// default; VLMGRAPH_PDL=0 in the environment turns it off whatever this says). Process-wide, read
// when a kernel launches: set it before graphs are captured. No effect in a build without CUDA.
void SetProgrammaticDependentLaunch(bool enabled);

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
// values into the pages of cache rows slots[b] (or b when undefined) at those positions: paged
// cache_k / cache_v (num_pages, n_kv, page_size, D) and page_table (rows, pages_per_row) int32
// (Note [Paged KV layout], model/kv_cache.h); positions past the row's pages are not written.
RopeKvOutput RopeKvWrite(const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling,
                         const at::Tensor& positions, const at::Tensor& slots, int64_t n_heads,
                         int64_t n_kv, const at::Tensor& cache_k, const at::Tensor& cache_v,
                         const at::Tensor& page_table, bool want_k);

// One decode token per row: qkv (B, (n_heads + 2 n_kv) D) from the fused projection, unrotated;
// token b is at position positions[b] (B int64). Rotates q and the new key (as RopeKvWrite),
// writes the new key and value into cache row b at that position, and attends over the row's
// positions [0, min(positions[b] + 1, kv_len)) with grouped-query attention (softmax(q K^T /
// sqrt(D)) V). Paged cache (num_pages, n_kv, page_size, D) with page_table (rows >= B,
// pages_per_row) int32, pages_per_row x page_size >= kv_len (Note [Paged KV layout],
// model/kv_cache.h); semaphores (rows, n_kv) int32, zero (KVCache::attention_semaphores).
// Returns (B, n_heads * D).
at::Tensor RopeDecodeAttention(const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling,
                               const at::Tensor& positions, const at::Tensor& cache_k,
                               const at::Tensor& cache_v, const at::Tensor& page_table,
                               const at::Tensor& semaphores, int64_t kv_len, int64_t n_heads);

// The decode attention's output left as the partial softmax states of its key splits, for an
// out projection that combines them in its input staging (AttentionCombineLinear): the combine
// then costs no split counter, no fence and no round trips of its own, but every block of the
// projection combines every row. DecodeAttentionCombinesInLinear(B): whether a decode step of B
// rows takes it (B <= 2, measured; see fused_ops_cuda.cc).
struct DecodeAttentionPartials {
  at::Tensor partials;   // float32 scratch, the attention kernel's layout
  at::Tensor positions;  // (B) int64, as given to the attention
  int64_t kv_len = 0, n_heads = 0, n_kv = 0, head_dim = 0;
  at::ScalarType dtype = at::kFloat;  // of the attention output they stand for
};
bool DecodeAttentionCombinesInLinear(int64_t batch);
// RopeDecodeAttention (same arguments) without its last step: the key-split blocks only leave
// their partial states; the semaphores are not touched.
DecodeAttentionPartials RopeDecodeAttentionPartials(
    const at::Tensor& qkv, const at::Tensor& inv_freq, double scaling, const at::Tensor& positions,
    const at::Tensor& cache_k, const at::Tensor& cache_v, const at::Tensor& page_table,
    const at::Tensor& semaphores, int64_t kv_len, int64_t n_heads);
// Linear(a, weight, residual) for the attention output a that RopeDecodeAttention would have
// returned, combined from `partials` inside the GEMV with that kernel's formula and order: the
// same values to the bit. weight (n, n_heads * D), residual (B, n), both in the attention's
// dtype; B <= 4 (the CUDA-core GEMV), else c10::Error.
at::Tensor AttentionCombineLinear(const DecodeAttentionPartials& partials, const at::Tensor& weight,
                                  const at::Tensor& residual = {});

// x (rows, k) @ weight (n, k)^T (+ residual (rows, n)): a small-batch GEMV kernel when rows <= 8
// and the shapes are 16-byte aligned (decode steps), else cuBLAS (at::linear / at::addmm).
// add_into_residual (inference, no autograd): the sum may be written over a contiguous residual,
// which the caller reads no more; cuBLAS then adds the product into it in place instead of first
// copying it to a new output (cuBLASLt's `memcpy32_post`, 1.4 us per GEMM at 256 rows of the
// SmolLM2 shape). The GEMV writes a new output either way.
at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& residual = {},
                  bool add_into_residual = false);

// Linear(RmsNorm(x, norm_weight, eps), weight) with the norm computed inside the GEMV kernel
// when it applies (else the two ops).
at::Tensor RmsNormLinear(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                         const at::Tensor& weight);

// Linear(SiluMul(gate_up), weight, residual, add_into_residual), the activation computed inside
// the GEMV kernel when it applies (else the two ops).
at::Tensor SiluMulLinear(const at::Tensor& gate_up, const at::Tensor& weight,
                         const at::Tensor& residual = {}, bool add_into_residual = false);

// ---- Training: differentiable versions (autograd functions) for the reference path ---------
// The reference path (RMSNormImpl::forward, ApplyRotary) takes these on CUDA while its module is
// in training mode: the ATen chains cost ~23 (RMSNorm) and ~18 (RoPE of q and k) small kernels
// forward + backward, these 1 + 2 and 1 + 1.

// RmsNorm as above, with a backward: gn = T(g * w); dx = T(gn * r - x * r^3 * sum(gn * x) / H);
// dweight = sum over rows of T(g * T(x * r)), summed in float32 (the order autograd takes the
// reference ops in). Applies when RmsNormDifferentiableSupported: a CUDA tensor, weight of x's
// dtype, H <= 4096.
bool RmsNormDifferentiableSupported(const at::Tensor& x, const at::Tensor& weight);
at::Tensor RmsNormDifferentiable(const at::Tensor& x, const at::Tensor& weight, double eps);

// RoPE with a backward, bit-identical to ApplyRotary's ATen ops forward and backward (each product
// and sum rounded to the dtype as they round it). q (B, T, n_q, D), k (B, T, n_k, D) (any strides;
// the outputs are contiguous in this layout), cos/sin (B, T, D) float32 as RotaryEmbedding returns
// them. Returns rotated (q, k) in the (B, T, heads, D) layout. CUDA float32/bfloat16 only.
std::pair<at::Tensor, at::Tensor> RotaryDifferentiable(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& cos,
                                                       const at::Tensor& sin);

// x + bias (bias (n) broadcast over x's last dimension), differentiable, with exactly the values
// and gradients of ATen's `x + bias` (each sum rounded to the dtype once; the bias gradient by
// at::sum_to). On CUDA float32/bfloat16 with n a multiple of 16 bytes' elements, one vectorised
// kernel: ATen's broadcast add takes its non-vectorised loop (3.2 ms per training step of the
// 460M preset for the ViT's biases). Elsewhere ATen's add. The output is contiguous.
at::Tensor BiasAdd(const at::Tensor& x, const at::Tensor& bias);

// Index of each row's largest element, x (rows, n) -> (rows) int64, exactly at::argmax(x, -1)
// (NaN counts as the largest, ties go to the lower index). On CUDA for float32/bfloat16 with unit
// stride along n, one kernel with a block per row: ATen's argmax takes ~16 us (H100) for a row of
// nanovlm-460m's 49218 logits in one 512-thread block. Elsewhere at::argmax.
at::Tensor ArgmaxRows(const at::Tensor& x);
// ArgmaxRows written into `out` ((rows) int64 on x's device, contiguous), e.g. a static buffer
// that a captured graph writes in place.
void ArgmaxRowsInto(const at::Tensor& x, const at::Tensor& out);

// Summed cross entropy of the head's logits, differentiable in hidden and weight:
// sum over rows r with a counted target of lse(l_r) - l_r[target_r], l = hidden @ weight^T
// rounded to the dtype, lse in float32 (upstream nanoVLM: F.cross_entropy(ignore_index=-100),
// reduction sum; a target equal to ignore_index or outside [0, vocab) is not counted).
// hidden (rows, H), weight (vocab, H), one dtype (float32/bfloat16) on one CUDA device; targets
// (rows) int64 there. Returns a float32 scalar. Against the ATen chain (linear, cast to float32,
// log_softmax, nll_loss), the logits never exist in float32: one kernel reads them for the loss,
// one writes their gradient over them, and the head's three GEMMs run on a vocabulary padded to a
// multiple of 64 (Note [Logits buffer] in fused_ops_cuda.cc). The backward runs once. CPU builds:
// not supported.
bool LinearCrossEntropySupported(const at::Tensor& hidden, const at::Tensor& weight);
at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t ignore_index);

}  // namespace vlmgraph::ops
