// model/cuda/kernel_util.cuh: what the fused kernels' .cu files share: element conversion, block
// and warp reductions, 16-byte vector loads, the formulas that the separate and the fused kernels
// must round alike, and programmatic dependent launch. Device code and launch helpers only;
// included by model/cuda/*.cu and engine/cuda/*.cu, never by host-only sources.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "model/cuda/fused_kernels.h"

namespace vlmgraph::cuda {

// Whether a pointer allows 16-byte vector loads and stores (host side, for the launchers).
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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

// Every lane's (value, index) pair reduced over the warp in an order: Order::Beats(v, i, best,
// best_i) says whether the candidate (v, i) replaces the best so far. Every lane ends with the
// warp's best. The greedy argmax (torch.argmax's order, fused_kernels.cu) and the sampler's
// Gumbel-max draw (engine/cuda/sampler_kernels.cu) use it.
template <typename Order, typename Index>
__device__ __forceinline__ void WarpReduceBest(float& best, Index& best_i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, best, o);
    const Index i = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (Order::Beats(v, i, best, best_i)) {
      best = v;
      best_i = i;
    }
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
// A 16-byte load meant to be in flight while the kernel waits in WaitForPrerequisites (parameters,
// which no kernel writes). It must be a coherent ld.global: ptxas schedules griddepcontrol.wait
// above non-coherent loads (ld.global.nc, __ldg) even where the source issues them first, so those
// would only start after the wait (seen in the SASS of sm_90 builds, CUDA 13.0), but it keeps
// the wait below coherent ones.
__device__ __forceinline__ uint4 LoadBeforeWait(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p)
               : "memory");
  return r;
}
// Lets the next kernel of the stream launch (its blocks then wait in WaitForPrerequisites).
__device__ __forceinline__ void AllowDependentsToLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// c (16 x 8, float32) += a (16 x 16, bf16, row-major) b (16 x 8, bf16, column-major) with
// mma.sync.m16n8k16 (compute capability >= 8.0; a no-op below). Fragments as the PTX ISA lays
// them out ("Matrix Fragments for mma.m16n8k16"), lane = 4 g + t: a0 = a[g][2t, 2t + 1], a1 =
// a[g + 8][2t, 2t + 1], a2 = a[g][2t + 8, 2t + 9], a3 = a[g + 8][2t + 8, 2t + 9]; b0 =
// b[2t, 2t + 1][g], b1 = b[2t + 8, 2t + 9][g]; c = {c[g][2t], c[g][2t + 1], c[g + 8][2t],
// c[g + 8][2t + 1]}; the lower column (a) or row (b) index in each register's low half.
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

// ---- Formulas shared by the separate kernels and the fused ones, so both round alike ---------

// Element offset of the head_dim-D row of (cache row b, KV head kh, position pos) in a paged cache
// (KvPages; Note [Paged KV layout], model/kv_cache.h). pos < kv.max_seq().
template <int D>
__device__ __forceinline__ int64_t KvRowOffset(const KvPages& kv, int64_t b, int kh, int64_t pos) {
  const int page = kv.table[b * kv.pages_per_row + (pos >> kv.page_shift)];
  const int64_t in_page = pos & ((int64_t(1) << kv.page_shift) - 1);
  return (((int64_t(page) * kv.n_kv + kh) << kv.page_shift) + in_page) * D;
}
// Whether position pos of cache row b has a page of its own: a position on the scratch page (page
// 0: a padding row, a prefill's padded positions past what its sequence took) is not written, so
// no two blocks store to the same scratch addresses and scratch stays zero.
__device__ __forceinline__ bool KvWritable(const KvPages& kv, int64_t b, int64_t pos) {
  return pos < kv.max_seq() && kv.table[b * kv.pages_per_row + (pos >> kv.page_shift)] != 0;
}

