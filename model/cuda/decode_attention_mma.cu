// model/cuda/decode_attention_mma.cu: decode attention on the tensor cores for many rows (bf16,
// head_dim 64 or 128, at most 4 query heads per KV head): RopeDecodeAttentionMmaKernel, launched
// by LaunchRopeDecodeAttention (decode_attention.cu) where the CUDA-core warps kernel would run.
//
// Why: at 256 rows of ~150 keys the warps kernel reads its keys and values at ~1.5 TB/s, bound by
// each lane group's chain of shuffles and exponentials per key, not by the loads
// (docs/design/decode-kernels.md, "Attention at large batch"). Here a warp takes 16 keys at a time
// and spends two tensor-core instructions per 16 dims of the scores and per 8 dims of the output
// on all of them, with one online-softmax rescale per 16 keys: the flash-attention-2 warp tile
// (Dao 2023, "FlashAttention-2", section 3.1) with the query heads of one KV head as the rows of
// the MMA (kG of its 16 rows used: the tensor cores have room to spare, the bytes do not).
#include <cuda_bf16.h>

#include <cstdlib>
#include <cstring>

#include "model/cuda/decode_attention_common.cuh"
#include "model/cuda/kernel_util.cuh"

namespace vlmgraph::cuda {
namespace {

// Same grid and warp merge as RopeDecodeAttentionWarpsKernel (FinishWarpsAttention); kWarps warps
// per block.
constexpr int kTileKeys = 16;  // keys per warp tile: the k of the P V product
constexpr int kStages = 3;     // tiles in flight per warp (cp.async ring)

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-filled without reading `src` when !valid.
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CommitCopies() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WaitCopies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Four 8 x 8 bf16 matrices from shared memory; lane i gives the address of row i % 8 of matrix
// i / 8. Without .trans lane 4 g + t receives elements [g][2t, 2t + 1] of each matrix, with .trans
// elements [2t, 2t + 1][g] (PTX ISA, "ldmatrix").
__device__ __forceinline__ void LoadMatrices(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LoadMatricesTransposed(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Element offset of 16-byte chunk c of key row r in a (kTileKeys, D) tile: the chunk index is
// XORed with r % 8, so the 8 rows an ldmatrix reads at one logical chunk fall in 8 different
// bank groups (rows are 128 or 256 bytes, a multiple of the 32 banks' 128).
template <int D>
__device__ __forceinline__ int TileOffset(int r, int c) {
  return r * D + ((c ^ (r & 7)) << 3);
}

// ---- The kernel --------------------------------------------------------------------------------
// Grid (splits, n_kv, batch), kWarps warps (MmaAttentionWarps); block (s, kh, b) attends over keys
// [j0, j0 + n) of cache row b (j0 = s * split_len, as RopeDecodeAttentionWarpsKernel). Its keys
// form tiles of kTileKeys; warp w takes tiles w, w + kWarps, ..., each copied (keys and values)
// into the warp's ring of kStages tiles in shared memory with cp.async, the first kStages - 1
// before the dependency wait (rows before this step's position were written by earlier steps). Keys
// past n are zero-filled, so their values add 0 x 0. The tile holding this step's position takes
// the new key and value from the prologue (they reach the cache in this kernel). Per tile, lane 4 g
// + t: S = Q K^T with Q's rows the kG query heads (rows >= kG zero) as the A operand and K^T
// (ldmatrix) as B, two n-tiles of 8 keys; the online softmax in base 2 on row g (the scale folded
// into log2 e), shared by the 4 lanes of the quad through two shuffles; then O += P V with P's bf16
// A fragment taken from the score registers as they are (the C layout of S is the A layout of P)
// and V through ldmatrix.trans. The warp's m (back in natural log), l and O go to shared memory for
// FinishWarpsAttention, which merges the warps and writes the row or its partial state exactly as
// the warps kernel does.
template <int D, int kG, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    RopeDecodeAttentionMmaKernel(const __nv_bfloat16* __restrict__ qkv,
                                 const float* __restrict__ inv_freq, float scaling,
                                 const int64_t* __restrict__ positions, __nv_bfloat16* cache_k,
                                 __nv_bfloat16* cache_v, __nv_bfloat16* __restrict__ out,
                                 float* partials, int* semaphores, int n_heads, int n_kv,
                                 KvPages kv, int kv_len, int split_len, float scale, bool combine) {
  using T = __nv_bfloat16;
  constexpr int kChunks = D / 8;  // 16-byte chunks per key row
  constexpr int kTileElems = kTileKeys * D;
  static_assert(kG >= 1 && kG <= 8, "the query heads of a KV head are rows 0..7 of the MMA");
  extern __shared__ __align__(128) unsigned char attn_smem_raw[];
  const int s = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const DecodeSplit split = SplitOfRow(positions, b, s, kv_len, split_len);
  if (s >= split.active) return;
  const int64_t pos = split.pos;
  const int active = split.active, j0 = split.j0, n = split.n;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  // Shared memory: the key/value rings first (128-byte aligned for the swizzle), then floats.
  T* rings = reinterpret_cast<T*>(attn_smem_raw);  // (warps, stages, 2, kTileKeys, D)
  T* ring = rings + warp * kStages * 2 * kTileElems;
  float* q_s = reinterpret_cast<float*>(rings + kWarps * kStages * 2 * kTileElems);
  float* kv_new = q_s + kG * D;                    // (2, D)
  float* merge = kv_new + 2 * D;                   // (warps, kG, D + 2): m, l, o
  float* scratch = merge + kWarps * kG * (D + 2);  // (2 * splits, kG): the combine's
  __shared__ float w_s[kG];
  const int tiles = (n + kTileKeys - 1) / kTileKeys;
  const int my_tiles = warp < tiles ? (tiles - warp + kWarps - 1) / kWarps : 0;
  // Copies tile number i of this warp (keys (warp + kWarps i) * 16 ..) into ring stage i % kStages.
  auto copy_tile = [&](int i) {
    if (i < my_tiles) {
      const int key0 = (warp + i * kWarps) * kTileKeys;
      T* ks = ring + (i % kStages) * 2 * kTileElems;
      T* vs = ks + kTileElems;
      // A tile's 16 keys are consecutive positions of one page (j0 + key0 is a multiple of 16,
      // page_size a multiple of 16).
      const int64_t tile_at = KvRowOffset<D>(kv, b, kh, j0 + key0);
#pragma unroll
      for (int u = 0; u < kTileKeys * kChunks / 32; ++u) {
        const int idx = u * 32 + lane, r = idx / kChunks, c = idx % kChunks;
        const bool valid = key0 + r < n;
        const int64_t at = tile_at + (valid ? r : 0) * D + c * 8;
        CopyAsync16(SharedAddress(ks + TileOffset<D>(r, c)), cache_k + at, valid);
        CopyAsync16(SharedAddress(vs + TileOffset<D>(r, c)), cache_v + at, valid);
      }
    }
    CommitCopies();  // one group per tile number, empty or not, so the wait counts alike
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) copy_tile(i);
  WaitForPrerequisites();
  AllowDependentsToLaunch();
  RotateQueryAndKey<T, D, kWarps * 32>(qkv, inv_freq, scaling, pos, b, kh, n_heads, n_kv, q_s,
                                       kv_new);
  __syncthreads();
  StoreNewKeyValue<T, D, kWarps * 32>(kv_new, cache_k, cache_v, kv, b, kh, pos, s, kv_len,
                                      split_len);
  // Q as the A operand, per 16 dims: a0 = q[g][16 ks + 2t ..], a2 = q[g][16 ks + 8 + 2t ..]; rows
  // g + 8 (a1, a3) and g >= kG are zero. q_s holds values already rounded to bf16.
  uint32_t qa[D / 16][2];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const float* qr = q_s + g * D + 16 * ks + 2 * t;
    qa[ks][0] = g < kG ? PackBf16(qr[0], qr[1]) : 0u;
    qa[ks][1] = g < kG ? PackBf16(qr[8], qr[9]) : 0u;
  }
  const float scale_log2 = scale * 1.4426950408889634f;  // scores in base 2
  float m = -INFINITY, l = 0.f;                          // row g, this lane's keys for l
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  for (int i = 0; i < my_tiles; ++i) {
    copy_tile(i + kStages - 1);
    WaitCopies<kStages - 1>();  // this lane's copies of tile i have landed
    __syncwarp();               // and every lane's
    const int key0 = (warp + i * kWarps) * kTileKeys;
    T* ks = ring + (i % kStages) * 2 * kTileElems;
    T* vs = ks + kTileElems;
    const int64_t new_key = pos - j0 - key0;  // this step's key, when it is in this tile
    if (new_key >= 0 && new_key < kTileKeys && key0 + new_key < n) {
      const int r = static_cast<int>(new_key);
      for (int e = lane; e < 2 * kChunks; e += 32) {  // chunk e % kChunks of K (e < kChunks) or V
        const int c = e % kChunks;
        T* dst = (e < kChunks ? ks : vs) + TileOffset<D>(r, c);
        const float* src = kv_new + (e < kChunks ? 0 : D) + c * 8;
#pragma unroll
        for (int x = 0; x < 8; ++x) dst[x] = __float2bfloat16(src[x]);
      }
      __syncwarp();
    }
    // Scores of keys 8 nt + 2t, + 1 of row g: sc[nt][0..1] (sc[nt][2..3] are rows g + 8).
    float sc[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
      for (int p = 0; p < D / 32; ++p) {  // matrices: keys 8 nt .. + 8, dims 32 p + 8 (lane / 8)
        uint32_t kb[4];
        LoadMatrices(SharedAddress(ks + TileOffset<D>(8 * nt + (lane & 7), 4 * p + (lane >> 3))),
                     kb);
        MmaBf16(sc[nt], qa[2 * p][0], 0u, qa[2 * p][1], 0u, kb[0], kb[1]);
        MmaBf16(sc[nt], qa[2 * p + 1][0], 0u, qa[2 * p + 1][1], 0u, kb[2], kb[3]);
      }
    }
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = key0 + 8 * nt + 2 * t + e < n;
        sc[nt][e] = valid ? sc[nt][e] * scale_log2 : -INFINITY;
        tile_max = fmaxf(tile_max, sc[nt][e]);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);  // finite: every tile has a key
    const float rescale = exp2f(m - m_new);
    float p[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) p[nt][e] = exp2f(sc[nt][e] - m_new);
    }
    l = l * rescale + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
    m = m_new;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= rescale;
      o[j][1] *= rescale;
    }
    // P (rows g, keys 2t, 2t + 1 and 8 + 2t, 9 + 2t) as the A operand; rows g + 8 zero.
    const uint32_t pa0 = PackBf16(p[0][0], p[0][1]), pa2 = PackBf16(p[1][0], p[1][1]);
#pragma unroll
    for (int q = 0; q < D / 16; ++q) {  // dims 16 q .. + 16: matrices (keys 0-7 | 8-15) x 2
      uint32_t vb[4];
      LoadMatricesTransposed(SharedAddress(vs + TileOffset<D>(8 * ((lane >> 3) & 1) + (lane & 7),
                                                              2 * q + (lane >> 4))),
                             vb);
      MmaBf16(o[2 * q], pa0, 0u, pa2, 0u, vb[0], vb[1]);
      MmaBf16(o[2 * q + 1], pa0, 0u, pa2, 0u, vb[2], vb[3]);
    }
    __syncwarp();  // every lane has read stage i % kStages before the next copy refills it
  }
  WaitCopies<0>();  // no copy may land after the block's shared memory is reused or freed
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (g < kG) {
    float* w = merge + (warp * kG + g) * (D + 2);
    if (t == 0) {
      w[0] = m == -INFINITY ? m : m * 0.6931471805599453f;  // natural log, as the other kernels
      w[1] = l;
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      w[2 + 8 * j + 2 * t] = o[j][0];
      w[2 + 8 * j + 2 * t + 1] = o[j][1];
    }
  }
  __syncthreads();
  FinishWarpsAttention<T, D, kG, kWarps * 32>(merge, scratch, w_s, partials, semaphores, out, s, kh,
                                              b, n_heads, n_kv, active, combine);
}

