// model/cuda/fused_kernels.cu: fused kernels for the decoder's hot path. Each replaces a chain of
// small ATen kernels (see model/fused_ops.h for the reference formulas they implement).
#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

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

template <typename T>
__device__ __forceinline__ void StoreVec(T* dst, const float* v) {
  constexpr int kVec = 16 / sizeof(T);
  uint4 packed;
  T* e = reinterpret_cast<T*>(&packed);
#pragma unroll
  for (int i = 0; i < kVec; ++i) e[i] = FromFloat<T>(v[i]);
  *reinterpret_cast<uint4*>(dst) = packed;
}

template <typename T>
__device__ __forceinline__ void LoadVec(const T* src, float* v) {
  constexpr int kVec = 16 / sizeof(T);
  const uint4 packed = *reinterpret_cast<const uint4*>(src);
  const T* e = reinterpret_cast<const T*>(&packed);
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = ToFloat(e[i]);
}

// ---- Programmatic dependent launch (Hopper and newer; no-ops before sm_90) -------------------
// A kernel launched with the programmatic-stream-serialization attribute may start while the
// previous kernel of the stream is still running. It must call WaitForPrerequisites() before it
// reads anything an earlier kernel wrote or writes anything at all; work before that point (here:
// streaming weights, which no kernel writes) overlaps the previous kernel's tail. The wait returns
// once the previous grid has completed and its memory is visible, so as long as every kernel so
// launched waits, each one also sees the writes of every kernel before it.
__device__ __forceinline__ void WaitForPrerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel of the stream launch (its blocks then wait in WaitForPrerequisites).
__device__ __forceinline__ void AllowDependentsToLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- Decode attention with RoPE, KV-cache write and split keys -----------------------------
// Grid (splits, n_kv, batch), kAttnThreads threads. Block (s, kh, b) attends over keys
// [s * split_len, (s + 1) * split_len) of cache row b clipped to len_b = min(positions[b] + 1,
// kv_len); blocks past len_b exit at once. Before waiting for the previous kernel it copies its
// keys and values into shared memory (cp.async): those rows were written by earlier steps, never
// by the kernel it waits for. Then it rotates the g = n_heads / n_kv query heads of KV head kh and
// the new key (RoPE exactly as RopeKvWriteKernel), takes the new key and value at position
// positions[b] from shared memory instead of the cache, and the block holding that position
// stores them in the cache. Each block writes its partial softmax state (max m, sum l,
// unnormalised output o per head) to `partials`; the last of the active blocks of (b, kh), counted
// on semaphores[b * n_kv + kh], combines them: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s
// with M = max_s m_s (the online softmax of Milakov & Gimelshein 2018, split over keys as in
// flash-decoding, Dao et al. 2023), then resets the semaphore to 0 for the next launch.
// Lane mapping: kLanes = D / (16 / sizeof(T)) consecutive lanes share one key row, each holding
// one 16-byte slice, so shared-memory reads are conflict-free and a warp covers 32 / kLanes keys.
constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnMaxGroups = 16;
constexpr int kAttnMaxSplitLen = 64;

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads)
    RopeDecodeAttentionKernel(const T* __restrict__ qkv, const float* __restrict__ inv_freq,
                              float scaling, const int64_t* __restrict__ positions, T* cache_k,
                              T* cache_v, T* __restrict__ out, float* partials, int* semaphores,
                              int n_heads, int n_kv, int64_t max_seq, int kv_len, int split_len,
                              float scale) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLanes = D / kVec;               // lanes per key row
  constexpr int kSlots = kAttnThreads / kLanes;  // keys in flight per block
  constexpr int kHalf = D / 2;
  extern __shared__ __align__(16) unsigned char attn_smem_raw[];
  const int s = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const int g = n_heads / n_kv;
  // positions and the cache rows before this step's position were written before the previous
  // kernel started (see WaitForPrerequisites), so they may be read now.
  const int64_t pos = positions[b];
  const int len = static_cast<int>(pos + 1 < kv_len ? pos + 1 : kv_len);
  const int active = (len + split_len - 1) / split_len;
  if (s >= active) return;  // the block storing the new key is always active (see below)
  const int j0 = s * split_len;
  const int n = min(split_len, len - j0);
  T* k_s = reinterpret_cast<T*>(attn_smem_raw);                // (split_len, D)
  T* v_s = k_s + split_len * D;                                // (split_len, D)
  float* q_s = reinterpret_cast<float*>(v_s + split_len * D);  // (g, D)
  float* kv_new = q_s + g * D;                                 // (2, D)
  const int p_stride = max(split_len, static_cast<int>(gridDim.x));
  float* p_s = kv_new + 2 * D;               // (g, p_stride)
  float* red = p_s + g * p_stride;           // (warps, g, D)
  __shared__ float w_s[2 * kAttnMaxGroups];  // per head: m, l; then 1 / L
  __shared__ bool is_last;
  const int64_t row = (int64_t(b) * n_kv + kh) * max_seq;
  for (int i = threadIdx.x; i < n * kLanes; i += kAttnThreads) {
    const int j = i / kLanes, c = (i % kLanes) * kVec;
    __pipeline_memcpy_async(k_s + j * D + c, cache_k + (row + j0 + j) * D + c, 16);
    __pipeline_memcpy_async(v_s + j * D + c, cache_v + (row + j0 + j) * D + c, 16);
  }
  __pipeline_commit();
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  const T* src = qkv + int64_t(b) * (n_heads + 2 * n_kv) * D;
  for (int i = threadIdx.x; i < (g + 1) * kHalf; i += kAttnThreads) {
    const int h = i / kHalf, p = i - h * kHalf;
    float sn, cs;
    sincosf(static_cast<float>(pos) * inv_freq[p], &sn, &cs);
    cs *= scaling;
    sn *= scaling;
    const T* x = h < g ? src + (kh * g + h) * D : src + (n_heads + kh) * D;
    const float x1 = ToFloat(x[p]), x2 = ToFloat(x[p + kHalf]);
    float* dst = h < g ? q_s + h * D : kv_new;
    dst[p] = ToFloat(FromFloat<T>(x1 * cs - x2 * sn));  // rounded as the cache stores it
    dst[p + kHalf] = ToFloat(FromFloat<T>(x2 * cs + x1 * sn));
  }
  for (int d = threadIdx.x; d < D; d += kAttnThreads) {
    kv_new[D + d] = ToFloat(src[(n_heads + n_kv + kh) * D + d]);
  }
  __pipeline_wait_prior(0);
  __syncthreads();
  // The block whose split holds pos (the last one when pos is past the window) stores the new key
  // and value; when pos < kv_len that split holds pos, else it is the last split, active too.
  const int64_t writer = (pos < kv_len ? pos : kv_len - 1) / split_len;
  if (s == writer && pos < max_seq) {
    for (int d = threadIdx.x; d < D; d += kAttnThreads) {
      cache_k[(row + pos) * D + d] = FromFloat<T>(kv_new[d]);
      cache_v[(row + pos) * D + d] = FromFloat<T>(kv_new[D + d]);
    }
  }
  const int slot = threadIdx.x / kLanes, c = (threadIdx.x % kLanes) * kVec;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Scores: kLanes lanes per key, partial dot products reduced with shuffles.
  for (int first = 0; first < n; first += kSlots) {  // same trip count in every lane (shuffles)
    const int j = first + slot;
    float k[kVec];
    if (j0 + j == pos) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) k[e] = kv_new[c + e];
    } else if (j < n) {
      LoadVec(k_s + j * D + c, k);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) k[e] = 0.f;
    }
    for (int h = 0; h < g; ++h) {
      float acc = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc += q_s[h * D + c + e] * k[e];
#pragma unroll
      for (int o = kLanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (c == 0 && j < n) p_s[h * p_stride + j] = acc * scale;
    }
  }
  __syncthreads();
  for (int h = warp; h < g; h += kAttnWarps) {
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, p_s[h * p_stride + j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float l = 0.f;
    for (int j = lane; j < n; j += 32) {
      const float e = __expf(p_s[h * p_stride + j] - m);
      p_s[h * p_stride + j] = e;
      l += e;
    }
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) {
      w_s[h] = m;
      w_s[kAttnMaxGroups + h] = l;
    }
  }
  __syncthreads();
  // Unnormalised outputs, one head at a time: sum over this lane's keys, then over the key slots
  // of the warp (shuffles), then over the warps (shared memory).
  for (int h = 0; h < g; ++h) {
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int j = slot; j < n; j += kSlots) {
      const float p = p_s[h * p_stride + j];
      float v[kVec];
      if (j0 + j == pos) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = kv_new[D + c + e];
      } else {
        LoadVec(v_s + j * D + c, v);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += p * v[e];
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
#pragma unroll
      for (int o = kLanes; o < 32; o <<= 1) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
    }
    if (lane < kLanes) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) red[(warp * g + h) * D + c + e] = acc[e];
    }
  }
  __syncthreads();
  const int splits = gridDim.x;
  float* part = partials + ((int64_t(b) * n_kv + kh) * splits + s) * g * (D + 2);
  for (int i = threadIdx.x; i < g * D; i += kAttnThreads) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) sum += red[w * g * D + i];
    part[2 * g + i] = sum;
  }
  if (threadIdx.x < g) {
    part[threadIdx.x] = w_s[threadIdx.x];
    part[g + threadIdx.x] = w_s[kAttnMaxGroups + threadIdx.x];
  }
  // Publish the partials, then count this split in.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&semaphores[b * n_kv + kh], 1) == active - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Combine: weights e^(m_s - M) / L per (split, head) in shared memory, then one pass over o.
  const float* base = partials + (int64_t(b) * n_kv + kh) * splits * g * (D + 2);
  float* wgt = p_s;  // (active, g), reuses the scores' space (active * g <= splits * g)
  for (int i = threadIdx.x; i < active * g; i += kAttnThreads) {
    wgt[i] = __ldcg(base + (i / g) * g * (D + 2) + (i % g));  // m
  }
  __syncthreads();
  if (threadIdx.x < g) {
    const int h = threadIdx.x;
    float mx = -INFINITY;
    for (int t = 0; t < active; ++t) mx = fmaxf(mx, wgt[t * g + h]);
    float l = 0.f;
    for (int t = 0; t < active; ++t) {
      const float e = __expf(wgt[t * g + h] - mx);
      wgt[t * g + h] = e;
      l += e * __ldcg(base + t * g * (D + 2) + g + h);
    }
    w_s[h] = 1.f / l;
  }
  __syncthreads();
  T* ob = out + (int64_t(b) * n_heads + int64_t(kh) * g) * D;
  for (int i = threadIdx.x; i < g * D; i += kAttnThreads) {
    const int h = i / D;
    float o = 0.f;
#pragma unroll 4
    for (int t = 0; t < active; ++t)
      o += wgt[t * g + h] * __ldcg(base + t * g * (D + 2) + 2 * g + i);
    ob[i] = FromFloat<T>(o * w_s[h]);
  }
  if (threadIdx.x == 0) semaphores[b * n_kv + kh] = 0;
}

