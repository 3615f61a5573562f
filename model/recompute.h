// model/recompute.h: activation recomputation (checkpointing) for training.
//
// Recompute(fn, x) returns fn(x) but keeps only x for the backward pass: the backward pass runs
// fn(x) again with autograd on and backpropagates through that copy, so the activations inside fn
// never stay alive between the forward and the backward pass (Chen et al. 2016, "Training Deep
// Nets with Sublinear Memory Cost"; the reentrant form of torch.utils.checkpoint). Gradients of
// the parameters fn uses accumulate into their .grad as usual; the gradient of x flows back.
// Cost: one more forward pass of fn.
//
// fn must compute the same values when run again (no dropout or other randomness) and must not
// modify x; tensors it captures must stay valid until the backward pass (capture them by value).
// Without grad mode, or when x does not require grad, it is just fn(x). The nested backward pass
// issues no host synchronisation, so steps using it can be captured into CUDA graphs.
//
// Thread rules: as autograd.
#pragma once

#include <ATen/Tensor.h>

#include <functional>

namespace vlmgraph {

using RecomputeFn = std::function<at::Tensor(const at::Tensor&)>;
at::Tensor Recompute(const RecomputeFn& fn, const at::Tensor& x);

}  // namespace vlmgraph
