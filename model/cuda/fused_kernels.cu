// model/cuda/fused_kernels.cu: the element-wise kernels (RMSNorm, SiLU-mul, RoPE + KV-cache write)
// used by prefill and as the fused GEMV's fallbacks. Decode attention is in decode_attention.cu,
// the GEMV in gemv.cu; see model/fused_ops.h for the reference formulas.
#include <algorithm>
#include <atomic>
#include <climits>
#include <type_traits>

#include "model/cuda/fused_kernels.h"
#include "model/cuda/kernel_util.cuh"

namespace vlmgraph::cuda {
namespace {

template <typename T>
__global__ void RmsNormKernel(const T* x, int64_t xs, const T* w, T* out, int64_t os, int hidden,
                              float eps) {
  __shared__ float scratch[32];
  const T* xr = x + blockIdx.x * xs;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = ToFloat(xr[i]);
    ss += v * v;
  }
  const float r = rsqrtf(BlockReduce<false>(ss, scratch) / hidden + eps);
  T* o = out + blockIdx.x * os;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    o[i] = FromFloat<T>(RmsNormScale<T>(ToFloat(xr[i]), r, ToFloat(w[i])));
  }
}

template <typename T>
__global__ void SiluMulKernel(const T* in, T* out, int64_t rows, int64_t inter) {
  const int64_t n = rows * inter;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter, c = i - r * inter;
    const float g = ToFloat(in[r * 2 * inter + c]);
    const float u = ToFloat(in[r * 2 * inter + inter + c]);
    out[i] = FromFloat<T>(SiluTimes(g, u));
  }
}

template <typename T>
__global__ void RopeKvWriteKernel(const T* qkv, const float* inv_freq, float scaling,
                                  const int64_t* positions, const int64_t* slots, int seq,
                                  int n_heads, int n_kv, int head_dim, T* q_out, T* k_out,
                                  T* cache_k, T* cache_v, KvPages kv) {
  const int64_t token = blockIdx.x;
  const int b = static_cast<int>(token / seq), t = static_cast<int>(token % seq);
  const int64_t pos = (positions ? positions[b] : 0) + t;
  const int64_t slot = slots ? slots[b] : b;
  const int half = head_dim / 2;
  const T* src = qkv + token * int64_t(n_heads + 2 * n_kv) * head_dim;
  // The token's row of KV head 0 in the paged cache (a page's heads are page_size rows apart);
  // positions past the row's pages or on the scratch page are not written (KvWritable).
  const bool write = cache_k != nullptr && KvWritable(kv, slot, pos);
  const int64_t at = write ? KvRowOffset<1>(kv, slot, 0, pos) * head_dim : 0;
  const int64_t head_stride = (int64_t(1) << kv.page_shift) * head_dim;
  // Rotated q and k heads: one thread per (head, pair).
  for (int i = threadIdx.x; i < (n_heads + n_kv) * half; i += blockDim.x) {
    const int h = i / half, p = i % half;
    const T* x = src + h * head_dim;
    float r1, r2;
    Rotate(ToFloat(x[p]), ToFloat(x[p + half]), pos, inv_freq[p], scaling, &r1, &r2);
    const T y1 = FromFloat<T>(r1), y2 = FromFloat<T>(r2);
    if (h < n_heads) {
      T* q = q_out + token * int64_t(n_heads) * head_dim + h * head_dim;
      q[p] = y1;
      q[p + half] = y2;
    } else {
      const int kh = h - n_heads;
      if (write) {
        T* dst = cache_k + at + kh * head_stride;
        dst[p] = y1;
        dst[p + half] = y2;
      }
      if (k_out) {
        T* k = k_out + token * int64_t(n_kv) * head_dim + kh * head_dim;
        k[p] = y1;
        k[p + half] = y2;
      }
    }
  }
  // Values: copied as they are.
  if (!write || !cache_v) return;
  for (int i = threadIdx.x; i < n_kv * head_dim; i += blockDim.x) {
    const int vh = i / head_dim, d = i % head_dim;
    cache_v[at + vh * head_stride + d] = src[(n_heads + n_kv) * head_dim + i];
  }
}

// ---- Training (differentiable) versions: RoPE forward/backward, RMSNorm backward -------------

template <typename T>
__device__ __forceinline__ float Round(float v) {
  return ToFloat(FromFloat<T>(v));
}

