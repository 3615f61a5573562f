#include "model/recompute.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

namespace vlmgraph {
namespace {

struct Callable : torch::CustomClassHolder {
  explicit Callable(RecomputeFn f) : fn(std::move(f)) {}
  RecomputeFn fn;
};

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  // Runs with grad mode off (autograd::Function), so fn(x) records nothing.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const RecomputeFn& fn) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(c10::make_intrusive<Callable>(fn));
    return fn(x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto holder = ctx->saved_data["fn"].toCapsule();
    const RecomputeFn& fn = static_cast<Callable*>(holder.get())->fn;
    const at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode enable(true);
      y = fn(x);
    }
    torch::autograd::backward({y}, {grad_outputs[0]});
    return {x.grad(), at::Tensor()};
  }
};

}  // namespace

at::Tensor Recompute(const RecomputeFn& fn, const at::Tensor& x) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return fn(x);
  return RecomputeFunction::apply(x, fn);
}

}  // namespace vlmgraph
