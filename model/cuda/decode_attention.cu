// model/cuda/decode_attention.cu: one decode token per row, RoPE + KV-cache write + split-key
// grouped-query attention in one kernel (LaunchRopeDecodeAttention in fused_kernels.h).
#include <cuda_pipeline.h>

#include <algorithm>

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
// Splits whose partial outputs the one-round combine (256 threads) loads at once.
constexpr int kCombineChunk = 8;

template <typename T, int D, int kAttnThreads>
__global__ void __launch_bounds__(kAttnThreads)
    RopeDecodeAttentionKernel(const T* __restrict__ qkv, const float* __restrict__ inv_freq,
                              float scaling, const int64_t* __restrict__ positions, T* cache_k,
                              T* cache_v, T* __restrict__ out, float* partials, int* semaphores,
                              int n_heads, int n_kv, int64_t max_seq, int kv_len, int split_len,
                              float scale, bool combine) {
  constexpr int kAttnWarps = kAttnThreads / 32;
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
  const int len = DecodeKeys(pos, kv_len);
  const int active = DecodeActiveSplits(pos, kv_len, split_len);
  if (s >= active) return;  // the block storing the new key is always active (see below)
  const int j0 = s * split_len;
  const int n = min(split_len, len - j0);
  T* k_s = reinterpret_cast<T*>(attn_smem_raw);                // (split_len, D)
  T* v_s = k_s + split_len * D;                                // (split_len, D)
  float* q_s = reinterpret_cast<float*>(v_s + split_len * D);  // (g, D)
  float* kv_new = q_s + g * D;                                 // (2, D)
  const int p_stride = max(split_len, 2 * static_cast<int>(gridDim.x));
  float* p_s = kv_new + 2 * D;               // (g, p_stride); the combine's (m, l) after the scores
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
    const T* x = h < g ? src + (kh * g + h) * D : src + (n_heads + kh) * D;
    float r1, r2;
    Rotate(ToFloat(x[p]), ToFloat(x[p + kHalf]), pos, inv_freq[p], scaling, &r1, &r2);
    float* dst = h < g ? q_s + h * D : kv_new;
    dst[p] = ToFloat(FromFloat<T>(r1));  // rounded as the cache stores it
    dst[p + kHalf] = ToFloat(FromFloat<T>(r2));
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
  if (!combine) return;  // the next kernel combines the partial states (LaunchGemvAttnCombine)
  // Publish the partials, then count this split in: the barrier orders every thread's partial
  // stores before thread 0's release fence, which orders them before its increment (the
  // threadfence-reduction pattern with one fence per block); the block that makes the count
  // `active` acquires the others' partials with a fence after its increment, and its barrier
  // passes that on to its threads. One thread's acq_rel fence (MEMBAR.ALL) on each side, not
  // __threadfence (fence.sc, MEMBAR.SC) in every thread, is the cheaper fence on the step's
  // critical path (`vlmgraph-decode-ops-bench`, whole decoder; docs/design/decode-kernels.md,
  // "Where the attention kernel's 6 us go").
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    is_last = atomicAdd(&semaphores[b * n_kv + kh], 1) == active - 1;
    if (is_last) asm volatile("fence.acq_rel.gpu;" ::: "memory");
  }
  __syncthreads();
  if (!is_last) return;
  // Combine: weights w_(s,h) = e^(m_s - M) / L per (split, head) in shared memory (M = max_s m_s,
  // L = sum_s e^(m_s - M) l_s), then out = sum_s w_(s,h) o_s.
  const float* base = partials + (int64_t(b) * n_kv + kh) * splits * g * (D + 2);
  const int64_t split_stride = int64_t(g) * (D + 2);
  float* wgt = p_s;                // (active, g): m, then e^(m_s - M)
  float* lsum = p_s + active * g;  // (active, g): l (p_stride >= 2 * splits)
  T* ob = out + (int64_t(b) * n_heads + int64_t(kh) * g) * D;
  // With 256 threads (few (row, KV head) pairs, see DecodeAttentionThreads) the last block's
  // combine is on the step's critical path, so it issues its global loads in one round: each
  // thread's first output element's o for up to kCombineChunk splits together with the (m, l)
  // pairs. Otherwise it loads m, then l, then o (about five dependent L2 round trips), which
  // measures faster with 128 threads. Bench: `vlmgraph-decode-ops-bench --batch 1`, `--batch 8`
  // and `--context 1024 --length 700` (whole decoder); figures in docs/design/decode-kernels.md,
  // "Where the attention kernel's 6 us go".
  constexpr bool kOneRound = kAttnThreads == 256;
  const int i0 = threadIdx.x;
  float o_first[kOneRound ? kCombineChunk : 1];
  if constexpr (kOneRound) {
#pragma unroll
    for (int u = 0; u < kCombineChunk; ++u) {
      o_first[u] = i0 < g * D && u < active ? __ldcg(base + u * split_stride + 2 * g + i0) : 0.f;
    }
  }
  for (int i = threadIdx.x; i < active * g; i += kAttnThreads) {
    wgt[i] = __ldcg(base + (i / g) * split_stride + i % g);
    if constexpr (kOneRound) lsum[i] = __ldcg(base + (i / g) * split_stride + g + i % g);
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
      l += e * (kOneRound ? lsum[t * g + h] : __ldcg(base + t * split_stride + g + h));
    }
    w_s[h] = 1.f / l;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < g * D; i += kAttnThreads) {
    const int h = i / D;
    float o = 0.f;
    int t = 0;
    if constexpr (kOneRound) {
      if (i == i0) {
#pragma unroll
        for (int u = 0; u < kCombineChunk; ++u) {
          if (u < active) o += wgt[u * g + h] * o_first[u];
        }
        t = kCombineChunk;
      }
    }
#pragma unroll 4
    for (; t < active; ++t) o += wgt[t * g + h] * __ldcg(base + t * split_stride + 2 * g + i);
    ob[i] = FromFloat<T>(o * w_s[h]);
  }
  if (threadIdx.x == 0) semaphores[b * n_kv + kh] = 0;
}

