// model/cuda/decode_stack.cu: the whole decoder stack of one decode step as one persistent kernel
// (LaunchDecodeStack in fused_kernels.h).
//
// EXPERIMENTAL, off by default (ops::DecodeStackEnabled): correct (tests/fused_ops_test.cc) but, on
// an H100 at nanovlm-460m shapes, slower than the per-layer kernels: 1.29 against 0.79 ms for 32
// blocks at batch 1 (bench/decode_ops_bench.cc prints both and this kernel's per-stage timeline;
// docs/benchmarks.md discusses it). Each stage's work inside an SM takes 2-4 us and each grid
// barrier about 1.5 us, against ~5 us per dependent kernel for the per-layer path.
//
// The idea: the per-layer kernels (gemv.cu, decode_attention.cu) run a decode step as 5 dependent
// kernels per block; each dependency costs ~2 us of drain, launch and ramp-up, more than the
// ~0.2 us its weights take to stream. Here one block per SM lives for the whole step and the stages
// meet at grid barriers (a counter in global memory), while every block streams the weights of its
// next stages into shared memory with TMA bulk copies, ahead of the barriers, so that the weight
// stream never waits for the dependency chain and the chain no longer pays for launches.
//
// Per decoder block l, with G blocks and each stage's output rows split evenly over them:
//   A  x_n = RMSNorm(x, norm1); qkv = x_n W_qkv^T                     rows of W_qkv per block
//   B  RoPE on q and the new key, KV-cache write, split-key attention  (row, KV head, split) items;
//      the last split of each (row, KV head) combines the partial softmax states into a (B, n_heads D)
//   C  x = x + a W_out^T                                              rows of W_out per block
//   D  x_n = RMSNorm(x, norm2); h = silu(x_n W_gate^T) * (x_n W_up^T)  rows j of gate and up
//   E  x = x + h W_down^T                                             rows of W_down per block
// with a grid barrier before every stage but the first. Every intermediate is rounded to the
// activations' dtype exactly where the per-layer kernels round it (their shared formulas from
// kernel_util.cuh), so both paths agree to float32 summation order.
//
// Requirements (DecodeStackPlan::ok): compute capability >= 9.0 (bulk copies, mbarriers), bf16,
// head_dim in {64, 128}, <= 8 query heads per KV head, <= kDecodeStackMaxBatch rows, widths that
// are multiples of 8, and the slots fitting the SM's shared memory. All G blocks must be resident
// at once (spinning blocks wait for the others): G = the SM count with one block per SM, which
// holds unless another process confines this one to fewer SMs.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

// The sm_80 pass compiles the kernel's body out (it needs sm_90), leaving its helpers unused.
#pragma nv_diag_suppress 177

#include "model/cuda/fused_kernels.h"
#include "model/cuda/kernel_util.cuh"

namespace vlmgraph::cuda {
namespace {

using T = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;          // bf16 elements per 16-byte vector
constexpr int kRowGroup = 4;     // weight rows a warp multiplies per pass over the activations
constexpr int kMaxGroups = 8;    // query heads per KV head
constexpr int kMaxSplits = 16;   // key splits per (row, KV head)
constexpr int kAlign = 128;      // shared-memory region alignment

// ---- mbarriers and TMA bulk copies (sm_90) --------------------------------------------------
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void MbarInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SmemAddr(bar)) : "memory");
}
// Arms the barrier's current phase for `bytes` of bulk copies (the one arrival it expects).
__device__ __forceinline__ void MbarExpect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
// Global -> shared copy of `bytes` (multiple of 16, both addresses 16-byte aligned) by the TMA
// unit, completing on `bar`.
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory accesses (after a __syncthreads, the
// block's) before later bulk copies into the same bytes.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void FenceMbarInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
#endif

// ---- Grid barrier ----------------------------------------------------------------------------
// One counter, G arrivals per barrier. Arrive: the block's writes so far (ordered before thread 0
// by __syncthreads) are released to every block that then acquires the count in GridWait. Data
// written by other blocks in this launch is read with ld.global.cg (L2), never through the
// non-coherent L1. Thread 0 only arrives and waits; bulk copies are issued by kIssuer, so that
// the release never waits behind a thread's own outstanding copies.
constexpr int kIssuer = 32;
__device__ __forceinline__ void GridArrive(unsigned* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
  }
}
// The same, returning the count before this arrival (thread 0 only).
__device__ __forceinline__ unsigned GridArriveCounted(unsigned* counter) {
  __syncthreads();
  unsigned old = 0;
  if (threadIdx.x == 0) {
    asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;"
                 : "=r"(old)
                 : "l"(counter)
                 : "memory");
  }
  return old;
}
__device__ __forceinline__ void GridWait(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) {
    unsigned v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    } while (v < target);
  }
  __syncthreads();
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int RowBegin(int n, int block, int grid) {
  return static_cast<int>(int64_t(n) * block / grid);
}

