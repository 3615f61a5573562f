// engine/trainer.h: training steps replayed from CUDA graphs, one per training bucket.
//
// A training step is: for each micro-batch (gradient accumulation), forward + loss + backward,
// accumulating into persistent float32 gradients; then gradient-norm clipping, AdamW and zeroing
// the gradients in place. On CUDA with graphs on, each micro-batch bucket (batch x seq) is one
// captured graph and the optimizer part another; every persistent tensor they touch keeps its
// address (gradients zeroed in place, optimizer state preallocated, learning rates, step
// counters and the number of micro-batches are device tensors), so a learning-rate schedule or
// another batch size changes them without recapture. A batch with more examples than the largest
// train batch bucket is split into micro-batches that fit it (Note [Micro-batches] in
// trainer_step.cc), never run eagerly at its own size. CPU, graphs off, or a micro-batch longer
// than every bucket run the same code eagerly. On CUDA an
// eager run encodes the whole padded tile buffer as a graph does, so graphed and eager steps
// compute the same values; on the CPU it encodes the real tiles only. On CUDA each micro-batch
// (ids, targets, tiles in the compute dtype) is staged in pinned host memory and copied
// asynchronously.
//
//   TrainOptions opt;  opt.device = at::kCUDA;  opt.learning_rates.vision = 0;  // frozen
//   Trainer trainer(LoadModel(dir), opt);  // keeps its own copy and float32 master weights
//   trainer.Warmup();                      // captures every train bucket
//   TrainStepResult r = trainer.Step(examples);
//   trainer.SaveCheckpoint("out/");        // config.json, model.safetensors, optimizer.safetensors
//
// A step in pieces, for a thread that runs other work between micro-batches (the server's GPU
// thread decodes between them, server/core/scheduler.h):
//   trainer.BeginStep(examples);                     // checks and plans the micro-batches
//   while (!trainer.RunNextMicroBatch()) Decode();   // one forward + backward per call
//   TrainStepResult r = trainer.StepResult();        // the last call ran the optimizer part too
//
// Data parallel (TrainOptions::data_parallel): one Trainer per rank, each given its rank's shard
// of every global batch; the loss each Step reports is the global one, the token counts are the
// rank's. Save checkpoints on rank 0 (every rank holds the same weights and optimizer state); they
// load on any number of ranks.
//
// Formulas: loss = mean cross entropy over targets != -100 (upstream nanoVLM, ignore_index=-100),
// computed in float32 from the logits, divided by the step's number of micro-batches and summed
// over micro-batches, as nanoVLM's train.py does with its accumulation steps; clipping as
// torch.nn.utils.clip_grad_norm_ (total L2 norm, coef = min(1, max / (norm + 1e-6))); AdamW
// (Loshchilov & Hutter 2019) with decoupled weight decay, as at::_fused_adamw_ computes it. On CUDA
// the optimizer runs as the multi-tensor kernels of engine/fused_optimizer.h
// (TrainOptions::fused_optimizer), elsewhere as ATen's _foreach_* ops and _fused_adamw_.
//
// Precision (compute_dtype):
// - float32: the model's parameters are the master weights; backward accumulates into their
//   float32 .grad tensors, which clipping and AdamW read. 16 device bytes per trained parameter
//   (weight, grad, exp_avg, exp_avg_sq).
// - bfloat16 (CPU or CUDA): bf16 working weights + float32 master weights, as NVIDIA Apex amp O2
//   and Megatron-LM do (Micikevicius et al. 2018, "Mixed Precision Training"). The model's
//   parameters are bf16; the forward and backward run in bf16 without autocast (the loss upcasts
//   the logits to float32). The trainer owns float32 masters, float32 gradient accumulators and
//   the float32 AdamW state. The bf16 parameters have no persistent .grad: backward produces
//   transient bf16 gradients that each micro-step adds into the accumulators and then releases
//   (Note [Transient bf16 gradients] in trainer.cc), so accumulation over micro-batches is float32
//   and no kernel adds into or zeroes a bf16 gradient; the optimizer part clips the accumulators,
//   runs AdamW on the masters, copies the masters into the bf16 weights (round to nearest even)
//   and zeroes the accumulators. 18 persistent device bytes per trained parameter (bf16 weight 2 +
//   master 4 + accumulator 4 + exp_avg 4 + exp_avg_sq 4: the 16 of ZeRO, Rajbhandari et al. 2020,
//   with Megatron-LM's float32 main_grad accumulator in place of a float32 grad, plus the bf16
//   weight), plus up to 2 transient bytes (its bf16 gradient) during a backward (14 when the fused
//   optimizer runs inside a one-micro-batch step, without the accumulator, until a step with
//   several micro-batches needs one); 2 per frozen one
//   (plus a float32 host copy of it when the source model was not bf16, so checkpoints stay
//   exact).
//   SaveCheckpoint's model.safetensors and master_weights() carry the float32 masters;
//   optimizer.safetensors keeps its format (float32 exp_avg, exp_avg_sq, step). Against autocast
//   over float32 weights, each weight is rounded to bf16 once per step instead of once per use,
//   and its gradient is produced in bf16 instead of through a cast's float32 backward.
//
// Thread rules: one thread drives a Trainer (the engine's GPU thread in the server).
// Errors: EngineError(kInvalidArgument) at construction for a model whose config asks for dropout
// (vit_dropout or lm_dropout not 0: the model has no dropout layers), for a learning rate out of
// range (naming the field, LearningRates::Validate) or every rate 0; for bad examples (ids out of
// range, image-token count not matching tiles, targets length) and for a batch that no trained
// parameter can learn from (the language model is not trained and no example has an image);
// std::runtime_error for I/O (std::system_error naming the file and errno when a checkpoint cannot
// be written).
#pragma once

