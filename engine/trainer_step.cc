// engine/trainer_step.cc: the Trainer's steps (engine/trainer.h): micro-batches filled and run
// (FillBuffers, MicroStep), a step begun, run a micro-batch at a time, submitted and waited for,
// completed and reported; Step, the one-call form. Set-up and graphs: engine/trainer.cc.
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "base/clock.h"
#include "base/log.h"
#include "engine/device.h"
#include "engine/gradient_reducer.h"
#include "engine/trainer.h"
#include "engine/trainer_internal.h"
#include "model/prompt_check.h"

namespace vlmgraph {

using trainer_internal::AccumulatingGraph;
using trainer_internal::Clock;
using trainer_internal::kOptimizerKey;
using trainer_internal::PlainBucket;

// Note [Uploads beside the step]: a bucket's static inputs (ids, targets, tiles: ~12 MiB of bf16
// tiles at 8 x 1024 with one 512 px tile each) go up through a DeviceUploader
// (engine/device.h): the transfer runs on a stream of its own into device staging tensors, and
// the step's stream only copies them device to device into the static buffers. Copied on the
// step's stream the transfer took ~0.5 ms between two steps with no kernel running (2 x H100
// trace); beside the step before (a submitted step, Note [Submitted steps]) it takes none of the
// step's stream. Buffers made for one exact-shape run are copied directly.
void Trainer::FillBuffers(MicroBuffers& buf, const std::vector<const TrainExample*>& micro,
                          int64_t* target_tokens, bool persistent) {
  const int64_t b = buf.key.batch, s = buf.key.seq;
  const int64_t pad = model_->cfg.pad_token_id();
  // The batch is staged in pinned host memory for a CUDA device, so the host->device copies are
  // asynchronous DMA. The caching host allocator keeps each pinned block until its copy is done,
  // so the staging tensors may die at the end of this function.
  const bool pinned = options_.device.is_cuda();
  auto host = at::TensorOptions().pinned_memory(pinned);
  at::Tensor ids = at::full({b, s}, pad, host.dtype(at::kLong));
  at::Tensor targets = at::full({b, s}, -100, host.dtype(at::kLong));
  int64_t* ids_p = ids.data_ptr<int64_t>();
  int64_t* tgt_p = targets.data_ptr<int64_t>();
  std::vector<at::Tensor> tiles;
  int64_t n_tiles = 0;
  bool tiles_on_host = true;
  for (size_t i = 0; i < micro.size(); ++i) {
    const auto& e = *micro[i];
    std::copy(e.input_ids.begin(), e.input_ids.end(), ids_p + i * s);
    std::copy(e.targets.begin(), e.targets.end(), tgt_p + i * s);
    for (int64_t t : e.targets) *target_tokens += t != -100;
    if (e.tiles.defined() && e.tiles.numel() > 0) {
      tiles.push_back(e.tiles);
      n_tiles += e.tiles.size(0);
      tiles_on_host = tiles_on_host && e.tiles.is_cpu();
    }
  }
  // Note [Uploads beside the step]: the host tensors and where they go, copied together.
  std::vector<at::Tensor> from = {ids, targets}, to = {buf.ids, buf.targets};
  buf.real_tiles = n_tiles;
  // Stale tiles beyond n_tiles are never selected by an image token: no need to clear them.
  if (buf.tiles.defined() && n_tiles > 0) {
    at::Tensor dst = buf.tiles.narrow(0, 0, n_tiles);
    bool in_compute_dtype = true;  // Note [Staged tiles]
    for (const at::Tensor& t : tiles)
      in_compute_dtype = in_compute_dtype && t.scalar_type() == dst.scalar_type();
    if (!tiles_on_host) {
      dst.copy_(at::cat(tiles, 0));
    } else if (in_compute_dtype) {
      int64_t offset = 0;
      for (const at::Tensor& t : tiles) {
        from.push_back(t);
        to.push_back(dst.narrow(0, offset, t.size(0)));
        offset += t.size(0);
      }
    } else {
      // Concatenated and converted to the compute dtype on the host: bf16 halves the bytes
      // copied.
      at::Tensor staged = at::empty(dst.sizes(), host.dtype(dst.scalar_type()));
      at::cat_out(staged, tiles, 0);
      from.push_back(staged);
      to.push_back(dst);
    }
  }
  if (persistent) {
    uploader_->Upload(from, to);
    return;
  }
  for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i], /*non_blocking=*/true);
}