// ---- Shared-memory GEMV ------------------------------------------------------------------------
// acc[r * kDecodeStackMaxBatch + b] += sum_k w[r, k] * x[b, k] for r < rows, b < batch <= M; w
// (rows, k) and x (batch, k) bf16 in shared memory, acc float in shared memory (set by the caller).
// Work units are (group of kRowGroup rows, slice of k) so that every warp has work even when the
// block owns fewer rows than it has warps; each x vector is read once per row group.
// Not inlined, like the other stage helpers: one copy of each stays in the instruction cache for
// the whole kernel (inlined into every stage, the kernel's code outgrew it and every stage of every
// layer stalled on instruction fetches).
template <int M>
__device__ __noinline__ void SmemGemv(const T* w, int rows, const T* x, int batch, int k,
                                      float* acc) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int vecs = k / kVec;
  const int groups = (rows + kRowGroup - 1) / kRowGroup;
  if (groups == 0) return;
  // About two units per warp, k slices of at least one vector per lane.
  const int parts = max(1, min((2 * kWarps + groups - 1) / groups, vecs / 32));
  const uint4* w4 = reinterpret_cast<const uint4*>(w);
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  #pragma unroll 1
  for (int u = warp; u < groups * parts; u += kWarps) {
    const int r0 = (u / parts) * kRowGroup, part = u % parts;
    float a[kRowGroup][M];
#pragma unroll
    for (int r = 0; r < kRowGroup; ++r) {
#pragma unroll
      for (int b = 0; b < M; ++b) a[r][b] = 0.f;
    }
    #pragma unroll 1
    for (int v = part * 32 + lane; v < vecs; v += parts * 32) {
      float wf[kRowGroup][kVec];
#pragma unroll
      for (int r = 0; r < kRowGroup; ++r) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (r0 + r < rows) raw = w4[(r0 + r) * vecs + v];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < kVec; ++i) wf[r][i] = ToFloat(e[i]);
      }
#pragma unroll
      for (int b = 0; b < M; ++b) {
        if (b < batch) {
          const uint4 raw = x4[b * vecs + v];
          const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const float xv = ToFloat(e[i]);
#pragma unroll
            for (int r = 0; r < kRowGroup; ++r) a[r][b] += wf[r][i] * xv;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRowGroup; ++r) {
#pragma unroll
      for (int b = 0; b < M; ++b) {
        float v = a[r][b];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && b < batch && r0 + r < rows) {
          atomicAdd(&acc[(r0 + r) * kDecodeStackMaxBatch + b], v);
        }
      }
    }
  }
}

// xs (batch, hidden) = T(RmsNormScale(x, rsqrt(mean(x^2) + eps), w)) for x (batch, hidden) in
// global memory (read through L2) and w (hidden) in shared memory; as GemvKernel's kRmsNorm
// prologue.
__device__ __noinline__ void RmsNormToShared(const T* x, const T* w, float eps, int batch,
                                             int hidden, T* xs, float* ss) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, vecs = hidden / kVec;
  #pragma unroll 1
  for (int b = warp; b < batch; b += kWarps) {
    float part = 0.f;
    for (int v = lane; v < vecs; v += 32) {
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(b) * hidden) + v);
      reinterpret_cast<uint4*>(xs + b * hidden)[v] = raw;
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) part += ToFloat(e[i]) * ToFloat(e[i]);
    }
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) ss[b] = part;
  }
  __syncthreads();
  #pragma unroll 1
  for (int i = threadIdx.x; i < batch * vecs; i += kThreads) {
    const int b = i / vecs, c = (i - b * vecs) * kVec;
    const float r = rsqrtf(ss[b] / hidden + eps);
    float e[kVec], g[kVec];
    LoadVec(xs + b * hidden + c, e);
    LoadVec(w + c, g);
#pragma unroll
    for (int j = 0; j < kVec; ++j) e[j] = RmsNormScale<T>(e[j], r, g[j]);
    StoreVec(xs + b * hidden + c, e);
  }
  __syncthreads();
}

// ---- The kernel ------------------------------------------------------------------------------
struct Smem {  // byte offsets into dynamic shared memory, from DecodeStackPlan
  T *slot_a, *slot_c, *slot_d, *slot_e, *act;
  float *q, *kv_new, *p, *red, *acc, *ss, *w;
  int* is_last;
};

