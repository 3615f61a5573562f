// engine/gradient_reducer.h: a data-parallel trainer's gradient averaging, overlapped with the
// backward pass and captured inside the step's CUDA graphs (Note [Overlapped all-reduce] in
// gradient_reducer.cc), as PyTorch DDP's Reducer does it (Li et al. 2020, section 3.2.3).
//
// The trained parameters are packed, in reverse order (the order the backward produces their
// gradients), into buckets of at most DataParallelOptions::bucket_bytes (the first at most 1 MiB,
// DDP's first_bucket_bytes); a gradient hook on every parameter launches a bucket's SUM
// all-reduce once all its gradients have arrived and every earlier bucket is launched. Two
// reduction dtypes (FSDP's MixedPrecision.reduce_dtype; DataParallelOptions::reduce_dtype):
// - float32: each bucket is one flat float32 buffer whose views are the parameters' float32
//   gradient accumulators; every micro-batch adds its gradients into them and the step's last
//   micro-batch all-reduces them. 4 bytes per parameter on the wire.
// - bfloat16 (bf16 training only): the step's only micro-batch all-reduces the backward's own
//   bf16 gradients in place, a bucket's tensors as one coalesced collective
//   (TakeReducedGradients hands them to the optimizer), so no float32 accumulator and no copy
//   exist; a step of several micro-batches accumulates in the float32 accumulators and
//   ReduceAccumulated rounds them into flat bf16 buffers (reduced_gradients(), made on first
//   use). 2 bytes per parameter on the wire, as DDP's bf16_compress_hook sends; the optimizer's
//   master update stays float32.
// The losses that produced the gradients are divided by world_size beforehand, so the SUM is the
// mean.
//
// With the sharded optimizer (ZeRO stage 1) each gradient is SUM-reduced to its owner rank only,
// in the same buckets: half the bytes of an all-reduce on the wire during the backward.
//
// Thread rules: the hooks run on autograd's thread while the thread that drives the trainer
// waits in backward(); everything else on the trainer's thread. Every rank must build its reducer
// from the same parameters and call the same operations in the same order (the collectives pair
// by order). Errors: EngineError(kUnavailable) from the group's collectives.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

#include "engine/data_parallel.h"
#include "engine/optimizer_shards.h"

namespace vlmgraph {

class GradientReducer {
 public:
  // params: the trained working parameters (their gradients' dtype is the model's compute
  // dtype), in the optimizer's order; they get the reducer's gradient hooks and must outlive it.
  // reduce_dtype: kFloat or kBFloat16 (the latter only for bf16 params). float32 mode: each
  // *float32_accumulators[k] (float32, params[k]'s shape) is replaced by a view of its bucket.
  // fused: the bf16 additions run as engine/fused_optimizer.h's AccumulateGradients (CUDA),
  // else as ATen's _foreach_add_. shards: null, or (the sharded optimizer,
  // DataParallelOptions::shard_optimizer) each parameter's owner: its gradient is SUM-reduced to
  // the owner only (DataParallelGroup::StartReduceSum), the other ranks' copy keeps the local
  // gradient; must outlive the reducer.
  GradientReducer(const std::vector<at::Tensor>& params, DataParallelGroup& group,
                  at::ScalarType reduce_dtype, bool fused,
                  const std::vector<at::Tensor*>& float32_accumulators,
                  const OptimizerShards* shards = nullptr);
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // What a backward does with its gradients.
  enum class Mode {
    // Add them into `accumulators` (float32), no collective: every micro-batch of a step but
    // the last (DDP's no_sync), and in bfloat16 mode the last one of several too.
    kAccumulate,
    // The step's last micro-batch: float32 mode adds them into the accumulators (the buckets)
    // and all-reduces each bucket; bfloat16 mode copies them into the buckets (the step's only
    // micro-batch) and all-reduces each. Then loss_sum is all-reduced and the current stream
    // waits for every collective.
    kReduce,
  };

