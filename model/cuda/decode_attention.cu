// model/cuda/decode_attention.cu: one decode token per row, RoPE + KV-cache write + split-key
// grouped-query attention in one kernel (LaunchRopeDecodeAttention in fused_kernels.h): a kernel
// that stages its keys in shared memory for few rows, one whose warps stream them for more (or,
// in bf16, the tensor-core kernel of decode_attention_mma.cu).
#include <cuda_pipeline.h>

#include <algorithm>
#include <type_traits>

#include "model/cuda/decode_attention_common.cuh"
#include "model/cuda/fused_kernels.h"
#include "model/cuda/kernel_util.cuh"

namespace vlmgraph::cuda {
namespace {

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
// kAttnThreads: 128 or 256, see DecodeAttentionThreads.
// Lane mapping: kLanes = D / (16 / sizeof(T)) consecutive lanes share one key row, each holding
// one 16-byte slice, so shared-memory reads are conflict-free and a warp covers 32 / kLanes keys.
constexpr int kAttnMaxGroups = 16;
constexpr int kAttnMaxSplitLen = 64;

template <typename T, int D, int kAttnThreads>
__global__ void __launch_bounds__(kAttnThreads)
    RopeDecodeAttentionKernel(const T* __restrict__ qkv, const float* __restrict__ inv_freq,
                              float scaling, const int64_t* __restrict__ positions, T* cache_k,
                              T* cache_v, T* __restrict__ out, float* partials, int* semaphores,
                              int n_heads, int n_kv, KvPages kv, int kv_len, int split_len,
                              float scale, bool combine) {
  constexpr int kAttnWarps = kAttnThreads / 32;
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLanes = D / kVec;               // lanes per key row
  constexpr int kSlots = kAttnThreads / kLanes;  // keys in flight per block
  extern __shared__ __align__(16) unsigned char attn_smem_raw[];
  const int s = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const int g = n_heads / n_kv;
  // positions and the cache rows before this step's position were written before the previous
  // kernel started (see WaitForPrerequisites), so they may be read now.
  const DecodeSplit split = SplitOfRow(positions, b, s, kv_len, split_len);
  if (s >= split.active) return;
  const int64_t pos = split.pos;
  const int active = split.active, j0 = split.j0, n = split.n;
  T* k_s = reinterpret_cast<T*>(attn_smem_raw);                // (split_len, D)
  T* v_s = k_s + split_len * D;                                // (split_len, D)
  float* q_s = reinterpret_cast<float*>(v_s + split_len * D);  // (g, D)
  float* kv_new = q_s + g * D;                                 // (2, D)
  const int p_stride = max(split_len, 2 * static_cast<int>(gridDim.x));
  float* p_s = kv_new + 2 * D;               // (g, p_stride); the combine's (m, l) after the scores
  float* red = p_s + g * p_stride;           // (warps, g, D)
  __shared__ float w_s[2 * kAttnMaxGroups];  // per head: m, l; then 1 / L
  for (int i = threadIdx.x; i < n * kLanes; i += kAttnThreads) {
    const int j = i / kLanes, c = (i % kLanes) * kVec;
    const int64_t at = KvRowOffset<D>(kv, b, kh, j0 + j) + c;
    __pipeline_memcpy_async(k_s + j * D + c, cache_k + at, 16);
    __pipeline_memcpy_async(v_s + j * D + c, cache_v + at, 16);
  }
  __pipeline_commit();
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  RotateQueryAndKey<T, D, kAttnThreads>(qkv, inv_freq, scaling, pos, b, kh, n_heads, n_kv, q_s,
                                        kv_new);
  __pipeline_wait_prior(0);
  __syncthreads();
  StoreNewKeyValue<T, D, kAttnThreads>(kv_new, cache_k, cache_v, kv, b, kh, pos, s, kv_len,
                                       split_len);
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
  if (!combine) return;  // the next kernel combines the partial states (LaunchGemvAttnCombine)
  CountInAndCombine<T, D, kAttnThreads>(partials, semaphores, out, b, kh, n_kv, n_heads, gridDim.x,
                                        active, p_s, w_s);
}

// ---- Decode attention for large batches: warps over keys ------------------------------------
// Same grid, partial states, combine and results as RopeDecodeAttentionKernel, for launches with
// many (row, KV head) pairs and kG = n_heads / n_kv <= kWarpAttnMaxGroups. There each block's
// chain of dependent phases (shared-memory copy, barrier, scores, barrier, softmax, barrier,
// weighted sum, barrier) and its few warps, not the bytes, bound the kernel. Here no barrier
// separates keys: lane group grp = lane / kLanes of warp w holds key (r * kWarps + w) * kGroups
// + grp of the split in round r, one 16-byte slice of its key and value row per lane, read from
// global memory into registers a round ahead of use (the first two rounds before the dependency
// wait). Each group keeps its own running maximum m, sum l and unnormalised output slice o per
// head, updated key by key (the online softmax of Milakov & Gimelshein 2018); at the end the
// groups of a warp merge through shuffles and the warps through shared memory, with the same
// rescaling. A row whose keys fit one split writes its output directly.
constexpr int kWarpAttnThreads = 128;
constexpr int kWarpAttnMaxGroups = 4;
constexpr int kWarpAttnMaxSplitLen = 512;

template <typename T, int D, int kG>
__global__ void __launch_bounds__(kWarpAttnThreads)
    RopeDecodeAttentionWarpsKernel(const T* __restrict__ qkv, const float* __restrict__ inv_freq,
                                   float scaling, const int64_t* __restrict__ positions, T* cache_k,
                                   T* cache_v, T* __restrict__ out, float* partials,
                                   int* semaphores, int n_heads, int n_kv, KvPages kv, int kv_len,
                                   int split_len, float scale, bool combine) {
  constexpr int kWarps = kWarpAttnThreads / 32;
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kLanes = D / kVec;      // lanes per key row
  constexpr int kGroups = 32 / kLanes;  // keys per warp and round
  extern __shared__ __align__(16) unsigned char attn_smem_raw[];
  const int s = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const DecodeSplit split = SplitOfRow(positions, b, s, kv_len, split_len);
  if (s >= split.active) return;
  const int64_t pos = split.pos;
  const int active = split.active, j0 = split.j0, n = split.n;
  const int rounds = (n + kWarps * kGroups - 1) / (kWarps * kGroups);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = lane / kLanes, c = (lane % kLanes) * kVec;
  float* q_s = reinterpret_cast<float*>(attn_smem_raw);  // (kG, D)
  float* kv_new = q_s + kG * D;                          // (2, D)
  float* merge = kv_new + 2 * D;                         // (warps, kG, D + 2): m, l, o
  float* scratch = merge + kWarps * kG * (D + 2);        // (2 * splits, kG): the combine's
  __shared__ float w_s[kG];
  // Key and value slices of round r (slot u of the two in flight); keys past n are not read.
  uint4 k_in[2], v_in[2];
  auto load = [&](int r, uint4& kd, uint4& vd) {
    const int j = (r * kWarps + warp) * kGroups + grp;
    if (j < n) {
      const int64_t at = KvRowOffset<D>(kv, b, kh, j0 + j) + c;
      kd = *reinterpret_cast<const uint4*>(cache_k + at);
      vd = *reinterpret_cast<const uint4*>(cache_v + at);
    }
  };
  load(0, k_in[0], v_in[0]);
  load(1, k_in[1], v_in[1]);
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  RotateQueryAndKey<T, D, kWarpAttnThreads>(qkv, inv_freq, scaling, pos, b, kh, n_heads, n_kv, q_s,
                                            kv_new);
  __syncthreads();
  StoreNewKeyValue<T, D, kWarpAttnThreads>(kv_new, cache_k, cache_v, kv, b, kh, pos, s, kv_len,
                                           split_len);
  float q[kG][kVec], m[kG], l[kG], o[kG][kVec];
#pragma unroll
  for (int h = 0; h < kG; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      q[h][e] = q_s[h * D + c + e] * scale;
      o[h][e] = 0.f;
    }
  }
  for (int r0 = 0; r0 < rounds; r0 += 2) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int r = r0 + u;
      const int j = (r * kWarps + warp) * kGroups + grp;
      const bool valid = r < rounds && j < n;  // the same in every lane of a group
      float k[kVec], v[kVec];
      if (j0 + j == pos) {  // this step's key and value, not yet in the cache
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          k[e] = kv_new[c + e];
          v[e] = kv_new[D + c + e];
        }
      } else {
        const T* ke = reinterpret_cast<const T*>(&k_in[u]);
        const T* ve = reinterpret_cast<const T*>(&v_in[u]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          k[e] = valid ? ToFloat(ke[e]) : 0.f;
          v[e] = valid ? ToFloat(ve[e]) : 0.f;
        }
      }
      load(r + 2, k_in[u], v_in[u]);
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        float score = 0.f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) score += q[h][e] * k[e];
#pragma unroll
        for (int off = kLanes / 2; off > 0; off >>= 1) {
          score += __shfl_xor_sync(0xffffffffu, score, off);
        }
        if (valid) {
          const float mx = fmaxf(m[h], score);
          const float rescale = __expf(m[h] - mx), p = __expf(score - mx);
          l[h] = l[h] * rescale + p;
#pragma unroll
          for (int e = 0; e < kVec; ++e) o[h][e] = o[h][e] * rescale + p * v[e];
          m[h] = mx;
        }
      }
    }
  }
  // Merge the groups of the warp (a group without keys has m = -inf, l = 0, o = 0).
