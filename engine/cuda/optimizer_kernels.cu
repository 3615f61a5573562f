// engine/cuda/optimizer_kernels.cu: multi-tensor gradient accumulation and AdamW (launchers in
// optimizer_kernels.h, API and formulas in engine/fused_optimizer.h).
//
// Layout: the tensors of one launch are cut into tiles of kTile elements, numbered tensor after
// tensor; thread block x takes tile x and finds its tensor by binary search over the tiles'
// running end (tile_end). The table travels by value as a __grid_constant__ kernel argument (at
// most 32 KB, CUDA >= 12.1 on sm_70+), so a captured graph keeps it. Tensors whose pointers are
// 16-byte aligned (bf16: 8) and whose size is a multiple of 4 go 4 elements per access, all of a
// thread's loads issued before its arithmetic; the rest one element at a time.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "engine/cuda/optimizer_kernels.h"
#include "model/cuda/kernel_util.cuh"

namespace vlmgraph::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;                         // float4 accesses in flight per thread
constexpr int64_t kTile = kThreads * 4 * kUnroll;  // elements per thread block

struct AccumulateBatch {
  int count;
  int64_t tile_end[kMaxTensorsPerLaunch];
  float* acc[kMaxTensorsPerLaunch];
  const void* grad[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  bool vec[kMaxTensorsPerLaunch];
};

struct AdamWBatch {
  int count;
  double beta1, beta2, eps, weight_decay, max_grad_norm;
  bool skip_non_finite;
  int64_t tile_end[kMaxTensorsPerLaunch];
  AdamWTensor t[kMaxTensorsPerLaunch];
  bool vec[kMaxTensorsPerLaunch];
};
static_assert(sizeof(AccumulateBatch) < 32000 && sizeof(AdamWBatch) < 32000,
              "kernel arguments are limited to 32 KB");

// The tensor whose tiles hold tile `x`: the first with tile_end > x.
__device__ __forceinline__ int FindTensor(const int64_t* tile_end, int count, int64_t x) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (tile_end[mid] > x) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

__device__ __forceinline__ void Load4(const float* p, float* v) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
}
__device__ __forceinline__ void Load4(const __nv_bfloat16* p, float* v) {
  const uint2 x = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}
