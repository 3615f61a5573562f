// model/cuda/decode_attention_common.cuh: what the decode attention kernels share
// (decode_attention.cu: the split-key and warps kernels; decode_attention_mma.cu: the tensor-core
// kernel): the RoPE prologue, the new key's store, the merge of a block's warps and the combine of
// a row's split blocks, and the tensor-core launcher. Included by those .cu files only.
#pragma once

#include "model/cuda/kernel_util.cuh"

namespace vlmgraph::cuda {

// Splits whose partial outputs the one-round combine (256 threads) loads at once.
constexpr int kCombineChunk = 8;

// Block s's share of decode row b, whose new token is at pos = positions[b] (written before the
// previous kernel started): the row attends over positions [0, DecodeKeys(pos, kv_len)), split_len
// keys per split, and split s holds keys [j0, j0 + n) of them. Splits s >= active hold none and
// exit at once; the split that stores the new key is always active.
struct DecodeSplit {
  int64_t pos;
  int active, j0, n;
};
__device__ __forceinline__ DecodeSplit SplitOfRow(const int64_t* positions, int b, int s,
                                                  int kv_len, int split_len) {
  DecodeSplit d;
  d.pos = positions[b];
  d.active = DecodeActiveSplits(d.pos, kv_len, split_len);
  d.j0 = s * split_len;
  d.n = min(split_len, DecodeKeys(d.pos, kv_len) - d.j0);
  return d;
}

// The decode attention's prologue, by the kThreads threads of a block of (row b, KV head kh),
// after WaitForPrerequisites: RoPE at position pos on the g = n_heads / n_kv query heads of kh
// into q_s (g, D) and on the new key into kv_new[0, D), the new value into kv_new[D, 2D), float32
// rounded to T as the cache stores them. The caller synchronises the block before reading them.
template <typename T, int D, int kThreads>
__device__ __forceinline__ void RotateQueryAndKey(const T* qkv, const float* inv_freq,
                                                  float scaling, int64_t pos, int b, int kh,
                                                  int n_heads, int n_kv, float* q_s,
                                                  float* kv_new) {
  constexpr int kHalf = D / 2;
  const int g = n_heads / n_kv;
  const T* src = qkv + int64_t(b) * (n_heads + 2 * n_kv) * D;
  for (int i = threadIdx.x; i < (g + 1) * kHalf; i += kThreads) {
    const int h = i / kHalf, p = i - h * kHalf;
    const T* x = h < g ? src + (kh * g + h) * D : src + (n_heads + kh) * D;
    float r1, r2;
    Rotate(ToFloat(x[p]), ToFloat(x[p + kHalf]), pos, inv_freq[p], scaling, &r1, &r2);
    float* dst = h < g ? q_s + h * D : kv_new;
    dst[p] = ToFloat(FromFloat<T>(r1));  // rounded as the cache stores it
    dst[p + kHalf] = ToFloat(FromFloat<T>(r2));
  }
  for (int d = threadIdx.x; d < D; d += kThreads) {
    kv_new[D + d] = ToFloat(src[(n_heads + n_kv + kh) * D + d]);
  }
}

// The block of split s whose keys hold pos (the last split when pos is past the window) stores the
// new key and value of (cache row b, KV head kh) at pos through the page table; when pos < kv_len
// that split holds pos, else it is the last split, active too. kv_new as RotateQueryAndKey leaves
// it. A position past the row's pages or on the scratch page is not stored (KvWritable).
template <typename T, int D, int kThreads>
__device__ __forceinline__ void StoreNewKeyValue(const float* kv_new, T* cache_k, T* cache_v,
                                                 const KvPages& kv, int b, int kh, int64_t pos,
                                                 int s, int kv_len, int split_len) {
  const int64_t writer = (pos < kv_len ? pos : kv_len - 1) / split_len;
  if (s == writer && KvWritable(kv, b, pos)) {
    const int64_t at = KvRowOffset<D>(kv, b, kh, pos);
    for (int d = threadIdx.x; d < D; d += kThreads) {
      cache_k[at + d] = FromFloat<T>(kv_new[d]);
      cache_v[at + d] = FromFloat<T>(kv_new[D + d]);
    }
  }
}

// The end of a split block of the decode attention, after it wrote its partial state (m, l, o per
// head) to `partials`: counts the split in on semaphores[b * n_kv + kh] and, in the last of the
// `active` blocks of (b, kh), combines the splits' partial states into out[b, kh * g .. (kh + 1) *
// g) and resets the semaphore. scratch: >= 2 * splits * g floats of shared memory; w_s: >= g.
template <typename T, int D, int kThreads>
__device__ void CountInAndCombine(const float* partials, int* semaphores, T* out, int b, int kh,
                                  int n_kv, int n_heads, int splits, int active, float* scratch,
                                  float* w_s) {
  const int g = n_heads / n_kv;
  __shared__ bool is_last;
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
  float* wgt = scratch;                // (active, g): m, then e^(m_s - M)
  float* lsum = scratch + active * g;  // (active, g): l
  T* ob = out + (int64_t(b) * n_heads + int64_t(kh) * g) * D;
  // With 256 threads (few (row, KV head) pairs, see DecodeAttentionThreads) the last block's
  // combine is on the step's critical path, so it issues its global loads in one round: each
  // thread's first output element's o for up to kCombineChunk splits together with the (m, l)
  // pairs. Otherwise it loads m, then l, then o (about five dependent L2 round trips), which
  // measures faster with 128 threads. Bench: `vlmgraph-decode-ops-bench --batch 1`, `--batch 8`
  // and `--context 1024 --length 700` (whole decoder); figures in docs/design/decode-kernels.md,
  // "Where the attention kernel's 6 us go".
  constexpr bool kOneRound = kThreads == 256;
  const int i0 = threadIdx.x;
  float o_first[kOneRound ? kCombineChunk : 1];
  if constexpr (kOneRound) {
#pragma unroll
    for (int u = 0; u < kCombineChunk; ++u) {
      o_first[u] = i0 < g * D && u < active ? __ldcg(base + u * split_stride + 2 * g + i0) : 0.f;
    }
  }
  for (int i = threadIdx.x; i < active * g; i += kThreads) {
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
  for (int i = threadIdx.x; i < g * D; i += kThreads) {
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

// The end of a block of kThreads threads in kThreads / 32 warps that attended over its split of a
// row's keys for the kG query heads of KV head kh, after a __syncthreads: each warp w left its
// partial state in merge[(w * kG + h) * (D + 2) + ...]: m (the natural-log maximum of its scores;
// -inf for a warp without keys), l (sum of e^(score - m)), o (D unnormalised outputs). Merges the
// warps with the online softmax's rescaling; then, when the block is the row's only active split
// and `combine`, writes out[b, kh * kG .., :] directly, otherwise its partial state to
// `partials` and, with `combine`, counts in and combines the row's splits (CountInAndCombine).
// scratch: >= 2 * gridDim.x * kG floats of shared memory; w_s: >= kG.
template <typename T, int D, int kG, int kThreads>
__device__ __forceinline__ void FinishWarpsAttention(const float* merge, float* scratch, float* w_s,
                                                     float* partials, int* semaphores, T* out,
                                                     int s, int kh, int b, int n_heads, int n_kv,
                                                     int active, bool combine) {
  constexpr int kWarps = kThreads / 32;
  // Merge the warps: each thread takes output elements i = (h, d) of the block.
  const int splits = gridDim.x;
  float* part = partials + ((int64_t(b) * n_kv + kh) * splits + s) * kG * (D + 2);
  const bool direct = combine && active == 1;  // the row's keys are all in this split
  T* ob = out + (int64_t(b) * n_heads + int64_t(kh) * kG) * D;
  for (int i = threadIdx.x; i < kG * D; i += kThreads) {
    const int h = i / D, d = i - h * D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, merge[(w * kG + h) * (D + 2)]);
    float sum_l = 0.f, sum_o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float* ws = merge + (w * kG + h) * (D + 2);
      const float f = ws[0] == -INFINITY ? 0.f : __expf(ws[0] - mx);
      sum_l += ws[1] * f;
      sum_o += ws[2 + d] * f;
    }
    if (direct) {
      ob[i] = FromFloat<T>(sum_o * (1.f / sum_l));  // as CountInAndCombine's one split
    } else {
      part[2 * kG + i] = sum_o;
      if (d == 0) {
        part[h] = mx;
        part[kG + h] = sum_l;
      }
    }
  }
  if (direct || !combine) return;
  CountInAndCombine<T, D, kThreads>(partials, semaphores, out, b, kh, n_kv, n_heads, splits, active,
                                    scratch, w_s);
}

// The tensor-core decode attention (decode_attention_mma.cu) for what the warps kernel would run
// (UsesWarpsKernel: from 4 rows, at most 4 query heads per KV head), bf16 with head_dim 64 or 128:
// the same arguments, grid, split length, partial states and results (within bf16 rounding of the
// probabilities) as RopeDecodeAttentionWarpsKernel. DecodeAttentionMmaSupports says which
// launches it takes: bf16, D in {64, 128}, g in [1, 4], and VLMGRAPH_DECODE_ATTENTION not "warps"
// (read once per process; selects the CUDA-core warps kernel instead, for comparisons).
bool DecodeAttentionMmaSupports(bool bf16, int64_t head_dim, int64_t groups);
cudaError_t LaunchRopeDecodeAttentionMma(const void* qkv, const float* inv_freq, float scaling,
                                         const int64_t* positions, void* cache_k, void* cache_v,
                                         void* out, float* partials, int* semaphores, int64_t batch,
                                         int64_t n_heads, int64_t n_kv, int64_t head_dim,
                                         KvPages kv, int64_t kv_len, int split_len, int splits,
                                         float scale, bool combine, cudaStream_t stream);

}  // namespace vlmgraph::cuda
