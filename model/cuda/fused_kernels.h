// model/cuda/fused_kernels.h: launchers for vlmgraph's fused CUDA kernels (fused_kernels.cu,
// decode_attention.cu, gemv.cu, decode_stack.cu).
// Plain pointers and sizes, no ATen, so the .cu compiles with nvcc alone. Every launcher queues
// work on `stream` and returns cudaGetLastError(); shapes are documented at each launcher and
// checked by the ATen wrappers in fused_ops_cuda.cc. `bf16` selects __nv_bfloat16 elements,
// otherwise float.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vlmgraph::cuda {

// out[r, :] = T(x[r, :] * rsqrt(mean(x[r, :]^2) + eps)) * w, accumulated in float32.
// x, out: (rows, hidden) with row strides; w: (hidden).
cudaError_t LaunchRmsNorm(bool bf16, const void* x, int64_t x_row_stride, const void* w, void* out,
                          int64_t out_row_stride, int64_t rows, int64_t hidden, float eps,
                          cudaStream_t stream);

// out (rows, inter) = silu(in[:, :inter]) * in[:, inter:], in: (rows, 2 * inter) contiguous.
cudaError_t LaunchSiluMul(bool bf16, const void* in, void* out, int64_t rows, int64_t inter,
                          cudaStream_t stream);

// RoPE (rotate_half form, Su et al. 2021) on the q and k parts of a fused projection and KV-cache
// write. qkv: (batch * seq, (n_heads + 2 * n_kv) * head_dim) contiguous, row b * seq + t.
// Position of token (b, t): positions[b] + t when positions != nullptr, else t. Cache row of batch
// row b: slots[b] when slots != nullptr, else b. Writes q_out (batch * seq, n_heads * head_dim)
// and, when k_out != nullptr, rotated keys (batch * seq, n_kv * head_dim); keys and values go to
// cache_k / cache_v (rows, n_kv, max_seq, head_dim) at [slot, head, position, :].
cudaError_t LaunchRopeKvWrite(bool bf16, const void* qkv, const float* inv_freq, float scaling,
                              const int64_t* positions, const int64_t* slots, int64_t batch,
                              int64_t seq, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                              void* q_out, void* k_out, void* cache_k, void* cache_v,
                              int64_t max_seq, cudaStream_t stream);

// One decode token per batch row: RoPE on its query heads and new key (as LaunchRopeKvWrite), the
// new key and value written to the KV cache at positions[b], and grouped-query attention over
// cache row b: out[b, h, :] = softmax(q[b, h] . K[b, h / g, 0..len_b) * scale) V[b, h / g,
// 0..len_b) with len_b = min(positions[b] + 1, kv_len), g = n_heads / n_kv <= 16. qkv: (batch,
// (n_heads + 2 n_kv) * head_dim) contiguous, unrotated (the fused projection); cache_k, cache_v:
// (rows >= batch, n_kv, max_seq, head_dim); out: (batch, n_heads * head_dim). The keys are split
// into chunks of DecodeAttentionSplitLen(kv_len) attended by separate thread blocks
// (flash-decoding) whose partial softmax states go to `partials` (at least
// RopeDecodeAttentionPartialFloats(...) floats, scratch) and are combined by the last block of
// each (row, KV head), counted on `semaphores` (rows >= batch, n_kv) int32, which must be zero
// before the launch and are zero again after it. head_dim in {16, 32, 64, 128}; returns
// cudaErrorInvalidValue otherwise. Launched with programmatic dependent launch where supported.
cudaError_t LaunchRopeDecodeAttention(bool bf16, const void* qkv, const float* inv_freq,
                                      float scaling, const int64_t* positions, void* cache_k,
                                      void* cache_v, void* out, float* partials, int* semaphores,
                                      int64_t batch, int64_t n_heads, int64_t n_kv,
                                      int64_t head_dim, int64_t max_seq, int64_t kv_len,
                                      float scale, cudaStream_t stream);
// Keys per split of LaunchRopeDecodeAttention for a kv_len window (32 .. 256).
int DecodeAttentionSplitLen(int64_t kv_len);
// Floats of scratch LaunchRopeDecodeAttention needs.
int64_t RopeDecodeAttentionPartialFloats(int64_t batch, int64_t n_heads, int64_t head_dim,
                                         int64_t kv_len);

// What LaunchGemv applies to its input rows before the product (see GemvKernel in the .cu).
enum class GemvInput {
  kPlain,    // x (rows, k)
  kRmsNorm,  // x (rows, k) -> T(T(x * rsqrt(mean(x^2) + eps)) * norm_w), as LaunchRmsNorm
  kSiluMul,  // x (rows, 2k) -> silu(x[:, :k]) * x[:, k:], as LaunchSiluMul
};
// Measured on an H100 at nanovlm-460m shapes (bench/decode_ops_bench.cc): the CUDA-core GEMV
// beats cuBLAS up to 4 rows and loses at 8, where its per-row multiply-adds no longer hide behind
// the loads; 5 to 8 rows (bf16) take the tensor-core GEMV instead.
constexpr int64_t kMaxCudaCoreGemvRows = 4;
constexpr int64_t kMaxGemvRows = 8;
constexpr int64_t kMaxGemvSharedBytes = 160 * 1024;  // (rows + 1) * k * sizeof(element) per block