  // loss.backward() (when `learns`; otherwise every gradient is zero) with the hooks on.
  // accumulators: float32, one per parameter (may be empty for bfloat16 kReduce); grad_sq_sum:
  // float64 device scalar that AccumulateGradients adds into (not read here); loss_sum: the
  // step's loss, all-reduced last with kReduce. Undefined gradients (a parameter the loss does
  // not reach) count as zero. Afterwards no parameter has a .grad, except after a bfloat16
  // kReduce: then each holds its averaged gradient until TakeReducedGradients.
  void Backward(const at::Tensor& loss, bool learns, Mode mode,
                const std::vector<at::Tensor>& accumulators, const at::Tensor& grad_sq_sum,
                const at::Tensor& loss_sum);

  // bfloat16 mode, after a kReduce backward: the rank-averaged bf16 gradients, one per
  // parameter (zeros for one the loss did not reach), which the parameters' .grad give up.
  std::vector<at::Tensor> TakeReducedGradients();

  // bfloat16 mode, after a step's micro-batches all ran kAccumulate: every bucket takes its
  // accumulators rounded to bf16 (reduced_gradients()), the accumulators are zeroed, the buckets
  // and then loss_sum are all-reduced and the current stream waits for them. The collectives
  // pair with a kReduce backward's on ranks whose step had one micro-batch.
  void ReduceAccumulated(const std::vector<at::Tensor>& accumulators, const at::Tensor& loss_sum);

  // bfloat16 mode: flat per-bucket bf16 buffers, viewed one per parameter (params[k]'s shape),
  // that ReduceAccumulated fills with the rank-averaged gradients; their addresses never change
  // (a captured optimizer reads them). Allocated on the first call (2 bytes per parameter).
  const std::vector<at::Tensor>& reduced_gradients();
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }
  // Bytes all-reduced (sharded: reduced) per step: every bucket + the float32 loss.
  int64_t bytes_per_step() const { return bytes_; }
  // Host seconds spent waiting for the collectives since reset (gloo blocks; NCCL only queues a
  // stream wait).
  double wait_seconds() const { return wait_seconds_; }
  void ResetWaitSeconds() { wait_seconds_ = 0; }

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    int64_t numel = 0;
    // The bucket's gradients back to back: float32 mode, the accumulators; bfloat16 mode,
    // ReduceAccumulated's buffer (undefined until reduced_gradients()).
    at::Tensor flat;
    std::vector<at::Tensor> views;  // flat's views, one per parameter of the bucket
    std::vector<int64_t> owners;    // sharded: each parameter's owner rank
    size_t ready = 0;  // gradients of the backward in progress that have arrived
  };
  struct Hook;
  // Allocates b.flat (zeros of `dtype`, b.numel elements) and b.views: its views, one per
  // parameter of b, in b.params order and with each parameter's shape.
  void MakeFlat(Bucket& b, at::ScalarType dtype) const;
  // Starts the bucket's collective over `tensors` (one per parameter of b, or b.flat alone):
  // SUM all-reduce, or with shards a SUM reduce of each tensor to its owner.
  void StartBucket(const Bucket& b, const std::vector<at::Tensor>& tensors);
  // The hook: parameter i's gradient of the backward in progress is in its .grad.
  void OnGradient(size_t i);
  // Handles (and with kReduce starts the all-reduce of) every bucket whose gradients have all
  // arrived, in bucket order; `all`: every bucket not launched yet.
  void LaunchReadyBuckets(bool all);
  void Finish(const at::Tensor& loss_sum);

  DataParallelGroup& group_;
  at::ScalarType reduce_dtype_;
  bool fused_;
  const OptimizerShards* shards_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;    // launch order
  std::vector<size_t> bucket_of_;  // params_ index -> bucket
  std::vector<at::Tensor> reduced_;
  int64_t bytes_ = 0;
  double wait_seconds_ = 0;
  // The backward in progress.
  bool active_ = false;
  Mode mode_ = Mode::kAccumulate;
  size_t next_ = 0;                    // first bucket not launched yet
  const std::vector<at::Tensor>* accumulators_ = nullptr;
  at::Tensor grad_sq_sum_;
};

}  // namespace vlmgraph