// ApplyRotary's ATen ops (language_model.cc) on one pair (x1, x2) = (x[p], x[p + D/2]), with each
// product and each sum rounded to T as those ops round them: y = x * c + rotate_half(x) * s, c and
// s rounded to T first. Backward: the adjoint, gx[p] = g[p] c[p] + g[p + D/2] s[p + D/2] and gx[p +
// D/2] = g[p + D/2] c[p + D/2] - g[p] s[p], rounded as autograd's ops round them. _rn intrinsics
// keep the compiler from contracting into FMAs (the ATen kernels round each op).
template <typename T, bool kBackward>
__global__ void RotaryKernel(const T* q, const T* k, const float* cos, const float* sin, T* q_out,
                             T* k_out, int n_q, int n_k, int head_dim) {
  const int64_t token = blockIdx.x;
  const int half = head_dim / 2;
  const float* c = cos + token * head_dim;
  const float* s = sin + token * head_dim;
  for (int i = threadIdx.x; i < (n_q + n_k) * half; i += blockDim.x) {
    const int h = i / half, p = i % half;
    const int64_t offset =
        h < n_q ? (token * n_q + h) * head_dim : (token * n_k + (h - n_q)) * head_dim;
    const T* x = (h < n_q ? q : k) + offset;
    T* y = (h < n_q ? q_out : k_out) + offset;
    const float c1 = Round<T>(c[p]), c2 = Round<T>(c[p + half]);
    const float s1 = Round<T>(s[p]), s2 = Round<T>(s[p + half]);
    const float x1 = ToFloat(x[p]), x2 = ToFloat(x[p + half]);
    float y1, y2;
    if (!kBackward) {
      y1 = __fadd_rn(Round<T>(__fmul_rn(x1, c1)), Round<T>(__fmul_rn(-x2, s1)));
      y2 = __fadd_rn(Round<T>(__fmul_rn(x2, c2)), Round<T>(__fmul_rn(x1, s2)));
    } else {
      y1 = __fadd_rn(Round<T>(__fmul_rn(x1, c1)), Round<T>(__fmul_rn(x2, s2)));
      y2 = __fadd_rn(Round<T>(__fmul_rn(x2, c2)), -Round<T>(__fmul_rn(x1, s1)));
    }
    y[p] = FromFloat<T>(y1);
    y[p + half] = FromFloat<T>(y2);
  }
}

// RMSNorm backward for y = T(x * r) * w, r = rsqrt(mean(x^2) + eps), in the order autograd takes
// the reference ops (RMSNormImpl::forward): gn = T(g * w); gx = T(gn * r - x * r^3 * sum(gn * x)
// / H); the weight's gradient sum over rows of T(g * T(x * r)), here per block of rows into
// dw_partial (blocks, H) float32, summed over blocks by the caller. One block of kNormThreads
// threads takes rows_per_block rows one after another; thread t owns columns t + j * kNormThreads.
constexpr int kNormThreads = 256, kNormCols = 16;  // hidden <= 4096
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    RmsNormBackwardKernel(const T* x, const T* w, const T* g, T* dx, float* dw_partial,
                          int64_t rows, int rows_per_block, int hidden, float eps) {
  __shared__ float scratch[32];
  float wv[kNormCols], acc[kNormCols];
#pragma unroll
  for (int j = 0; j < kNormCols; ++j) {
    const int col = threadIdx.x + j * kNormThreads;
    wv[j] = col < hidden ? ToFloat(w[col]) : 0.f;
    acc[j] = 0.f;
  }
  const int64_t first = blockIdx.x * int64_t(rows_per_block);
  const int64_t last = min(rows, first + rows_per_block);
  for (int64_t row = first; row < last; ++row) {
    const T* xr = x + row * hidden;
    const T* gr = g + row * hidden;
    float xv[kNormCols], gn[kNormCols];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kNormCols; ++j) {
      const int col = threadIdx.x + j * kNormThreads;
      xv[j] = col < hidden ? ToFloat(xr[col]) : 0.f;
      gn[j] = col < hidden ? ToFloat(gr[col]) : 0.f;  // g until the next loop
      ss += xv[j] * xv[j];
    }
    const float r = rsqrtf(BlockReduce<false>(ss, scratch) / hidden + eps);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kNormCols; ++j) {
      acc[j] += Round<T>(gn[j] * Round<T>(xv[j] * r));
      gn[j] = Round<T>(gn[j] * wv[j]);
      dot += gn[j] * xv[j];
    }
    dot = BlockReduce<false>(dot, scratch);
    const float k = dot * -0.5f * r * r * r / hidden * 2.f;
    T* dr = dx + row * hidden;
