// engine/cuda/optimizer_kernels.h: launchers of the multi-tensor optimizer kernels
// (optimizer_kernels.cu). Plain pointers, no ATen, so the .cu compiles with nvcc alone; the ATen
// wrappers and their checks are in fused_optimizer.cc (API and formulas: engine/fused_optimizer.h).
// Each launcher queues one kernel per kMaxTensorsPerLaunch tensors on `stream` and returns the
// first launch error. Every pointer is device memory; sizes are element counts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vlmgraph::cuda {

constexpr int kMaxTensorsPerLaunch = 256;

struct AccumulateTensor {
  float* acc;        // float32 accumulator, or nullptr: only grad's squares are summed
  const void* grad;  // bf16 or float32 gradient (grad_bf16), or nullptr
  int64_t numel;
};

// acc += grad for every tensor, and *grad_sq_sum += sum(acc^2) over all of them (sum(grad^2)
// where acc is nullptr).
cudaError_t LaunchAccumulateGradients(const AccumulateTensor* tensors, int count, bool grad_bf16,
                                      double* grad_sq_sum, cudaStream_t stream);

struct AdamWTensor {
  float* param;
  void* grad;  // float32: zeroed after use; bf16 (grad_bf16): read only; nullptr: zero gradient
  float* exp_avg;
  float* exp_avg_sq;
  void* working;      // bf16 copy of param, or nullptr
  const float* step;  // already advanced
  const float* lr;
  int64_t numel;
  const double* group_sq_sum;  // nullptr, or: *group_sq_sum == 0 leaves the tensor alone (a float32
                               // gradient is still zeroed)
};

struct AdamWScalars {
  double beta1, beta2, eps, weight_decay;
  double max_grad_norm;  // > 0: clip with the norm sqrt(*grad_sq_sum)
  bool skip_non_finite;  // *grad_sq_sum NaN or inf: update nothing, only zero float32 gradients
};

cudaError_t LaunchAdamW(const AdamWTensor* tensors, int count, bool grad_bf16,
                        const AdamWScalars& s, const double* grad_sq_sum, cudaStream_t stream);

}  // namespace vlmgraph::cuda