#pragma unroll
  for (int off = kLanes; off < 32; off <<= 1) {
#pragma unroll
    for (int h = 0; h < kG; ++h) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[h], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[h], off);
      const float mx = fmaxf(m[h], mo);
      const float ra = m[h] == -INFINITY ? 0.f : __expf(m[h] - mx);
      const float rb = mo == -INFINITY ? 0.f : __expf(mo - mx);
      l[h] = l[h] * ra + lo * rb;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        o[h][e] = o[h][e] * ra + __shfl_xor_sync(0xffffffffu, o[h][e], off) * rb;
      }
      m[h] = mx;
    }
  }
  if (lane < kLanes) {
#pragma unroll
    for (int h = 0; h < kG; ++h) {
      float* w = merge + (warp * kG + h) * (D + 2);
      if (lane == 0) {
        w[0] = m[h];
        w[1] = l[h];
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) w[2 + c + e] = o[h][e];
    }
  }
  __syncthreads();
  FinishWarpsAttention<T, D, kG, kWarpAttnThreads>(merge, scratch, w_s, partials, semaphores, out,
                                                   s, kh, b, n_heads, n_kv, active, combine);
}

// Threads per block: 256 when the launch has few (row, KV head) pairs, so that the extra warps
// shorten each block's dependent chain (scores, softmax, weighted sum); 128 otherwise, where more
// blocks share each SM. Bench: `vlmgraph-decode-ops-bench --batch 1` and `--batch 8` (whole
// decoder); figures in docs/design/decode-kernels.md, "Threads per block".
int DecodeAttentionThreads(int64_t batch, int64_t n_kv) { return batch * n_kv <= 8 ? 256 : 128; }

