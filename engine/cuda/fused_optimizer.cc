// engine/cuda/fused_optimizer.cc: ATen wrappers of the multi-tensor optimizer kernels (see
// engine/fused_optimizer.h).
#include "engine/fused_optimizer.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

#include "engine/cuda/optimizer_kernels.h"

namespace vlmgraph {
namespace {

void CheckFloat32(const at::Tensor& t, const at::Device& device, const char* what) {
  TORCH_CHECK(
      t.defined() && t.device() == device && t.scalar_type() == at::kFloat && t.is_contiguous(),
      what, " must be contiguous float32 tensors on ", device);
}

void CheckGradSqSum(const at::Tensor& s, const at::Device& device) {
  TORCH_CHECK(
      s.defined() && s.device() == device && s.scalar_type() == at::kDouble && s.numel() == 1,
      "grad_sq_sum must be a float64 scalar on ", device);
}

// The common dtype of the defined gradients (float32 or bf16, one per call, each on `device`);
// nullopt when none is defined.
std::optional<at::ScalarType> GradientDtype(const std::vector<at::Tensor>& grads,
                                            const at::Device& device, const char* op) {
  std::optional<at::ScalarType> dtype;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    TORCH_CHECK(g.device() == device, op, ": gradient ", i, " must be on ", device);
    TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16, op,
                ": gradients must be float32 or bfloat16");
    TORCH_CHECK(!dtype || *dtype == g.scalar_type(), op,
                ": the gradients of one call must share a dtype");
    dtype = g.scalar_type();
  }
  return dtype;
}

// g's elements for a kernel: g's own when contiguous, else a contiguous copy kept alive in `keep`
// until the launch is queued.
void* ReadPointer(const at::Tensor& g, std::vector<at::Tensor>& keep) {
  if (g.is_contiguous()) return g.data_ptr();
  keep.push_back(g.contiguous());
  return keep.back().data_ptr();
}

}  // namespace

bool FusedOptimizerAvailable(const at::Device& device) { return device.is_cuda(); }