at::Tensor Trainer::MicroStep(const std::vector<const TrainExample*>& micro, bool direct, bool last,
                              BucketKey* key, RunKind* kind, int64_t* target_tokens,
                              std::vector<at::Tensor>* optimizer_out) {
  // bf16 reduction: a step of several micro-batches reduces after its last one (FinishStep).
  const bool reduce = data_parallel_ && last && (!reduce_bf16() || direct);
  int64_t max_len = 0;
  for (const auto* e : micro) max_len = std::max<int64_t>(max_len, e->input_ids.size());
  const int64_t n = static_cast<int64_t>(micro.size());
  std::optional<BucketKey> graph =
      options_.exact_shapes ? std::nullopt : options_.buckets.PickTrain(n, max_len);
  bool captured = false;
  // The second graph of a bucket: micro-batches that accumulate without the optimizer (direct_)
  // or without the all-reduce (data parallel, Note [Overlapped all-reduce] in
  // engine/gradient_reducer.cc).
  const bool accumulating = (direct_ && !direct) || (data_parallel_ && !reduce);
  if (graph && accumulating) graph = AccumulatingGraph(*graph);
  if (graph && runner_->captures() && !runner_->Has(*graph)) {
    // Only accumulating graphs are captured here (Warmup captured the rest). Their warm-up runs
    // and capture see neutral inputs (every target -100: zero loss, zero gradients), so the
    // accumulators keep what earlier micro-batches of this step added.
    if (!accumulating) {
      throw EngineError(EngineError::Code::kInternal,
                        "train bucket " + graph->Label() + " was not captured by Warmup");
    }
    MicroBuffers& buf = BuffersFor(PlainBucket(*graph));
    buf.targets.fill_(-100);
    const double seconds =
        runner_->Capture(*graph, [this, &buf] { return RunMicro(buf, false, /*reduce=*/false); });
    ++captures_;
    captured = true;
    if (options_.observer) options_.observer->OnCapture(PlainBucket(*graph), seconds);
  }
  std::unique_ptr<MicroBuffers> exact_buffers;
  const DispatchResult r = dispatch_->Run(
      graph, BucketKey{Region::kTrain, n, max_len, 0},
      [&](const BucketKey& k) -> RegionFn {
        MicroBuffers& buf = BuffersFor(PlainBucket(k));
        FillBuffers(buf, micro, target_tokens, /*persistent=*/true);
        return [this, &buf, direct, reduce] { return RunMicro(buf, direct, reduce); };
      },
      [&] {
        exact_buffers = MakeBuffers(BucketKey{Region::kTrain, n, max_len, 0});
        FillBuffers(*exact_buffers, micro, target_tokens, /*persistent=*/false);
        return RunMicro(*exact_buffers, direct, reduce);
      },
      /*exact_requested=*/options_.exact_shapes);
  *key = PlainBucket(r.key);
  *kind = r.kind;
  if (r.kind == RunKind::kCaptureAndReplay) {
    ++captures_;
    if (options_.observer) options_.observer->OnCapture(*key, r.seconds);
  }
  if (captured && r.kind == RunKind::kReplay) *kind = RunKind::kCaptureAndReplay;
  if (r.kind != RunKind::kEager) ++replays_;
  if (!r.bucketed) {
    if (r.outputs.size() > 2) *optimizer_out = {r.outputs[1], r.outputs[2]};
    return r.outputs[0];
  }
  // A bucket's static outputs are overwritten by its next replay: clone them.
  if (r.outputs.size() > 2) *optimizer_out = {r.outputs[1].clone(), r.outputs[2].clone()};
  return r.outputs[0].clone();
}