// A decode attention row whose new token is at `pos` attends over positions [0, DecodeKeys) of its
// kv_len window, split_len keys per split; DecodeActiveSplits of its splits hold keys
// (RopeDecodeAttentionKernel, and the out projection that combines its partial states).
__device__ __forceinline__ int DecodeKeys(int64_t pos, int kv_len) {
  return static_cast<int>(pos + 1 < kv_len ? pos + 1 : kv_len);
}
__device__ __forceinline__ int DecodeActiveSplits(int64_t pos, int kv_len, int split_len) {
  return (DecodeKeys(pos, kv_len) + split_len - 1) / split_len;
}

// RMSNorm's output before its final rounding: normalise, round to T, then scale by the weight
// (the reference's order: T(x * r) * w). r = rsqrt(mean(x^2) + eps).
template <typename T>
__device__ __forceinline__ float RmsNormScale(float x, float r, float w) {
  return ToFloat(FromFloat<T>(x * r)) * w;
}

// SwiGLU's activation: silu(g) * u.
__device__ __forceinline__ float SiluTimes(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// RoPE, rotate_half form (Su et al. 2021): the pair (x1, x2) = (x[p], x[p + D/2]) of a head at
// position pos, angle pos * inv_freq[p], both factors scaled by `scaling`.
__device__ __forceinline__ void Rotate(float x1, float x2, int64_t pos, float inv_freq,
                                       float scaling, float* y1, float* y2) {
  float s, c;
  sincosf(static_cast<float>(pos) * inv_freq, &s, &c);
  c *= scaling;
  s *= scaling;
  *y1 = x1 * c - x2 * s;
  *y2 = x2 * c + x1 * s;
}

// A positive attribute of the current device, asked once per device and attribute kind (kernel
// launchers call this on every launch); `fallback` when it cannot be read (the CUDA error that
// caused it is cleared).
template <cudaDeviceAttr kAttr>
inline int CachedDeviceAttribute(int fallback) {
  static std::atomic<int> value[64];  // 0 = not asked yet, -1 = unreadable
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return fallback;
  }
  int v = value[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, kAttr, dev) != cudaSuccess || v <= 0) {
      (void)cudaGetLastError();
      v = -1;
    }
    value[dev].store(v, std::memory_order_relaxed);
  }
  return v > 0 ? v : fallback;
}
inline int ComputeCapabilityMajor() {
  return CachedDeviceAttribute<cudaDevAttrComputeCapabilityMajor>(0);
}
inline int MultiprocessorCount() {
  return CachedDeviceAttribute<cudaDevAttrMultiProcessorCount>(1);
}

// Whether launches use programmatic stream serialization: compute capability >= 9.0,
// SetProgrammaticDependentLaunch (fused_kernels.h) left on, and VLMGRAPH_PDL is not "0".
inline bool PdlEnabled() {
  static const bool disabled = [] {
    const char* e = std::getenv("VLMGRAPH_PDL");
    return e != nullptr && std::strcmp(e, "0") == 0;
  }();
  return !disabled && ProgrammaticDependentLaunchRequested() && ComputeCapabilityMajor() >= 9;
}

// Launches `kernel` with programmatic stream serialization when PdlEnabled(), a plain launch
// otherwise; with thread block clusters of `cluster` blocks when that is not 1 x 1 x 1 (compute
// capability >= 9.0; the grid must be a multiple of it).
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchMaybePdlCluster(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                                  dim3 cluster, size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned n = 0;
  if (PdlEnabled()) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster.x * cluster.y * cluster.z != 1) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n].val.clusterDim.x = cluster.x;
    attribute[n].val.clusterDim.y = cluster.y;
    attribute[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
}

template <typename... KernelArgs, typename... Args>
cudaError_t LaunchMaybePdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, Args... args) {
  return LaunchMaybePdlCluster(kernel, grid, block, dim3(1, 1, 1), smem, stream, args...);
}

template <typename Kernel>
cudaError_t AllowSharedMemory(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem));
}

}  // namespace vlmgraph::cuda
