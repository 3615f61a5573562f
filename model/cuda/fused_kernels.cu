// model/cuda/fused_kernels.cu: fused kernels for the decoder's hot path. Each replaces a chain of
// small ATen kernels (see model/fused_ops.h for the reference formulas they implement).
#include <cuda_bf16.h>

#include <algorithm>

#include "model/cuda/fused_kernels.h"

namespace vlmgraph::cuda {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

// Sum (or max) over the block; every thread gets the result. `scratch` holds >= 32 floats.
template <bool kMax>
__device__ float BlockReduce(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : (kMax ? -INFINITY : 0.f);
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  return v;
}

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
    // Same rounding order as the reference: normalise, cast, then scale by the weight.
    o[i] = FromFloat<T>(ToFloat(FromFloat<T>(ToFloat(xr[i]) * r)) * ToFloat(w[i]));
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
    out[i] = FromFloat<T>(g / (1.f + __expf(-g)) * u);
  }
}

template <typename T>
__global__ void RopeKvWriteKernel(const T* qkv, const float* inv_freq, float scaling,
                                  const int64_t* positions, const int64_t* slots, int seq,
                                  int n_heads, int n_kv, int head_dim, T* q_out, T* k_out,
                                  T* cache_k, T* cache_v, int64_t max_seq) {
  const int64_t token = blockIdx.x;
  const int b = static_cast<int>(token / seq), t = static_cast<int>(token % seq);
  const int64_t pos = (positions ? positions[b] : 0) + t;
  const int64_t slot = slots ? slots[b] : b;
  const int half = head_dim / 2;
  const T* src = qkv + token * int64_t(n_heads + 2 * n_kv) * head_dim;
  // Rotated q and k heads: one thread per (head, pair).
  for (int i = threadIdx.x; i < (n_heads + n_kv) * half; i += blockDim.x) {
    const int h = i / half, p = i % half;
    float s, c;
    sincosf(static_cast<float>(pos) * inv_freq[p], &s, &c);
    c *= scaling;
    s *= scaling;
    const T* x = src + h * head_dim;
    const float x1 = ToFloat(x[p]), x2 = ToFloat(x[p + half]);
    const T y1 = FromFloat<T>(x1 * c - x2 * s), y2 = FromFloat<T>(x2 * c + x1 * s);
    if (h < n_heads) {
      T* q = q_out + token * int64_t(n_heads) * head_dim + h * head_dim;
      q[p] = y1;
      q[p + half] = y2;
    } else {
      const int kh = h - n_heads;
      if (cache_k) {
        T* dst = cache_k + ((slot * n_kv + kh) * max_seq + pos) * head_dim;
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
  if (!cache_v) return;
  for (int i = threadIdx.x; i < n_kv * head_dim; i += blockDim.x) {
    const int vh = i / head_dim, d = i % head_dim;
    cache_v[((slot * n_kv + vh) * max_seq + pos) * head_dim + d] =
        src[(n_heads + n_kv) * head_dim + i];
  }
}

// Loads D elements of a row into float registers with 16-byte vector loads (rows are 16-byte
// aligned: the cache's last dim is contiguous and D * sizeof(T) is a multiple of 16 for D >= 8).
template <typename T, int D>
__device__ __forceinline__ void LoadRow(const T* row, float* out) {
  constexpr int kPer = 16 / sizeof(T);
  const uint4* v = reinterpret_cast<const uint4*>(row);
#pragma unroll
  for (int c = 0; c < D / kPer; ++c) {
    uint4 chunk = v[c];
    const T* e = reinterpret_cast<const T*>(&chunk);
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[c * kPer + k] = ToFloat(e[k]);
  }
}

// Grid (batch, n_kv); one block serves the g = n_heads / n_kv query heads of one KV head.
// Phase 1: a thread per key computes g scores (vector loads of the key row); phase 2: softmax per
// head over the block; phase 3: thread groups split the keys, each thread of a group sums p * V
// for one (head, dim) over its share (coalesced V rows), and the groups' partial sums are added.
template <typename T, int D>
__global__ void DecodeAttentionKernel(const T* q, const T* cache_k, const T* cache_v,
                                      const int64_t* positions, T* out, int n_heads, int n_kv,
                                      int64_t max_seq, int kv_len, float scale) {
  extern __shared__ float smem[];
  const int g = n_heads / n_kv;
  float* q_s = smem;                     // (g, D)
  float* scores = smem + g * D;          // (g, kv_len)
  float* partial = scores + g * kv_len;  // (blockDim.x) partial sums of phase 3
  __shared__ float scratch[32];
  __shared__ float stats[16];  // per head: 1 / softmax denominator (g <= 16)
  const int b = blockIdx.x, kh = blockIdx.y;
  const int64_t pos_end = positions[b] + 1;
  const int len = static_cast<int>(pos_end < kv_len ? pos_end : kv_len);
  const T* qb = q + (int64_t(b) * n_heads + int64_t(kh) * g) * D;
  for (int i = threadIdx.x; i < g * D; i += blockDim.x) q_s[i] = ToFloat(qb[i]);
  __syncthreads();
  const T* kb = cache_k + (int64_t(b) * n_kv + kh) * max_seq * D;
  const T* vb = cache_v + (int64_t(b) * n_kv + kh) * max_seq * D;
  for (int j = threadIdx.x; j < len; j += blockDim.x) {
    float k[D];
    LoadRow<T, D>(kb + int64_t(j) * D, k);
    for (int h = 0; h < g; ++h) {
      float acc = 0.f;
#pragma unroll
      for (int d = 0; d < D; ++d) acc += q_s[h * D + d] * k[d];
      scores[h * kv_len + j] = acc * scale;
    }
  }
  __syncthreads();
  for (int h = 0; h < g; ++h) {
    float m = -INFINITY;
    for (int j = threadIdx.x; j < len; j += blockDim.x) m = fmaxf(m, scores[h * kv_len + j]);
    m = BlockReduce<true>(m, scratch);
    float sum = 0.f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
      const float e = __expf(scores[h * kv_len + j] - m);
      scores[h * kv_len + j] = e;
      sum += e;
    }
    sum = BlockReduce<false>(sum, scratch);
    if (threadIdx.x == 0) stats[h] = 1.f / sum;
  }
  __syncthreads();
  // Phase 3: warp w takes keys w, w + W, ...; lane l owns dims l, l + 32, ... of every head, so
  // one V row is one coalesced load per warp and a warp's loads for its keys are independent.
  constexpr int kDimsPerLane = (D + 31) / 32;
  constexpr int kMaxGroups = 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float acc[kMaxGroups][kDimsPerLane];
#pragma unroll
  for (int h = 0; h < kMaxGroups; ++h)
#pragma unroll
    for (int c = 0; c < kDimsPerLane; ++c) acc[h][c] = 0.f;
#pragma unroll 4
  for (int j = warp; j < len; j += warps) {
    float v[kDimsPerLane];
#pragma unroll
    for (int c = 0; c < kDimsPerLane; ++c) {
      const int d = lane + 32 * c;
      v[c] = d < D ? ToFloat(vb[int64_t(j) * D + d]) : 0.f;
    }
#pragma unroll
    for (int h = 0; h < kMaxGroups; ++h) {
      if (h < g) {
        const float p = scores[h * kv_len + j];
#pragma unroll
        for (int c = 0; c < kDimsPerLane; ++c) acc[h][c] += p * v[c];
      }
    }
  }
  // Sum the warps' partial outputs: partial is (warps, g * D).
  const int pairs = g * D;
#pragma unroll
  for (int h = 0; h < kMaxGroups; ++h) {
    if (h < g) {
#pragma unroll
      for (int c = 0; c < kDimsPerLane; ++c) {
        const int d = lane + 32 * c;
        if (d < D) partial[warp * pairs + h * D + d] = acc[h][c];
      }
    }
  }
  __syncthreads();
  T* ob = out + (int64_t(b) * n_heads + int64_t(kh) * g) * D;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    float sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += partial[w * pairs + i];
    ob[i] = FromFloat<T>(sum * stats[i / D]);
  }
}

template <typename T, int D>
cudaError_t DecodeAttentionFor(const void* q, const void* ck, const void* cv,
                               const int64_t* positions, void* out, int64_t batch, int64_t n_heads,
                               int64_t n_kv, int64_t max_seq, int64_t kv_len, float scale,
                               cudaStream_t stream) {
  const int g = static_cast<int>(n_heads / n_kv);
  if (g > 16) return cudaErrorInvalidValue;
  const int threads = 512;
  const size_t smem =
      sizeof(float) * (size_t(g) * D + size_t(g) * kv_len + size_t(threads / 32) * g * D);
  auto kernel = DecodeAttentionKernel<T, D>;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  kernel<<<dim3(static_cast<unsigned>(batch), static_cast<unsigned>(n_kv)), threads, smem,
           stream>>>(static_cast<const T*>(q), static_cast<const T*>(ck), static_cast<const T*>(cv),
                     positions, static_cast<T*>(out), static_cast<int>(n_heads),
                     static_cast<int>(n_kv), max_seq, static_cast<int>(kv_len), scale);
  return cudaGetLastError();
}

template <typename T>
cudaError_t DecodeAttentionTyped(const void* q, const void* ck, const void* cv,
                                 const int64_t* positions, void* out, int64_t batch,
                                 int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t max_seq,
                                 int64_t kv_len, float scale, cudaStream_t s) {
  switch (head_dim) {
    case 16:
      return DecodeAttentionFor<T, 16>(q, ck, cv, positions, out, batch, n_heads, n_kv, max_seq,
                                       kv_len, scale, s);
    case 32:
      return DecodeAttentionFor<T, 32>(q, ck, cv, positions, out, batch, n_heads, n_kv, max_seq,
                                       kv_len, scale, s);
    case 64:
      return DecodeAttentionFor<T, 64>(q, ck, cv, positions, out, batch, n_heads, n_kv, max_seq,
                                       kv_len, scale, s);
    case 128:
      return DecodeAttentionFor<T, 128>(q, ck, cv, positions, out, batch, n_heads, n_kv, max_seq,
                                        kv_len, scale, s);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T, int M>
__global__ void SmallBatchGemvKernel(const T* __restrict__ x, const T* __restrict__ w,
                                     const T* __restrict__ residual, T* __restrict__ y, int n,
                                     int k) {
  constexpr int kVec = 16 / sizeof(T);
  const int col = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (col >= n) return;
  const int lane = threadIdx.x & 31;
  const T* wr = w + int64_t(col) * k;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
#pragma unroll 4
  for (int i = lane * kVec; i < k; i += 32 * kVec) {
    const uint4 wv = __ldg(reinterpret_cast<const uint4*>(wr + i));
    const T* we = reinterpret_cast<const T*>(&wv);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + int64_t(m) * k + i));
      const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[m] += ToFloat(we[e]) * ToFloat(xe[e]);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
  }
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float r = residual ? ToFloat(residual[int64_t(m) * n + col]) : 0.f;
      y[int64_t(m) * n + col] = FromFloat<T>(acc[m] + r);
    }
  }
}

