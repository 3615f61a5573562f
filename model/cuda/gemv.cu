// model/cuda/gemv.cu: the small-batch GEMVs with their fused RMSNorm or SiLU-mul input prologue
// (LaunchGemv in fused_kernels.h): CUDA cores up to 4 rows, tensor cores for 5 to 8 rows (bf16).
#include <algorithm>
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
enum GemvPrologue : int {
  kGemvPlain = 0,
  kGemvRmsNorm = 1,
  kGemvSiluMul = 2,
  kGemvAttnCombine = 3
};
constexpr int kGemvWarps = 8;

// Stages columns [kb, kb + klen) of f(x) for all rows in shared memory, xs (rows, klen), in the
// activations' dtype (see GemvKernel): one pass over x (its only read from global memory),
// copying, or SiLU-multiplying, or copying while summing squares per row for the norm (over the
// whole row, k columns, whatever the slice), which is then applied in shared memory. gs holds the
// norm weight's slice (kRmsNorm; written before the call, made visible by the barrier below).
// ss_warp (kThreads / 32, M) is scratch for the per-warp sums of squares. kb and klen are
// multiples of 16 / sizeof(T). For the norm each thread takes one 16-byte column vector of every
// row per round, issuing all those loads before using any, and keeps one sum of squares per row
// in registers; per-warp sums then meet in ss_warp, so the reduction needs no shared-memory
// atomics. The copy and the SiLU-multiply spread (row, vector) pairs over all threads instead:
// with one vector of every row per thread, most threads idle when k / 8 < the block's threads.
// Bench: `vlmgraph-decode-ops-bench --batch 1` and `--batch 8` (qkv, gate_up and down rows);
// figures in docs/design/decode-kernels.md ("The PDL wait and ptxas", "GEMV variants").
// Call after WaitForPrerequisites; returns after a __syncthreads.
template <typename T, int M, int P, int kThreads>
__device__ __forceinline__ void StageGemvInput(const T* __restrict__ x, float eps, int rows, int k,
                                               int kb, int klen, T* xs, const T* gs,
                                               float* ss_warp) {
  constexpr int kVec = 16 / sizeof(T);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // kRmsNorm reads whole rows (the sums of squares), the others only the slice.
  const int vecs = (P == kGemvRmsNorm ? k : klen) / kVec;
  const int64_t stride = P == kGemvSiluMul ? 2 * int64_t(k) : k;  // between rows of x
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; ++m) ss[m] = 0.f;
  if (P == kGemvRmsNorm) {
    // One column vector of every row per thread and round, so that each row's sum of squares
    // stays in its own register.
    for (int v = threadIdx.x; v - int(threadIdx.x) < vecs; v += kThreads) {
      const int c = v * kVec;  // column of x
      const bool in = v < vecs;
      uint4 raw[M];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (in && m < rows) raw[m] = *reinterpret_cast<const uint4*>(x + m * stride + c);
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (!in || m >= rows) continue;
        if (c >= kb && c < kb + klen) {
          *reinterpret_cast<uint4*>(xs + m * klen + (c - kb)) = raw[m];
        }
        const T* e = reinterpret_cast<const T*>(&raw[m]);
#pragma unroll
        for (int j = 0; j < kVec; ++j) ss[m] += ToFloat(e[j]) * ToFloat(e[j]);
      }
    }
  } else {
    // Copying and SiLU-multiplying spread (row, vector) pairs over all threads, several
    // iterations' loads in flight per thread (the compiler unrolls this loop).
    for (int i = threadIdx.x; i < rows * vecs; i += kThreads) {
      const int m = i / vecs, c = kb + (i - m * vecs) * kVec;  // column of x
      T* dst = xs + m * klen + (c - kb);
      if (P == kGemvPlain) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(x + m * stride + c);
      } else {
        float e[kVec], u[kVec];
        LoadVec(x + m * stride + c, e);
        LoadVec(x + m * stride + k + c, u);
#pragma unroll
        for (int j = 0; j < kVec; ++j) e[j] = SiluTimes(e[j], u[j]);
        StoreVec(dst, e);
      }
    }
  }
  if (P == kGemvRmsNorm) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      for (int o = 16; o > 0; o >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) ss_warp[warp * M + m] = ss[m];
    }
    __syncthreads();
    float r[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) total += ss_warp[w * M + m];
      r[m] = rsqrtf(total / k + eps);
    }
    for (int v = threadIdx.x; v < klen / kVec; v += kThreads) {
      float g[kVec];
      LoadVec(gs + v * kVec, g);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (m >= rows) continue;
        float e[kVec];
        LoadVec(xs + m * klen + v * kVec, e);
#pragma unroll
        for (int j = 0; j < kVec; ++j) e[j] = RmsNormScale<T>(e[j], r[m], g[j]);
        StoreVec(xs + m * klen + v * kVec, e);
      }
    }
  }
  __syncthreads();
}

