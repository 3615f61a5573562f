// Builds without CUDA: the fused kernels do not exist and the model keeps its reference path.
#include <c10/util/Exception.h>

#include "model/fused_ops.h"

namespace vlmgraph::ops {

bool FusedKernelsAvailable(const at::Tensor&) { return false; }
void SetProgrammaticDependentLaunch(bool) {}
at::Tensor RmsNorm(const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
at::Tensor SiluMul(const at::Tensor&) { TORCH_CHECK(false, "no CUDA kernels in this build"); }
RopeKvOutput RopeKvWrite(const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                         const at::Tensor&, int64_t, int64_t, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, bool) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
at::Tensor RopeDecodeAttention(const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, int64_t, int64_t) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
bool DecodeAttentionCombinesInLinear(int64_t) { return false; }
DecodeAttentionPartials RopeDecodeAttentionPartials(const at::Tensor&, const at::Tensor&, double,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, int64_t, int64_t) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
at::Tensor AttentionCombineLinear(const DecodeAttentionPartials&, const at::Tensor&,
                                  const at::Tensor&) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
at::Tensor Linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
at::Tensor RmsNormLinear(const at::Tensor&, const at::Tensor&, double, const at::Tensor&) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
at::Tensor SiluMulLinear(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}

bool RmsNormDifferentiableSupported(const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor RmsNormDifferentiable(const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
std::pair<at::Tensor, at::Tensor> RotaryDifferentiable(const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}
at::Tensor BiasAdd(const at::Tensor& x, const at::Tensor& bias) { return x + bias; }
at::Tensor ArgmaxRows(const at::Tensor& x) { return x.argmax(-1); }
void ArgmaxRowsInto(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 1 && out.size(0) == x.size(0) &&
                  out.scalar_type() == at::kLong && out.is_contiguous() &&
                  out.device() == x.device(),
              "ArgmaxRowsInto: x (rows, n) and out (rows) int64, contiguous, on x's device");
  at::argmax_out(const_cast<at::Tensor&>(out), x, -1);
}
bool LinearCrossEntropySupported(const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor LinearCrossEntropy(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "no CUDA kernels in this build");
}

}  // namespace vlmgraph::ops
