// model/cuda/gemv.cu: the small-batch GEMVs with their fused RMSNorm or SiLU-mul input prologue
// (LaunchGemv in fused_kernels.h): CUDA cores up to 4 rows, tensor cores for 5 to 8 rows (bf16).
#include <type_traits>

#include "model/cuda/fused_kernels.h"
#include "model/cuda/kernel_util.cuh"

namespace vlmgraph::cuda {
namespace {

// ---- GEMV with a fused input prologue -----------------------------------------------------
// y (rows, n) = f(x) W^T (+ residual), rows <= M <= 4, W (n, k) row-major. One warp per output
// column streams its weight row with 16-byte loads, kGemvChunks of them in flight per lane, and
// issues the first ones before waiting for the previous kernel (weights are never written by a
// kernel). The block then stages f(x) for all rows in shared memory, in the activations' dtype:
//   kPlain:   f(x) = x                                               x (rows, k)
//   kRmsNorm: f(x) = T(RmsNormScale(x, rsqrt(mean(x^2) + eps), norm_w))   x (rows, k)
//   kSiluMul: f(x) = T(SiluTimes(x[:, :k], x[:, k:]))                     x (rows, 2k)
// so the products see the same rounded inputs as the unfused kernels.
enum GemvPrologue : int { kGemvPlain = 0, kGemvRmsNorm = 1, kGemvSiluMul = 2 };
constexpr int kGemvWarps = 8;

// Stages f(x) for all rows in shared memory, in the activations' dtype (see GemvKernel): one pass
// over x (its only read from global memory), copying, or SiLU-multiplying, or copying while summing
// squares per row for the norm, which is then applied in shared memory. gs holds the norm weight
// (kRmsNorm) and row_ss (M) is zero (kRmsNorm). Call after WaitForPrerequisites; returns after a
// __syncthreads.
template <typename T, int M, int P>
__device__ __forceinline__ void StageGemvInput(const T* __restrict__ x, float eps, int rows, int k,
                                               T* xs, const T* gs, float* row_ss) {
  constexpr int kVec = 16 / sizeof(T);
  const int lane = threadIdx.x & 31;
  const int vecs = k / kVec;
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) ss[m] = 0.f;
  for (int i = threadIdx.x; i < rows * vecs; i += kGemvWarps * 32) {
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
      for (int j = 0; j < kVec; ++j) e[j] = SiluTimes(e[j], u[j]);
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
    for (int i = threadIdx.x; i < rows * vecs; i += kGemvWarps * 32) {
      const int m = i / vecs, c = (i - m * vecs) * kVec;
      const float r = rsqrtf(row_ss[m] / k + eps);
      float e[kVec], g[kVec];
      LoadVec(xs + m * k + c, e);
      LoadVec(gs + c, g);
#pragma unroll
      for (int j = 0; j < kVec; ++j) e[j] = RmsNormScale<T>(e[j], r, g[j]);
      StoreVec(xs + m * k + c, e);
    }
  }
  __syncthreads();
}

// What both GEMV kernels do between issuing their first weight loads and the product: copy the
// norm weight into gs and zero row_ss (kRmsNorm; neither depends on the previous kernel), wait for
// the previous kernel, stage f(x) (StageGemvInput), and let the next kernel launch.
template <typename T, int M, int P>
__device__ __forceinline__ void WaitAndStageGemvInput(const T* __restrict__ x,
                                                      const T* __restrict__ norm_w, float eps,
                                                      int rows, int k, T* xs, T* gs,
                                                      float* row_ss) {
  if (P == kGemvRmsNorm) {
    for (int v = threadIdx.x; v < k / (16 / int(sizeof(T))); v += blockDim.x) {
      reinterpret_cast<uint4*>(gs)[v] = __ldg(reinterpret_cast<const uint4*>(norm_w) + v);
    }
    if (threadIdx.x < M) row_ss[threadIdx.x] = 0.f;
    __syncthreads();
  }
  WaitForPrerequisites();
  StageGemvInput<T, M, P>(x, eps, rows, k, xs, gs, row_ss);
  AllowDependentsToLaunch();
}

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
  WaitAndStageGemvInput<T, M, P>(x, norm_w, eps, rows, k, xs, gs, row_ss);
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

// ---- Tensor-core GEMV for 5 to 8 rows (bf16) -----------------------------------------------
// y (rows, n) = f(x) W^T (+ residual) with mma.sync m16n8k16: a block's 16 output columns are the
// MMA's M dimension and the (up to 8) input rows its N dimension, so each weight element meets all
// rows in one tensor-core instruction where the CUDA-core GEMV spends a multiply-add per row per
// element (which no longer hid behind the weight loads beyond 4 rows). Block = 8 warps = 16 output
// columns; the warps split k into chunks of 32 columns, kMmaChunks chunks in flight per lane (two
// 16-byte weight loads each, issued before the PDL wait); f(x) is staged in shared memory as in
// GemvKernel; partial sums are reduced over the warps in shared memory.
// Column permutation: a dot product does not depend on the order of k, so in each 32-column chunk
// lane (g = lane / 4, t = lane % 4) loads columns [8t, 8t + 8) of weight rows g and g + 8 and of
// input row g, and feeds columns 8t..8t+3 to one MMA and 8t+4..8t+7 to the next, as the fragments'
// logical columns {2t, 2t+1, 2t+8, 2t+9} (PTX ISA, "Matrix Fragments for mma.m16n8k16").
constexpr int kMmaChunks = 4;
// Measured on an H100 (bench/decode_ops_bench.cc, 8 rows): every block stages all rows of f(x), so
// for large weights (nanovlm-460m's gate/up and down projections) cuBLAS plus a separate norm or
// SiLU-mul kernel is faster; the qkv and out projections (n * k <= 1.6M) gain.
constexpr int64_t kMaxMmaGemvWeights = 2 << 20;

__device__ __forceinline__ void MmaBf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

template <int P>
__global__ void __launch_bounds__(kGemvWarps * 32)
    GemvMmaKernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ norm_w,
                  float eps, const __nv_bfloat16* __restrict__ w,
                  const __nv_bfloat16* __restrict__ residual, __nv_bfloat16* __restrict__ y,
                  int rows, int n, int k) {
  using T = __nv_bfloat16;
  constexpr int M = 8, kVec = 8;
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  T* xs = reinterpret_cast<T*>(gemv_smem);  // (rows, k) f(x)
  T* gs = xs + rows * k;                    // (k) norm weight (kGemvRmsNorm)
  __shared__ float row_ss[M];
  __shared__ float red[kGemvWarps][16][M + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.x * 16, chunks = (k + 31) / 32;
  const bool lo_ok = col0 + g < n, hi_ok = col0 + g + 8 < n;
  const T* w_lo = w + int64_t(lo_ok ? col0 + g : 0) * k;
  const T* w_hi = w + int64_t(hi_ok ? col0 + g + 8 : 0) * k;
  uint4 wl[kMmaChunks], wh[kMmaChunks];
  auto load = [&](int first) {
#pragma unroll
    for (int i = 0; i < kMmaChunks; ++i) {
      const int kk = (first + warp + kGemvWarps * i) * 32 + kVec * t;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      wl[i] = lo_ok && kk < k ? __ldg(reinterpret_cast<const uint4*>(w_lo + kk)) : zero;
      wh[i] = hi_ok && kk < k ? __ldg(reinterpret_cast<const uint4*>(w_hi + kk)) : zero;
    }
  };
  // Parameters are never written by a kernel: load them before waiting for the previous one.
  load(0);
  WaitAndStageGemvInput<T, M, P>(x, norm_w, eps, rows, k, xs, gs, row_ss);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int first = 0; first < chunks; first += kGemvWarps * kMmaChunks) {
    if (first > 0) load(first);
#pragma unroll
    for (int i = 0; i < kMmaChunks; ++i) {
      const int chunk = first + warp + kGemvWarps * i;
      if (chunk >= chunks) break;  // uniform over the warp
      const int kk = chunk * 32 + kVec * t;
      uint4 xv = make_uint4(0, 0, 0, 0);
      if (g < rows && kk < k) xv = *reinterpret_cast<const uint4*>(xs + g * k + kk);
      MmaBf16(c, wl[i].x, wh[i].x, wl[i].y, wh[i].y, xv.x, xv.y);
      MmaBf16(c, wl[i].z, wh[i].z, wl[i].w, wh[i].w, xv.z, xv.w);
    }
  }
  // c: (output column g, input row 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
  red[warp][g][2 * t] = c[0];
  red[warp][g][2 * t + 1] = c[1];
  red[warp][g + 8][2 * t] = c[2];
  red[warp][g + 8][2 * t + 1] = c[3];
  __syncthreads();
  if (threadIdx.x < 16 * M) {
    const int j = threadIdx.x / M, m = threadIdx.x % M, col = col0 + j;
    if (col < n && m < rows) {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < kGemvWarps; ++v) sum += red[v][j][m];
      const float r = residual ? ToFloat(residual[int64_t(m) * n + col]) : 0.f;
      y[int64_t(m) * n + col] = FromFloat<T>(sum + r);
    }
  }
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
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (rows <= 8 && n * k <= kMaxMmaGemvWeights) {
      auto kernel = GemvMmaKernel<P>;
      cudaError_t e = AllowSharedMemory(kernel, smem);
      if (e != cudaSuccess) return e;
      return LaunchMaybePdl(kernel, dim3(static_cast<unsigned>((n + 15) / 16)), block, smem, s, xp,
                            gp, eps, wp, rp, yp, ri, ni, ki);
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchGemv(bool bf16, GemvInput input, const void* x, const void* norm_w, float eps,
                       const void* w, const void* residual, void* y, int64_t rows, int64_t n,
                       int64_t k, cudaStream_t stream) {
  const int64_t elem = bf16 ? 2 : 4;
  auto aligned = [](const void* p) { return p == nullptr || Aligned16(p); };
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
