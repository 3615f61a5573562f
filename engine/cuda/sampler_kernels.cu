// engine/cuda/sampler_kernels.cu: the sampler's kernels (formulas: NucleusPrefix and
// GumbelMaxDraw in engine/sampler.h; the per-candidate ones in engine/sampler_formulas.h, shared
// with the CPU loops in engine/sampler.cc, so the draw picks the same token from the same inputs
// on both).
//
// NucleusPrefix: one block per row; the top-k prefix by binary search, the top-k mass by a block
// reduction, then a block scan chunk by chunk until the preceding mass passes top_p's share
// (usually within the first chunk of a sorted row).
//
// GumbelMaxDraw. Pass 1, grid (ceil(cols / kDrawChunk), rows): each block scores its chunk of one
// row's kept candidates (a thread per candidate in turn, a Philox block and two float64 logs
// each; the blocks past a sorted row's kept prefix do nothing) and writes its winner. Pass 2, one
// warp per row, picks the row's winner among its chunks. Both keep the CPU loop's order (the
// higher score, then the lower token id), so the result does not depend on how the candidates are
// split over threads.
#include <cuda_bf16.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <limits>

#include "engine/cuda/sampler_kernels.h"
#include "engine/sampler_formulas.h"
#include "model/cuda/kernel_util.cuh"