void Trainer::CheckSomethingLearns(const std::vector<TrainExample>& examples) const {
  // The language model's parameters see every token; the vision encoder's and the projector's
  // only what an image reaches.
  std::string trained;
  for (const auto& g : groups_) {
    if (g.name == "language") return;
    trained += (trained.empty() ? "" : " and ") + g.name;
  }
  for (const auto& e : examples) {
    if (TileCount(e.tiles) > 0) return;
  }
  throw EngineError::InvalidArgument(
      "no trained parameter can learn from this batch: the job trains only the " + trained +
      ", which see images only, and no example has an image; send examples with "
      "images, or train the language model too (with a learning rate above 0)");
}

// Note [Micro-batches]: a step's examples are split in order into contiguous micro-batches (as
// ShardForRank splits a global batch): at least grad_accum_steps of them, and more when the
// examples would not fit the largest train batch bucket, so no micro-batch has more rows than a
// bucket and none runs eagerly for its row count. With n examples, B = max(train_batch_sizes) and
// a = grad_accum_steps: count = max(a, ceil(n / B)) micro-batches of ceil(n / count) examples (the
// last may be smaller, and there are fewer when ceil(n / count) rounds up). Each micro-batch's
// mean loss is divided by the number of micro-batches the step has (a device scalar, so one
// graph serves any count) and the gradients add up in the float32 accumulators: exactly the step
// that grad_accum_steps = count takes, nanoVLM's gradient accumulation. (Like nanoVLM's, it is
// the mean of micro-batch means, not the mean over every target of the batch.)
//
// A trainer that runs AdamW inside the micro-step (direct_, Note [Optimizer inside the
// micro-step]) does so for steps of one micro-batch only. Its first step with several
// micro-batches allocates the float32 accumulators it had saved (4 bytes per trained parameter)
// and captures the optimizer graph (PrepareAccumulation), and each bucket's accumulating
// micro-step graph is captured the first time a micro-batch uses it (MicroStep); one-micro-batch
// steps keep their graphs.
//
// Note [Micro-steps]: BeginStep, each RunNextMicroBatch and StepResult are separate calls, so the
// thread that drives the trainer may run other work between micro-batches: the server's GPU
// thread runs a decode step between them (server/core/scheduler.h, Note [Interleaving bound]), so
// one micro-batch's forward + backward (the last one with the optimizer part) is the most a decode
// waits for. The step's state (accumulated gradients, the device loss sum) lives on the device
// between the calls; nothing else may use the trainer meanwhile.
void Trainer::BeginStep(std::vector<TrainExample> examples) {
  RequireAtRest("BeginStep");
  BeginStepAt(std::move(examples), Clock::now());
}

void Trainer::BeginStepAt(std::vector<TrainExample> examples, Clock::time_point t0) {
  AbandonStep();
  finished_.reset();
  if (examples.empty())
    throw EngineError::InvalidArgument("a training step needs at least one example");
  for (const auto& e : examples) ValidateExample(e);
  // With data parallelism a rank whose shard has no image still takes part (its micro-batches
  // add zero gradients); only a single rank refuses such a step.
  if (!data_parallel_) CheckSomethingLearns(examples);
  Warmup();
  if (data_parallel_) {  // Note [A rank that dies]
    CheckPeers();
    options_.data_parallel->ArmStepWatchdog();
  }
  auto step = std::make_unique<PendingStep>();
  const int64_t n = static_cast<int64_t>(examples.size());
  const int64_t max_rows = options_.buckets.train_batch_sizes.back();
  const int64_t count = std::max(options_.grad_accum_steps, (n + max_rows - 1) / max_rows);
  const int64_t per_micro = (n + count - 1) / count;
  for (int64_t i = 0; i < n; i += per_micro) step->starts.push_back(static_cast<size_t>(i));
  step->starts.push_back(static_cast<size_t>(n));
  const int64_t micro_batches = static_cast<int64_t>(step->starts.size()) - 1;
  step->direct = direct_ && micro_batches == 1;
  if (direct_ && micro_batches > 1) PrepareAccumulation();
  // Note [Weights broadcast in the forward]: only the direct micro-step's graph broadcasts the
  // weights the last direct step deferred; any other step has them broadcast first.
  if (!step->direct && forward_broadcast_pending_) FinishForwardBroadcast();
  if (step->direct && forward_chunk_ < broadcast_chunks_.size()) forward_broadcast_pending_ = true;
  // Data parallel: the SUM over the ranks then averages (Note [Overlapped all-reduce],
  // engine/gradient_reducer.cc).
  micro_batches_.fill_(static_cast<double>(
      micro_batches * (data_parallel_ ? options_.data_parallel->world_size() : 1)));
  if (data_parallel_) {
    dp_loss_sum_.zero_();
    reducer_->ResetWaitSeconds();
  }
  step->loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(options_.device));
  TrainStepResult& r = step->result;
  r.learning_rates = LearningRates::All(0);
  for (const auto& g : groups_)
    *r.learning_rates.Find(g.name) = *learning_rates_.Find(g.name) * lr_scale_;
  r.kind = RunKind::kReplay;
  step->examples = std::move(examples);
  r.seconds = SecondsSince(t0);
  pending_ = std::move(step);
}

