// engine/trainer_optimizer.cc: the Trainer's optimizer part: the gradient norm by group,
// clipping, AdamW (the fused kernels or ATen's), skipped steps and unreached groups, and the
// optimizer sharded over data-parallel ranks with its weights' broadcast (Notes [Skipped steps],
// [Unreached groups], [Sharded optimizer], [Weights broadcast in the forward]). The step that
// runs it: engine/trainer_step.cc.
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <string>
#include <vector>

#include "engine/data_parallel.h"
#include "engine/fused_optimizer.h"
#include "engine/gradient_reducer.h"
#include "engine/optimizer_shards.h"
#include "engine/trainer.h"
#include "engine/trainer_internal.h"

namespace vlmgraph {

std::vector<at::Tensor> Trainer::RunFusedAdamW(const AdamWTensors& all, bool direct) {
  RECORD_USER_SCOPE("vlmgraph::optimizer");
  // Note [Sharded optimizer]: this rank's parameters only.
  const AdamWTensors t = shards_ ? shards_->Owned(all) : all;
  // The squared norm is always computed: it decides whether the step is skipped (Note [Skipped
  // steps]) and, with clipping on, the clipping coefficient.
  if (shards_) {
    // In the micro-step's graph: the owned gradients' norm, summed over the ranks. Otherwise
    // FinishStep summed it before the optimizer's graph (which holds no collective).
    if (direct) ShardedSquaredNorm(t.grads);
  } else if (direct) {  // the backward's bf16 gradients: their norm
    SquaredNormsByGroup(t.grads, all_indices_);
  } else if (!mixed_precision() || data_parallel_) {
    // float32: autograd filled the gradients; data parallel: the averaged ones
    SquaredNormsByGroup(master_grads_, all_indices_);
  }  // else bf16 accumulation: AccumulateGradients left the norms in group_sq_sum_, grad_sq_sum_
  at::Tensor finite = at::isfinite(grad_sq_sum_).to(at::kFloat);
  // A skipped step, or a group no example reached (Note [Unreached groups]), keeps the count.
  for (size_t g = 0; g < groups_.size(); ++g) {
    const at::Tensor reached =
        group_sq_sum_.select(0, static_cast<int64_t>(g)).ne(0).to(at::kFloat);
    at::_foreach_add_(groups_[g].steps, finite * reached);
  }
  const AdamWHyperparameters h{options_.beta1,          options_.beta2,         options_.eps,
                               options_.weight_decay,   options_.max_grad_norm,
                               /*skip_non_finite=*/true};
  if (shards_ && direct) {
    // Note [Sharded optimizer]: chunk by chunk, each chunk's broadcast overlapping the next
    // chunk's AdamW.
    for (size_t c = 0; c < broadcast_chunks_.size(); ++c) {
      AdamWTensors part;
      for (size_t k : broadcast_chunks_[c]) {
        if (!shards_->owns(k)) continue;
        part.params.push_back(all.params[k]);
        part.grads.push_back(all.grads[k]);
        part.exp_avg.push_back(all.exp_avg[k]);
        part.exp_avg_sq.push_back(all.exp_avg_sq[k]);
        if (!all.working.empty()) part.working.push_back(all.working[k]);
        part.steps.push_back(all.steps[k]);
        part.lrs.push_back(all.lrs[k]);
        part.group_sq_sums.push_back(all.group_sq_sums[k]);
      }
      if (!part.params.empty()) FusedAdamW(part, grad_sq_sum_, h);
      // Chunks from forward_chunk_ on go out in the next step's forward.
      if (c < forward_chunk_) StartBroadcastChunk(c);
    }
    options_.data_parallel->FinishAllReduces();
  } else if (!t.params.empty()) {
    FusedAdamW(t, grad_sq_sum_, h);
  }
  // The float32 accumulators of parameters other ranks own were not zeroed by FusedAdamW.
  if (shards_ && !direct && !all.grads.empty() && all.grads[0].scalar_type() == at::kFloat)
    at::_foreach_zero_(all.grads);
  return {grad_sq_sum_.sqrt(), 1.0 - finite};
}

// Note [Skipped steps]: a step whose gradients are not all finite (their global norm is NaN or
// inf) changes no weight and no optimizer state, as torch.cuda.amp.GradScaler and Megatron-LM skip
// such iterations: AdamW sees found_inf = 1 (_fused_adamw_'s own argument, or the fused kernel's
// check of the same squared norm), the step counters advance by 1 - found_inf, and the gradients
// are zeroed as after any step. All of it stays on the device, so the decision is part of the
// captured graph. Step() reports the step as skipped; the server counts consecutive skips.
//
// Note [Unreached groups]: torch.optim.AdamW leaves a parameter whose .grad is None alone: no
// weight decay, no moment decay, no step count. A text-only step reaches neither the vision
// encoder nor the projector, and a zero gradient is not None: AdamW would still decay their
// weights and moments (a text-only run moved the vision tower by 3.8e-6 and the projector by
// 4.5e-5). So the optimizer takes each parameter group's squared gradient norm (group_sq_sum_,
// summed over every micro-batch and, through the averaged gradients or the sharded norm's
// all-reduce, over every rank) and treats a group whose norm is exactly 0 as one no example of
// the step reached: found_inf = 1 for that group (_fused_adamw_), or the fused kernel's own check,
// and its step counters stay. On the device like Note [Skipped steps], so a captured graph decides
// it on every replay. A group that examples reached but whose gradient is exactly zero (every
// target masked) is skipped too; torch would decay it.
std::vector<at::Tensor> Trainer::RunOptimizer() {
  RECORD_USER_SCOPE("vlmgraph::optimizer");
  at::NoGradGuard no_grad;
  if (reduce_bf16()) {  // the averaged bf16 gradients that ReduceAccumulated left in the buckets
    AdamWTensors t = adamw_;
    t.grads = reducer_->reduced_gradients();
    // Sharded: FinishStep took their norm (over the ranks) before this graph.
    return RunFusedAdamW(t, /*direct=*/shards_ == nullptr);
  }
  if (fused_) return RunFusedAdamW(adamw_, /*direct=*/false);
  // Sharded (Note [Sharded optimizer]): this rank's parameters, the norm FinishStep summed.
  std::vector<Group>& groups = shards_ ? owned_groups_ : groups_;
  at::Tensor total;
  if (shards_) {
    total = grad_sq_sum_.sqrt().to(at::kFloat);  // FinishStep's, with group_sq_sum_
  } else {
    const std::vector<at::Tensor> norms = at::_foreach_norm(master_grads_, 2);
    total = at::linalg_vector_norm(at::stack(norms), 2);
    std::vector<std::vector<at::Tensor>> by_group(groups_.size());
    for (size_t i = 0; i < norms.size(); ++i) by_group[param_group_[i]].push_back(norms[i]);
    for (size_t g = 0; g < groups_.size(); ++g) {
      group_sq_sum_.select(0, static_cast<int64_t>(g))
          .copy_(at::stack(by_group[g]).to(at::kDouble).pow(2).sum());
    }
  }
  at::Tensor found_inf = at::isfinite(total).logical_not().to(at::kFloat);
  if (options_.max_grad_norm > 0) {
    at::Tensor coef = (max_grad_norm_ / (total + 1e-6)).clamp_max(1.0);
    at::_foreach_mul_(master_grads_, coef);
  }
  // _fused_adamw_ reads but does not advance the step counters; a skipped step leaves them, and
  // so does a group no example reached (Note [Unreached groups]), which AdamW sees as found_inf.
  for (size_t k = 0; k < groups_.size(); ++k) {
    const at::Tensor skip = at::maximum(
        found_inf, group_sq_sum_.select(0, static_cast<int64_t>(k)).eq(0).to(at::kFloat));
    at::_foreach_add_(groups_[k].steps, 1.0 - skip);
    Group& g = groups[k];
    if (g.params.empty()) continue;
    at::_fused_adamw_(g.params, g.grads, g.exp_avg, g.exp_avg_sq, {}, g.steps, g.lr, options_.beta1,
                      options_.beta2, options_.weight_decay, options_.eps, /*amsgrad=*/false,
                      /*maximize=*/false, /*grad_scale=*/std::nullopt, skip);
  }
  if (mixed_precision()) {  // round the masters to the bf16 working weights
    std::vector<at::Tensor> masters;
    masters.reserve(master_weights_.size());
    for (const auto& named : master_weights_) masters.push_back(named.second);
    if (shards_) {
      const std::vector<at::Tensor> mine = shards_->Owned(masters);
      if (!mine.empty()) at::_foreach_copy_(shards_->Owned(params_), mine);
    } else {
      at::_foreach_copy_(params_, masters);
    }
  }
  at::_foreach_zero_(master_grads_);
  return {total, found_inf};
}

// Note [Sharded optimizer]: ZeRO stage 1 (Rajbhandari et al. 2020, section 5.1), with whole
// parameters as the unit (engine/optimizer_shards.h, PyTorch's ZeroRedundancyOptimizer's
// partition). Each trained parameter has one owner rank. In the step's last backward each
// bucket's gradients are SUM-reduced to their owners (one coalesced NCCL group per bucket, in
// place: half the bytes of an all-reduce); the owners' squared gradient norms are summed over
// the ranks (one float64 all-reduce) for clipping and the skip of a non-finite step; each rank
// runs AdamW on the parameters it owns only (1 / world_size of the optimizer's 12 bytes read and
// written per parameter: the largest kernel of a nanovlm-460m step); then every working weight
// is broadcast from its owner, in 8 chunks of parameters in order (one coalesced group each):
// in the micro-step's graph each chunk's AdamW runs, then its broadcast starts on NCCL's stream
// while the next chunk's AdamW runs. In a step of one bf16 micro-batch all of
// it is inside the micro-step's graph; otherwise the norm's all-reduce and the broadcast run
// eagerly around the optimizer's graph, which a rank may capture alone (PrepareAccumulation).
// A rank's master weights and moments of parameters it does not own go stale: they are kept
// allocated (a checkpoint holds every rank's state in the one-rank format, so it resumes at any
// world size) and GatherOptimizerState brings them back, by broadcasts from the owners, before
// a save or a read of the masters. The float32 parity of 2 ranks against one holds unchanged:
// a reduce sums what an all-reduce sums.
//
// Note [Weights broadcast in the forward]: the broadcast takes longer than the AdamW it overlaps
// (measured on 2 x H100, nanovlm-460m bf16: 2.1 ms of each step's broadcast ran with no kernel
// beside it). So in a step of one bf16 micro-batch (the direct graph) the chunks from
// forward_chunk_ on (the longest run of last chunks whose parameters the forward first reads in
// a decoder block: the blocks, the final norm, an untied head) are not broadcast after their
// AdamW but at the start of the next step's graph, on NCCL's stream while the vision encoder
// runs; the decoder's forward makes the compute stream wait for each chunk before the first block
// it holds (LanguageModelImpl::BlockHook, DataParallelGroup::FinishOldest): FSDP's forward
// prefetch of its all-gathers. What stays at the step's end (the vision encoder, the projector,
// the embedding) is broadcast beside the later chunks' AdamW. Between two steps the deferred
// working weights are current on their owners only: a step without the direct graph (several
// micro-batches) and GatherOptimizerState broadcast them first (FinishForwardBroadcast), so every
// read of the weights between steps goes through GatherOptimizerState. The first direct step
// re-broadcasts weights every rank already holds: harmless. DataParallelOptions::
// broadcast_in_forward = false keeps every chunk in its own step.
void Trainer::ShardedSquaredNorm(const std::vector<at::Tensor>& owned_grads) {
  at::NoGradGuard no_grad;
  SquaredNormsByGroup(owned_grads, owned_indices_);
  options_.data_parallel->StartAllReduceSum(group_sq_sum_);
  options_.data_parallel->FinishAllReduces();
  grad_sq_sum_.copy_(group_sq_sum_.sum());
}

void Trainer::SquaredNormsByGroup(const std::vector<at::Tensor>& grads,
                                  const std::vector<size_t>& indices) {
  at::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> by_group(groups_.size());
  for (size_t i = 0; i < grads.size() && i < indices.size(); ++i) {
    if (grads[i].defined()) by_group[param_group_[indices[i]]].push_back(grads[i]);
  }
  group_sq_sum_.zero_();
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (by_group[g].empty()) continue;
    at::Tensor sum = group_sq_sum_.select(0, static_cast<int64_t>(g));
    if (fused_) {
      AddSquaredNorm(by_group[g], sum);
    } else {
      sum.add_(at::stack(at::_foreach_norm(by_group[g], 2)).to(at::kDouble).pow(2).sum());
    }
  }
  grad_sq_sum_.copy_(group_sq_sum_.sum());
}