template <int D>
__device__ __noinline__ void AttentionItem(const DecodeStackArgs& a, const DecodeStackPlan& p, const Smem& s,
                              int l, int item, uint64_t* kv_bar, uint32_t kv_parity,
                              uint64_t* trace) {
  constexpr int kLanes = D / kVec;
  constexpr int kSlots = kThreads / kLanes;
  constexpr int kHalf = D / 2;
  const int splits = p.splits, split_len = p.split_len;
  const int sp = item % splits, kh = (item / splits) % a.n_kv, b = item / (splits * a.n_kv);
  const int g = a.n_heads / a.n_kv;
  const int64_t pos = a.positions[b];
  const int len = static_cast<int>(pos + 1 < a.kv_len ? pos + 1 : a.kv_len);
  const int j0 = sp * split_len, n = min(split_len, len - j0);
  const int qkv_width = (a.n_heads + 2 * a.n_kv) * D;
  const T* src = static_cast<const T*>(a.qkv) + int64_t(b) * qkv_width;
  T* cache_k = static_cast<T*>(a.layer[l].cache_k);
  T* cache_v = static_cast<T*>(a.layer[l].cache_v);
  const int64_t row = (int64_t(b) * a.n_kv + kh) * a.max_seq;
  // Rotated query heads and new key (rounded as the cache stores them), new value; as
  // RopeDecodeAttentionKernel.
  #pragma unroll 1
  for (int i = threadIdx.x; i < (g + 1) * kHalf; i += kThreads) {
    const int h = i / kHalf, q = i - h * kHalf;
    const T* x = h < g ? src + (kh * g + h) * D : src + (a.n_heads + kh) * D;
    float r1, r2;
    Rotate(ToFloat(__ldcg(x + q)), ToFloat(__ldcg(x + q + kHalf)), pos, a.inv_freq[q],
           a.rope_scaling, &r1, &r2);
    float* dst = h < g ? s.q + h * D : s.kv_new;
    dst[q] = ToFloat(FromFloat<T>(r1));
    dst[q + kHalf] = ToFloat(FromFloat<T>(r2));
  }
  #pragma unroll 1
  for (int d = threadIdx.x; d < D; d += kThreads) {
    s.kv_new[D + d] = ToFloat(__ldcg(src + (a.n_heads + a.n_kv + kh) * D + d));
  }
  if (trace != nullptr && threadIdx.x == 0) trace[6] = GlobalTimerNs();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  MbarWait(kv_bar, kv_parity);
#endif
  __syncthreads();
  if (trace != nullptr && threadIdx.x == 0) trace[7] = GlobalTimerNs();
  const T* k_s = s.act;
  const T* v_s = s.act + split_len * D;
  const int64_t writer = (pos < a.kv_len ? pos : a.kv_len - 1) / split_len;
  if (sp == writer && pos < a.max_seq) {
    #pragma unroll 1
    for (int d = threadIdx.x; d < D; d += kThreads) {
      cache_k[(row + pos) * D + d] = FromFloat<T>(s.kv_new[d]);
      cache_v[(row + pos) * D + d] = FromFloat<T>(s.kv_new[D + d]);
    }
  }
  const int slot = threadIdx.x / kLanes, c = (threadIdx.x % kLanes) * kVec;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  #pragma unroll 1
  for (int first = 0; first < n; first += kSlots) {
    const int j = first + slot;
    float k[kVec];
    if (j0 + j == pos) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) k[e] = s.kv_new[c + e];
    } else if (j < n) {
      LoadVec(k_s + j * D + c, k);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) k[e] = 0.f;
    }
    for (int h = 0; h < g; ++h) {
      float acc = 0.f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc += s.q[h * D + c + e] * k[e];
#pragma unroll
      for (int o = kLanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (c == 0 && j < n) s.p[h * split_len + j] = acc * p.scale;
    }
  }
  __syncthreads();
  #pragma unroll 1
  for (int h = warp; h < g; h += kWarps) {
    float m = -INFINITY;
    #pragma unroll 1
    for (int j = lane; j < n; j += 32) m = fmaxf(m, s.p[h * split_len + j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sum = 0.f;
    #pragma unroll 1
    for (int j = lane; j < n; j += 32) {
      const float e = __expf(s.p[h * split_len + j] - m);
      s.p[h * split_len + j] = e;
      sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
      s.w[h] = m;
      s.w[kMaxGroups + h] = sum;
    }
  }
  __syncthreads();
  for (int h = 0; h < g; ++h) {
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    #pragma unroll 1
    for (int j = slot; j < n; j += kSlots) {
      const float pr = s.p[h * split_len + j];
      float v[kVec];
      if (j0 + j == pos) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[e] = s.kv_new[D + c + e];
      } else {
        LoadVec(v_s + j * D + c, v);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += pr * v[e];
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
#pragma unroll
      for (int o = kLanes; o < 32; o <<= 1) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], o);
    }
    if (lane < kLanes) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) s.red[(warp * g + h) * D + c + e] = acc[e];
    }
  }
  __syncthreads();
  float* part = a.partials + ((int64_t(b) * a.n_kv + kh) * splits + sp) * g * (D + 2);
  #pragma unroll 1
  for (int i = threadIdx.x; i < g * D; i += kThreads) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += s.red[w * g * D + i];
    part[2 * g + i] = sum;
  }
  if (threadIdx.x < g) {
    part[threadIdx.x] = s.w[threadIdx.x];
    part[g + threadIdx.x] = s.w[kMaxGroups + threadIdx.x];
  }
  // The last active split of (b, kh) combines them (as RopeDecodeAttentionKernel): out = sum_s
  // e^(m_s - M) o_s / sum_s e^(m_s - M) l_s, M = max_s m_s; then resets the semaphore.
  const int active = (len + split_len - 1) / split_len;
  __threadfence();
  __syncthreads();
  if (trace != nullptr && threadIdx.x == 0) trace[8] = GlobalTimerNs();
  if (threadIdx.x == 0) s.is_last[0] = atomicAdd(&a.semaphores[b * a.n_kv + kh], 1) == active - 1;
  __syncthreads();
  if (!s.is_last[0]) return;
  __threadfence();
  const float* base = a.partials + (int64_t(b) * a.n_kv + kh) * splits * g * (D + 2);
  float* wgt = s.p;  // (active, g)
  #pragma unroll 1
  for (int i = threadIdx.x; i < active * g; i += kThreads) {
    wgt[i] = __ldcg(base + (i / g) * g * (D + 2) + (i % g));
  }
  __syncthreads();
  if (threadIdx.x < g) {
    const int h = threadIdx.x;
    float mx = -INFINITY;
    #pragma unroll 1
    for (int t = 0; t < active; ++t) mx = fmaxf(mx, wgt[t * g + h]);
    float l = 0.f;
    #pragma unroll 1
    for (int t = 0; t < active; ++t) {
      const float e = __expf(wgt[t * g + h] - mx);
      wgt[t * g + h] = e;
      l += e * __ldcg(base + t * g * (D + 2) + g + h);
    }
    s.w[h] = 1.f / l;
  }
  __syncthreads();
  T* ob = static_cast<T*>(a.attn) + (int64_t(b) * a.n_heads + int64_t(kh) * g) * D;
  #pragma unroll 1
  for (int i = threadIdx.x; i < g * D; i += kThreads) {
    const int h = i / D;
    float o = 0.f;
#pragma unroll 8
    for (int t = 0; t < active; ++t) o += wgt[t * g + h] * __ldcg(base + t * g * (D + 2) + 2 * g + i);
    ob[i] = FromFloat<T>(o * s.w[h]);
  }
  if (threadIdx.x == 0) a.semaphores[b * a.n_kv + kh] = 0;
  __syncthreads();
}