template <typename T>
cudaError_t SmallBatchGemvTyped(const void* x, const void* w, const void* residual, void* y,
                                int64_t rows, int64_t n, int64_t k, cudaStream_t s) {
  constexpr int kWarps = 8;
  const unsigned blocks = static_cast<unsigned>((n + kWarps - 1) / kWarps);
  const T* xp = static_cast<const T*>(x);
  const T* wp = static_cast<const T*>(w);
  const T* rp = static_cast<const T*>(residual);
  T* yp = static_cast<T*>(y);
  const int ni = static_cast<int>(n), ki = static_cast<int>(k);
  switch (rows) {
#define VLMGRAPH_GEMV_CASE(M)                                                          \
  case M:                                                                              \
    SmallBatchGemvKernel<T, M><<<blocks, kWarps * 32, 0, s>>>(xp, wp, rp, yp, ni, ki); \
    break;
    VLMGRAPH_GEMV_CASE(1)
    VLMGRAPH_GEMV_CASE(2)
    VLMGRAPH_GEMV_CASE(3)
    VLMGRAPH_GEMV_CASE(4)
    VLMGRAPH_GEMV_CASE(5)
    VLMGRAPH_GEMV_CASE(6)
    VLMGRAPH_GEMV_CASE(7)
    VLMGRAPH_GEMV_CASE(8)
#undef VLMGRAPH_GEMV_CASE
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int ThreadsFor(int64_t work) {
  return static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(32, (work + 31) / 32 * 32)));
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
                              void* q_out, void* k_out, void* cache_k, void* cache_v,
                              int64_t max_seq, cudaStream_t stream) {
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
        static_cast<T*>(cache_v), max_seq);
  } else {
    using T = float;
    RopeKvWriteKernel<T><<<blocks, threads, 0, stream>>>(
        static_cast<const T*>(qkv), inv_freq, scaling, positions, slots, static_cast<int>(seq),
        static_cast<int>(n_heads), static_cast<int>(n_kv), static_cast<int>(head_dim),
        static_cast<T*>(q_out), static_cast<T*>(k_out), static_cast<T*>(cache_k),
        static_cast<T*>(cache_v), max_seq);
  }
  return cudaGetLastError();
}