// kGemvAttnCombine: f(x) = the decode attention's output, combined here from the partial softmax
// states its split blocks left (RopeDecodeAttentionKernel with combine = false), by the formula and
// in the order of that kernel's own combine, so the values are the same: per (row, head) M =
// max_t m_t, e_t = e^(m_t - M), L = sum_t e_t l_t, out = T((sum_t e_t o_t) * (1 / L)) over the
// row's active splits t (ascending). Each thread takes 4 consecutive elements of one head and
// loads, in one round, their o for the first kCombineSplits splits (8-byte loads: a split's o
// starts 8-byte aligned, not always 16) and its head's (m, l) pairs, then combines in registers:
// no shared-memory pass, no barrier until xs is full.
constexpr int kCombineSplits = 8;
template <int M>
__device__ __forceinline__ int RowValue(const int (&v)[M], int m) {  // v[m], constant indices
  int r = v[0];
#pragma unroll
  for (int j = 1; j < M; ++j) r = m == j ? v[j] : r;
  return r;
}
template <typename T, int M, int kThreads>
__device__ __forceinline__ void StageAttnCombine(const AttnCombineArgs& a, const int (&act)[M],
                                                 int rows, int k, T* xs) {
  const int g = a.groups, d = a.head_dim, S = a.splits;
  const int64_t split_stride = int64_t(g) * (d + 2);
  for (int q = threadIdx.x; q < rows * k / 4; q += kThreads) {
    const int m = (4 * q) / k, c = 4 * q - m * k, h = c / d, kh = h / g, hh = h - kh * g;
    const int n_act = RowValue<M>(act, m);
    const float* base = a.partials + (int64_t(m) * a.n_kv + kh) * S * split_stride;
    const int o_off = 2 * g + hh * d + (c - h * d);  // of this thread's elements in a split
    float2 o_lo[kCombineSplits], o_hi[kCombineSplits];
    float m_t[kCombineSplits], l_t[kCombineSplits];
#pragma unroll
    for (int u = 0; u < kCombineSplits; ++u) {
      if (u < n_act) {
        const float* p = base + u * split_stride;
        m_t[u] = p[hh];
        l_t[u] = p[g + hh];
        const float2* o2 = reinterpret_cast<const float2*>(p + o_off);
        o_lo[u] = o2[0];
        o_hi[u] = o2[1];
      }
    }
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < kCombineSplits; ++u) {
      if (u < n_act) mx = fmaxf(mx, m_t[u]);
    }
    for (int t = kCombineSplits; t < n_act; ++t) mx = fmaxf(mx, base[t * split_stride + hh]);
    float l = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < kCombineSplits; ++u) {
      if (u < n_act) {
        const float e = __expf(m_t[u] - mx);
        l += e * l_t[u];
        o[0] += e * o_lo[u].x;
        o[1] += e * o_lo[u].y;
        o[2] += e * o_hi[u].x;
        o[3] += e * o_hi[u].y;
      }
    }
    for (int t = kCombineSplits; t < n_act; ++t) {
      const float* p = base + t * split_stride;
      const float e = __expf(p[hh] - mx);
      l += e * p[g + hh];
      const float2* o2 = reinterpret_cast<const float2*>(p + o_off);
      const float2 lo = o2[0], hi = o2[1];
      o[0] += e * lo.x;
      o[1] += e * lo.y;
      o[2] += e * hi.x;
      o[3] += e * hi.y;
    }
    const float inv = 1.f / l;