// Threads per block: 256 when the launch has few (row, KV head) pairs, so that the extra warps
// shorten each block's dependent chain (scores, softmax, weighted sum); 128 otherwise, where more
// blocks share each SM. Bench: `vlmgraph-decode-ops-bench --batch 1` and `--batch 8` (whole
// decoder); figures in docs/design/decode-kernels.md, "Threads per block".
int DecodeAttentionThreads(int64_t batch, int64_t n_kv) { return batch * n_kv <= 8 ? 256 : 128; }

template <typename T, int D>
cudaError_t RopeDecodeAttentionFor(const void* qkv, const float* inv_freq, float scaling,
                                   const int64_t* positions, void* ck, void* cv, void* out,
                                   float* partials, int* semaphores, int64_t batch, int64_t n_heads,
                                   int64_t n_kv, int64_t max_seq, int64_t kv_len, float scale,
                                   bool combine, cudaStream_t stream) {
  const int g = static_cast<int>(n_heads / n_kv);
  const int split_len = DecodeAttentionSplitLen(kv_len);
  const int splits = DecodeAttentionSplits(kv_len);
  const int threads = DecodeAttentionThreads(batch, n_kv);
  const size_t p_stride = std::max(split_len, 2 * splits);  // as in the kernel
  const size_t smem =
      2 * sizeof(T) * size_t(split_len) * D +
      sizeof(float) * (size_t(g) * D + 2 * D + size_t(g) * p_stride + size_t(threads / 32) * g * D);
  auto kernel =
      threads == 256 ? RopeDecodeAttentionKernel<T, D, 256> : RopeDecodeAttentionKernel<T, D, 128>;
  cudaError_t e = AllowSharedMemory(kernel, smem);
  if (e != cudaSuccess) return e;
  return LaunchMaybePdl(kernel,
                        dim3(static_cast<unsigned>(splits), static_cast<unsigned>(n_kv),
                             static_cast<unsigned>(batch)),
                        dim3(threads), smem, stream, static_cast<const T*>(qkv), inv_freq, scaling,
                        positions, static_cast<T*>(ck), static_cast<T*>(cv), static_cast<T*>(out),
                        partials, semaphores, static_cast<int>(n_heads), static_cast<int>(n_kv),
                        max_seq, static_cast<int>(kv_len), split_len, scale, combine);
}

template <typename T>
cudaError_t RopeDecodeAttentionTyped(const void* qkv, const float* inv_freq, float scaling,
                                     const int64_t* positions, void* ck, void* cv, void* out,
                                     float* partials, int* semaphores, int64_t batch,
                                     int64_t n_heads, int64_t n_kv, int64_t head_dim,
                                     int64_t max_seq, int64_t kv_len, float scale, bool combine,
                                     cudaStream_t s) {
#define VLMGRAPH_ATTN_CASE(D)                                                                     \
  case D:                                                                                         \
    return RopeDecodeAttentionFor<T, D>(qkv, inv_freq, scaling, positions, ck, cv, out, partials, \
                                        semaphores, batch, n_heads, n_kv, max_seq, kv_len, scale, \
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

int DecodeAttentionSplitLen(int64_t kv_len) {
  // About 16 splits per (row, KV head), 32 or 64 keys each (more splits for longer windows).
  return kv_len > 16 * 32 ? kAttnMaxSplitLen : 32;
}

int DecodeAttentionSplits(int64_t kv_len) {
  return static_cast<int>((kv_len + DecodeAttentionSplitLen(kv_len) - 1) /
                          DecodeAttentionSplitLen(kv_len));
}

int64_t RopeDecodeAttentionPartialFloats(int64_t batch, int64_t n_heads, int64_t head_dim,
                                         int64_t kv_len) {
  return batch * DecodeAttentionSplits(kv_len) * (n_heads * head_dim + 2 * n_heads);
}

cudaError_t LaunchRopeDecodeAttention(bool bf16, const void* qkv, const float* inv_freq,
                                      float scaling, const int64_t* positions, void* cache_k,
                                      void* cache_v, void* out, float* partials, int* semaphores,
                                      int64_t batch, int64_t n_heads, int64_t n_kv,
                                      int64_t head_dim, int64_t max_seq, int64_t kv_len,
                                      float scale, bool combine, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (n_kv <= 0 || n_heads % n_kv != 0 || n_heads / n_kv > kAttnMaxGroups || kv_len <= 0) {
    return cudaErrorInvalidValue;
  }
  return bf16 ? RopeDecodeAttentionTyped<__nv_bfloat16>(
                    qkv, inv_freq, scaling, positions, cache_k, cache_v, out, partials, semaphores,
                    batch, n_heads, n_kv, head_dim, max_seq, kv_len, scale, combine, stream)
              : RopeDecodeAttentionTyped<float>(qkv, inv_freq, scaling, positions, cache_k, cache_v,
                                                out, partials, semaphores, batch, n_heads, n_kv,
                                                head_dim, max_seq, kv_len, scale, combine, stream);
}

}  // namespace vlmgraph::cuda
