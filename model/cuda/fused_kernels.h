// model/cuda/fused_kernels.h: launchers for vlmgraph's fused CUDA kernels (fused_kernels.cu).
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

// One decode token per batch row, grouped-query attention over its KV-cache row:
// out[b, h, :] = softmax(q[b, h] . K[b, h / g, 0..len_b) * scale) V[b, h / g, 0..len_b),
// len_b = positions[b] + 1, g = n_heads / n_kv. q, out: (batch, n_heads * head_dim); cache_k,
// cache_v: (rows, n_kv, max_seq, head_dim), batch row b reads cache row b. kv_len bounds len_b
// (sizes shared memory). head_dim in {16, 32, 64, 128}; returns cudaErrorInvalidValue otherwise.
cudaError_t LaunchDecodeAttention(bool bf16, const void* q, const void* cache_k,
                                  const void* cache_v, const int64_t* positions, void* out,
                                  int64_t batch, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                                  int64_t max_seq, int64_t kv_len, float scale,
                                  cudaStream_t stream);

// y (rows, n) = x (rows, k) W^T (+ residual (rows, n) when given), W: (n, k) row-major, for
// rows <= 8 (decode): one warp per output column streams its weight row with 16-byte loads, the
// memory-bound regime where a general GEMM leaves bandwidth unused. k * sizeof(element) must be a
// multiple of 16 and every pointer 16-byte aligned; returns cudaErrorInvalidValue otherwise.
cudaError_t LaunchSmallBatchGemv(bool bf16, const void* x, const void* w, const void* residual,
                                 void* y, int64_t rows, int64_t n, int64_t k, cudaStream_t stream);

}  // namespace vlmgraph::cuda