namespace vlmgraph::cuda {
namespace {

constexpr int kDrawThreads = 256;
constexpr int kNucleusThreads = 1024;
constexpr int64_t kNoId = std::numeric_limits<int64_t>::max();

struct MinOp {  // (cub::Min is gone from CUDA 13's CUB)
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

template <typename T>
__global__ void __launch_bounds__(kNucleusThreads) NucleusKernel(SamplerArgs a, int64_t* kept) {
  using Reduce = cub::BlockReduce<double, kNucleusThreads>;
  using MinReduce = cub::BlockReduce<int64_t, kNucleusThreads>;
  using Scan = cub::BlockScan<double, kNucleusThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename MinReduce::TempStorage min_reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int64_t n_k_shared, cut_shared;
  __shared__ double total_shared;
  const int64_t r = blockIdx.x;
  const T* xr = static_cast<const T*>(a.x) + r * a.cols;
  const float top_p = a.top_p[r];
  if (threadIdx.x == 0) n_k_shared = TopKPrefix(xr, a.cols, a.top_k[r]);
  __syncthreads();
  const int64_t n_k = n_k_shared;
  if (!(top_p < 1.f)) {
    if (threadIdx.x == 0) kept[r] = n_k;
    return;
  }
  const float x0 = static_cast<float>(xr[0]);
  double part = 0.0;
  for (int64_t j = threadIdx.x; j < n_k; j += kNucleusThreads)
    part += expf(static_cast<float>(xr[j]) - x0);
  const double total = Reduce(tmp.reduce).Sum(part);
  if (threadIdx.x == 0) total_shared = total;
  __syncthreads();
  const double limit = static_cast<double>(top_p) * total_shared;
  double before = 0.0;  // the mass of the chunks already scanned
  int64_t cut = n_k;
  for (int64_t c0 = 0; c0 < n_k; c0 += kNucleusThreads) {
    const int64_t j = c0 + threadIdx.x;
    const double e = j < n_k ? static_cast<double>(expf(static_cast<float>(xr[j]) - x0)) : 0.0;
    double inclusive, chunk;
    Scan(tmp.scan).InclusiveSum(e, inclusive, chunk);
    // Entry j + 1 is cut when the mass of entries 0..j exceeds the limit.
    const int64_t mine = j + 1 < n_k && before + inclusive > limit ? j + 1 : n_k;
    __syncthreads();  // tmp is reused
    const int64_t first = MinReduce(tmp.min_reduce).Reduce(mine, MinOp());
    if (threadIdx.x == 0) cut_shared = first;
    __syncthreads();
    cut = cut_shared;
    if (cut < n_k) break;  // uniform over the block
    before += chunk;
  }
  if (threadIdx.x == 0) kept[r] = cut;
}

// The draw's order (SamplingBeats) for WarpReduceBest.
struct SamplingOrder {
  static __device__ __forceinline__ bool Beats(float s, int64_t i, float best, int64_t best_i) {
    return SamplingBeats(s, i, best, best_i);
  }
};

template <typename T>
__global__ void __launch_bounds__(kDrawThreads)
    DrawChunkKernel(SamplerArgs a, const int64_t* ids, const int64_t* kept, float* partial_scores,
                    int64_t* partial_ids) {
  const int64_t r = blockIdx.y, chunk = blockIdx.x;
  const T* xr = static_cast<const T*>(a.x) + r * a.cols;
  const float temperature = a.temperature[r];
  const auto seed = static_cast<uint64_t>(a.seed[r]);
  const auto draw = static_cast<uint64_t>(a.draw[r]);
  const int64_t n_kept = kept ? min(max(kept[r], int64_t{1}), a.cols) : a.cols;
  float best = -INFINITY;
  int64_t best_id = kNoId;
  const int64_t end = min(n_kept, (chunk + 1) * kDrawChunk);
  for (int64_t j = chunk * kDrawChunk + threadIdx.x; j < end; j += kDrawThreads) {
    const int64_t t = ids ? ids[r * a.cols + j] : j;
    const float s = SamplingScore(static_cast<float>(xr[j]), temperature, seed, draw, t);
    if (SamplingBeats(s, t, best, best_id)) {
      best = s;
      best_id = t;
    }
  }
  WarpReduceBest<SamplingOrder>(best, best_id);
  __shared__ float warp_score[kDrawThreads / 32];
  __shared__ int64_t warp_id[kDrawThreads / 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    warp_score[warp] = best;
    warp_id[warp] = best_id;
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kDrawThreads / 32 ? warp_score[lane] : -INFINITY;
    best_id = lane < kDrawThreads / 32 ? warp_id[lane] : kNoId;
    WarpReduceBest<SamplingOrder>(best, best_id);
    if (lane == 0) {
      partial_scores[r * gridDim.x + chunk] = best;
      partial_ids[r * gridDim.x + chunk] = best_id;
    }
  }
}

__global__ void DrawReduceKernel(const int64_t* ids, int64_t cols, const float* partial_scores,
                                 const int64_t* partial_ids, int chunks, int64_t* out) {
  const int64_t r = blockIdx.x;
  float best = -INFINITY;
  int64_t best_id = kNoId;
  for (int c = threadIdx.x; c < chunks; c += 32) {
    const float s = partial_scores[r * chunks + c];
    const int64_t t = partial_ids[r * chunks + c];
    if (SamplingBeats(s, t, best, best_id)) {
      best = s;
      best_id = t;
    }
  }
  WarpReduceBest<SamplingOrder>(best, best_id);
  // Only NaN scores lose to the initial value: fall back to the first candidate.
  if (threadIdx.x == 0) out[r] = best_id != kNoId ? best_id : (ids ? ids[r * cols] : 0);
}

}  // namespace

cudaError_t LaunchNucleusPrefix(const SamplerArgs& args, int64_t* kept, cudaStream_t stream) {
  if (args.rows <= 0) return cudaSuccess;
  if (args.rows > std::numeric_limits<int>::max()) return cudaErrorInvalidValue;
  const auto grid = static_cast<unsigned>(args.rows);
  if (args.bf16) {
    NucleusKernel<__nv_bfloat16><<<grid, kNucleusThreads, 0, stream>>>(args, kept);
  } else {
    NucleusKernel<float><<<grid, kNucleusThreads, 0, stream>>>(args, kept);
  }
  return cudaGetLastError();
}

cudaError_t LaunchGumbelMaxDraw(const SamplerArgs& args, const int64_t* ids, const int64_t* kept,
                                float* partial_scores, int64_t* partial_ids, int64_t* out,
                                cudaStream_t stream) {
  if (args.rows <= 0) return cudaSuccess;
  const int64_t chunks = (args.cols + kDrawChunk - 1) / kDrawChunk;
  if (chunks > std::numeric_limits<int>::max() || args.rows > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(args.rows));
  if (args.bf16) {
    DrawChunkKernel<__nv_bfloat16>
        <<<grid, kDrawThreads, 0, stream>>>(args, ids, kept, partial_scores, partial_ids);
  } else {
    DrawChunkKernel<float>
        <<<grid, kDrawThreads, 0, stream>>>(args, ids, kept, partial_scores, partial_ids);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  DrawReduceKernel<<<static_cast<unsigned>(args.rows), 32, 0, stream>>>(
      ids, args.cols, partial_scores, partial_ids, static_cast<int>(chunks), out);
  return cudaGetLastError();
}

}  // namespace vlmgraph::cuda