#pragma unroll
    for (int j = 0; j < kNormCols; ++j) {
      const int col = threadIdx.x + j * kNormThreads;
      if (col < hidden) dr[col] = FromFloat<T>(gn[j] * r + k * xv[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < kNormCols; ++j) {
    const int col = threadIdx.x + j * kNormThreads;
    if (col < hidden) dw_partial[blockIdx.x * int64_t(hidden) + col] = acc[j];
  }
}

int ThreadsFor(int64_t work) {
  return static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(32, (work + 31) / 32 * 32)));
}

// out = x + bias over rows of n columns (bias broadcast), each sum rounded to T once, as ATen's
// add computes it (float(x) + float(bias)). One 16-byte vector per thread and iteration;
// n % (16 / sizeof(T)) == 0 and 16-byte aligned pointers (the launcher checks).
template <typename T>
__global__ void BiasAddKernel(const T* __restrict__ x, const T* __restrict__ bias,
                              T* __restrict__ out, int64_t vecs, int64_t vecs_per_row) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
       v += stride) {
    float a[kVec], b[kVec];
    LoadVec(x + v * kVec, a);
    LoadVec(bias + (v % vecs_per_row) * kVec, b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) a[j] += b[j];
    StoreVec(out + v * kVec, a);
  }
}

// Cross entropy over rows of `vocab` logits (row stride ld, a multiple of 16 / sizeof(T), 16-byte
// aligned rows). One block per row: an online max / sum of exp over the row (Milakov & Gimelshein
// 2018, "Online normalizer calculation for softmax"), then lse = max + log(sum) and
// loss = lse - logit[target] (0 for an ignored or out-of-range target).
constexpr int kCrossEntropyThreads = 512;

template <typename T>
__global__ void __launch_bounds__(kCrossEntropyThreads)
    CrossEntropyForwardKernel(const T* __restrict__ logits, int64_t ld, int vocab,
                              const int64_t* __restrict__ targets, int64_t ignore_index,
                              float* __restrict__ lse_out, float* __restrict__ loss_out) {
  constexpr int kVec = 16 / sizeof(T);
  __shared__ float scratch[32];
  const T* x = logits + blockIdx.x * ld;
  float m = -INFINITY, s = 0.f;
  auto add = [&](float v) {
    if (v > m) {
      s *= expf(m - v);  // 0 while m is still -inf
      m = v;
    }
    s += expf(v - m);
  };
  const int full = vocab / kVec;
  for (int v = threadIdx.x; v < full; v += blockDim.x) {
    float e[kVec];
    LoadVec(x + v * kVec, e);
#pragma unroll
    for (int j = 0; j < kVec; ++j) add(e[j]);
  }
  for (int j = full * kVec + threadIdx.x; j < vocab; j += blockDim.x) add(ToFloat(x[j]));
  const float row_max = BlockReduce<true>(m, scratch);
  const float row_sum = BlockReduce<false>(m == -INFINITY ? 0.f : s * expf(m - row_max), scratch);
  if (threadIdx.x == 0) {
    const float lse = row_max + logf(row_sum);
    const int64_t t = targets[blockIdx.x];
    const bool counted = t != ignore_index && t >= 0 && t < vocab;
    lse_out[blockIdx.x] = lse;
    loss_out[blockIdx.x] = counted ? lse - ToFloat(x[t]) : 0.f;
  }
}

// The gradient of CrossEntropyForwardKernel's summed loss, scaled by *grad_scale, written over the
// logits in place: g = scale * (exp(logit - lse) - [j == target]); 0 on an uncounted row and in
// the padding columns [vocab, ld), so GEMMs may read whole rows of ld.
template <typename T>
__global__ void __launch_bounds__(kCrossEntropyThreads)
    CrossEntropyBackwardKernel(T* __restrict__ logits, int64_t ld, int vocab,
                               const int64_t* __restrict__ targets, int64_t ignore_index,
                               const float* __restrict__ lse,
                               const float* __restrict__ grad_scale) {
  constexpr int kVec = 16 / sizeof(T);
  T* x = logits + blockIdx.x * ld;
  const int64_t t = targets[blockIdx.x];
  const bool counted = t != ignore_index && t >= 0 && t < vocab;
  const float scale = counted ? *grad_scale : 0.f, row_lse = lse[blockIdx.x];
  const int vecs = static_cast<int>(ld / kVec);
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float e[kVec];
    LoadVec(x + v * kVec, e);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int col = v * kVec + j;
      e[j] = counted && col < vocab ? scale * (expf(e[j] - row_lse) - (col == t ? 1.f : 0.f)) : 0.f;
    }
    StoreVec(x + v * kVec, e);
  }
}