// y (rows, n) = f(x) W^T (+ residual (rows, n) when given), W: (n, k) row-major, rows <= 8
// (decode), f per `input`. Up to kMaxCudaCoreGemvRows rows one warp per output column streams its
// weight row with 16-byte loads (the memory-bound regime where a general GEMM leaves bandwidth
// unused). 5 to 8 rows in bf16 take a tensor-core GEMV (one block per 16 output columns and
// mma.sync; a long k is split over a thread block cluster on sm_90), except with the RMSNorm
// prologue when the output has more 16-column tiles than the GPU has SMs (nanovlm-460m's gate/up
// projection): there, as for float32, it returns cudaErrorInvalidValue and cuBLAS with the
// separate norm kernel is faster. The first weight loads are issued before waiting for the
// previous kernel (programmatic dependent launch on compute capability >= 9.0; VLMGRAPH_PDL=0
// turns it off). k * sizeof(element) must be a multiple of 16, every pointer 16-byte aligned and
// (rows + 1) * k * sizeof(element) <= kMaxGemvSharedBytes; returns cudaErrorInvalidValue
// otherwise (callers then use cuBLAS).
cudaError_t LaunchGemv(bool bf16, GemvInput input, const void* x, const void* norm_w, float eps,
                       const void* w, const void* residual, void* y, int64_t rows, int64_t n,
                       int64_t k, cudaStream_t stream);

// ---- The decoder stack of one decode step as one persistent kernel (decode_stack.cu) ---------
constexpr int kDecodeStackMaxLayers = 48;
constexpr int kDecodeStackMaxBatch = 8;
// DecodeStackArgs::trace points per (block, layer), globaltimer ns. Stage s in A..E has points
// 5s + 0 (passed its grid barrier) to 5s + 4 (about to arrive at the next one) and 25 + s
// (arrived). In between: A and D: + 1 weights in, + 2 norm done, + 3 GEMV done; C and E: + 1 inputs
// and weights in, + 2 GEMV done, + 3 outputs written; B (blocks with an attention item, its first
// one):
// + 1 query loaded, + 2 keys and values in, + 3 partial softmax state written.
constexpr int kDecodeStackTracePoints = 30;

// One decoder block's tensors, bf16, contiguous: norm weights (hidden); w_qkv ((n_heads + 2 n_kv)
// head_dim, hidden) = q, k, v projections stacked; w_out (hidden, n_heads head_dim); w_gate_up
// (2 inter, hidden) = gate then up; w_down (hidden, inter); cache_k, cache_v (rows >= batch, n_kv,
// max_seq, head_dim).
struct DecodeStackLayer {
  const void* norm1;
  const void* w_qkv;
  const void* w_out;
  const void* norm2;
  const void* w_gate_up;
  const void* w_down;
  void* cache_k;
  void* cache_v;
};

struct DecodeStackArgs {
  DecodeStackLayer layer[kDecodeStackMaxLayers];
  int layers = 0;
  const void* x = nullptr;  // (batch, hidden) hidden states entering block 0
  void* out = nullptr;      // (batch, hidden) hidden states leaving the last block (no final norm)
  const int64_t* positions = nullptr;  // (batch) position of each row's new token
  const float* inv_freq = nullptr;     // (head_dim / 2) RoPE inverse frequencies
  float rope_scaling = 1.f;
  float eps = 1e-5f;  // RMSNorm epsilon
  int batch = 0, hidden = 0, n_heads = 0, n_kv = 0, head_dim = 0, inter = 0;
  int64_t max_seq = 0;          // the cache's positions per row
  int kv_len = 0;               // attend over cache positions [0, min(position + 1, kv_len))
  void* qkv = nullptr;          // scratch (batch, (n_heads + 2 n_kv) head_dim) bf16
  void* act = nullptr;          // scratch (batch, inter) bf16
  void* attn = nullptr;         // scratch (batch, n_heads head_dim) bf16
  float* partials = nullptr;    // scratch, DecodeStackPartialFloats(...) floats
  int* semaphores = nullptr;    // (rows >= batch, n_kv) int32, zero before and after the launch
  unsigned* barrier = nullptr;  // one uint32, zero before the launch and zero again after it
  uint64_t* trace = nullptr;    // optional (grid, layers, kDecodeStackTracePoints) timeline
};