// Whether a launch takes RopeDecodeAttentionWarpsKernel: from 4 rows (1 and 2 rows keep the
// split-key kernel, whose partial states the out projection combines) when the GQA group fits.
// H200, SmolLM2-135M shape (`vlmgraph-bench --decode-only 1 --batch-buckets derived
// --max-decode-batch 256`): the decode step 0.824 -> 0.814 ms at batch 4, 0.819 -> 0.796 at 8,
// 1.095 -> 1.012 at 32, 1.907 -> 1.515 at 256; figures in docs/design/decode-kernels.md,
// "Attention at large batch".
constexpr int64_t kWarpAttnMinRows = 4;
bool UsesWarpsKernel(int64_t batch, int64_t n_heads, int64_t n_kv) {
  return batch >= kWarpAttnMinRows && n_heads / n_kv <= kWarpAttnMaxGroups;
}

template <typename T, int D>
cudaError_t RopeDecodeAttentionFor(const void* qkv, const float* inv_freq, float scaling,
                                   const int64_t* positions, void* ck, void* cv, void* out,
                                   float* partials, int* semaphores, int64_t batch, int64_t n_heads,
                                   int64_t n_kv, KvPages kv, int64_t kv_len, float scale,
                                   bool combine, cudaStream_t stream) {
  const int g = static_cast<int>(n_heads / n_kv);
  const int split_len = DecodeAttentionSplitLen(batch, n_heads, n_kv, kv_len);
  const int splits = DecodeAttentionSplits(batch, n_heads, n_kv, kv_len);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(n_kv),
                  static_cast<unsigned>(batch));
  if (UsesWarpsKernel(batch, n_heads, n_kv) &&
      DecodeAttentionMmaSupports(std::is_same_v<T, __nv_bfloat16>, D, g)) {
    return LaunchRopeDecodeAttentionMma(qkv, inv_freq, scaling, positions, ck, cv, out, partials,
                                        semaphores, batch, n_heads, n_kv, D, kv, kv_len, split_len,
                                        splits, scale, combine, stream);
  }
  if (UsesWarpsKernel(batch, n_heads, n_kv)) {
    constexpr int kWarps = kWarpAttnThreads / 32;
    const size_t smem = sizeof(float) * (size_t(g) * D + 2 * D + size_t(kWarps) * g * (D + 2) +
                                         2 * size_t(splits) * g);
    auto kernel = g == 1   ? RopeDecodeAttentionWarpsKernel<T, D, 1>
                  : g == 2 ? RopeDecodeAttentionWarpsKernel<T, D, 2>
                  : g == 3 ? RopeDecodeAttentionWarpsKernel<T, D, 3>
                           : RopeDecodeAttentionWarpsKernel<T, D, 4>;
    cudaError_t e = AllowSharedMemory(kernel, smem);
    if (e != cudaSuccess) return e;
    return LaunchMaybePdl(kernel, grid, dim3(kWarpAttnThreads), smem, stream,
                          static_cast<const T*>(qkv), inv_freq, scaling, positions,
                          static_cast<T*>(ck), static_cast<T*>(cv), static_cast<T*>(out), partials,
                          semaphores, static_cast<int>(n_heads), static_cast<int>(n_kv), kv,
                          static_cast<int>(kv_len), split_len, scale, combine);
  }
  const int threads = DecodeAttentionThreads(batch, n_kv);
  const size_t p_stride = std::max(split_len, 2 * splits);  // as in the kernel
  const size_t smem =
      2 * sizeof(T) * size_t(split_len) * D +
      sizeof(float) * (size_t(g) * D + 2 * D + size_t(g) * p_stride + size_t(threads / 32) * g * D);
  auto kernel =
      threads == 256 ? RopeDecodeAttentionKernel<T, D, 256> : RopeDecodeAttentionKernel<T, D, 128>;
  cudaError_t e = AllowSharedMemory(kernel, smem);
  if (e != cudaSuccess) return e;
  return LaunchMaybePdl(kernel, grid, dim3(threads), smem, stream, static_cast<const T*>(qkv),
                        inv_freq, scaling, positions, static_cast<T*>(ck), static_cast<T*>(cv),
                        static_cast<T*>(out), partials, semaphores, static_cast<int>(n_heads),
                        static_cast<int>(n_kv), kv, static_cast<int>(kv_len), split_len, scale,
                        combine);
}