// ---- Argmax over each row (greedy decoding) --------------------------------------------------
// One block per row. Every thread issues up to kArgmaxBatch 16-byte loads of the row before it
// compares any (a decode step's ~49k bf16 logits: 6 loads per thread, one round trip), keeps its
// best (value, index), then the warps and the block reduce. A row need not start 16-byte aligned
// (49218 bf16 logits per row): the elements before its first aligned address and after its last
// whole vector are read one by one. ArgmaxOrder is torch.argmax's order:
// the larger value wins, NaN above every number, ties to the lower index.
constexpr int kArgmaxThreads = 1024;
constexpr int kArgmaxBatch = 8;

struct ArgmaxOrder {
  static __device__ __forceinline__ bool Beats(float v, int i, float best, int best_i) {
    const bool v_nan = v != v, best_nan = best != best;
    if (v_nan || best_nan) return v_nan && (!best_nan || i < best_i);
    return v > best || (v == best && i < best_i);
  }
};

template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads)
    ArgmaxKernel(const T* __restrict__ x, int64_t ld, int n, int64_t* __restrict__ out) {
  constexpr int kVec = 16 / sizeof(T);
  WaitForPrerequisites();  // the logits come from the previous kernel
  const T* row = x + blockIdx.x * ld;
  float best = -INFINITY;
  int best_i = INT_MAX;
  const int head =
      min(n, static_cast<int>(((16 - (reinterpret_cast<uintptr_t>(row) & 15)) & 15) / sizeof(T)));
  const T* body = row + head;  // 16-byte aligned
  const int vecs = (n - head) / kVec;
  for (int c0 = threadIdx.x; c0 < vecs; c0 += kArgmaxThreads * kArgmaxBatch) {
    uint4 raw[kArgmaxBatch];
#pragma unroll
    for (int u = 0; u < kArgmaxBatch; ++u) {
      const int c = c0 + u * kArgmaxThreads;
      if (c < vecs) raw[u] = *reinterpret_cast<const uint4*>(body + int64_t(c) * kVec);
    }
#pragma unroll
    for (int u = 0; u < kArgmaxBatch; ++u) {
      const int c = c0 + u * kArgmaxThreads;
      if (c >= vecs) break;
      const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float v = ToFloat(e[k]);
        const int i = head + c * kVec + k;
        if (ArgmaxOrder::Beats(v, i, best, best_i)) {
          best = v;
          best_i = i;
        }
      }
    }
  }
  // The unaligned head [0, head) and the tail after the last whole vector.
  const int tail = head + vecs * kVec;
  for (int t = threadIdx.x; t < head + (n - tail); t += kArgmaxThreads) {
    const int i = t < head ? t : tail + (t - head);
    const float v = ToFloat(row[i]);
    if (ArgmaxOrder::Beats(v, i, best, best_i)) {
      best = v;
      best_i = i;
    }
  }
  __shared__ float warp_best[32];
  __shared__ int warp_best_i[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int round = 0; round < 2; ++round) {
    WarpReduceBest<ArgmaxOrder>(best, best_i);
    if (round == 1) break;
    if (lane == 0) {
      warp_best[warp] = best;
      warp_best_i[warp] = best_i;
    }
    __syncthreads();
    if (warp != 0) return;
    best = lane < kArgmaxThreads / 32 ? warp_best[lane] : -INFINITY;
    best_i = lane < kArgmaxThreads / 32 ? warp_best_i[lane] : INT_MAX;
  }
  if (threadIdx.x == 0) out[blockIdx.x] = best_i;
}

}  // namespace