__device__ __forceinline__ void Store4(float* p, const float* v) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void Store4(__nv_bfloat16* p, const float* v) {
  uint2 x;
  *reinterpret_cast<__nv_bfloat162*>(&x.x) = __floats2bfloat162_rn(v[0], v[1]);
  *reinterpret_cast<__nv_bfloat162*>(&x.y) = __floats2bfloat162_rn(v[2], v[3]);
  *reinterpret_cast<uint2*>(p) = x;
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    AccumulateKernel(const __grid_constant__ AccumulateBatch b, double* grad_sq_sum) {
  const int t = FindTensor(b.tile_end, b.count, blockIdx.x);
  const int64_t begin = (blockIdx.x - (t == 0 ? 0 : b.tile_end[t - 1])) * kTile;
  const int64_t end = ::min(begin + kTile, b.numel[t]);
  float* acc = b.acc[t];
  const G* grad = static_cast<const G*>(b.grad[t]);
  float sq = 0.f;
  if (b.vec[t]) {
    float a[kUnroll][4], g[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = begin + (u * kThreads + threadIdx.x) * 4;
      if (i >= end) continue;
      if (acc != nullptr) Load4(acc + i, a[u]);
      if (grad != nullptr) Load4(grad + i, g[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = begin + (u * kThreads + threadIdx.x) * 4;
      if (i >= end) continue;
      if (acc == nullptr) {
#pragma unroll
        for (int k = 0; k < 4; ++k) a[u][k] = grad != nullptr ? g[u][k] : 0.f;
      } else if (grad != nullptr) {
#pragma unroll
        for (int k = 0; k < 4; ++k) a[u][k] += g[u][k];
        Store4(acc + i, a[u]);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) sq += a[u][k] * a[u][k];
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      float a = acc != nullptr ? acc[i] : 0.f;
      if (grad != nullptr) {
        a += ToFloat(grad[i]);
        if (acc != nullptr) acc[i] = a;
      }
      sq += a * a;
    }
  }
  __shared__ float scratch[32];
  sq = BlockReduce<false>(sq, scratch);
  if (threadIdx.x == 0) atomicAdd(grad_sq_sum, static_cast<double>(sq));
}

// Per-tensor constants of one AdamW step, as ATen's adam_math computes them (opmath float
// from double hyperparameters).
struct AdamWStep {
  float coef;  // clipping coefficient
  double lr, lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  bool decay;
  float step_size, bias_correction2_sqrt;
};

// One element of AdamW (ATen/native/cuda/fused_adam_utils.cuh, ADAMW mode).
__device__ __forceinline__ void AdamWElement(const AdamWStep& s, float& param, float grad,
                                             float& exp_avg, float& exp_avg_sq) {
  grad *= s.coef;
  if (s.decay) param -= s.lr_wd * param;
  exp_avg = s.beta1 * exp_avg + s.one_minus_beta1 * grad;
  exp_avg_sq = s.beta2 * exp_avg_sq + s.one_minus_beta2 * grad * grad;
  const float denom = (sqrtf(exp_avg_sq) / s.bias_correction2_sqrt) + s.eps;
  param -= s.step_size * exp_avg / denom;
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    AdamWKernel(const __grid_constant__ AdamWBatch b, const double* grad_sq_sum) {
  // A float32 gradient is the trainer's accumulator, zeroed for the next step; a bf16 one is
  // the backward's own, read only.
  constexpr bool kZeroGrad = std::is_same_v<G, float>;
  const int t = FindTensor(b.tile_end, b.count, blockIdx.x);
  const int64_t begin = (blockIdx.x - (t == 0 ? 0 : b.tile_end[t - 1])) * kTile;
  const AdamWTensor& x = b.t[t];
  const int64_t end = ::min(begin + kTile, x.numel);
  if ((b.skip_non_finite && !isfinite(*grad_sq_sum)) ||
      (x.group_sq_sum != nullptr && *x.group_sq_sum == 0)) {
    // A skipped step (Note [Skipped steps], engine/trainer_optimizer.cc) or a group no example
    // reached (Note [Unreached groups]): only the accumulator is reset.
    if (kZeroGrad && x.grad != nullptr) {
      for (int64_t i = begin + threadIdx.x; i < end; i += kThreads)
        static_cast<float*>(x.grad)[i] = 0.f;
    }
    return;
  }
  AdamWStep s;
  s.coef = 1.f;
  if (b.max_grad_norm > 0) {
    // clip_grad_norm_: total norm in float32, coef = max / (norm + 1e-6) clamped to 1.
    const float norm = static_cast<float>(sqrt(*grad_sq_sum));
    s.coef = fminf(static_cast<float>(b.max_grad_norm) / (norm + 1e-6f), 1.f);
  }
  s.lr = *x.lr;
  s.lr_wd = s.lr * b.weight_decay;
  s.decay = b.weight_decay != 0;
  s.beta1 = b.beta1, s.one_minus_beta1 = 1 - b.beta1;
  s.beta2 = b.beta2, s.one_minus_beta2 = 1 - b.beta2;
  s.eps = b.eps;
  const float step = *x.step;
  const float bias_correction1 = 1 - pow(b.beta1, static_cast<double>(step));
  s.step_size = s.lr / bias_correction1;
  const float bias_correction2 = 1 - pow(b.beta2, static_cast<double>(step));
  s.bias_correction2_sqrt = sqrtf(bias_correction2);
  auto* working = static_cast<__nv_bfloat16*>(x.working);
  G* grad = static_cast<G*>(x.grad);
  if (b.vec[t]) {
    float p[kUnroll][4], g[kUnroll][4], m[kUnroll][4], v[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = begin + (u * kThreads + threadIdx.x) * 4;
      if (i >= end) continue;
      Load4(x.param + i, p[u]);
      if (grad != nullptr) {
        Load4(grad + i, g[u]);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) g[u][k] = 0.f;
      }
      Load4(x.exp_avg + i, m[u]);
      Load4(x.exp_avg_sq + i, v[u]);
    }
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = begin + (u * kThreads + threadIdx.x) * 4;
      if (i >= end) continue;
#pragma unroll
      for (int k = 0; k < 4; ++k) AdamWElement(s, p[u][k], g[u][k], m[u][k], v[u][k]);
      Store4(x.param + i, p[u]);
      Store4(x.exp_avg + i, m[u]);
      Store4(x.exp_avg_sq + i, v[u]);
      if (kZeroGrad && grad != nullptr) Store4(reinterpret_cast<float*>(grad) + i, zero);
      if (working != nullptr) Store4(working + i, p[u]);
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      float p = x.param[i], m = x.exp_avg[i], v = x.exp_avg_sq[i];
      AdamWElement(s, p, grad != nullptr ? ToFloat(grad[i]) : 0.f, m, v);
      x.param[i] = p;
      x.exp_avg[i] = m;
      x.exp_avg_sq[i] = v;
      if (kZeroGrad && grad != nullptr) reinterpret_cast<float*>(grad)[i] = 0.f;
      if (working != nullptr) working[i] = __float2bfloat16_rn(p);
    }
  }
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int64_t Tiles(int64_t numel) { return (numel + kTile - 1) / kTile; }

// Launches once per kMaxTensorsPerLaunch tensors: for each tensor, `fill(batch, i, tensor)` puts
// it into the batch's table and returns whether it may take the vectorised path; the running tile
// ends are set here; then `launch(batch, tiles)` launches the kernel over the batch's tiles.
template <typename Batch, typename Tensor, typename Fill, typename Launch>
cudaError_t LaunchInBatches(const Tensor* tensors, int count, const Batch& prototype, Fill fill,
                            Launch launch) {
  for (int first = 0; first < count; first += kMaxTensorsPerLaunch) {
    Batch b = prototype;
    b.count = std::min(kMaxTensorsPerLaunch, count - first);
    int64_t tiles = 0;
    for (int i = 0; i < b.count; ++i) {
      const Tensor& x = tensors[first + i];
      b.vec[i] = fill(b, i, x);
      tiles += Tiles(x.numel);
      b.tile_end[i] = tiles;
    }
    if (tiles == 0) continue;
    launch(b, tiles);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchAccumulateGradients(const AccumulateTensor* tensors, int count, bool grad_bf16,
                                      double* grad_sq_sum, cudaStream_t stream) {
  auto fill = [&](AccumulateBatch& b, int i, const AccumulateTensor& x) {
    b.acc[i] = x.acc;
    b.grad[i] = x.grad;
    b.numel[i] = x.numel;
    return x.numel % 4 == 0 && (x.acc == nullptr || Aligned(x.acc, 16)) &&
           (x.grad == nullptr || Aligned(x.grad, grad_bf16 ? 8 : 16));
  };
  auto launch = [&](const AccumulateBatch& b, int64_t tiles) {
    if (grad_bf16) {
      AccumulateKernel<__nv_bfloat16><<<tiles, kThreads, 0, stream>>>(b, grad_sq_sum);
    } else {
      AccumulateKernel<float><<<tiles, kThreads, 0, stream>>>(b, grad_sq_sum);
    }
  };
  return LaunchInBatches(tensors, count, AccumulateBatch{}, fill, launch);
}

cudaError_t LaunchAdamW(const AdamWTensor* tensors, int count, bool grad_bf16,
                        const AdamWScalars& s, const double* grad_sq_sum, cudaStream_t stream) {
  AdamWBatch prototype{};
  prototype.beta1 = s.beta1, prototype.beta2 = s.beta2, prototype.eps = s.eps;
  prototype.weight_decay = s.weight_decay, prototype.max_grad_norm = s.max_grad_norm;
  prototype.skip_non_finite = s.skip_non_finite;
  auto fill = [&](AdamWBatch& b, int i, const AdamWTensor& x) {
    b.t[i] = x;
    return x.numel % 4 == 0 && Aligned(x.param, 16) &&
           (x.grad == nullptr || Aligned(x.grad, grad_bf16 ? 8 : 16)) && Aligned(x.exp_avg, 16) &&
           Aligned(x.exp_avg_sq, 16) && (x.working == nullptr || Aligned(x.working, 8));
  };
  auto launch = [&](const AdamWBatch& b, int64_t tiles) {
    if (grad_bf16) {
      AdamWKernel<__nv_bfloat16><<<tiles, kThreads, 0, stream>>>(b, grad_sq_sum);
    } else {
      AdamWKernel<float><<<tiles, kThreads, 0, stream>>>(b, grad_sq_sum);
    }
  };
  return LaunchInBatches(tensors, count, prototype, fill, launch);
}

}  // namespace vlmgraph::cuda