#pragma unroll
    for (int j = 0; j < 4; ++j) xs[4 * q + j] = FromFloat<T>(o[j] * inv);
  }
  __syncthreads();
}

// What both GEMV kernels do between issuing their first weight loads and the product: copy the
// norm weight's slice [kb, kb + klen) into gs (kRmsNorm; it does not depend on the previous
// kernel), wait for the previous kernel, stage f(x) (StageGemvInput), and let the next kernel
// launch. gs is copied with plain loads: a cp.async copy waited for only before the
// normalisation pass is slower (`vlmgraph-decode-ops-bench`, qkv and gate_up rows;
// docs/design/decode-kernels.md, "Prefetching weights").
template <typename T, int M, int P, int kThreads>
__device__ __forceinline__ void WaitAndStageGemvInput(const T* __restrict__ x,
                                                      const T* __restrict__ norm_w, float eps,
                                                      int rows, int k, int kb, int klen, T* xs,
                                                      T* gs, float* ss_warp,
                                                      const AttnCombineArgs& comb) {
  if constexpr (P == kGemvAttnCombine) {
    // Positions were written before the previous kernel started: read them before the wait.
    int act[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      act[m] = m < rows ? DecodeActiveSplits(comb.positions[m], comb.kv_len, comb.split_len) : 0;
    }
    WaitForPrerequisites();
    StageAttnCombine<T, M, kThreads>(comb, act, rows, k, xs);
    AllowDependentsToLaunch();
    return;
  }
  if (P == kGemvRmsNorm) {
    const uint4* src = reinterpret_cast<const uint4*>(norm_w + kb);
    for (int v = threadIdx.x; v < klen / (16 / int(sizeof(T))); v += kThreads) {
      reinterpret_cast<uint4*>(gs)[v] = LoadBeforeWait(src + v);
    }
  }
  WaitForPrerequisites();
  StageGemvInput<T, M, P, kThreads>(x, eps, rows, k, kb, klen, xs, gs, ss_warp);
  AllowDependentsToLaunch();
}