cudaError_t LaunchRmsNorm(bool bf16, const void* x, int64_t xs, const void* w, void* out,
                          int64_t os, int64_t rows, int64_t hidden, float eps,
                          cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = ThreadsFor(std::min<int64_t>(hidden, 512));
  if (bf16) {
    RmsNormKernel<__nv_bfloat16><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), xs, static_cast<const __nv_bfloat16*>(w),
        static_cast<__nv_bfloat16*>(out), os, static_cast<int>(hidden), eps);
  } else {
    RmsNormKernel<float><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        static_cast<const float*>(x), xs, static_cast<const float*>(w), static_cast<float*>(out),
        os, static_cast<int>(hidden), eps);
  }
  return cudaGetLastError();
}

cudaError_t LaunchSiluMul(bool bf16, const void* in, void* out, int64_t rows, int64_t inter,
                          cudaStream_t stream) {
  const int64_t n = rows * inter;
  if (n == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535));
  if (bf16) {
    SiluMulKernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(in), static_cast<__nv_bfloat16*>(out), rows, inter);
  } else {
    SiluMulKernel<float><<<blocks, 256, 0, stream>>>(static_cast<const float*>(in),
                                                     static_cast<float*>(out), rows, inter);
  }
  return cudaGetLastError();
}

cudaError_t LaunchRopeKvWrite(bool bf16, const void* qkv, const float* inv_freq, float scaling,
                              const int64_t* positions, const int64_t* slots, int64_t batch,
                              int64_t seq, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                              void* q_out, void* k_out, void* cache_k, void* cache_v, KvPages kv,
                              cudaStream_t stream) {
  if (batch * seq == 0) return cudaSuccess;
  const int threads =
      ThreadsFor(std::max<int64_t>((n_heads + n_kv) * head_dim / 2, n_kv * head_dim));
  const unsigned blocks = static_cast<unsigned>(batch * seq);
  if (bf16) {
    using T = __nv_bfloat16;
    RopeKvWriteKernel<T><<<blocks, threads, 0, stream>>>(
        static_cast<const T*>(qkv), inv_freq, scaling, positions, slots, static_cast<int>(seq),
        static_cast<int>(n_heads), static_cast<int>(n_kv), static_cast<int>(head_dim),
        static_cast<T*>(q_out), static_cast<T*>(k_out), static_cast<T*>(cache_k),
        static_cast<T*>(cache_v), kv);
  } else {
    using T = float;
    RopeKvWriteKernel<T><<<blocks, threads, 0, stream>>>(
        static_cast<const T*>(qkv), inv_freq, scaling, positions, slots, static_cast<int>(seq),
        static_cast<int>(n_heads), static_cast<int>(n_kv), static_cast<int>(head_dim),
        static_cast<T*>(q_out), static_cast<T*>(k_out), static_cast<T*>(cache_k),
        static_cast<T*>(cache_v), kv);
  }
  return cudaGetLastError();
}

cudaError_t LaunchRotary(bool bf16, bool backward, const void* q, const void* k, const float* cos,
                         const float* sin, void* q_out, void* k_out, int64_t tokens, int64_t n_q,
                         int64_t n_k, int64_t head_dim, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  const int threads = ThreadsFor((n_q + n_k) * head_dim / 2);
  const unsigned blocks = static_cast<unsigned>(tokens);
  auto launch = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    auto kernel = backward ? RotaryKernel<T, true> : RotaryKernel<T, false>;
    kernel<<<blocks, threads, 0, stream>>>(static_cast<const T*>(q), static_cast<const T*>(k), cos,
                                           sin, static_cast<T*>(q_out), static_cast<T*>(k_out),
                                           static_cast<int>(n_q), static_cast<int>(n_k),
                                           static_cast<int>(head_dim));
  };
  if (bf16) {
    launch(static_cast<__nv_bfloat16*>(nullptr));
  } else {
    launch(static_cast<float*>(nullptr));
  }
  return cudaGetLastError();
}

int64_t RmsNormBackwardBlocks(int64_t rows, int64_t hidden) {
  if (hidden > kNormThreads * kNormCols || rows == 0) return 0;
  return (rows + RmsNormBackwardRowsPerBlock(rows) - 1) / RmsNormBackwardRowsPerBlock(rows);
}

int RmsNormBackwardRowsPerBlock(int64_t rows) {
  // About 4 blocks per SM of an H100 (132 SMs); fewer rows per block only add partial sums.
  return static_cast<int>(std::max<int64_t>(1, (rows + 527) / 528));
}