void AccumulateGradients(const std::vector<at::Tensor>& accumulators,
                         const std::vector<at::Tensor>& grads, const at::Tensor& grad_sq_sum) {
  if (accumulators.empty()) return;
  const at::Device device = accumulators[0].device();
  TORCH_CHECK(grads.size() == accumulators.size(), "AccumulateGradients: ", grads.size(),
              " gradients for ", accumulators.size(), " accumulators");
  CheckGradSqSum(grad_sq_sum, device);
  const auto grad_dtype = GradientDtype(grads, device, "AccumulateGradients");
  std::vector<at::Tensor> keep;
  std::vector<cuda::AccumulateTensor> table(accumulators.size());
  for (size_t i = 0; i < accumulators.size(); ++i) {
    const at::Tensor &acc = accumulators[i], &g = grads[i];
    CheckFloat32(acc, device, "accumulators");
    TORCH_CHECK(!g.defined() || g.sizes() == acc.sizes(), "AccumulateGradients: gradient ", i,
                " must match its accumulator's shape");
    table[i] = {acc.data_ptr<float>(), g.defined() ? ReadPointer(g, keep) : nullptr, acc.numel()};
  }
  c10::cuda::CUDAGuard guard(device);
  const cudaError_t e = cuda::LaunchAccumulateGradients(
      table.data(), static_cast<int>(table.size()), grad_dtype == at::kBFloat16,
      grad_sq_sum.data_ptr<double>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(e == cudaSuccess, "gradient accumulation launch failed: ", cudaGetErrorString(e));
}

void AddSquaredNorm(const std::vector<at::Tensor>& grads, const at::Tensor& grad_sq_sum) {
  CheckGradSqSum(grad_sq_sum, grad_sq_sum.device());
  const auto dtype = GradientDtype(grads, grad_sq_sum.device(), "AddSquaredNorm");
  if (!dtype) return;
  std::vector<at::Tensor> keep;
  std::vector<cuda::AccumulateTensor> table;
  for (const at::Tensor& g : grads) {
    if (g.defined()) table.push_back({nullptr, ReadPointer(g, keep), g.numel()});
  }
  c10::cuda::CUDAGuard guard(grad_sq_sum.device());
  const cudaError_t e = cuda::LaunchAccumulateGradients(
      table.data(), static_cast<int>(table.size()), dtype == at::kBFloat16,
      grad_sq_sum.data_ptr<double>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(e == cudaSuccess, "squared norm launch failed: ", cudaGetErrorString(e));
}

void FusedAdamW(const AdamWTensors& t, const at::Tensor& grad_sq_sum,
                const AdamWHyperparameters& h) {
  const size_t n = t.params.size();
  if (n == 0) return;
  TORCH_CHECK(t.grads.size() == n && t.exp_avg.size() == n && t.exp_avg_sq.size() == n &&
                  t.steps.size() == n && t.lrs.size() == n &&
                  (t.working.empty() || t.working.size() == n) &&
                  (t.group_sq_sums.empty() || t.group_sq_sums.size() == n),
              "FusedAdamW: every list needs one tensor per parameter");
  const at::Device device = t.params[0].device();
  const bool reads_norm = h.max_grad_norm > 0 || h.skip_non_finite;
  if (reads_norm) CheckGradSqSum(grad_sq_sum, device);
  const bool bf16_grads =
      GradientDtype(t.grads, device, "FusedAdamW").value_or(at::kBFloat16) == at::kBFloat16;
  std::vector<at::Tensor> keep;
  std::vector<cuda::AdamWTensor> table(n);
  for (size_t i = 0; i < n; ++i) {
    CheckFloat32(t.params[i], device, "params");
    CheckFloat32(t.exp_avg[i], device, "exp_avg");
    CheckFloat32(t.exp_avg_sq[i], device, "exp_avg_sq");
    CheckFloat32(t.steps[i], device, "steps");
    CheckFloat32(t.lrs[i], device, "lrs");
    const int64_t numel = t.params[i].numel();
    TORCH_CHECK(t.exp_avg[i].numel() == numel && t.exp_avg_sq[i].numel() == numel &&
                    t.steps[i].numel() == 1 && t.lrs[i].numel() == 1,
                "FusedAdamW: parameter ", i, "'s state does not match its size");
    void* grad = nullptr;
    if (t.grads[i].defined()) {
      const at::Tensor& g = t.grads[i];
      TORCH_CHECK(g.numel() == numel, "FusedAdamW: gradient ", i, " does not match its parameter");
      if (bf16_grads) {
        grad = ReadPointer(g, keep);
      } else {
        CheckFloat32(g, device, "float32 grads");  // zeroed in place: no copy
        grad = g.data_ptr();
      }
    } else {
      TORCH_CHECK(bf16_grads, "FusedAdamW: only bf16 gradient lists may leave one undefined");
    }
    void* working = nullptr;
    if (!t.working.empty()) {
      const at::Tensor& w = t.working[i];
      TORCH_CHECK(w.device() == device && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                      w.numel() == numel,
                  "working weights must be contiguous bfloat16 tensors of the params' sizes");
      working = w.data_ptr();
    }
    const double* group_sq_sum = nullptr;
    if (!t.group_sq_sums.empty()) {
      const at::Tensor& q = t.group_sq_sums[i];
      TORCH_CHECK(q.device() == device && q.scalar_type() == at::kDouble && q.numel() == 1,
                  "FusedAdamW: group_sq_sums must be float64 scalars on the params' device");
      group_sq_sum = q.data_ptr<double>();
    }
    table[i] = {t.params[i].data_ptr<float>(),
                grad,
                t.exp_avg[i].data_ptr<float>(),
                t.exp_avg_sq[i].data_ptr<float>(),
                working,
                t.steps[i].data_ptr<float>(),
                t.lrs[i].data_ptr<float>(),
                numel,
                group_sq_sum};
  }
  const cuda::AdamWScalars s{h.beta1,        h.beta2,         h.eps,
                             h.weight_decay, h.max_grad_norm, h.skip_non_finite};
  c10::cuda::CUDAGuard guard(device);
  const cudaError_t e =
      cuda::LaunchAdamW(table.data(), static_cast<int>(n), bf16_grads, s,
                        reads_norm ? grad_sq_sum.data_ptr<double>() : nullptr,
                        c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(e == cudaSuccess, "AdamW launch failed: ", cudaGetErrorString(e));
}

}  // namespace vlmgraph