// ---- GEMV with a fused input prologue -----------------------------------------------------
// y (rows, n) = f(x) W^T (+ residual), rows <= M <= 4, W (n, k) row-major. One warp per output
// column streams its weight row with 16-byte loads, kGemvChunks of them in flight per lane, and
// issues the first ones before waiting for the previous kernel (weights are never written by a
// kernel). The block then stages f(x) for all rows in shared memory, in the activations' dtype:
//   kPlain:   f(x) = x                                               x (rows, k)
//   kRmsNorm: f(x) = T(T(x * rsqrt(mean(x^2) + eps)) * norm_w)     x (rows, k)  (RmsNormKernel)
//   kSiluMul: f(x) = T(silu(x[:, :k]) * x[:, k:])                   x (rows, 2k) (SiluMulKernel)
// so the products see the same rounded inputs as the unfused kernels.
enum GemvPrologue : int { kGemvPlain = 0, kGemvRmsNorm = 1, kGemvSiluMul = 2 };
constexpr int kGemvWarps = 8;

// kChunks 16-byte weight loads in flight per lane: 4 (k <= 1024 in bf16, 512 in float32, in one
// pass; few registers, so about 4 blocks fit on an SM and a 5120-column GEMV runs in one wave) or
// 12 (longer rows, fewer passes).
template <typename T, int M, int P, int kGemvChunks>
__global__ void __launch_bounds__(kGemvWarps * 32, kGemvChunks <= 4 ? 4 : 2)
    GemvKernel(const T* __restrict__ x, const T* __restrict__ norm_w, float eps,
               const T* __restrict__ w, const T* __restrict__ residual, T* __restrict__ y, int rows,
               int n, int k) {
  constexpr int kVec = 16 / sizeof(T);
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  T* xs = reinterpret_cast<T*>(gemv_smem);  // (rows, k) f(x)
  T* gs = xs + rows * k;                    // (k) norm weight (kGemvRmsNorm)
  __shared__ float row_ss[M];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int col = blockIdx.x * kGemvWarps + warp;
  const bool active = col < n;
  const uint4* wr = reinterpret_cast<const uint4*>(w + int64_t(active ? col : 0) * k);
  const int vecs = k / kVec;
  // Parameters are never written by a kernel: load them before waiting for the previous one.
  uint4 wreg[kGemvChunks];
#pragma unroll
  for (int c = 0; c < kGemvChunks; ++c) {
    const int v = c * 32 + lane;
    if (active && v < vecs) wreg[c] = __ldg(wr + v);
  }
  if (P == kGemvRmsNorm) {
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      reinterpret_cast<uint4*>(gs)[v] = __ldg(reinterpret_cast<const uint4*>(norm_w) + v);
    }
    if (threadIdx.x < M) row_ss[threadIdx.x] = 0.f;
    __syncthreads();
  }
  WaitForPrerequisites();
  // One pass over x (its only read from global memory): copy, or SiLU-mul, or copy while summing
  // squares per row for the norm, which is then applied in shared memory.
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) ss[m] = 0.f;
  for (int i = threadIdx.x; i < rows * vecs; i += blockDim.x) {
    const int m = i / vecs, c = (i - m * vecs) * kVec;
    if (P == kGemvPlain) {
      reinterpret_cast<uint4*>(xs + m * k)[c / kVec] =
          reinterpret_cast<const uint4*>(x + int64_t(m) * k)[c / kVec];
    } else if (P == kGemvRmsNorm) {
      const uint4 raw = reinterpret_cast<const uint4*>(x + int64_t(m) * k)[c / kVec];
      reinterpret_cast<uint4*>(xs + m * k)[c / kVec] = raw;
      const T* e = reinterpret_cast<const T*>(&raw);
      float part = 0.f;
#pragma unroll
      for (int j = 0; j < kVec; ++j) part += ToFloat(e[j]) * ToFloat(e[j]);
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        if (mm == m) ss[mm] += part;
      }
    } else {
      float e[kVec], u[kVec];
      LoadVec(x + int64_t(m) * 2 * k + c, e);
      LoadVec(x + int64_t(m) * 2 * k + k + c, u);
#pragma unroll
      for (int j = 0; j < kVec; ++j) e[j] = e[j] / (1.f + __expf(-e[j])) * u[j];
      StoreVec(xs + m * k + c, e);
    }
  }
  if (P == kGemvRmsNorm) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      for (int o = 16; o > 0; o >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
      if (lane == 0 && m < rows) atomicAdd(&row_ss[m], ss[m]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * vecs; i += blockDim.x) {
      const int m = i / vecs, c = (i - m * vecs) * kVec;
      const float r = rsqrtf(row_ss[m] / k + eps);
      float e[kVec], g[kVec];
      LoadVec(xs + m * k + c, e);
      LoadVec(gs + c, g);
#pragma unroll
      for (int j = 0; j < kVec; ++j) e[j] = ToFloat(FromFloat<T>(e[j] * r)) * g[j];
      StoreVec(xs + m * k + c, e);
    }
  }
  __syncthreads();
  AllowDependentsToLaunch();
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int first = 0; first < vecs; first += kGemvChunks * 32) {
    if (first > 0) {
#pragma unroll
      for (int c = 0; c < kGemvChunks; ++c) {
        const int v = first + c * 32 + lane;
        if (active && v < vecs) wreg[c] = __ldg(wr + v);
      }
    }
#pragma unroll
    for (int c = 0; c < kGemvChunks; ++c) {
      const int v = first + c * 32 + lane;
      if (!active || v >= vecs) continue;
      const T* we = reinterpret_cast<const T*>(&wreg[c]);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (m < rows) {
          const uint4 xv = reinterpret_cast<const uint4*>(xs + m * k)[v];
          const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[m] += ToFloat(we[e]) * ToFloat(xe[e]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
  }
  if (active && lane == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m < rows) {
        const float r = residual ? ToFloat(residual[int64_t(m) * n + col]) : 0.f;
        y[int64_t(m) * n + col] = FromFloat<T>(acc[m] + r);
      }
    }
  }
}