bool Trainer::RunNextMicroBatch() {
  if (!pending_) throw std::logic_error("Trainer::RunNextMicroBatch: no step begun (BeginStep)");
  const auto t0 = Clock::now();
  PendingStep& s = *pending_;
  TrainStepResult& r = s.result;
  bool last = false;
  try {
    const size_t m = s.next++;
    last = s.next + 1 == s.starts.size();
    std::vector<const TrainExample*> micro;
    for (size_t i = s.starts[m]; i < s.starts[m + 1]; ++i) {
      micro.push_back(&s.examples[i]);
      r.real_tokens += static_cast<int64_t>(s.examples[i].input_ids.size());
    }
    BucketKey key;
    RunKind kind;
    s.loss_sum += MicroStep(micro, s.direct, last, &key, &kind, &r.target_tokens, &s.optimizer_out);
    r.buckets.push_back(key);
    r.padded_tokens += key.batch * key.seq;
    if (kind == RunKind::kEager) r.kind = RunKind::kEager;
    if (kind == RunKind::kCaptureAndReplay && r.kind != RunKind::kEager)
      r.kind = RunKind::kCaptureAndReplay;
    if (last) {
      FinishStep();
      if (!s.submitted) CompleteStep(s);
    }
  } catch (...) {
    try {
      AbandonStep();
    } catch (...) {  // e.g. the device failed: the original error says more
    }
    throw;
  }
  r.seconds += SecondsSince(t0);
  if (!last) return false;
  if (s.submitted) {
    in_flight_.push_back(std::move(pending_));
    return true;
  }
  finished_ = std::make_unique<TrainStepResult>(std::move(r));
  pending_.reset();
  ReportStep(*finished_);
  return true;
}

void Trainer::ReportStep(const TrainStepResult& r) {
  if (!options_.observer) return;
  // One step of region train: its first micro-batch's bucket.
  options_.observer->OnStep(r.buckets.front(), r.kind != RunKind::kEager, r.seconds);
  options_.observer->OnTokens(Region::kTrain, r.real_tokens, r.padded_tokens);
}

// Note [Submitted steps]: Step() ends with the step's one host synchronisation (its loss, norm
// and found_inf), so between two Step() calls the device waits for the host: the report's round
// trip, the next step's checks and packing, its launches (measured on 2 x H100, nanovlm-460m bf16
// 8 x 1024: ~0.3 ms, then ~0.5 ms of tile uploads, of an 83 ms step). Submit queues a whole step
// and returns; Wait completes the oldest submitted step. With one step submitted ahead, the host
// prepares and launches step i + 1 while step i runs, and step i + 1's uploads run beside step
// i's kernels (Note [Uploads beside the step]): the device goes from one step to the next without
// waiting, as a PyTorch loop that reads loss.item() only after queuing the next step. Stream order
// keeps every step's effects as Step() has them (same results, bit for bit): a step's inputs are
// written into the static buffers after the step before has read them, its learning rates are
// the device scalars SetLearningRateScale wrote before its Submit. At most two steps are
// unfinished; the calls that need the trainer at rest (BeginStep, Step, GatherOptimizerState,
// SaveCheckpoint, LoadOptimizerState) refuse while any is. Data parallel: each Wait waits with the
// group's deadline, and the step watchdog stays armed while a step is unfinished.
void Trainer::Submit(std::vector<TrainExample> examples) {
  const auto t0 = Clock::now();
  if (pending_) {
    throw std::logic_error(
        "Trainer::Submit: a step begun with BeginStep is unfinished (RunNextMicroBatch)");
  }
  if (in_flight_.size() >= kMaxSubmittedSteps) {
    throw std::logic_error("Trainer::Submit: " + std::to_string(in_flight_.size()) +
                           " submitted steps unfinished: call Wait before submitting another");
  }
  BeginStepAt(std::move(examples), t0);
  pending_->submitted = true;
  pending_->submitted_at = t0;
  while (!RunNextMicroBatch()) {
  }
}