// Launch shape and shared-memory layout for one (shape, device); ok == false when the kernel
// cannot run here (see decode_stack.cu's requirements), and the caller uses the per-layer kernels.
struct DecodeStackPlan {
  bool ok = false;
  int grid = 0;       // one block per SM
  int split_len = 0;  // keys per attention item
  int splits = 0;     // attention items per (row, KV head)
  int acc_floats = 0;
  float scale = 0.f;  // 1 / sqrt(head_dim)
  uint32_t off_slot_a = 0, off_slot_c = 0, off_slot_d = 0, off_slot_e = 0, off_act = 0,
           off_attn = 0, off_acc = 0, smem_bytes = 0;
};
// For the current device.
DecodeStackPlan PlanDecodeStack(int64_t batch, int64_t hidden, int64_t n_heads, int64_t n_kv,
                                int64_t head_dim, int64_t inter, int64_t layers, int64_t kv_len);
int64_t DecodeStackPartialFloats(const DecodeStackPlan& plan, int64_t batch, int64_t n_heads,
                                 int64_t head_dim);

// Runs every decoder block for one new token per row (RMSNorm, qkv, RoPE, KV-cache write,
// grouped-query attention, out projection, residual, RMSNorm, SwiGLU MLP, residual), computing what
// the per-layer kernels compute (LaunchGemv, LaunchRopeDecodeAttention) with the same roundings.
// Launched with programmatic dependent launch where supported.
cudaError_t LaunchDecodeStack(const DecodeStackArgs& args, const DecodeStackPlan& plan,
                              cudaStream_t stream);

// out[r] = argmax over x[r, 0..n) (torch.argmax's order: NaN above every number, ties to the lower
// index), x: (rows, ld) with ld >= n; out (rows) int64. One block per row; launched with
// programmatic dependent launch where supported.
cudaError_t LaunchArgmax(bool bf16, const void* x, int64_t ld, int64_t rows, int64_t n,
                         int64_t* out, cudaStream_t stream);

// Training (autograd) kernels, wrapped by ops::RotaryDifferentiable / RmsNormDifferentiable.
// RoPE of ApplyRotary (language_model.cc), rounding as its ATen ops do: q (tokens, n_q, D),
// k (tokens, n_k, D) contiguous, cos/sin (tokens, D) float32 (scaled, the cat(freqs, freqs)
// layout). Forward writes the rotated q_out, k_out; backward (q, k = upstream gradients) the
// gradients of the unrotated inputs.
cudaError_t LaunchRotary(bool bf16, bool backward, const void* q, const void* k, const float* cos,
                         const float* sin, void* q_out, void* k_out, int64_t tokens, int64_t n_q,
                         int64_t n_k, int64_t head_dim, cudaStream_t stream);
// RMSNorm backward of LaunchRmsNorm's formula: x, g, dx (rows, hidden) contiguous, w (hidden);
// dw_partial (RmsNormBackwardBlocks(rows, hidden), hidden) float32 receives per-block sums of the
// weight gradient (the caller sums them over blocks). hidden <= 4096, else cudaErrorInvalidValue
// (RmsNormBackwardBlocks returns 0).
cudaError_t LaunchRmsNormBackward(bool bf16, const void* x, const void* w, const void* g, void* dx,
                                  float* dw_partial, int64_t rows, int64_t hidden, float eps,
                                  cudaStream_t stream);
int64_t RmsNormBackwardBlocks(int64_t rows, int64_t hidden);
int RmsNormBackwardRowsPerBlock(int64_t rows);

// out (rows, n) = x (rows, n) + bias (n), contiguous, each sum rounded to the dtype once as
// ATen's add rounds it (bit-identical to `x + bias`). cudaErrorInvalidValue unless n is a multiple
// of 16 / sizeof(element) and the pointers are 16-byte aligned.
cudaError_t LaunchBiasAdd(bool bf16, const void* x, const void* bias, void* out, int64_t rows,
                          int64_t n, cudaStream_t stream);
// Cross entropy over logits (rows, vocab) with row stride ld (a multiple of 16 / sizeof(element),
// 16-byte aligned), targets (rows) int64; a target equal to ignore_index or outside [0, vocab)
// counts 0. Forward (grad_scale unused): lse (rows) = log(sum(exp(logits))), loss (rows) =
// lse - logit[target], float32. Backward (loss unused): overwrites the logits with
// *grad_scale * (softmax - onehot(target)), rounded to the dtype, and writes 0 on uncounted rows
// and in the padding columns [vocab, ld).
cudaError_t LaunchCrossEntropy(bool bf16, bool backward, void* logits, int64_t ld, int64_t rows,
                               int64_t vocab, const int64_t* targets, int64_t ignore_index,
                               float* lse, float* loss, const float* grad_scale,
                               cudaStream_t stream);

}  // namespace vlmgraph::cuda
