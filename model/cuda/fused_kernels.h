// model/cuda/fused_kernels.h: launchers for vlmgraph's fused CUDA kernels (fused_kernels.cu,
// decode_attention.cu, decode_attention_mma.cu, gemv.cu).
// Plain pointers and sizes, no ATen, so the .cu compiles with nvcc alone. Every launcher queues
// work on `stream` and returns cudaGetLastError(); shapes are documented at each launcher and
// checked by the ATen wrappers in fused_ops_cuda.cc. `bf16` selects __nv_bfloat16 elements,
// otherwise float.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vlmgraph::cuda {

// Programmatic dependent launch of the fused decode kernels (compute capability >= 9.0): each
// kernel issues its first weight loads before waiting for the previous one. On unless
// SetProgrammaticDependentLaunch(false) (config key capture.programmatic_dependent_launch) or the
// environment variable VLMGRAPH_PDL=0, which wins. Read at each launch, so a captured graph keeps
// what was set when it was captured. Process-wide; safe from any thread.
void SetProgrammaticDependentLaunch(bool enabled);
bool ProgrammaticDependentLaunchRequested();

// out[r, :] = T(x[r, :] * rsqrt(mean(x[r, :]^2) + eps)) * w, accumulated in float32.
// x, out: (rows, hidden) with row strides; w: (hidden).
cudaError_t LaunchRmsNorm(bool bf16, const void* x, int64_t x_row_stride, const void* w, void* out,
                          int64_t out_row_stride, int64_t rows, int64_t hidden, float eps,
                          cudaStream_t stream);

// out (rows, inter) = silu(in[:, :inter]) * in[:, inter:], in: (rows, 2 * inter) contiguous.
cudaError_t LaunchSiluMul(bool bf16, const void* in, void* out, int64_t rows, int64_t inter,
                          cudaStream_t stream);

#if defined(__CUDACC__)
#define VLMGRAPH_HOST_DEVICE __host__ __device__
#else
#define VLMGRAPH_HOST_DEVICE
#endif

// A paged KV cache as the kernels index it (Note [Paged KV layout], model/kv_cache.h): keys and
// values (num_pages, n_kv, 1 << page_shift, head_dim); position p of row r lives in page
// table[r * pages_per_row + (p >> page_shift)] at offset p & (page_size - 1). Plain data, passed
// to kernels by value.
struct KvPages {
  const int* table = nullptr;  // (rows, pages_per_row) int32, on the device
  int pages_per_row = 0;
  int page_shift = 4;  // log2(page_size); page_size >= 16
  int n_kv = 0;
  // The positions a row can hold: pages_per_row x page_size.
  VLMGRAPH_HOST_DEVICE int64_t max_seq() const { return int64_t(pages_per_row) << page_shift; }
};

// RoPE (rotate_half form, Su et al. 2021) on the q and k parts of a fused projection and KV-cache
// write. qkv: (batch * seq, (n_heads + 2 * n_kv) * head_dim) contiguous, row b * seq + t.
// Position of token (b, t): positions[b] + t when positions != nullptr, else t. Cache row of batch
// row b: slots[b] when slots != nullptr, else b. Writes q_out (batch * seq, n_heads * head_dim)
// and, when k_out != nullptr, rotated keys (batch * seq, n_kv * head_dim); keys and values go to
// the paged cache_k / cache_v at (row slot, head, position) through `kv` (positions past
// kv.max_seq() are not written).
cudaError_t LaunchRopeKvWrite(bool bf16, const void* qkv, const float* inv_freq, float scaling,
                              const int64_t* positions, const int64_t* slots, int64_t batch,
                              int64_t seq, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                              void* q_out, void* k_out, void* cache_k, void* cache_v, KvPages kv,
                              cudaStream_t stream);