TrainStepResult Trainer::Wait() {
  if (in_flight_.empty()) throw std::logic_error("Trainer::Wait: no submitted step (Submit)");
  std::unique_ptr<PendingStep> s = std::move(in_flight_.front());
  in_flight_.pop_front();
  CompleteStep(*s);
  // Its share of the wall time: from its Submit, or the end of the step before it when that was
  // later, to now.
  const Clock::time_point end = Clock::now();
  s->result.seconds =
      std::chrono::duration<double>(end - std::max(s->submitted_at, last_submitted_end_)).count();
  last_submitted_end_ = end;
  ReportStep(s->result);
  return std::move(s->result);
}

void Trainer::FinishStep() {
  PendingStep& s = *pending_;
  TrainStepResult& r = s.result;
  if (data_parallel_) {
    // The last micro-batch averaged the gradients and the loss over the ranks (Note [Overlapped
    // all-reduce]): the optimizer below sees the global gradient on every rank.
    // bf16 reduction of several micro-batches: the accumulated gradients are rounded into the
    // buckets and averaged here, eagerly (its collectives pair with those the other ranks run).
    if (reduce_bf16() && !s.direct) reducer_->ReduceAccumulated(master_grads_, dp_loss_sum_);
    r.all_reduce_bytes = reducer_->bytes_per_step();
    r.all_reduce_seconds = reducer_->wait_seconds();
    s.loss_sum = dp_loss_sum_.squeeze(0);
  }
  if (!s.direct) {
    // Note [Sharded optimizer]: the collectives stay outside the optimizer's graph, which a rank
    // may capture alone (PrepareAccumulation).
    if (shards_) {
      ShardedSquaredNorm(
          shards_->Owned(reduce_bf16() ? reducer_->reduced_gradients() : master_grads_));
    }
    const RunKind opt_kind = runner_->Run(
        kOptimizerKey, [this] { return RunOptimizer(); }, runner_->captures(), &s.optimizer_out);
    if (opt_kind != RunKind::kEager) ++replays_;
    if (shards_) BroadcastUpdatedWeights();
  }
  if (shards_) optimizer_state_gathered_ = false;
  // The step's one host synchronisation: loss, gradient norm and found_inf together, queued
  // behind the step and copied into pinned host memory, so the wait (CompleteStep) covers the
  // copy too (one round trip to the device, not two).
  at::Tensor on_device =
      at::stack({s.loss_sum.to(at::kDouble), s.optimizer_out.at(0).to(at::kDouble),
                 s.optimizer_out.at(1).to(at::kDouble)});
  s.report = at::empty(
      {3}, at::TensorOptions().dtype(at::kDouble).pinned_memory(options_.device.is_cuda()));
  s.report.copy_(on_device, /*non_blocking=*/true);
  s.done = std::make_unique<DeviceEvent>(options_.device);
  s.done->Record();
}