enum { kBarA = 0, kBarC = 1, kBarD = 2, kBarE = 3, kBarKv = 4 };  // mbarriers: weight slots, keys

// Streams stage `stage`'s weights of block l into its slot (the issuing thread only; every reader
// of the slot's previous contents is past a __syncthreads).
__device__ __noinline__ void IssueWeights(const DecodeStackArgs& a, const Smem& s, uint64_t* bars,
                                          int stage, int l) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  FenceProxyAsync();
  const DecodeStackLayer& w = a.layer[l];
  const int G = gridDim.x, blk = blockIdx.x, H = a.hidden, I = a.inter;
  const uint32_t el = sizeof(T);
  switch (stage) {
    case kBarA: {
      const int n = (a.n_heads + 2 * a.n_kv) * a.head_dim;
      const int r0 = RowBegin(n, blk, G), r1 = RowBegin(n, blk + 1, G);
      const uint32_t rows = uint32_t(r1 - r0) * H * el;
      MbarExpect(&bars[kBarA], H * el + rows);
      BulkCopy(s.slot_a, w.norm1, H * el, &bars[kBarA]);
      if (rows) {
        BulkCopy(s.slot_a + H, static_cast<const T*>(w.w_qkv) + int64_t(r0) * H, rows,
                 &bars[kBarA]);
      }
      break;
    }
    case kBarC: {
      const int k = a.n_heads * a.head_dim;
      const int r0 = RowBegin(H, blk, G), r1 = RowBegin(H, blk + 1, G);
      const uint32_t rows = uint32_t(r1 - r0) * k * el;
      MbarExpect(&bars[kBarC], rows);
      if (rows) {
        BulkCopy(s.slot_c, static_cast<const T*>(w.w_out) + int64_t(r0) * k, rows, &bars[kBarC]);
      }
      break;
    }
    case kBarD: {
      const int r0 = RowBegin(I, blk, G), r1 = RowBegin(I, blk + 1, G);
      const uint32_t rows = uint32_t(r1 - r0) * H * el;
      MbarExpect(&bars[kBarD], H * el + 2 * rows);
      BulkCopy(s.slot_d, w.norm2, H * el, &bars[kBarD]);
      if (rows) {
        const T* gu = static_cast<const T*>(w.w_gate_up);
        BulkCopy(s.slot_d + H, gu + int64_t(r0) * H, rows, &bars[kBarD]);
        BulkCopy(s.slot_d + H + (r1 - r0) * H, gu + (int64_t(I) + r0) * H, rows, &bars[kBarD]);
      }
      break;
    }
    case kBarE: {
      const int r0 = RowBegin(H, blk, G), r1 = RowBegin(H, blk + 1, G);
      const uint32_t rows = uint32_t(r1 - r0) * I * el;
      MbarExpect(&bars[kBarE], rows);
      if (rows) {
        BulkCopy(s.slot_e, static_cast<const T*>(w.w_down) + int64_t(r0) * I, rows, &bars[kBarE]);
      }
      break;
    }
  }
