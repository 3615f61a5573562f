#include "engine/gradient_reducer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <stdexcept>

#include "engine/fused_optimizer.h"

namespace vlmgraph {

// Note [Overlapped all-reduce]: with data parallelism the gradients are averaged over the ranks
// as PyTorch DDP's Reducer does it (Li et al. 2020, section 3.2.3), inside the step's graphs:
// - Buckets: the trained parameters in reverse order (the order the backward produces their
//   gradients), packed into buckets of at most DataParallelOptions::bucket_bytes of the reduce
//   dtype (the first one at most 1 MiB, DDP's first_bucket_bytes, so the first all-reduce starts
//   early; a larger parameter alone). A bucket is one flat buffer, all-reduced in place.
// - A gradient hook on every trained parameter (it runs on autograd's thread, before autograd
//   stores the gradient) records the gradient; once every gradient of a bucket has arrived and
//   every earlier bucket is launched, the bucket's gradients go into it (added into the float32
//   accumulators, or copied as bf16) and, in the step's last micro-batch, its SUM all-reduce is
//   started (NCCL: on its own stream, so it runs while the backward of the earlier layers goes
//   on). Buckets launch in bucket order on every rank, whatever order their gradients arrive in,
//   so every rank starts the same collectives in the same order (DDP's rule); parameters that get
//   no gradient are launched after the backward. The loss is all-reduced last, then the stream
//   waits for every collective.
// - Earlier micro-batches of a step only accumulate (DDP's no_sync); their graph has no
//   collective, so a rank may capture it alone.
// - bfloat16 reduction: a step of one micro-batch never touches float32 gradients: each bucket's
//   bf16 gradients are all-reduced in place, as one coalesced collective, and the optimizer reads
//   them inside the same graph (Note [Optimizer inside the micro-step] in trainer.cc). Against
//   float32 reduction this removes the accumulation pass (read bf16, read and write float32),
//   the float32 norm pass and the zeroing of 4 bytes per parameter, and halves the bytes on the
//   wire; against copying the gradients into flat bf16 buckets first (measured: 86.1 ms per
//   step on 2 x H100, against 84.5 ms in place) it removes one read and write of 2 bytes per
//   parameter. A step of several micro-batches accumulates in float32 and rounds once, after its
//   last backward (ReduceAccumulated); its all-reduce is not overlapped.
// With NCCL the collectives are captured into the micro-step's CUDA graph (NCCL supports capture
// with one GPU per process; every rank captures the same collectives in the same order, after
// warm-up runs on the capture stream, as CudaGraphStepRunner::Capture does): a replay runs the
// backward and the bucket all-reduces overlapped, with no host work between them.

// Note [Gradients after accumulation]: the hook runs after autograd's AccumulateGrad stored the
// parameter's gradient in its .grad (a post-accumulate-grad hook, as PyTorch's
// Tensor.register_post_accumulate_grad_hook and FSDP use), so the reducer holds no reference to
// a gradient while AccumulateGrad runs. A tensor pre-hook that kept the gradient until its
// bucket launched made AccumulateGrad see a second reference and clone the gradient (one
// device-to-device copy per parameter: 1.1 ms of a 86 ms nanovlm-460m step on an H100) instead
// of taking it.
struct GradientReducer::Hook : torch::autograd::PostAccumulateGradHook {
  Hook(GradientReducer* reducer, size_t index) : reducer(reducer), index(index) {}
  void operator()(const torch::autograd::Variable&) override { reducer->OnGradient(index); }
  GradientReducer* reducer;
  size_t index;
};

GradientReducer::GradientReducer(const std::vector<at::Tensor>& params, DataParallelGroup& group,
                                 at::ScalarType reduce_dtype, bool fused,
                                 const std::vector<at::Tensor*>& float32_accumulators,
                                 const OptimizerShards* shards)
    : group_(group), reduce_dtype_(reduce_dtype), fused_(fused), shards_(shards), params_(params) {
  if (shards != nullptr && shards->owners().size() != params.size())
    throw std::invalid_argument("GradientReducer: one owner per parameter");
  if (reduce_dtype != at::kFloat && reduce_dtype != at::kBFloat16)
    throw std::invalid_argument("GradientReducer: reduce_dtype must be float32 or bfloat16");
  const bool float32 = reduce_dtype == at::kFloat;
  if (float32 && float32_accumulators.size() != params.size())
    throw std::invalid_argument("GradientReducer: one float32 accumulator per parameter");
  const int64_t element_bytes = float32 ? 4 : 2;
  const int64_t cap = group.options().bucket_bytes;
  constexpr int64_t kFirstBucketBytes = 1 << 20;  // DDP's first_bucket_bytes
  bucket_of_.assign(params_.size(), 0);
  std::vector<std::vector<size_t>> packed;
  int64_t bucket_bytes = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const int64_t bytes = params_[k].numel() * element_bytes;
    const int64_t limit = packed.size() == 1 ? std::min(cap, kFirstBucketBytes) : cap;
    if (packed.empty() || (!packed.back().empty() && bucket_bytes + bytes > limit)) {
      packed.emplace_back();
      bucket_bytes = 0;
    }
    packed.back().push_back(k);
    bucket_bytes += bytes;
  }
  at::NoGradGuard no_grad;
  for (const auto& indices : packed) {
    if (indices.empty()) continue;
    Bucket b;
    b.params = indices;
    for (size_t k : indices) {
      bucket_of_[k] = buckets_.size();
      b.numel += params_[k].numel();
    }
    if (shards != nullptr) b.owners = shards->Owners(indices);
    if (float32) {
      MakeFlat(b, at::kFloat);
      for (size_t i = 0; i < indices.size(); ++i) *float32_accumulators[indices[i]] = b.views[i];
    }
    bytes_ += b.numel * element_bytes;
    buckets_.push_back(std::move(b));
  }
  bytes_ += 4;  // the loss
  for (size_t k = 0; k < params_.size(); ++k) {
    // The accumulators are separate from the parameters' .grad: autograd's gradient is transient
    // (Note [Transient bf16 gradients] in trainer.cc), in float32 mode too.
    params_[k].mutable_grad() = at::Tensor();
    torch::autograd::impl::set_post_acc_grad_hooks(params_[k], std::make_unique<Hook>(this, k));
  }
}