template <int D, int kWarps>
cudaError_t LaunchFor(const void* qkv, const float* inv_freq, float scaling,
                      const int64_t* positions, void* ck, void* cv, void* out, float* partials,
                      int* semaphores, int64_t batch, int64_t n_heads, int64_t n_kv, KvPages kv,
                      int64_t kv_len, int split_len, int splits, float scale, bool combine,
                      cudaStream_t stream) {
  using T = __nv_bfloat16;
  const int g = static_cast<int>(n_heads / n_kv);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(n_kv),
                  static_cast<unsigned>(batch));
  const size_t smem = sizeof(T) * kWarps * kStages * 2 * kTileKeys * D +
                      sizeof(float) * (size_t(g) * D + 2 * D + size_t(kWarps) * g * (D + 2) +
                                       2 * size_t(splits) * g);
  auto kernel = g == 1   ? RopeDecodeAttentionMmaKernel<D, 1, kWarps>
                : g == 2 ? RopeDecodeAttentionMmaKernel<D, 2, kWarps>
                : g == 3 ? RopeDecodeAttentionMmaKernel<D, 3, kWarps>
                         : RopeDecodeAttentionMmaKernel<D, 4, kWarps>;
  cudaError_t e = AllowSharedMemory(kernel, smem);
  if (e != cudaSuccess) return e;
  return LaunchMaybePdl(kernel, grid, dim3(kWarps * 32), smem, stream, static_cast<const T*>(qkv),
                        inv_freq, scaling, positions, static_cast<T*>(ck), static_cast<T*>(cv),
                        static_cast<T*>(out), partials, semaphores, static_cast<int>(n_heads),
                        static_cast<int>(n_kv), kv, static_cast<int>(kv_len), split_len, scale,
                        combine);
}