// Launches `kernel` with programmatic stream serialization when the device supports it (compute
// capability >= 9.0) and VLMGRAPH_PDL is not "0"; a plain launch otherwise.
bool PdlEnabled() {
  static const bool disabled = [] {
    const char* e = std::getenv("VLMGRAPH_PDL");
    return e != nullptr && std::strcmp(e, "0") == 0;
  }();
  if (disabled) return false;
  static std::atomic<int> major[64];  // 0 = not asked yet, -1 = unknown
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  int m = major[dev].load(std::memory_order_relaxed);
  if (m == 0) {
    if (cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) m = -1;
    major[dev].store(m, std::memory_order_relaxed);
  }
  return m >= 9;
}

template <typename... KernelArgs, typename... Args>
cudaError_t LaunchMaybePdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = PdlEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
}

template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem));
}

template <typename T, int D>
cudaError_t RopeDecodeAttentionFor(const void* qkv, const float* inv_freq, float scaling,
                                   const int64_t* positions, void* ck, void* cv, void* out,
                                   float* partials, int* semaphores, int64_t batch, int64_t n_heads,
                                   int64_t n_kv, int64_t max_seq, int64_t kv_len, float scale,
                                   cudaStream_t stream) {
  const int g = static_cast<int>(n_heads / n_kv);
  const int split_len = DecodeAttentionSplitLen(kv_len);
  const int splits = static_cast<int>((kv_len + split_len - 1) / split_len);
  const size_t p_stride = std::max(split_len, splits);
  const size_t smem =
      2 * sizeof(T) * size_t(split_len) * D +
      sizeof(float) * (size_t(g) * D + 2 * D + size_t(g) * p_stride + size_t(kAttnWarps) * g * D);
  auto kernel = RopeDecodeAttentionKernel<T, D>;
  cudaError_t e = AllowSharedMemory(kernel, smem);
  if (e != cudaSuccess) return e;
  return LaunchMaybePdl(kernel,
                        dim3(static_cast<unsigned>(splits), static_cast<unsigned>(n_kv),
                             static_cast<unsigned>(batch)),
                        dim3(kAttnThreads), smem, stream, static_cast<const T*>(qkv), inv_freq,
                        scaling, positions, static_cast<T*>(ck), static_cast<T*>(cv),
                        static_cast<T*>(out), partials, semaphores, static_cast<int>(n_heads),
                        static_cast<int>(n_kv), max_seq, static_cast<int>(kv_len), split_len,
                        scale);
}