cudaError_t LaunchDecodeAttention(bool bf16, const void* q, const void* cache_k,
                                  const void* cache_v, const int64_t* positions, void* out,
                                  int64_t batch, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                                  int64_t max_seq, int64_t kv_len, float scale,
                                  cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (bf16) {
    return DecodeAttentionTyped<__nv_bfloat16>(q, cache_k, cache_v, positions, out, batch, n_heads,
                                               n_kv, head_dim, max_seq, kv_len, scale, stream);
  }
  return DecodeAttentionTyped<float>(q, cache_k, cache_v, positions, out, batch, n_heads, n_kv,
                                     head_dim, max_seq, kv_len, scale, stream);
}

cudaError_t LaunchSmallBatchGemv(bool bf16, const void* x, const void* w, const void* residual,
                                 void* y, int64_t rows, int64_t n, int64_t k, cudaStream_t stream) {
  const int64_t elem = bf16 ? 2 : 4;
  auto aligned = [](const void* p) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  if ((k * elem) % 16 != 0 || !aligned(x) || !aligned(w) || !aligned(residual) || !aligned(y)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || n == 0) return cudaSuccess;
  return bf16 ? SmallBatchGemvTyped<__nv_bfloat16>(x, w, residual, y, rows, n, k, stream)
              : SmallBatchGemvTyped<float>(x, w, residual, y, rows, n, k, stream);
}

}  // namespace vlmgraph::cuda
