// model/cuda/fused_kernels.cu: the element-wise kernels (RMSNorm, SiLU-mul, RoPE + KV-cache write)
// used by prefill and as the fused GEMV's fallbacks. Decode attention is in decode_attention.cu,
// the GEMV in gemv.cu; see model/fused_ops.h for the reference formulas.
#include <algorithm>

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

}  // namespace vlmgraph::cuda