cudaError_t LaunchRmsNormBackward(bool bf16, const void* x, const void* w, const void* g, void* dx,
                                  float* dw_partial, int64_t rows, int64_t hidden, float eps,
                                  cudaStream_t stream) {
  const int64_t blocks = RmsNormBackwardBlocks(rows, hidden);
  if (blocks == 0) return rows == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const int rpb = RmsNormBackwardRowsPerBlock(rows);
  if (bf16) {
    using T = __nv_bfloat16;
    RmsNormBackwardKernel<T><<<static_cast<unsigned>(blocks), kNormThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(g),
        static_cast<T*>(dx), dw_partial, rows, rpb, static_cast<int>(hidden), eps);
  } else {
    using T = float;
    RmsNormBackwardKernel<T><<<static_cast<unsigned>(blocks), kNormThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(g),
        static_cast<T*>(dx), dw_partial, rows, rpb, static_cast<int>(hidden), eps);
  }
  return cudaGetLastError();
}

cudaError_t LaunchBiasAdd(bool bf16, const void* x, const void* bias, void* out, int64_t rows,
                          int64_t n, cudaStream_t stream) {
  const int vec = bf16 ? 8 : 4;
  if (n % vec != 0 || !Aligned16(x) || !Aligned16(bias) || !Aligned16(out))
    return cudaErrorInvalidValue;
  const int64_t vecs = rows * n / vec;
  if (vecs == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  // Enough blocks to fill the GPU several times over; the grid-stride loop takes the rest.
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((vecs + kThreads - 1) / kThreads, 4096));
  auto launch = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    BiasAddKernel<T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(out), vecs, n / vec);
  };
  if (bf16) {
    launch(static_cast<__nv_bfloat16*>(nullptr));
  } else {
    launch(static_cast<float*>(nullptr));
  }
  return cudaGetLastError();
}

cudaError_t LaunchCrossEntropy(bool bf16, bool backward, void* logits, int64_t ld, int64_t rows,
                               int64_t vocab, const int64_t* targets, int64_t ignore_index,
                               float* lse, float* loss, const float* grad_scale,
                               cudaStream_t stream) {
  const int vec = bf16 ? 8 : 4;
  if (ld % vec != 0 || ld < vocab || !Aligned16(logits) || vocab > INT32_MAX)
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(rows);
  auto launch = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    if (backward) {
      CrossEntropyBackwardKernel<T><<<blocks, kCrossEntropyThreads, 0, stream>>>(
          static_cast<T*>(logits), ld, static_cast<int>(vocab), targets, ignore_index, lse,
          grad_scale);
    } else {
      CrossEntropyForwardKernel<T><<<blocks, kCrossEntropyThreads, 0, stream>>>(
          static_cast<const T*>(logits), ld, static_cast<int>(vocab), targets, ignore_index, lse,
          loss);
    }
  };
  if (bf16) {
    launch(static_cast<__nv_bfloat16*>(nullptr));
  } else {
    launch(static_cast<float*>(nullptr));
  }
  return cudaGetLastError();
}

cudaError_t LaunchArgmax(bool bf16, const void* x, int64_t ld, int64_t rows, int64_t n,
                         int64_t* out, cudaStream_t stream) {
  const size_t elem = bf16 ? 2 : 4;
  if (n <= 0 || n > INT32_MAX || ld < n || reinterpret_cast<uintptr_t>(x) % elem != 0 ||
      rows > INT32_MAX)
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(rows));
  cudaError_t e =
      bf16 ? LaunchMaybePdl(ArgmaxKernel<__nv_bfloat16>, grid, dim3(kArgmaxThreads), 0, stream,
                            static_cast<const __nv_bfloat16*>(x), ld, static_cast<int>(n), out)
           : LaunchMaybePdl(ArgmaxKernel<float>, grid, dim3(kArgmaxThreads), 0, stream,
                            static_cast<const float*>(x), ld, static_cast<int>(n), out);
  return e != cudaSuccess ? e : cudaGetLastError();
}

namespace {
std::atomic<bool> g_pdl_requested{true};
}  // namespace

void SetProgrammaticDependentLaunch(bool enabled) { g_pdl_requested.store(enabled); }
bool ProgrammaticDependentLaunchRequested() { return g_pdl_requested.load(); }

}  // namespace vlmgraph::cuda