// kChunks 16-byte weight loads in flight per lane: 4 (k <= 1024 in bf16, 512 in float32, in one
// pass) or 12 (longer rows, fewer passes). For one row the 4-chunk kernel is held to 48 registers
// so that 5 blocks fit on an SM and a 5120-column GEMV (640 blocks) runs in one wave on 132 SMs:
// H200, nanovlm-460m's gate/up projection at batch 1 6.16 -> 5.58 us, whole decoder 698 -> 678 us
// (`vlmgraph-decode-ops-bench`; docs/design/decode-kernels.md, "The PDL wait and ptxas"); with
// more rows, or the SiLU-multiply, 48 registers would spill.
constexpr int GemvMinBlocks(int rows, int prologue, int chunks) {
  return chunks > 4 || prologue == kGemvAttnCombine ? 2
         : rows == 1 && prologue != kGemvSiluMul    ? 5
                                                    : 4;
}
template <typename T, int M, int P, int kGemvChunks>
__global__ void __launch_bounds__(kGemvWarps * 32, GemvMinBlocks(M, P, kGemvChunks))
    GemvKernel(const T* __restrict__ x, const T* __restrict__ norm_w, float eps,
               const T* __restrict__ w, const T* __restrict__ residual, T* __restrict__ y, int rows,
               int n, int k, AttnCombineArgs comb) {
  constexpr int kVec = 16 / sizeof(T);
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  T* xs = reinterpret_cast<T*>(gemv_smem);  // (rows, k) f(x)
  T* gs =
      xs + rows * k;  // (k) norm weight (kGemvRmsNorm); the combine's scratch (kGemvAttnCombine)
  __shared__ float ss_warp[kGemvWarps * M];
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
    if (active && v < vecs) wreg[c] = LoadBeforeWait(wr + v);
  }
  WaitAndStageGemvInput<T, M, P, kGemvWarps * 32>(x, norm_w, eps, rows, k, 0, k, xs, gs, ss_warp,
                                                  comb);
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
// element (which do not hide behind the weight loads beyond 4 rows).
// Grid (n / 16 column tiles, splits). Block (tile, s) = 8 warps owns 16 output columns and the s-th
// of `splits` equal runs of 32-column chunks of k; its warps take the chunks in turn, kMmaChunks
// in flight per lane (two 16-byte weight loads each, the first issued before the PDL wait). f(x)
// is staged in shared memory for the block's columns only (StageGemvInput), partial sums are
// reduced over the warps in shared memory, and with splits > 1 the blocks of a column tile form
// one thread block cluster: rank 0 adds the other ranks' partial sums through distributed shared
// memory (sm_90) and writes y. Splitting k lets a long row (the down projection's k = 2560) stream
// in one round of loads instead of several dependent ones (see GemvMmaSplits).
// Column permutation: a dot product does not depend on the order of k, so in each 32-column chunk
// lane (g = lane / 4, t = lane % 4) loads columns [8t, 8t + 8) of weight rows g and g + 8 and of
// input row g, and feeds columns 8t..8t+3 to one MMA and 8t+4..8t+7 to the next, as the fragments'
// logical columns {2t, 2t+1, 2t+8, 2t+9} (PTX ISA, "Matrix Fragments for mma.m16n8k16").
constexpr int kMmaChunks = 4;
constexpr int kMaxMmaSplits = 4;

// What split s of `splits` covers of k: the 32-column chunks [c0, c1), i.e. the columns
// [kb, kb + klen) clipped to k. Split 0 is the longest.
struct MmaSplit {
  int c0, c1, kb, klen;
};
__host__ __device__ inline MmaSplit MmaSplitOf(int k, int splits, int s) {
  const int chunks = (k + 31) / 32, per = (chunks + splits - 1) / splits;
  const int c0 = min(chunks, s * per), c1 = min(chunks, c0 + per);
  const int kb = min(k, c0 * 32);
  return {c0, c1, kb, min(k, c1 * 32) - kb};
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
  const int splits = gridDim.y, s = blockIdx.y;
  const MmaSplit split = MmaSplitOf(k, splits, s);
  const int c0 = split.c0, c1 = split.c1, kb = split.kb, klen = split.klen;
  T* xs = reinterpret_cast<T*>(gemv_smem);  // (rows, klen) f(x)[:, kb : kb + klen]
  T* gs = xs + rows * klen;                 // (klen) norm weight (kGemvRmsNorm)
  __shared__ float ss_warp[kGemvWarps * M];
  __shared__ float red[kGemvWarps][16][M + 1];
  __shared__ float tile[16][M];  // this block's sums over its chunks
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.x * 16;
  const bool lo_ok = col0 + g < n, hi_ok = col0 + g + 8 < n;
  const T* w_lo = w + int64_t(lo_ok ? col0 + g : 0) * k;
  const T* w_hi = w + int64_t(hi_ok ? col0 + g + 8 : 0) * k;
  uint4 wl[kMmaChunks], wh[kMmaChunks];
  auto load = [&](int first) {
#pragma unroll
    for (int i = 0; i < kMmaChunks; ++i) {
      const int chunk = c0 + first + warp + kGemvWarps * i;
      const int kk = chunk * 32 + kVec * t;
      const bool in = chunk < c1 && kk < k;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      wl[i] = lo_ok && in ? LoadBeforeWait(reinterpret_cast<const uint4*>(w_lo + kk)) : zero;
      wh[i] = hi_ok && in ? LoadBeforeWait(reinterpret_cast<const uint4*>(w_hi + kk)) : zero;
    }
  };
  // Parameters are never written by a kernel: load them before waiting for the previous one.
  load(0);
  WaitAndStageGemvInput<T, M, P, kGemvWarps * 32>(x, norm_w, eps, rows, k, kb, klen, xs, gs,
                                                  ss_warp, AttnCombineArgs{});
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int first = 0; first < c1 - c0; first += kGemvWarps * kMmaChunks) {
    if (first > 0) load(first);
#pragma unroll
    for (int i = 0; i < kMmaChunks; ++i) {
      const int chunk = c0 + first + warp + kGemvWarps * i;
      if (chunk >= c1) break;  // uniform over the warp
      const int kk = chunk * 32 + kVec * t;
      uint4 xv = make_uint4(0, 0, 0, 0);
      if (g < rows && kk < k) xv = *reinterpret_cast<const uint4*>(xs + g * klen + (kk - kb));
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
  const int j = threadIdx.x / M, m = threadIdx.x % M;
  if (threadIdx.x < 16 * M) {
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kGemvWarps; ++v) sum += red[v][j][m];
    tile[j][m] = sum;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (splits > 1) {
    // The other ranks' tiles are read through distributed shared memory; the second barrier
    // keeps them resident until rank 0 has read them.
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
            : "memory");
    if (s == 0 && threadIdx.x < 16 * M) {
      float sum = tile[j][m];
      const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(&tile[j][m]));
      for (int r = 1; r < splits; ++r) {
        uint32_t remote;
        float v;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
        sum += v;
      }
      tile[j][m] = sum;
    }
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
            : "memory");
  } else {
    __syncthreads();
  }