template <typename T>
cudaError_t RopeDecodeAttentionTyped(const void* qkv, const float* inv_freq, float scaling,
                                     const int64_t* positions, void* ck, void* cv, void* out,
                                     float* partials, int* semaphores, int64_t batch,
                                     int64_t n_heads, int64_t n_kv, int64_t head_dim,
                                     int64_t max_seq, int64_t kv_len, float scale, cudaStream_t s) {
#define VLMGRAPH_ATTN_CASE(D)                                                                     \
  case D:                                                                                         \
    return RopeDecodeAttentionFor<T, D>(qkv, inv_freq, scaling, positions, ck, cv, out, partials, \
                                        semaphores, batch, n_heads, n_kv, max_seq, kv_len, scale, \
                                        s);
  switch (head_dim) {
    VLMGRAPH_ATTN_CASE(16)
    VLMGRAPH_ATTN_CASE(32)
    VLMGRAPH_ATTN_CASE(64)
    VLMGRAPH_ATTN_CASE(128)
    default:
      return cudaErrorInvalidValue;
  }
#undef VLMGRAPH_ATTN_CASE
}

template <typename T, int P>
cudaError_t GemvTyped(const void* x, const void* norm_w, float eps, const void* w,
                      const void* residual, void* y, int64_t rows, int64_t n, int64_t k,
                      cudaStream_t s) {
  const size_t smem = size_t(rows + (P == kGemvRmsNorm ? 1 : 0)) * k * sizeof(T);
  const dim3 grid(static_cast<unsigned>((n + kGemvWarps - 1) / kGemvWarps));
  const dim3 block(kGemvWarps * 32);
  const T* xp = static_cast<const T*>(x);
  const T* gp = static_cast<const T*>(norm_w);
  const T* wp = static_cast<const T*>(w);
  const T* rp = static_cast<const T*>(residual);
  T* yp = static_cast<T*>(y);
  const int ri = static_cast<int>(rows), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const bool short_rows = k * sizeof(T) <= 4 * 32 * 16;  // one pass of 4 chunks per lane
#define VLMGRAPH_GEMV_CASE(M)                                                                 \
  if (rows <= M) {                                                                            \
    auto kernel = short_rows ? GemvKernel<T, M, P, 4> : GemvKernel<T, M, P, 12>;              \
    cudaError_t e = AllowSharedMemory(kernel, smem);                                          \
    if (e != cudaSuccess) return e;                                                           \
    return LaunchMaybePdl(kernel, grid, block, smem, s, xp, gp, eps, wp, rp, yp, ri, ni, ki); \
  }
  VLMGRAPH_GEMV_CASE(1)
  VLMGRAPH_GEMV_CASE(2)
  VLMGRAPH_GEMV_CASE(4)
#undef VLMGRAPH_GEMV_CASE
  return cudaErrorInvalidValue;
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

int DecodeAttentionSplitLen(int64_t kv_len) {
  // About 16 splits per (row, KV head), 32 or 64 keys each (more splits for longer windows).
  return kv_len > 16 * 32 ? kAttnMaxSplitLen : 32;
}

int64_t RopeDecodeAttentionPartialFloats(int64_t batch, int64_t n_heads, int64_t head_dim,
                                         int64_t kv_len) {
  const int64_t splits =
      (kv_len + DecodeAttentionSplitLen(kv_len) - 1) / DecodeAttentionSplitLen(kv_len);
  return batch * splits * (n_heads * head_dim + 2 * n_heads);
}

cudaError_t LaunchRopeDecodeAttention(bool bf16, const void* qkv, const float* inv_freq,
                                      float scaling, const int64_t* positions, void* cache_k,
                                      void* cache_v, void* out, float* partials, int* semaphores,
                                      int64_t batch, int64_t n_heads, int64_t n_kv,
                                      int64_t head_dim, int64_t max_seq, int64_t kv_len,
                                      float scale, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (n_kv <= 0 || n_heads % n_kv != 0 || n_heads / n_kv > kAttnMaxGroups || kv_len <= 0) {
    return cudaErrorInvalidValue;
  }
  return bf16 ? RopeDecodeAttentionTyped<__nv_bfloat16>(
                    qkv, inv_freq, scaling, positions, cache_k, cache_v, out, partials, semaphores,
                    batch, n_heads, n_kv, head_dim, max_seq, kv_len, scale, stream)
              : RopeDecodeAttentionTyped<float>(qkv, inv_freq, scaling, positions, cache_k, cache_v,
                                                out, partials, semaphores, batch, n_heads, n_kv,
                                                head_dim, max_seq, kv_len, scale, stream);
}

cudaError_t LaunchGemv(bool bf16, GemvInput input, const void* x, const void* norm_w, float eps,
                       const void* w, const void* residual, void* y, int64_t rows, int64_t n,
                       int64_t k, cudaStream_t stream) {
  const int64_t elem = bf16 ? 2 : 4;
  auto aligned = [](const void* p) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  if (rows > kMaxGemvRows || (k * elem) % 16 != 0 || !aligned(x) || !aligned(w) ||
      !aligned(residual) || !aligned(y) || !aligned(norm_w) ||
      (input == GemvInput::kRmsNorm && norm_w == nullptr) ||
      (rows + 1) * k * elem > kMaxGemvSharedBytes) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || n == 0) return cudaSuccess;
  switch (input) {
    case GemvInput::kPlain:
      return bf16
                 ? GemvTyped<__nv_bfloat16, kGemvPlain>(x, norm_w, eps, w, residual, y, rows, n, k,
                                                        stream)
                 : GemvTyped<float, kGemvPlain>(x, norm_w, eps, w, residual, y, rows, n, k, stream);
    case GemvInput::kRmsNorm:
      return bf16 ? GemvTyped<__nv_bfloat16, kGemvRmsNorm>(x, norm_w, eps, w, residual, y, rows, n,
                                                           k, stream)
                  : GemvTyped<float, kGemvRmsNorm>(x, norm_w, eps, w, residual, y, rows, n, k,
                                                   stream);
    case GemvInput::kSiluMul:
      return bf16 ? GemvTyped<__nv_bfloat16, kGemvSiluMul>(x, norm_w, eps, w, residual, y, rows, n,
                                                           k, stream)
                  : GemvTyped<float, kGemvSiluMul>(x, norm_w, eps, w, residual, y, rows, n, k,
                                                   stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace vlmgraph::cuda