#endif
}

// Streams the keys and values of attention item `item` of block l into the act region.
__device__ __noinline__ void IssueKeysValues(const DecodeStackArgs& a, const DecodeStackPlan& p,
                                             const Smem& s, uint64_t* bar, int l, int item) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  FenceProxyAsync();
  const int D = a.head_dim;
  const int sp = item % p.splits, kh = (item / p.splits) % a.n_kv, b = item / (p.splits * a.n_kv);
  const int64_t pos = a.positions[b];
  const int len = static_cast<int>(pos + 1 < a.kv_len ? pos + 1 : a.kv_len);
  const int j0 = sp * p.split_len, n = min(p.split_len, len - j0);
  const uint32_t bytes = uint32_t(n) * D * sizeof(T);
  const int64_t first = ((int64_t(b) * a.n_kv + kh) * a.max_seq + j0) * D;
  MbarExpect(bar, 2 * bytes);
  BulkCopy(s.act, static_cast<const T*>(a.layer[l].cache_k) + first, bytes, bar);
  BulkCopy(s.act + p.split_len * D, static_cast<const T*>(a.layer[l].cache_v) + first, bytes, bar);
#endif
}

template <int D, int M>
__global__ void __launch_bounds__(kThreads, 1)
    DecodeStackKernel(const __grid_constant__ DecodeStackArgs a,
                      const __grid_constant__ DecodeStackPlan p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(kAlign) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[5];  // weight slots A, C, D, E; keys/values
  Smem s;
  s.slot_a = reinterpret_cast<T*>(smem_raw + p.off_slot_a);
  s.slot_c = reinterpret_cast<T*>(smem_raw + p.off_slot_c);
  s.slot_d = reinterpret_cast<T*>(smem_raw + p.off_slot_d);
  s.slot_e = reinterpret_cast<T*>(smem_raw + p.off_slot_e);
  s.act = reinterpret_cast<T*>(smem_raw + p.off_act);
  s.q = reinterpret_cast<float*>(smem_raw + p.off_attn);
  s.kv_new = s.q + kMaxGroups * D;
  s.p = s.kv_new + 2 * D;
  s.red = s.p + kMaxGroups * p.split_len;
  s.acc = reinterpret_cast<float*>(smem_raw + p.off_acc);
  s.ss = s.acc + p.acc_floats;
  s.w = s.ss + kDecodeStackMaxBatch;
  s.is_last = reinterpret_cast<int*>(s.w + 2 * kMaxGroups);

  const int G = gridDim.x, blk = blockIdx.x;
  const int H = a.hidden, I = a.inter, B = a.batch, g = a.n_heads / a.n_kv;
  const int n_qkv = (a.n_heads + 2 * a.n_kv) * D, n_attn = a.n_heads * D;
  const int qa0 = RowBegin(n_qkv, blk, G), qa1 = RowBegin(n_qkv, blk + 1, G);
  const int oc0 = RowBegin(H, blk, G), oc1 = RowBegin(H, blk + 1, G);
  const int gd0 = RowBegin(I, blk, G), gd1 = RowBegin(I, blk + 1, G);
  const int de0 = oc0, de1 = oc1;  // down rows: same split of H as the out projection
  T* out = static_cast<T*>(a.out);
  T* qkv = static_cast<T*>(a.qkv);
  T* act = static_cast<T*>(a.act);
  const int items = B * a.n_kv * p.splits;

  auto issue = [&](int stage, int l) {
    if (threadIdx.x == kIssuer && l < a.layers) IssueWeights(a, s, bars, stage, l);
  };
  // Whether attention item `item` lies within its row's length (else nothing is loaded for it).
  auto item_active = [&](int item) {
    const int sp = item % p.splits, b = item / (p.splits * a.n_kv);
    const int64_t pos = a.positions[b];
    const int len = static_cast<int>(pos + 1 < a.kv_len ? pos + 1 : a.kv_len);
    return sp * p.split_len < len;
  };
  auto issue_kv = [&](int l, int item) {
    if (threadIdx.x == kIssuer) IssueKeysValues(a, p, s, &bars[kBarKv], l, item);
  };

  if (threadIdx.x == kIssuer) {
    for (int i = 0; i < 5; ++i) MbarInit(&bars[i]);
    FenceMbarInit();
  }
  __syncthreads();
  // Weights are never written by a kernel: stream layer 0's before waiting for the previous one.
  issue(kBarA, 0);
  issue(kBarC, 0);
  issue(kBarD, 0);
  issue(kBarE, 0);
  WaitForPrerequisites();

  // Optional timeline (DecodeStackArgs::trace): per block, layer and stage, the times at which it
  // passed its barrier, had its inputs, and arrived.
  auto mark = [&](int l, int point) {
    if (a.trace != nullptr && threadIdx.x == 0) {
      a.trace[(int64_t(blk) * a.layers + l) * kDecodeStackTracePoints + point] = GlobalTimerNs();
    }
  };
  unsigned arrivals = 0;  // grid barriers passed so far (each one counts G arrivals)
  uint32_t kv_loads = 0;  // completed phases of the keys/values mbarrier
  unsigned* counter = a.barrier;
  for (int l = 0; l < a.layers; ++l) {
    const uint32_t parity = l & 1;
    const T* resid = l == 0 ? static_cast<const T*>(a.x) : out;
    // ---- A: qkv = RMSNorm(x) W_qkv^T
    if (l > 0) GridWait(counter, arrivals * G);
    mark(l, 0);
    MbarWait(&bars[kBarA], parity);
    mark(l, 1);
    RmsNormToShared(resid, s.slot_a, a.eps, B, H, s.act, s.ss);
    mark(l, 2);
    #pragma unroll 1
    for (int i = threadIdx.x; i < p.acc_floats; i += kThreads) s.acc[i] = 0.f;
    __syncthreads();
    SmemGemv<M>(s.slot_a + H, qa1 - qa0, s.act, B, H, s.acc);
    __syncthreads();
    mark(l, 3);
    #pragma unroll 1
    for (int i = threadIdx.x; i < (qa1 - qa0) * B; i += kThreads) {
      const int r = i / B, b = i - r * B;
      qkv[int64_t(b) * n_qkv + qa0 + r] = FromFloat<T>(s.acc[r * kDecodeStackMaxBatch + b]);
    }
    __syncthreads();
    issue(kBarA, l + 1);
    if (blk < items && item_active(blk)) issue_kv(l, blk);
    mark(l, 4);
    GridArrive(counter);
    mark(l, 25);
    ++arrivals;
    // ---- B: attention partials for items blk, blk + G, ...
    GridWait(counter, arrivals * G);
    mark(l, 5);
    #pragma unroll 1
    for (int item = blk; item < items; item += G) {
      if (!item_active(item)) continue;
      if (item != blk) issue_kv(l, item);
      uint64_t* item_trace = a.trace != nullptr && item == blk
                                 ? a.trace + (int64_t(blk) * a.layers + l) * kDecodeStackTracePoints
                                 : nullptr;
      AttentionItem<D>(a, p, s, l, item, &bars[kBarKv], kv_loads & 1, item_trace);
      ++kv_loads;
    }
    mark(l, 9);
    GridArrive(counter);
    mark(l, 26);
    ++arrivals;
    // ---- C: x = x + a W_out^T, a the attention output (combined in B)
    GridWait(counter, arrivals * G);
    mark(l, 10);
    #pragma unroll 1
    for (int i = threadIdx.x; i < B * n_attn / kVec; i += kThreads) {
      reinterpret_cast<uint4*>(s.act)[i] = __ldcg(reinterpret_cast<const uint4*>(a.attn) + i);
    }
    // The sums start from the residual (loaded now, with the attention output).
    #pragma unroll 1
    for (int i = threadIdx.x; i < (oc1 - oc0) * B; i += kThreads) {
      const int r = i / B, b = i - r * B;
      s.acc[r * kDecodeStackMaxBatch + b] = ToFloat(__ldcg(resid + int64_t(b) * H + oc0 + r));
    }
    MbarWait(&bars[kBarC], parity);
    mark(l, 11);
    __syncthreads();
    SmemGemv<M>(s.slot_c, oc1 - oc0, s.act, B, n_attn, s.acc);
    __syncthreads();
    mark(l, 12);
    #pragma unroll 1
    for (int i = threadIdx.x; i < (oc1 - oc0) * B; i += kThreads) {
      const int r = i / B, b = i - r * B;
      out[int64_t(b) * H + oc0 + r] = FromFloat<T>(s.acc[r * kDecodeStackMaxBatch + b]);
    }
    __syncthreads();
    mark(l, 13);
    issue(kBarC, l + 1);
    mark(l, 14);
    GridArrive(counter);
    mark(l, 27);
    ++arrivals;
    // ---- D: h = silu(RMSNorm(x) W_gate^T) * (RMSNorm(x) W_up^T)
    GridWait(counter, arrivals * G);
    mark(l, 15);
    MbarWait(&bars[kBarD], parity);
    mark(l, 16);
    RmsNormToShared(out, s.slot_d, a.eps, B, H, s.act, s.ss);
    mark(l, 17);
    #pragma unroll 1
    for (int i = threadIdx.x; i < p.acc_floats; i += kThreads) s.acc[i] = 0.f;
    __syncthreads();
    const int nd = gd1 - gd0;
    SmemGemv<M>(s.slot_d + H, 2 * nd, s.act, B, H, s.acc);
    __syncthreads();
    mark(l, 18);
    #pragma unroll 1
    for (int i = threadIdx.x; i < nd * B; i += kThreads) {
      const int r = i / B, b = i - r * B;
      // Rounded as the gate/up GEMV stores them, then as SiluMul stores its result.
      const float gate = ToFloat(FromFloat<T>(s.acc[r * kDecodeStackMaxBatch + b]));
      const float up = ToFloat(FromFloat<T>(s.acc[(nd + r) * kDecodeStackMaxBatch + b]));
      act[int64_t(b) * I + gd0 + r] = FromFloat<T>(SiluTimes(gate, up));
    }
    __syncthreads();
    issue(kBarD, l + 1);
    mark(l, 19);
    GridArrive(counter);
    mark(l, 28);
    ++arrivals;
    // ---- E: x = x + h W_down^T
    GridWait(counter, arrivals * G);
    mark(l, 20);
    #pragma unroll 1
    for (int i = threadIdx.x; i < B * I / kVec; i += kThreads) {
      reinterpret_cast<uint4*>(s.act)[i] = __ldcg(reinterpret_cast<const uint4*>(act) + i);
    }
    #pragma unroll 1
    for (int i = threadIdx.x; i < (de1 - de0) * B; i += kThreads) {
      const int r = i / B, b = i - r * B;
      s.acc[r * kDecodeStackMaxBatch + b] = ToFloat(__ldcg(out + int64_t(b) * H + de0 + r));
    }
    MbarWait(&bars[kBarE], parity);
    mark(l, 21);
    __syncthreads();
    SmemGemv<M>(s.slot_e, de1 - de0, s.act, B, I, s.acc);
    __syncthreads();
    mark(l, 22);
    #pragma unroll 1
    for (int i = threadIdx.x; i < (de1 - de0) * B; i += kThreads) {
      const int r = i / B, b = i - r * B;
      out[int64_t(b) * H + de0 + r] = FromFloat<T>(s.acc[r * kDecodeStackMaxBatch + b]);
    }
    __syncthreads();
    mark(l, 23);
    issue(kBarE, l + 1);
    mark(l, 24);
    if (l + 1 < a.layers) {
      GridArrive(counter);
      mark(l, 29);
      ++arrivals;
    } else {
      // The last arrival: every block is past its last wait, so the counter can go back to zero
      // for the next launch.
      AllowDependentsToLaunch();
      const unsigned old = GridArriveCounted(counter);
      ++arrivals;
      if (threadIdx.x == 0 && old == arrivals * G - 1) atomicExch(counter, 0u);
    }
  }
#endif
}