void Trainer::CompleteStep(PendingStep& s) {
  TrainStepResult& r = s.result;
  // Note [A rank that dies]: with NCCL a collective whose peer died never completes, and a
  // replayed graph cannot time out by itself (c10d's watchdog does not see captured collectives).
  // So a data-parallel rank waits for its step with the group's deadline; past it the step fails
  // with kUnavailable. The collective still occupies the device: ncclCommAbort does not end a
  // kernel of a replayed graph (measured on 2 H100s: c10d's abort itself timed out after 20 s and
  // the process hung), and anything that waits for the device (freeing the graphs' memory,
  // cudaDeviceSynchronize) would hang, so the process must end without waiting for the device:
  // vlmgraph-train prints the error and exits (std::_Exit) at once, as torchrun's agent ends the
  // job's other ranks. A host thread that blocks before it gets here (in FinishStep or a later
  // Submit: the CUDA runtime may block behind the hung kernel) is ended by the group's step
  // watchdog (DataParallelGroup::ArmStepWatchdog), which takes the process down 5 s later.
  if (data_parallel_ && options_.device.is_cuda()) {
    const double timeout = options_.data_parallel->options().timeout_seconds;
    if (!s.done->WaitFor(timeout)) {
      throw EngineError(EngineError::Code::kUnavailable,
                        "data parallel rank " + std::to_string(options_.data_parallel->rank()) +
                            ": the step did not finish within " + LogFormat("%g", timeout) +
                            " s (timeout_seconds): a rank died or hangs; the job ends");
    }
  } else {
    s.done->Synchronize();
  }
  if (data_parallel_) {
    // A later submitted step is still running: the watchdog guards it from now on.
    if (in_flight_.empty()) {
      options_.data_parallel->DisarmStepWatchdog();
    } else {
      options_.data_parallel->ArmStepWatchdog();
    }
    // A collective whose peer was lost may have returned without reducing (Note [Heartbeats] in
    // engine/data_parallel.cc): such a step must not count.
    CheckPeers();
  }
  ++steps_;
  r.step = steps_;
  const double* v = s.report.data_ptr<double>();
  r.loss = v[0];
  r.grad_norm = v[1];
  r.skipped = v[2] != 0;
  if (r.skipped) ++skipped_steps_;
}

void Trainer::PrepareAccumulation() {
  if (!master_grads_.empty()) return;
  at::NoGradGuard no_grad;
  for (auto& g : groups_) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      g.grads[i] = at::zeros_like(g.params[i]);
      master_grads_.push_back(g.grads[i]);
    }
  }
  adamw_.grads = master_grads_;
  if (!runner_->captures() || runner_->Has(kOptimizerKey)) return;
  // Captured before any gradient is accumulated, on a NaN gradient norm: its warm-up runs and
  // capture are skipped steps (Note [Skipped steps]) that change no weight, moment or counter
  // and zero the (zero) accumulators. The accumulating micro-steps zero the norm before they add
  // into it.
  grad_sq_sum_.fill_(std::numeric_limits<double>::quiet_NaN());
  // bf16 reduction: the optimizer takes the norm of the buckets' gradients, which every step
  // overwrites before it reads them.
  if (reduce_bf16()) {
    for (const at::Tensor& g : reducer_->reduced_gradients())
      g.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  const double seconds = runner_->Capture(kOptimizerKey, [this] { return RunOptimizer(); });
  grad_sq_sum_.zero_();
  ++captures_;
  if (options_.observer) options_.observer->OnCapture(kOptimizerKey, seconds);
}

TrainStepResult Trainer::StepResult() {
  if (!finished_) {
    throw std::logic_error(
        "Trainer::StepResult: no finished step (call RunNextMicroBatch until it returns true)");
  }
  TrainStepResult r = std::move(*finished_);
  finished_.reset();
  return r;
}

void Trainer::AbandonStep() {
  if (!pending_) return;
  pending_.reset();
  if (data_parallel_) options_.data_parallel->DisarmStepWatchdog();
  at::NoGradGuard no_grad;
  if (!master_grads_.empty()) at::_foreach_zero_(master_grads_);
  if (mixed_precision()) {
    for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
  }
  grad_sq_sum_.zero_();
  group_sq_sum_.zero_();
}

TrainStepResult Trainer::Step(const std::vector<TrainExample>& examples) {
  BeginStep(examples);
  while (!RunNextMicroBatch()) {
  }
  return StepResult();
}

void Trainer::SetLearningRateScale(double scale) {
  lr_scale_ = scale;
  for (auto& g : groups_) g.lr.fill_(*learning_rates_.Find(g.name) * scale);
}

void Trainer::RequireAtRest(const char* call) const {
  if (in_flight_.empty()) return;
  throw std::logic_error(std::string("Trainer::") + call + ": " +
                         std::to_string(in_flight_.size()) +
                         " submitted step(s) unfinished: call Wait first (Note [Submitted steps])");
}

}  // namespace vlmgraph
