// engine/fused_optimizer.h: the trainer's optimizer as two multi-tensor CUDA kernels.
//
// Against ATen's ops (`_foreach_add_` of bf16 gradients into float32 accumulators, which falls
// back to one kernel per tensor for mixed dtypes; `_foreach_norm` + `_foreach_mul_` for clipping;
// `_fused_adamw_`; `_foreach_copy_` of the masters into the bf16 weights; `_foreach_zero_` of the
// accumulators), each float32 state tensor is read and written once per step:
// - AccumulateGradients adds every gradient into its accumulator and sums the squares of the
//   results, so the gradient norm costs no extra pass;
// - FusedAdamW clips (coefficient from that sum), runs AdamW, writes the bf16 working weight and
//   zeroes the accumulator, all in one pass over the float32 state.
// Both launch one kernel per 256 tensors (the tensor table travels as a kernel argument, so a CUDA
// graph captures it) and take the current CUDA stream.
//
// Formulas: clipping as torch.nn.utils.clip_grad_norm_ (coef = min(1, max_norm / (norm + 1e-6)),
// norm = sqrt(sum of squares), the sum in float64); AdamW exactly as ATen's _fused_adamw_
// (ATen/native/cuda/fused_adam_utils.cuh: float32 state, float64 hyperparameters, decoupled weight
// decay p -= lr * wd * p, bias corrections 1 - beta^step from the device step counter).
//
// Thread rules: none of their own; call from the thread that owns the stream. Errors:
// c10::Error (TORCH_CHECK) for wrong dtypes, devices, sizes or list lengths, and for a failed
// launch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

namespace vlmgraph {

// True when this build has the kernels (VLMGRAPH_WITH_CUDA) and `device` is a CUDA device.
bool FusedOptimizerAvailable(const at::Device& device);

// For every i: accumulators[i] += grads[i] where grads[i] is defined (float32 or bf16, same shape;
// an undefined gradient counts as zero), then grad_sq_sum += sum over every accumulator of its
// elements squared (after the add). accumulators: contiguous float32 on one CUDA device;
// grads: one per accumulator (one dtype per call); grad_sq_sum: float64
// scalar on that device, which the caller zeroes before the first micro-batch of a step, so that
// after the last one it holds the squared norm of the accumulated gradient.
void AccumulateGradients(const std::vector<at::Tensor>& accumulators,
                         const std::vector<at::Tensor>& grads, const at::Tensor& grad_sq_sum);

// grad_sq_sum += sum over every defined tensor of `grads` (float32 or bf16, one dtype) of its
// elements squared: the squared gradient norm when the gradients are not accumulated.
void AddSquaredNorm(const std::vector<at::Tensor>& grads, const at::Tensor& grad_sq_sum);

struct AdamWTensors {
  // One entry per trained parameter, all on one CUDA device, contiguous:
  std::vector<at::Tensor> params;      // float32 master weights, updated in place
  std::vector<at::Tensor> grads;       // float32 accumulators, read, then zeroed; or bf16
                                       // gradients, read only, undefined = zero gradient
  std::vector<at::Tensor> exp_avg;     // float32, updated in place
  std::vector<at::Tensor> exp_avg_sq;  // float32, updated in place
  std::vector<at::Tensor> working;     // empty, or bf16 copies that get the rounded new weight
  std::vector<at::Tensor> steps;       // float32 scalars: the step count this update uses (the
                                       // caller advances them first, as for _fused_adamw_)
  std::vector<at::Tensor> lrs;         // float32 scalars: each parameter's learning rate
  // Empty, or float64 scalars: the squared gradient norm of each parameter's group; a parameter
  // whose group's is exactly 0 (no example of the step reached the group) is left alone, as
  // torch.optim.AdamW skips a parameter whose gradient is None (Note [Unreached groups],
  // engine/trainer_optimizer.cc). The caller leaves such a group's step counters alone.
  std::vector<at::Tensor> group_sq_sums;
};

struct AdamWHyperparameters {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  double max_grad_norm = 0;  // > 0: clip with the norm from grad_sq_sum
  // true: when grad_sq_sum is NaN or inf the step changes no parameter, moment or working weight
  // (float32 gradients are still zeroed), as _fused_adamw_ does with found_inf = 1. The caller
  // leaves the step counters alone for such a step (Note [Skipped steps],
  // engine/trainer_optimizer.cc).
  bool skip_non_finite = false;
};

// One AdamW step over every parameter of `t` (but those whose t.group_sq_sums entry is 0), with
// the gradients clipped first when h.max_grad_norm > 0 and skipped when h.skip_non_finite and they
// are not finite (grad_sq_sum,
// float64 scalar, must then hold their squared norm, as AccumulateGradients or AddSquaredNorm
// leave it); zeroes float32 gradients.
void FusedAdamW(const AdamWTensors& t, const at::Tensor& grad_sq_sum,
                const AdamWHyperparameters& h);

}  // namespace vlmgraph