#else
  __syncthreads();
#endif
  if (s == 0 && threadIdx.x < 16 * M) {
    const int col = col0 + j;
    if (col < n && m < rows) {
      const float r = residual ? ToFloat(residual[int64_t(m) * n + col]) : 0.f;
      y[int64_t(m) * n + col] = FromFloat<T>(tile[j][m] + r);
    }
  }
}

// Splits of k per column tile for the tensor-core GEMV: the fewest (a power of two, at most
// kMaxMmaSplits) with which every block's chunks fit in one round of its warps' in-flight loads
// (kGemvWarps * kMmaChunks chunks), so no block streams its weights in several dependent passes;
// 1 before sm_90 (the splits meet in a thread block cluster). Rows that already fit one round
// are not split: the two cluster barriers cost more than the shorter loop saves.
// Bench: `vlmgraph-decode-ops-bench --batch 8` (down and out rows); figures in
// docs/design/decode-kernels.md, "Tensor-core GEMV for 5 to 8 rows".
int GemvMmaSplits(int64_t k) {
  if (ComputeCapabilityMajor() < 9) return 1;
  const int64_t chunks = (k + 31) / 32;
  int splits = 1;
  while (splits < kMaxMmaSplits && chunks > int64_t(splits) * kGemvWarps * kMmaChunks) splits *= 2;
  return splits;
}

// Whether 5 to 8 rows take the tensor-core GEMV (else cuBLAS with the separate prologue kernel).
// Every block stages and normalises all rows of its input, so with the RMSNorm prologue it pays
// only while the column tiles fit one block per SM (qkv, not gate/up); without a norm it wins at
// every size measured. Bench: `vlmgraph-decode-ops-bench --batch 8`; figures in
// docs/design/decode-kernels.md, "Tensor-core GEMV for 5 to 8 rows".
bool UseMmaGemv(int P, int64_t n) {
  return P != kGemvRmsNorm || (n + 15) / 16 <= MultiprocessorCount();
}