// One decode token per batch row: RoPE on its query heads and new key (as LaunchRopeKvWrite), the
// new key and value written to the KV cache at positions[b], and grouped-query attention over
// cache row b: out[b, h, :] = softmax(q[b, h] . K[b, h / g, 0..len_b) * scale) V[b, h / g,
// 0..len_b) with len_b = min(positions[b] + 1, kv_len), g = n_heads / n_kv <= 16. qkv: (batch,
// (n_heads + 2 n_kv) * head_dim) contiguous, unrotated (the fused projection); cache_k, cache_v:
// paged, row b through `kv` (kv.max_seq() >= kv_len); out: (batch, n_heads * head_dim). The keys
// are split into chunks of DecodeAttentionSplitLen(...) attended by separate thread blocks
// (flash-decoding) whose partial softmax states go to `partials` (at least
// RopeDecodeAttentionPartialFloats(...) floats, scratch) and are combined by the last block of
// each (row, KV head), counted on `semaphores` (rows >= batch, n_kv) int32, which must be zero
// before the launch and are zero again after it; a row whose keys fit one chunk is written
// directly by the warps kernel. Below 4 rows, or with more than 4 query heads per KV head, each
// block stages a chunk of 32 or 64 keys in shared memory; otherwise the warps of a block stream
// chunks of up to 512 keys through registers (decode_attention.cu has both kernels), on the tensor
// cores in tiles of 16 keys for bf16 with head_dim 64 or 128 (decode_attention_mma.cu, unless
// VLMGRAPH_DECODE_ATTENTION=warps; its probabilities are rounded to bf16 as flash attention's
// are, the CUDA-core kernels keep them in float32). head_dim in
// {16, 32, 64, 128}; returns cudaErrorInvalidValue otherwise. Launched with programmatic dependent
// launch where supported. combine = false: the blocks only write their partial states and `out` and
// `semaphores` are untouched; the out projection combines them (LaunchGemvAttnCombine).
cudaError_t LaunchRopeDecodeAttention(bool bf16, const void* qkv, const float* inv_freq,
                                      float scaling, const int64_t* positions, void* cache_k,
                                      void* cache_v, void* out, float* partials, int* semaphores,
                                      int64_t batch, int64_t n_heads, int64_t n_kv,
                                      int64_t head_dim, KvPages kv, int64_t kv_len, float scale,
                                      bool combine, cudaStream_t stream);
// Keys per split of LaunchRopeDecodeAttention for a launch of `batch` rows over a kv_len window
// (32 or 64 keys with the shared-memory kernel, up to 512 with the warps kernel), and the splits
// (thread blocks per (row, KV head)): ceil(kv_len / split length).
int DecodeAttentionSplitLen(int64_t batch, int64_t n_heads, int64_t n_kv, int64_t kv_len);
int DecodeAttentionSplits(int64_t batch, int64_t n_heads, int64_t n_kv, int64_t kv_len);
// Floats of scratch LaunchRopeDecodeAttention needs.
int64_t RopeDecodeAttentionPartialFloats(int64_t batch, int64_t n_heads, int64_t n_kv,
                                         int64_t head_dim, int64_t kv_len);

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

// The partial softmax states a LaunchRopeDecodeAttention(combine = false) left, for
// LaunchGemvAttnCombine: partials (rows, n_kv, splits, groups * (head_dim + 2)) float32 as that
// kernel lays them out (m, l, o per split), positions (rows) int64 and kv_len as it was given.
// split_len and splits follow from the rows, heads and kv_len (DecodeAttentionSplitLen,
// DecodeAttentionSplits): LaunchGemvAttnCombine sets them, whatever the caller left there.
struct AttnCombineArgs {
  const float* partials = nullptr;
  const int64_t* positions = nullptr;
  int kv_len = 0, split_len = 0, splits = 0, n_kv = 0, groups = 0, head_dim = 0;
};
// y (rows, n) = a W^T (+ residual), a (rows, n_kv * groups * head_dim) the attention output that
// the decode attention kernel would have written, combined from its partial states inside this
// GEMV's input staging with that kernel's formula and order (so a is the same to the bit): the
// combine's global memory round trips and its kernel boundary leave the step's critical path.
// rows <= kMaxCudaCoreGemvRows; cudaErrorInvalidValue otherwise or for unaligned pointers.
cudaError_t LaunchGemvAttnCombine(bool bf16, const AttnCombineArgs& comb, const void* w,
                                  const void* residual, void* y, int64_t rows, int64_t n,
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