// Warps per block: 2 when the launch has at least 4 blocks per SM, so that every block is resident
// at once (8 blocks of 2 warps fit an SM; 4 of 4 do not hold 256 rows x 3 KV heads on 132 SMs), 4
// below that, where more warps per row shorten each block's chain. H200, SmolLM2-135M shape,
// decode step (`vlmgraph-bench --decode-only 1 --batch-buckets derived --max-decode-batch 256`),
// 1 / 2 / 4 / 8 warps: 128 rows 1.061 / 1.018 / 1.005 / 1.087 ms, 256 rows 1.242 / 1.203 /
// 1.263 / 1.349 ms (docs/design/decode-kernels.md, "Attention on the tensor cores").
int MmaAttentionWarps(int64_t blocks) { return blocks >= 4 * MultiprocessorCount() ? 2 : 4; }

template <int D>
cudaError_t LaunchForD(const void* qkv, const float* inv_freq, float scaling,
                       const int64_t* positions, void* ck, void* cv, void* out, float* partials,
                       int* semaphores, int64_t batch, int64_t n_heads, int64_t n_kv, KvPages kv,
                       int64_t kv_len, int split_len, int splits, float scale, bool combine,
                       cudaStream_t stream) {
  auto f = MmaAttentionWarps(batch * n_kv * splits) == 2 ? LaunchFor<D, 2> : LaunchFor<D, 4>;
  return f(qkv, inv_freq, scaling, positions, ck, cv, out, partials, semaphores, batch, n_heads,
           n_kv, kv, kv_len, split_len, splits, scale, combine, stream);
}

}  // namespace