void Trainer::StartBroadcastChunk(size_t c) {
  std::vector<at::Tensor> weights;
  for (size_t k : broadcast_chunks_[c]) weights.push_back(params_[k]);
  options_.data_parallel->StartBroadcast(weights, shards_->Owners(broadcast_chunks_[c]));
}

void Trainer::BroadcastUpdatedWeights() {
  for (size_t c = 0; c < broadcast_chunks_.size(); ++c) StartBroadcastChunk(c);
  options_.data_parallel->FinishAllReduces();
}

void Trainer::FinishForwardBroadcast() {
  at::NoGradGuard no_grad;
  for (size_t c = forward_chunk_; c < broadcast_chunks_.size(); ++c) StartBroadcastChunk(c);
  options_.data_parallel->FinishAllReduces();
  forward_broadcast_pending_ = false;
}

void Trainer::GatherOptimizerState() {
  RequireAtRest("GatherOptimizerState");
  if (!shards_ || (optimizer_state_gathered_ && !forward_broadcast_pending_)) return;
  if (pending_)
    throw std::logic_error("Trainer::GatherOptimizerState: a step is in progress (BeginStep)");
  at::NoGradGuard no_grad;
  if (forward_broadcast_pending_) FinishForwardBroadcast();
  if (optimizer_state_gathered_) return;
  DataParallelGroup& group = *options_.data_parallel;
  for (const std::vector<at::Tensor>* list : {&adamw_.params, &adamw_.exp_avg, &adamw_.exp_avg_sq})
    group.StartBroadcast(*list, shards_->owners());
  group.FinishAllReduces();
  optimizer_state_gathered_ = true;
}

}  // namespace vlmgraph