template <typename T>
cudaError_t RopeDecodeAttentionTyped(const void* qkv, const float* inv_freq, float scaling,
                                     const int64_t* positions, void* ck, void* cv, void* out,
                                     float* partials, int* semaphores, int64_t batch,
                                     int64_t n_heads, int64_t n_kv, int64_t head_dim, KvPages kv,
                                     int64_t kv_len, float scale, bool combine, cudaStream_t s) {
#define VLMGRAPH_ATTN_CASE(D)                                                                     \
  case D:                                                                                         \
    return RopeDecodeAttentionFor<T, D>(qkv, inv_freq, scaling, positions, ck, cv, out, partials, \
                                        semaphores, batch, n_heads, n_kv, kv, kv_len, scale,      \
                                        combine, s);
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

}  // namespace

int DecodeAttentionSplitLen(int64_t batch, int64_t n_heads, int64_t n_kv, int64_t kv_len) {
  if (UsesWarpsKernel(batch, n_heads, n_kv)) {
    // Up to 512 keys per block (a row of a 512-key window in one block, which writes its output
    // without a combine; 256 measured 0.5-1% slower at batch 64-256).
    return static_cast<int>(std::min<int64_t>((kv_len + 63) / 64 * 64, kWarpAttnMaxSplitLen));
  }
  // About 16 splits per (row, KV head), 32 or 64 keys each (more splits for longer windows).
  return kv_len > 16 * 32 ? kAttnMaxSplitLen : 32;
}

int DecodeAttentionSplits(int64_t batch, int64_t n_heads, int64_t n_kv, int64_t kv_len) {
  const int split_len = DecodeAttentionSplitLen(batch, n_heads, n_kv, kv_len);
  return static_cast<int>((kv_len + split_len - 1) / split_len);
}

int64_t RopeDecodeAttentionPartialFloats(int64_t batch, int64_t n_heads, int64_t n_kv,
                                         int64_t head_dim, int64_t kv_len) {
  return batch * DecodeAttentionSplits(batch, n_heads, n_kv, kv_len) *
         (n_heads * head_dim + 2 * n_heads);
}

cudaError_t LaunchRopeDecodeAttention(bool bf16, const void* qkv, const float* inv_freq,
                                      float scaling, const int64_t* positions, void* cache_k,
                                      void* cache_v, void* out, float* partials, int* semaphores,
                                      int64_t batch, int64_t n_heads, int64_t n_kv,
                                      int64_t head_dim, KvPages kv, int64_t kv_len, float scale,
                                      bool combine, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (n_kv <= 0 || n_heads % n_kv != 0 || n_heads / n_kv > kAttnMaxGroups || kv_len <= 0) {
    return cudaErrorInvalidValue;
  }
  return bf16 ? RopeDecodeAttentionTyped<__nv_bfloat16>(
                    qkv, inv_freq, scaling, positions, cache_k, cache_v, out, partials, semaphores,
                    batch, n_heads, n_kv, head_dim, kv, kv_len, scale, combine, stream)
              : RopeDecodeAttentionTyped<float>(qkv, inv_freq, scaling, positions, cache_k, cache_v,
                                                out, partials, semaphores, batch, n_heads, n_kv,
                                                head_dim, kv, kv_len, scale, combine, stream);
}

}  // namespace vlmgraph::cuda