bool DecodeAttentionMmaSupports(bool bf16, int64_t head_dim, int64_t groups) {
  static const bool warps_requested = [] {
    const char* e = std::getenv("VLMGRAPH_DECODE_ATTENTION");
    return e != nullptr && std::strcmp(e, "warps") == 0;
  }();
  return bf16 && (head_dim == 64 || head_dim == 128) && groups >= 1 && groups <= 4 &&
         !warps_requested && ComputeCapabilityMajor() >= 8;
}

cudaError_t LaunchRopeDecodeAttentionMma(const void* qkv, const float* inv_freq, float scaling,
                                         const int64_t* positions, void* cache_k, void* cache_v,
                                         void* out, float* partials, int* semaphores, int64_t batch,
                                         int64_t n_heads, int64_t n_kv, int64_t head_dim,
                                         KvPages kv, int64_t kv_len, int split_len, int splits,
                                         float scale, bool combine, cudaStream_t stream) {
  if (!DecodeAttentionMmaSupports(true, head_dim, n_heads / n_kv)) return cudaErrorInvalidValue;
  return head_dim == 64 ? LaunchForD<64>(qkv, inv_freq, scaling, positions, cache_k, cache_v, out,
                                         partials, semaphores, batch, n_heads, n_kv, kv, kv_len,
                                         split_len, splits, scale, combine, stream)
                        : LaunchForD<128>(qkv, inv_freq, scaling, positions, cache_k, cache_v, out,
                                          partials, semaphores, batch, n_heads, n_kv, kv, kv_len,
                                          split_len, splits, scale, combine, stream);
}

}  // namespace vlmgraph::cuda