template <int D, int M>
cudaError_t LaunchFor(const DecodeStackArgs& args, const DecodeStackPlan& plan,
                      cudaStream_t stream) {
  auto kernel = DecodeStackKernel<D, M>;
  cudaError_t e = AllowSharedMemory(kernel, plan.smem_bytes);
  if (e != cudaSuccess) return e;
  return LaunchMaybePdl(kernel, dim3(plan.grid), dim3(kThreads), plan.smem_bytes, stream, args,
                        plan);
}

template <int D>
cudaError_t LaunchForBatch(const DecodeStackArgs& args, const DecodeStackPlan& plan,
                           cudaStream_t stream) {
  if (args.batch <= 1) return LaunchFor<D, 1>(args, plan, stream);
  if (args.batch <= 2) return LaunchFor<D, 2>(args, plan, stream);
  if (args.batch <= 4) return LaunchFor<D, 4>(args, plan, stream);
  return LaunchFor<D, kDecodeStackMaxBatch>(args, plan, stream);
}

size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

}  // namespace

DecodeStackPlan PlanDecodeStack(int64_t batch, int64_t hidden, int64_t n_heads, int64_t n_kv,
                                int64_t head_dim, int64_t inter, int64_t layers, int64_t kv_len) {
  DecodeStackPlan p{};
  // 0 where a device attribute cannot be read: no plan then.
  const int sms = CachedDeviceAttribute<cudaDevAttrMultiProcessorCount>(0);
  const int max_smem = CachedDeviceAttribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(0);
  if (ComputeCapabilityMajor() < 9 || sms == 0 || max_smem == 0 || batch < 1 ||
      batch > kDecodeStackMaxBatch || layers < 1 ||
      layers > kDecodeStackMaxLayers || n_kv < 1 || n_heads % n_kv != 0 ||
      n_heads / n_kv > kMaxGroups || (head_dim != 64 && head_dim != 128) || hidden % kVec != 0 ||
      inter % kVec != 0 || kv_len < 1) {
    return p;
  }
  const int64_t G = sms, g = n_heads / n_kv, n_attn = n_heads * head_dim;
  const int64_t n_qkv = (n_heads + 2 * n_kv) * head_dim;
  auto max_rows = [&](int64_t n) { return (n + G - 1) / G; };
  // Splits: about one attention item per block, at most kMaxSplits per (row, KV head) so the
  // combine stays short, >= 32 keys each in 16-key multiples.
  const int64_t pairs = batch * n_kv;
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, G / pairs));
  int64_t split_len = (kv_len + want - 1) / want;
  split_len = std::max<int64_t>(32, (split_len + 15) / 16 * 16);
  p.split_len = static_cast<int>(split_len);
  p.splits = static_cast<int>((kv_len + split_len - 1) / split_len);
  const size_t el = 2;  // bf16
  const size_t slot_a = (hidden + max_rows(n_qkv) * hidden) * el;
  const size_t slot_c = max_rows(hidden) * n_attn * el;
  const size_t slot_d = (hidden + 2 * max_rows(inter) * hidden) * el;
  const size_t slot_e = max_rows(hidden) * inter * el;
  const size_t act = std::max<size_t>(batch * std::max({hidden, n_attn, inter}) * el,
                                      2 * split_len * head_dim * el);
  const size_t attn =
      (kMaxGroups * head_dim + 2 * head_dim + kMaxGroups * split_len + kWarps * g * head_dim) *
      sizeof(float);
  const int64_t acc_rows = std::max({max_rows(n_qkv), max_rows(hidden), 2 * max_rows(inter)});
  p.acc_floats = static_cast<int>(acc_rows * kDecodeStackMaxBatch);
  const size_t acc = (p.acc_floats + kDecodeStackMaxBatch + 2 * kMaxGroups + 1) * sizeof(float);
  size_t off = 0;
  p.off_slot_a = off;
  off = AlignUp(off + slot_a);
  p.off_slot_c = off;
  off = AlignUp(off + slot_c);
  p.off_slot_d = off;
  off = AlignUp(off + slot_d);
  p.off_slot_e = off;
  off = AlignUp(off + slot_e);
  p.off_act = off;
  off = AlignUp(off + act);
  p.off_attn = off;
  off = AlignUp(off + attn);
  p.off_acc = off;
  off = AlignUp(off + acc);
  p.smem_bytes = static_cast<uint32_t>(off);
  p.grid = static_cast<int>(G);
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  p.ok = off <= static_cast<size_t>(max_smem);
  return p;
}

int64_t DecodeStackPartialFloats(const DecodeStackPlan& plan, int64_t batch, int64_t n_heads,
                                 int64_t head_dim) {
  return batch * plan.splits * (n_heads * head_dim + 2 * n_heads);
}

cudaError_t LaunchDecodeStack(const DecodeStackArgs& args, const DecodeStackPlan& plan,
                              cudaStream_t stream) {
  if (!plan.ok) return cudaErrorInvalidValue;
  switch (args.head_dim) {
    case 64:
      return LaunchForBatch<64>(args, plan, stream);
    case 128:
      return LaunchForBatch<128>(args, plan, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace vlmgraph::cuda