template <typename T, int P>
cudaError_t GemvTyped(const void* x, const void* norm_w, float eps, const void* w,
                      const void* residual, void* y, int64_t rows, int64_t n, int64_t k,
                      cudaStream_t s, const AttnCombineArgs& comb = {}) {
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
#define VLMGRAPH_GEMV_CASE(M)                                                                \
  if (rows <= M) {                                                                           \
    auto kernel = short_rows ? GemvKernel<T, M, P, 4> : GemvKernel<T, M, P, 12>;             \
    cudaError_t e = AllowSharedMemory(kernel, smem);                                         \
    if (e != cudaSuccess) return e;                                                          \
    return LaunchMaybePdl(kernel, grid, block, smem, s, xp, gp, eps, wp, rp, yp, ri, ni, ki, \
                          comb);                                                             \
  }
  VLMGRAPH_GEMV_CASE(1)
  VLMGRAPH_GEMV_CASE(2)
  VLMGRAPH_GEMV_CASE(4)
#undef VLMGRAPH_GEMV_CASE
  if constexpr (std::is_same_v<T, __nv_bfloat16> && P != kGemvAttnCombine) {
    if (rows <= 8 && UseMmaGemv(P, n)) {
      const int splits = GemvMmaSplits(k);
      const size_t mma_smem =  // for the longest split's columns
          size_t(rows + (P == kGemvRmsNorm ? 1 : 0)) * MmaSplitOf(ki, splits, 0).klen * sizeof(T);
      auto kernel = GemvMmaKernel<P>;
      cudaError_t e = AllowSharedMemory(kernel, mma_smem);
      if (e != cudaSuccess) return e;
      return LaunchMaybePdlCluster(
          kernel, dim3(static_cast<unsigned>((n + 15) / 16), static_cast<unsigned>(splits)), block,
          dim3(1, static_cast<unsigned>(splits), 1), mma_smem, s, xp, gp, eps, wp, rp, yp, ri, ni,
          ki);
    }
  }
  return cudaErrorInvalidValue;
}

// An optional pointer (nullptr: not given) that allows 16-byte vector access.
bool AlignedOrNull(const void* p) { return p == nullptr || Aligned16(p); }

}  // namespace

cudaError_t LaunchGemv(bool bf16, GemvInput input, const void* x, const void* norm_w, float eps,
                       const void* w, const void* residual, void* y, int64_t rows, int64_t n,
                       int64_t k, cudaStream_t stream) {
  const int64_t elem = bf16 ? 2 : 4;
  if (rows > kMaxGemvRows || (k * elem) % 16 != 0 || !AlignedOrNull(x) || !AlignedOrNull(w) ||
      !AlignedOrNull(residual) || !AlignedOrNull(y) || !AlignedOrNull(norm_w) ||
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

cudaError_t LaunchGemvAttnCombine(bool bf16, const AttnCombineArgs& args, const void* w,
                                  const void* residual, void* y, int64_t rows, int64_t n,
                                  cudaStream_t stream) {
  const int64_t elem = bf16 ? 2 : 4;
  const int64_t k = int64_t(args.n_kv) * args.groups * args.head_dim;
  if (rows > kMaxCudaCoreGemvRows || args.partials == nullptr || args.positions == nullptr ||
      args.n_kv <= 0 || args.groups <= 0 || args.head_dim <= 0 || args.kv_len <= 0 ||
      (k * elem) % 16 != 0 || !AlignedOrNull(w) || !AlignedOrNull(residual) || !AlignedOrNull(y) ||
      args.head_dim % 4 != 0 || rows * k * elem > kMaxGemvSharedBytes) {
    return cudaErrorInvalidValue;
  }
  AttnCombineArgs comb = args;
  comb.split_len =
      DecodeAttentionSplitLen(rows, int64_t(args.groups) * args.n_kv, args.n_kv, args.kv_len);
  comb.splits =
      DecodeAttentionSplits(rows, int64_t(args.groups) * args.n_kv, args.n_kv, args.kv_len);
  if (rows == 0 || n == 0) return cudaSuccess;
  return bf16 ? GemvTyped<__nv_bfloat16, kGemvAttnCombine>(nullptr, nullptr, 0.f, w, residual, y,
                                                           rows, n, k, stream, comb)
              : GemvTyped<float, kGemvAttnCombine>(nullptr, nullptr, 0.f, w, residual, y, rows, n,
                                                   k, stream, comb);
}

}  // namespace vlmgraph::cuda