void GradientReducer::MakeFlat(Bucket& b, at::ScalarType dtype) const {
  at::NoGradGuard no_grad;
  b.flat = at::zeros({b.numel}, params_[b.params[0]].options().dtype(dtype));
  b.views.clear();
  int64_t offset = 0;
  for (size_t k : b.params) {
    b.views.push_back(b.flat.narrow(0, offset, params_[k].numel()).view(params_[k].sizes()));
    offset += params_[k].numel();
  }
}

void GradientReducer::StartBucket(const Bucket& b, const std::vector<at::Tensor>& tensors) {
  if (shards_ == nullptr) {
    group_.StartAllReduceSum(tensors);
  } else if (tensors.size() == b.params.size()) {
    group_.StartReduceSum(tensors, b.owners);
  } else {  // the flat buffer: reduce its views
    group_.StartReduceSum(b.views, b.owners);
  }
}

const std::vector<at::Tensor>& GradientReducer::reduced_gradients() {
  if (reduce_dtype_ != at::kBFloat16 || !reduced_.empty()) return reduced_;
  reduced_.resize(params_.size());
  for (Bucket& b : buckets_) {
    MakeFlat(b, at::kBFloat16);
    for (size_t i = 0; i < b.params.size(); ++i) reduced_[b.params[i]] = b.views[i];
  }
  return reduced_;
}

void GradientReducer::OnGradient(size_t i) {
  if (!active_) return;
  if (++buckets_[bucket_of_[i]].ready == buckets_[bucket_of_[i]].params.size())
    LaunchReadyBuckets(/*all=*/false);
}