#include <ATen/Tensor.h>

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/bucket.h"
#include "engine/data_parallel.h"
#include "engine/device.h"
#include "engine/dispatch.h"
#include "engine/engine_types.h"
#include "engine/fused_optimizer.h"
#include "engine/gradient_reducer.h"
#include "engine/learning_rates.h"
#include "engine/step_runner.h"
#include "model/vision_language_model.h"

namespace vlmgraph {

struct TrainOptions {
  at::Device device = at::kCPU;
  // kFloat, or kBFloat16 (bf16 working weights + float32 masters; see the file comment)
  at::ScalarType compute_dtype = at::kFloat;
  // AdamW learning rate of each parameter group (Note [Learning rates] in
  // engine/learning_rates.h): upstream nanoVLM's by default; a group whose rate is 0 is frozen.
  // Validated at construction: finite and >= 0 (EngineError naming the field); the APIs also
  // bound them by LearningRates::kMaxLearningRate.
  LearningRates learning_rates;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  double max_grad_norm = 0;  // 0 = no clipping
  // Micro-batches per optimizer step, at least: a step takes more when its examples do not fit
  // the largest train batch bucket in this many (Note [Micro-batches] in trainer_step.cc).
  int64_t grad_accum_steps = 1;
  int64_t max_tiles_per_example = 1;  // image tiles each example may carry (sizes the tile buffers)
  bool cuda_graphs = true;
  BucketSpec buckets;  // train_batch_sizes x train_seq_lens
  // Run every micro-batch at its own shape (right-padded to its longest example), eagerly,
  // instead of padding it to a bucket and replaying that bucket's graph. Micro-batches are split
  // as with buckets: at most max(train_batch_sizes) examples each.
  bool exact_shapes = false;
  // Activation recomputation (model/recompute.h) of the vision encoder's / the decoder's blocks:
  // only each block's input is kept for the backward pass, which runs the block again. Same
  // losses and gradients; less peak memory for one more forward pass of those blocks.
  bool recompute_vision = false, recompute_language = false;
  // CUDA: the optimizer as the multi-tensor kernels of engine/fused_optimizer.h (gradient
  // accumulation fused with the norm; clipping, AdamW, the bf16 copy and the zeroing in one pass).
  // false, or CPU: ATen's _foreach_* ops and _fused_adamw_. Same formulas either way.
  bool fused_optimizer = true;
  bool log_captures = true;
  // Reports the trainer's work as the engine reports its own: OnCapture for each graph it captures
  // (its graphs are its own, captured when it first steps; the optimizer's as region train,
  // batch 0), OnEagerFallback for a micro-batch no bucket fits (one longer than every
  // train_seq_lens bucket), and per step one OnStep (the first micro-batch's bucket, the step's
  // seconds) and OnTokens. May be null; not owned; called
  // on the thread that drives the Trainer.
  EngineObserver* observer = nullptr;
  // Data parallelism (engine/data_parallel.h): this trainer is one rank of the group. Null or a
  // group of one: a single rank. With more ranks the trainer starts from rank 0's weights
  // (broadcast at construction), each Step takes this rank's shard of the global batch
  // (ShardForRank), and the gradients and the loss are averaged over the ranks in buckets of
  // DataParallelOptions::bucket_bytes that are all-reduced while the backward of the step's last
  // micro-batch still runs, inside its CUDA graph (Note [Overlapped all-reduce] in
  // engine/gradient_reducer.cc; the earlier micro-batches only accumulate, as DDP's no_sync), so
  // world_size ranks with grad_accum_steps a take the step one rank takes with grad_accum_steps
  // world_size * a. The gradients travel in DataParallelOptions::reduce_dtype (by default the
  // compute dtype): float32 reduction averages the float32 accumulators, which the optimizer
  // reads; bf16 reduction (bf16 training with the fused optimizer) averages the backward's bf16
  // gradients and runs AdamW on them inside the same graph, as one rank does (Note [Optimizer
  // inside the micro-step] in trainer.cc), except for steps of several micro-batches, which
  // accumulate in float32 and are reduced, rounded once, after their last backward. The
  // gradient norm (clipping, skipped steps) is taken after the average, on the global gradient.
  // Every rank must call Step the same number of times with shards that differ by at most one
  // example. A step that does not finish within the group's timeout_seconds (a rank died or hangs)
  // aborts the group and throws EngineError(kUnavailable) (Note [A rank that dies]); the trainer
  // is unusable afterwards.
  std::shared_ptr<DataParallelGroup> data_parallel;
};

struct TrainExample {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> targets;  // same length, -100 = no loss at that position
  // (N, 3, S, S) float in [0, 1] (float32, or already the trainer's compute dtype), or undefined
  at::Tensor tiles;
};

// Note [Staged tiles]: a step copies each example's tiles into the device's tile buffer. Tiles
// already in the compute dtype go there directly (an asynchronous DMA from pinned memory); other
// tiles are first converted on the host, on the step's path: ~1 ms per 512 px tile, during
// which the device idles (8 ms of a 75 ms nanovlm-460m step at 8 x 1024). StageTrainExample does
// that conversion ahead, as a PyTorch DataLoader's workers and pin_memory thread do: tiles to
// `compute_dtype`, in pinned host memory when `device` is CUDA. Call it where the examples are
// made (vlmgraph-train's prefetch thread, the Train RPC's handler), not on the thread that
// drives the trainer. Thread-safe; no-op without tiles.
void StageTrainExample(TrainExample& example, const at::Device& device,
                       at::ScalarType compute_dtype);

struct TrainStepResult {
  int64_t step = 0;      // optimizer steps taken so far (1 after the first)
  double loss = 0;       // as nanoVLM logs it: sum over micro-batches of mean loss / accum
  double grad_norm = 0;  // global L2 norm of the gradients before clipping (NaN / inf: skipped)
  // True when the gradients were not all finite: no weight or optimizer state changed (Note
  // [Skipped steps] in trainer_optimizer.cc); `step` still counts it.
  bool skipped = false;
  // The learning rate each group took this step (its rate x the schedule's factor); 0 for a
  // frozen group.
  LearningRates learning_rates;
  // Wall time of the step's own work: BeginStep and every RunNextMicroBatch call (not what the
  // caller ran between them), the step's host synchronisation included.
  double seconds = 0;
  // Data parallel: bytes of gradients (and loss) averaged over the ranks, and the host time the
  // thread waited for the all-reduces after the backward (gloo on the CPU: the exchange's part
  // that the backward did not hide; NCCL: ~0, the wait is queued on the stream or is part of the
  // step's graph). 0 with one rank.
  int64_t all_reduce_bytes = 0;
  double all_reduce_seconds = 0;
  std::vector<BucketKey> buckets;  // one per micro-batch, in order
  RunKind kind = RunKind::kEager;  // kCaptureAndReplay / kReplay when graphed
  int64_t target_tokens = 0, real_tokens = 0, padded_tokens = 0;
};

class Trainer {
 public:
  // Takes a deep copy of `model` onto options.device: float32 masters (the parameters themselves
  // in float32 mode) and, in bfloat16 mode, bf16 working parameters rounded from them.
  Trainer(VisionLanguageModel& model, TrainOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Captures the optimizer graph and every train bucket (CUDA with graphs). Idempotent; Step()
  // calls it on first use.
  void Warmup();

  // One optimizer step over `examples`, split in order into micro-batches (Note [Micro-batches]
  // in trainer_step.cc): BeginStep, RunNextMicroBatch until it returns true, StepResult.
  TrainStepResult Step(const std::vector<TrainExample>& examples);

  // Step() in pieces (Note [Micro-steps] in trainer_step.cc). BeginStep checks every example and
  // plans the micro-batches (captures the trainer's graphs on its first call, Warmup); nothing
  // changes when it throws. A BeginStep while another step is unfinished abandons that one.
  void BeginStep(std::vector<TrainExample> examples);
  // Runs the next micro-batch's forward + backward, adding its gradients into the accumulators;
  // the call that runs the last one also runs the optimizer part and the step's one host
  // synchronisation, and returns true. If it throws, the step is abandoned (AbandonStep).
  bool RunNextMicroBatch();
  // The step that the last RunNextMicroBatch completed (once; std::logic_error otherwise).
  TrainStepResult StepResult();
  // Drops an unfinished step: its gradients are zeroed, weights and optimizer state are as
  // before it began. No-op without one.
  void AbandonStep();
  bool step_in_progress() const { return pending_ != nullptr; }

  // Steps without the host in the way (Note [Submitted steps] in trainer_step.cc): Submit queues a
  // whole step (BeginStep's checks, every micro-batch, the optimizer part) and returns without
  // waiting for the device; Wait waits for the oldest submitted step and returns its result, as
  // Step() would have. Submitting step i + 1 before waiting for step i keeps the device busy
  // between steps:
  //   trainer.Submit(batch[0]);
  //   for (i = 0; i < n; ++i) {
  //     if (i + 1 < n) trainer.Submit(batch[i + 1]);  // queued behind step i
  //     TrainStepResult r = trainer.Wait();             // step i
  //   }
  // At most kMaxSubmittedSteps are unfinished (std::logic_error beyond, or while a BeginStep step
  // is). A SetLearningRateScale between two Submits applies to the later one. BeginStep, Step,
  // GatherOptimizerState, SaveCheckpoint and LoadOptimizerState need every submitted step waited
  // for (std::logic_error). Submit throws what BeginStep and RunNextMicroBatch throw, before the
  // step is queued (bad examples) or abandoning it; Wait throws what the synchronisation throws
  // (EngineError(kUnavailable) when a data-parallel rank died), and the step is then dropped.
  // TrainStepResult::seconds of a submitted step: the wall time from its Submit, or the end of the
  // step before it when that is later, to the end of its Wait (steady state: the step time).
  static constexpr size_t kMaxSubmittedSteps = 2;
  void Submit(std::vector<TrainExample> examples);
  TrainStepResult Wait();
  size_t submitted_steps() const { return in_flight_.size(); }

  // A schedule's factor: every group's rate becomes its configured rate x `scale` (as PyTorch's
  // LambdaLR multiplies each group's initial rate). The rates are device scalars: no recapture.
  void SetLearningRateScale(double scale);
  double learning_rate_scale() const { return lr_scale_; }
  // Each group's configured rate: options().learning_rates, or the rates LoadOptimizerState
  // took back from a checkpoint (0 for a frozen group).
  const LearningRates& learning_rates() const { return learning_rates_; }

  // Writes config.json + model.safetensors (nanoVLM format, float32 master weights, tied head once)
  // and optimizer.safetensors (exp_avg.*, exp_avg_sq.*, step.* per trained parameter; metadata
  // with the hyperparameters, each group's rate as learning_rate.<group> and the rate its last
  // step took as scheduled_learning_rate.<group>) into `dir`.
  void SaveCheckpoint(const std::string& dir);
  // Bytes SaveCheckpoint writes, at most: 4 per weight and buffer element (float32), 12 per
  // trained element (exp_avg, exp_avg_sq) and step scalar, 512 per tensor for the safetensors
  // headers, 64 KiB for config.json (a checkpoint quota's estimate,
  // server/train/checkpoint_quota.h).
  int64_t checkpoint_bytes() const;
  // Restores optimizer.safetensors written by SaveCheckpoint (the model's weights load with
  // LoadWeights): the AdamW state, the step count, each trained group's rate and the schedule's
  // factor (as torch.optim.Optimizer.load_state_dict restores each param group's lr; Note
  // [Learning rates]: a file with only "lr", from before per-group rates, gives every group that
  // rate).
  // Throws std::runtime_error naming a missing or mis-shaped state tensor, and saying which
  // group's rate to set to 0 when the checkpoint froze a group this trainer trains.
  void LoadOptimizerState(const std::string& path);
  // The sharded optimizer (DataParallelOptions::shard_optimizer, Note [Sharded optimizer] in
  // trainer_optimizer.cc) leaves each rank's master weights and AdamW moments of the parameters it
  // does not own stale after a step, and the working weights of the decoder's later blocks current
  // on their owners only (DataParallelOptions::broadcast_in_forward). Every rank must call this (a
  // collective: each tensor broadcast from its owner, blocking) before SaveCheckpoint or a read of
  // master_weights() or of model()'s weights; afterwards every rank holds what one rank would,
  // until the next step. A no-op when the optimizer is not
  // sharded or nothing changed since the last call. std::logic_error between BeginStep and the
  // step's end; EngineError(kUnavailable) when a rank died.
  void GatherOptimizerState();
  // Whether each rank runs the optimizer on its own shard of the parameters (ZeRO stage 1).
  bool optimizer_sharded() const { return shards_ != nullptr; }
  // DataParallelOptions::broadcast_in_forward in effect: the decoder block before which each
  // step's forward waits for the weights the previous step's AdamW left on their owners (Note
  // [Weights broadcast in the forward] in trainer_optimizer.cc); -1 when every weight is broadcast
  // in its own step.
  int64_t forward_broadcast_wait_block() const {
    return forward_wait_blocks_.empty() ? -1 : forward_wait_blocks_.front();
  }

  // The working model the steps run: float32, or bf16 parameters equal to the masters rounded to
  // bf16 after every step. Read the trained weights through master_weights(); with the sharded
  // optimizer, model()'s weights only after GatherOptimizerState too.
  VisionLanguageModel& model() { return model_; }
  // (name, float32 master) of every trained parameter, named as model()->named_parameters(), on
  // options().device. Updated in place by Step(): the tensors keep their addresses. With the
  // sharded optimizer only after GatherOptimizerState (SaveCheckpoint refuses to write before).
  const std::vector<std::pair<std::string, at::Tensor>>& master_weights() const {
    return master_weights_;
  }
  // float32 gradient accumulator of each master weight, in master_weights() order (the .grad of
  // the parameters in float32 mode). All zero between steps: the optimizer part zeroes them.
  // Empty while every step has been one bf16 micro-batch that ran the fused optimizer on the
  // backward's own gradients (CUDA, fused_optimizer, grad_accum_steps 1): the first step with
  // several micro-batches allocates them.
  const std::vector<at::Tensor>& gradient_accumulators() const { return master_grads_; }
  int64_t steps() const { return steps_; }
  int64_t skipped_steps() const { return skipped_steps_; }  // steps with non-finite gradients
  int64_t captures() const { return captures_; }
  int64_t replays() const { return replays_; }
  int64_t graph_pool_bytes() const;
  const TrainOptions& options() const { return options_; }

 private:
  struct Group;
  struct MicroBuffers;
  struct PendingStep;

  void ValidateExample(const TrainExample& e) const;
  // INVALID_ARGUMENT when no trained parameter is reached by any example of `examples`.
  void CheckSomethingLearns(const std::vector<TrainExample>& examples) const;
  // Returns the micro-batch's scaled loss (device scalar) after forward + backward. With the
  // optimizer inside the micro-step (`direct`), *optimizer_out gets {gradient norm, found_inf}.
  // `last`: the step's last micro-batch (data parallel: the one that all-reduces).
  at::Tensor MicroStep(const std::vector<const TrainExample*>& micro, bool direct, bool last,
                       BucketKey* key, RunKind* kind, int64_t* target_tokens,
                       std::vector<at::Tensor>* optimizer_out);
  // The step's last part: the all-reduce (data parallel), the optimizer, the host report's copy
  // and the event CompleteStep waits for.
  void FinishStep();
  // Waits for the step FinishStep queued (data parallel: with the group's deadline), counts it
  // and reads its report into s.result.
  void CompleteStep(PendingStep& s);
  // BeginStep after its check that no submitted step is unfinished; t0 starts result.seconds.
  void BeginStepAt(std::vector<TrainExample> examples, std::chrono::steady_clock::time_point t0);
  // The observer's OnStep and OnTokens for a finished step.
  void ReportStep(const TrainStepResult& r);
  // std::logic_error naming `call` while a submitted step is unfinished.
  void RequireAtRest(const char* call) const;
  // A trainer with direct_ about to take a step of several micro-batches: allocates the float32
  // accumulators and captures the optimizer graph (Note [Micro-batches]).
  void PrepareAccumulation();
  bool mixed_precision() const { return options_.compute_dtype != at::kFloat; }
  // Data parallel, bf16, fused: the gradients are all-reduced in bf16 (DataParallelOptions::
  // reduce_dtype) and the optimizer reads them as the reducer averaged them.
  bool reduce_bf16() const { return reducer_ && reducer_->reduce_dtype() == at::kBFloat16; }
  // Forward + backward over `buf`; with `direct` (Note [Optimizer inside the micro-step]) AdamW
  // too, on the backward's own gradients; with `reduce` (data parallel, the step's last
  // micro-batch) the gradient buckets and the loss are all-reduced during the backward.
  std::vector<at::Tensor> RunMicro(MicroBuffers& buf, bool direct, bool reduce);
  // Data parallel: EngineError(kUnavailable) when the group lost a peer (LostPeer).
  void CheckPeers() const;
  std::vector<at::Tensor> RunOptimizer();
  // Squared norm, step counters and FusedAdamW over `t` (Note [Skipped steps]); returns
  // {gradient norm (float64 device scalar), found_inf (float32, 1 = skipped)}. `direct`: t.grads
  // are the backward's bf16 gradients (the norm is taken of them).
  std::vector<at::Tensor> RunFusedAdamW(const AdamWTensors& t, bool direct);
  // Sharded optimizer (Note [Sharded optimizer]): group_sq_sum_ and grad_sq_sum_ of this rank's
  // owned gradients `owned_grads` (owned_indices_ order), summed over the ranks (an all-reduce,
  // waited for).
  void ShardedSquaredNorm(const std::vector<at::Tensor>& owned_grads);
  // Note [Unreached groups]: group_sq_sum_[g] = the sum of the squares of the gradients `grads`
  // of group g's parameters among `indices` (params_ order, one per gradient; undefined = zero),
  // and grad_sq_sum_ = their total.
  void SquaredNormsByGroup(const std::vector<at::Tensor>& grads,
                           const std::vector<size_t>& indices);
  // Sharded optimizer: every working weight (params_) takes its owner's updated values, chunk by
  // chunk (broadcast_chunks_), then the stream waits for them.
  void BroadcastUpdatedWeights();
  // Starts chunk c's broadcast (its weights from their owners) on the group's stream.
  void StartBroadcastChunk(size_t c);
  // Note [Weights broadcast in the forward]: the deferred chunks' broadcast, eagerly, waited for.
  void FinishForwardBroadcast();
  // Packs `micro` into pinned host memory and copies it into `buf`; `persistent`: buf is a
  // bucket's (kept for the trainer's life), uploaded through uploader_ (Note [Uploads beside the
  // step]); else copied directly.
  void FillBuffers(MicroBuffers& buf, const std::vector<const TrainExample*>& micro,
                   int64_t* target_tokens, bool persistent);
  // Static inputs sized for `key`; BuffersFor keeps one set per bucket for the graphs.
  std::unique_ptr<MicroBuffers> MakeBuffers(const BucketKey& key) const;
  MicroBuffers& BuffersFor(const BucketKey& key);

  VisionLanguageModel model_;
  TrainOptions options_;
  std::vector<Group> groups_;
  // Working parameters (compute dtype), their float32 gradient accumulators and their named
  // float32 masters, in the same order. In float32 mode the masters are the parameters and the
  // accumulators their .grad tensors; in bfloat16 mode the parameters' .grad is undefined outside
  // a backward.
  std::vector<at::Tensor> params_, master_grads_;
  std::vector<std::pair<std::string, at::Tensor>> master_weights_;
  // bfloat16 mode: float32 host copies of frozen parameters whose source was not bf16.
  std::map<std::string, at::Tensor> frozen_float32_;
  std::unique_ptr<StepRunner> runner_;
  std::unique_ptr<RegionDispatcher>
      dispatch_;  // over runner_: bucket or exact shape per micro-step
  std::map<BucketKey, std::unique_ptr<MicroBuffers>> buffers_;
  std::vector<at::Tensor> optimizer_outputs_;
  at::Tensor max_grad_norm_;  // device scalar
  // Fused optimizer (TrainOptions::fused_optimizer on CUDA): every group's AdamW lists in one
  // table, and the squared gradient norm (float64 device scalar) that the bf16 micro-steps'
  // accumulation leaves for clipping.
  bool fused_ = false;
  // bf16, fused, one micro-batch per step: AdamW runs inside the micro-step on the bf16 gradients,
  // there are no float32 accumulators and no optimizer graph (Note [Optimizer inside the
  // micro-step] in trainer.cc).
  bool direct_ = false;
  // Device float32 scalar: the current step's number of micro-batches, which divides each
  // micro-batch's mean loss (read by the captured micro-steps).
  at::Tensor micro_batches_;
  std::unique_ptr<PendingStep> pending_;       // BeginStep .. the last RunNextMicroBatch
  std::unique_ptr<TrainStepResult> finished_;  // .. StepResult
  // Submitted steps whose work is queued, oldest first (Submit .. Wait), and when the last Wait
  // returned.
  std::deque<std::unique_ptr<PendingStep>> in_flight_;
  std::chrono::steady_clock::time_point last_submitted_end_{};
  // The bucket buffers' uploads (Note [Uploads beside the step] in trainer_step.cc).
  std::unique_ptr<DeviceUploader> uploader_;
  AdamWTensors adamw_;
  at::Tensor grad_sq_sum_;
  // Note [Unreached groups]: float64 [groups], each group's squared gradient norm; each
  // parameter's group (params_ order); all parameter indices, and those this rank owns.
  at::Tensor group_sq_sum_;
  std::vector<size_t> param_group_, all_indices_, owned_indices_;
  bool warmed_up_ = false;
  int64_t steps_ = 0, skipped_steps_ = 0, captures_ = 0, replays_ = 0;
  LearningRates learning_rates_;  // configured: options_.learning_rates or a checkpoint's
  double lr_scale_ = 1;           // SetLearningRateScale
  // More than one rank (TrainOptions::data_parallel).
  bool data_parallel_ = false;
  // Data parallel with DataParallelOptions::shard_optimizer: each trained parameter's owner rank
  // (ZeRO stage 1); built before reducer_, which reduces each gradient to its owner.
  std::unique_ptr<OptimizerShards> shards_;
  // Per group (groups_ order): the entries this rank owns (the ATen optimizer's lists).
  std::vector<Group> owned_groups_;
  // The weights' broadcast after AdamW in chunks: parameter indices, in order.
  std::vector<std::vector<size_t>> broadcast_chunks_;
  // Note [Weights broadcast in the forward]: chunks [forward_chunk_, size) (none when
  // forward_chunk_ == broadcast_chunks_.size()) are broadcast at the start of the next direct
  // step, whose forward waits for chunk forward_chunk_ + i before decoder block
  // forward_wait_blocks_[i] (non-decreasing). forward_broadcast_pending_: a direct step left them
  // current on their owners only.
  size_t forward_chunk_ = 0;
  std::vector<int64_t> forward_wait_blocks_;
  bool forward_broadcast_pending_ = false;
  bool optimizer_state_gathered_ = true;  // GatherOptimizerState ran since the last step
  // Data parallel only: the gradient buckets and their all-reduces (engine/gradient_reducer.h).
  std::unique_ptr<GradientReducer> reducer_;
  // Data parallel: device float32 scalar, the step's loss summed over its micro-batches (the
  // graphs add into it) and, after the last micro-batch's all-reduce, over the ranks.
  at::Tensor dp_loss_sum_;
};

}  // namespace vlmgraph