void GradientReducer::LaunchReadyBuckets(bool all) {
  at::NoGradGuard no_grad;
  const bool reduce = mode_ == Mode::kReduce;
  const bool in_place = reduce && reduce_dtype_ == at::kBFloat16;
  for (; next_ < buckets_.size(); ++next_) {
    Bucket& b = buckets_[next_];
    if (!all && b.ready < b.params.size()) return;
    if (in_place) {
      // The gradients themselves are all-reduced and stay in .grad for TakeReducedGradients.
      // Every rank passes one tensor per parameter (zeros where none came).
      std::vector<at::Tensor> grads;
      for (size_t k : b.params) {
        at::Tensor g = params_[k].grad();
        if (!g.defined()) {
          g = at::zeros_like(params_[k]);
        } else if (!g.is_contiguous()) {
          g = g.contiguous();
        }
        params_[k].mutable_grad() = g;
        grads.push_back(g);
      }
      StartBucket(b, grads);
      continue;
    }
    std::vector<at::Tensor> targets, grads;
    for (size_t k : b.params) {
      at::Tensor g = params_[k].grad();
      if (!g.defined()) continue;  // no gradient: zero
      targets.push_back((*accumulators_)[k]);
      grads.push_back(g);
    }
    if (!grads.empty()) {
      if (fused_) {
        // One multi-tensor kernel; the squared norm it also sums is not used (the optimizer
        // takes the norm of the averaged gradients).
        AccumulateGradients(targets, grads, grad_sq_sum_);
      } else {
        at::_foreach_add_(targets, grads);
      }
    }
    // Added: the gradients go back to the allocator (stream-ordered) before the backward ends.
    for (size_t k : b.params) params_[k].mutable_grad() = at::Tensor();
    if (reduce) StartBucket(b, {b.flat});
  }
}

void GradientReducer::Finish(const at::Tensor& loss_sum) {
  group_.StartAllReduceSum(loss_sum);
  const auto t0 = std::chrono::steady_clock::now();
  group_.FinishAllReduces();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void GradientReducer::Backward(const at::Tensor& loss, bool learns, Mode mode,
                               const std::vector<at::Tensor>& accumulators,
                               const at::Tensor& grad_sq_sum, const at::Tensor& loss_sum) {
  const bool needs_accumulators = mode == Mode::kAccumulate || reduce_dtype_ == at::kFloat;
  if (needs_accumulators && accumulators.size() != params_.size())
    throw std::logic_error("GradientReducer::Backward: one float32 accumulator per parameter");
  for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
  for (auto& b : buckets_) b.ready = 0;
  next_ = 0;
  mode_ = mode;
  accumulators_ = &accumulators;
  grad_sq_sum_ = grad_sq_sum;
  active_ = true;
  try {
    if (learns) loss.backward();
    active_ = false;
    LaunchReadyBuckets(/*all=*/true);
    if (mode == Mode::kReduce) Finish(loss_sum);
  } catch (...) {
    active_ = false;
    for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
    accumulators_ = nullptr;
    throw;
  }
  accumulators_ = nullptr;
}

std::vector<at::Tensor> GradientReducer::TakeReducedGradients() {
  std::vector<at::Tensor> grads;
  grads.reserve(params_.size());
  for (at::Tensor& p : params_) {
    grads.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  return grads;
}

void GradientReducer::ReduceAccumulated(const std::vector<at::Tensor>& accumulators,
                                        const at::Tensor& loss_sum) {
  if (reduce_dtype_ != at::kBFloat16)
    throw std::logic_error("GradientReducer::ReduceAccumulated: bfloat16 mode only");
  if (accumulators.size() != params_.size())
    throw std::logic_error("GradientReducer::ReduceAccumulated: one accumulator per parameter");
  const std::vector<at::Tensor>& reduced = reduced_gradients();
  at::NoGradGuard no_grad;
  for (const Bucket& b : buckets_) {
    std::vector<at::Tensor> to, from;
    for (size_t k : b.params) {
      to.push_back(reduced[k]);
      from.push_back(accumulators[k]);
    }
    at::_foreach_copy_(to, from);  // float32 -> bf16, round to nearest even
    at::_foreach_zero_(from);
    StartBucket(b, {b.flat});
  }
  Finish(loss_sum);
}

}  // namespace vlmgraph
