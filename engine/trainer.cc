#include "engine/trainer.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "base/clock.h"
#include "base/log.h"
#include "base/safetensors.h"
#include "engine/device.h"
#include "engine/gradient_reducer.h"
#include "engine/trainer_internal.h"
#include "model/checkpoint.h"
#include "model/prompt_check.h"
#include "model/weight_init.h"

namespace vlmgraph {
namespace {

using Clock = std::chrono::steady_clock;

// The optimizer part's graph key (no batch or sequence shape).
const BucketKey kOptimizerKey{Region::kTrain, 0, 0, 0};

// A trainer that runs AdamW inside its one-micro-batch steps (Note [Optimizer inside the
// micro-step]) keeps a second graph per bucket for the micro-steps of steps with several
// micro-batches, which accumulate instead (Note [Micro-batches]). BucketKey::tiles, which region
// train does not use and Label() does not show, tells the two graphs apart.
BucketKey AccumulatingGraph(BucketKey bucket) {
  bucket.tiles = 1;
  return bucket;
}
BucketKey PlainBucket(BucketKey key) {
  key.tiles = 0;
  return key;
}

}  // namespace

// Static inputs of one training bucket: examples right-padded with a pad id and target -100,
// missing rows all -100, missing tiles zero (their embeddings are never selected).
struct Trainer::MicroBuffers {
  BucketKey key;
  at::Tensor ids;      // (b, s) int64
  at::Tensor targets;  // (b, s) int64
  at::Tensor tiles;    // (b * max_tiles_per_example, 3, S, S) compute dtype, or undefined
  // Tiles the current micro-batch filled (CPU eager runs encode only these).
  int64_t real_tiles = 0;
};

// A step between BeginStep and its last RunNextMicroBatch.
struct Trainer::PendingStep {
  std::vector<TrainExample> examples;
  std::vector<size_t> starts;  // micro-batch i: examples [starts[i], starts[i + 1])
  size_t next = 0;             // the micro-batch RunNextMicroBatch runs next
  bool direct = false;         // AdamW inside the one micro-step (Note [Optimizer inside ...])
  at::Tensor loss_sum;         // device float32 scalar: the sum of the scaled micro-batch losses
  std::vector<at::Tensor> optimizer_out;  // device scalars: gradient norm, found_inf
  TrainStepResult result;
  // Submit's steps (Note [Submitted steps]): completed by Wait, not by the last micro-batch.
  bool submitted = false;
  Clock::time_point submitted_at;
  // FinishStep .. CompleteStep: {loss, gradient norm, found_inf} in pinned host memory, and the
  // point of the stream after the step's work and that copy.
  at::Tensor report;
  std::unique_ptr<DeviceEvent> done;
};

namespace {
// A model of `cfg` whose parameters are about to be overwritten: nanoVLM's random initialisation
// (seconds on the CPU for nanovlm-460m) is skipped.
VisionLanguageModel UninitialisedModel(const VlmConfig& cfg) {
  SkipWeightInit skip;
  return VisionLanguageModel(cfg);
}
}  // namespace

Trainer::Trainer(VisionLanguageModel& source, TrainOptions options)
    : model_(UninitialisedModel(source->cfg)), options_(std::move(options)) {
  try {
    options_.buckets.Validate();
  } catch (const std::invalid_argument& e) {
    throw EngineError::InvalidArgument(e.what());
  }
  if (options_.grad_accum_steps < 1)
    throw EngineError::InvalidArgument("grad_accum_steps must be >= 1");
  // Any finite rate >= 0: the APIs' [0, 1] is theirs (Note [Learning rates]).
  options_.learning_rates.Validate(std::numeric_limits<double>::infinity());
  learning_rates_ = options_.learning_rates;
  // The model has no dropout layers (upstream nanoVLM's configs set both rates to 0): a checkpoint
  // asking for dropout would silently train without it.
  if (source->cfg.vit_dropout != 0 || source->cfg.lm_dropout != 0) {
    throw EngineError::InvalidArgument(
        "the model's config.json asks for dropout (vit_dropout " +
        LogFormat("%g", source->cfg.vit_dropout) + ", lm_dropout " +
        LogFormat("%g", source->cfg.lm_dropout) +
        "), which the trainer does not apply: set both to 0 in config.json to train "
        "this checkpoint (serving ignores them, as evaluation mode does)");
  }
  if (options_.compute_dtype != at::kFloat && options_.compute_dtype != at::kBFloat16)
    throw EngineError::InvalidArgument("compute_dtype must be float32 or bfloat16");
  model_->vision_encoder->recompute_blocks = options_.recompute_vision;
  model_->decoder->recompute_blocks = options_.recompute_language;
  {
    // Deep float32 copy on the device: the trainer's master weights never alias the inference
    // engine's. Each parameter and buffer first gets fresh storage on the device (float32 where
    // floating, as Module::to(device, kFloat) would give, but without copying the uninitialised
    // CPU values there); copy_ then moves the source (wherever it lives) once and converts a bf16
    // source on the device.
    torch::NoGradGuard no_grad;
    auto on_device = [&](const at::Tensor& t) {
      const at::ScalarType dtype = t.is_floating_point() ? at::kFloat : t.scalar_type();
      return at::empty(t.sizes(), t.options().device(options_.device).dtype(dtype));
    };
    for (auto& p : model_->parameters()) p.set_data(on_device(p));
    for (auto& b : model_->buffers()) b.set_data(on_device(b));
    auto src = source->named_parameters();
    for (auto& p : model_->named_parameters()) p.value().copy_(src[p.key()].to(options_.device));
    auto src_buf = source->named_buffers();
    for (auto& b : model_->named_buffers()) b.value().copy_(src_buf[b.key()].to(options_.device));
    // Every rank starts from rank 0's weights, as DDP's constructor broadcasts them.
    if (options_.data_parallel && options_.data_parallel->world_size() > 1) {
      data_parallel_ = true;
      std::vector<at::Tensor> state;
      for (auto& p : model_->parameters()) state.push_back(p);
      for (auto& b : model_->buffers()) state.push_back(b);
      options_.data_parallel->Broadcast(state, 0);
    }
  }
  model_->train();
  // Each group's parameters (nanoVLM's module names); a group whose rate is 0 is frozen (Note
  // [Learning rates] in engine/learning_rates.h).
  struct Spec {
    const char* name;
    const char* prefix;
    double lr;
    bool train;
  };
  const LearningRates& rates = options_.learning_rates;
  const Spec specs[] = {
      {"vision", "vision_encoder.", rates.vision, rates.vision > 0},
      {"projector", "MP.", rates.projector, rates.projector > 0},
      {"language", "decoder.", rates.language, rates.language > 0},
  };
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(options_.device);
  const bool mixed = mixed_precision();
  fused_ = options_.fused_optimizer && FusedOptimizerAvailable(options_.device);
  // Note [Optimizer inside the micro-step]: with one bf16 micro-batch per step and the fused
  // optimizer, AdamW runs at the end of the micro-step (the same graph) on the backward's own bf16
  // gradients: no float32 accumulators (4 bytes per trained parameter, 1.8 GB for nanovlm-460m),
  // no accumulation pass, and the optimizer reads 2 gradient bytes per parameter instead of 4
  // and writes none.
  // With data parallelism only where the gradients are reduced in bf16: the optimizer then reads
  // the backward's bf16 gradients once they are averaged in place (Note [Overlapped all-reduce]
  // in engine/gradient_reducer.cc).
  const bool reduce_bf16 = data_parallel_ && mixed && fused_ &&
                           options_.data_parallel->options().reduce_dtype.value_or(
                               options_.compute_dtype) == at::kBFloat16;
  direct_ = fused_ && mixed && options_.grad_accum_steps == 1 && (!data_parallel_ || reduce_bf16);
  auto src = source->named_parameters();
  for (const auto& spec : specs) {
    Group g;
    g.name = spec.name;
    g.lr = at::full({}, spec.lr, f32);
    for (auto& p : model_->named_parameters()) {
      if (p.key().rfind(spec.prefix, 0) != 0) continue;
      at::Tensor master = p.value();  // float32, on the device
      if (mixed) {
        // The parameter becomes its bf16 rounding (new storage, same module); the float32 storage
        // stays with the master, which the module does not see. Buffers (inv_freq) stay float32.
        master = p.value().detach();
        p.value().set_data(master.to(options_.compute_dtype));
        if (!spec.train && src[p.key()].scalar_type() != options_.compute_dtype)
          frozen_float32_[p.key()] = master.to(at::kCPU);
      }
      p.value().set_requires_grad(spec.train);
      if (!spec.train) continue;
      // float32: a persistent .grad that backward accumulates into and the optimizer reads.
      // bfloat16: no persistent .grad (see Note [Transient bf16 gradients]); a float32
      // accumulator instead.
      if (!mixed) p.value().mutable_grad() = at::zeros_like(p.value());
      at::Tensor master_grad = direct_ ? at::Tensor()
                               : mixed ? at::zeros_like(master)
                                       : p.value().grad();
      g.names.push_back(p.key());
      g.params.push_back(master);
      g.grads.push_back(master_grad);
      g.exp_avg.push_back(at::zeros_like(master));
      g.exp_avg_sq.push_back(at::zeros_like(master));
      g.steps.push_back(at::zeros({}, f32));
      params_.push_back(p.value());
      if (master_grad.defined()) master_grads_.push_back(master_grad);
      master_weights_.emplace_back(p.key(), master);
    }
    if (!g.params.empty()) groups_.push_back(std::move(g));
  }
  if (params_.empty())
    throw EngineError::InvalidArgument(
        "nothing to train: every learning rate is 0 (a part whose rate is 0 is frozen); set "
        "language_learning_rate, vision_learning_rate or projector_learning_rate above 0");
  if (data_parallel_) {
    const DataParallelGroup& group = *options_.data_parallel;
    if (group.options().shard_optimizer && group.world_size() > 1) {
      std::vector<int64_t> numels;
      for (const at::Tensor& p : params_) numels.push_back(p.numel());
      shards_ = std::make_unique<OptimizerShards>(numels, group.world_size(), group.rank());
    }
    std::vector<at::Tensor*> accumulators;  // float32 reduction: replaced by bucket views
    for (auto& g : groups_)
      for (auto& grad : g.grads) accumulators.push_back(&grad);
    reducer_ = std::make_unique<GradientReducer>(params_, *options_.data_parallel,
                                                 reduce_bf16 ? at::kBFloat16 : at::kFloat, fused_,
                                                 accumulators, shards_.get());
    if (!reduce_bf16) {
      master_grads_.clear();
      for (auto& g : groups_)
        for (auto& grad : g.grads) master_grads_.push_back(grad);
    }
  }
  if (shards_) {
    // The broadcast's chunks (Note [Sharded optimizer]): parameters in order, kBroadcastChunks
    // runs of about equal size.
    constexpr int64_t kBroadcastChunks = 8;
    int64_t total = 0, done = 0;
    for (const at::Tensor& p : params_) total += p.numel();
    broadcast_chunks_.emplace_back();
    for (size_t k = 0; k < params_.size(); ++k) {
      if (!broadcast_chunks_.back().empty() &&
          done >= total * static_cast<int64_t>(broadcast_chunks_.size()) / kBroadcastChunks) {
        broadcast_chunks_.emplace_back();
      }
      broadcast_chunks_.back().push_back(k);
      done += params_[k].numel();
    }
    // Note [Weights broadcast in the forward]: the longest run of last chunks whose every
    // parameter the forward first reads in a decoder block or after the blocks; each chunk waited
    // for before the first block it holds.
    forward_chunk_ = broadcast_chunks_.size();
    const int64_t n_blocks = static_cast<int64_t>(model_->decoder->blocks->size());
    if (direct_ && options_.data_parallel->options().broadcast_in_forward) {
      std::vector<std::string> names;  // params_ order
      for (const Group& g : groups_) names.insert(names.end(), g.names.begin(), g.names.end());
      auto first_block = [n_blocks](const std::string& name) -> int64_t {  // -1: before the blocks
        static const std::string kBlocks = "decoder.blocks.";
        if (name.rfind(kBlocks, 0) == 0) return std::stoll(name.substr(kBlocks.size()));
        if (name.rfind("decoder.norm.", 0) == 0 || name.rfind("decoder.head.", 0) == 0)
          return n_blocks;
        return -1;
      };
      for (size_t c = broadcast_chunks_.size(); c > 0; --c) {
        int64_t wait_block = n_blocks;
        for (size_t k : broadcast_chunks_[c - 1]) {
          const int64_t b = first_block(names[k]);
          wait_block = b < 0 ? -1 : std::min(wait_block, b);
          if (wait_block < 0) break;
        }
        if (wait_block < 0) break;
        forward_chunk_ = c - 1;
        forward_wait_blocks_.insert(forward_wait_blocks_.begin(), wait_block);
      }
    }
  }
  if (shards_) {  // the ATen optimizer's per-group lists of what this rank owns
    size_t k = 0;
    for (const Group& g : groups_) {
      Group mine;
      mine.name = g.name;
      mine.lr = g.lr;
      for (size_t i = 0; i < g.params.size(); ++i, ++k) {
        if (!shards_->owns(k)) continue;
        mine.names.push_back(g.names[i]);
        mine.params.push_back(g.params[i]);
        mine.grads.push_back(g.grads[i]);
        mine.exp_avg.push_back(g.exp_avg[i]);
        mine.exp_avg_sq.push_back(g.exp_avg_sq[i]);
        mine.steps.push_back(g.steps[i]);
      }
      owned_groups_.push_back(std::move(mine));
    }
  }
  max_grad_norm_ = at::full({}, options_.max_grad_norm, f32);
  micro_batches_ = at::ones({}, f32);
  uploader_ = std::make_unique<DeviceUploader>(options_.device);
  dp_loss_sum_ = at::zeros({1}, f32);
  grad_sq_sum_ = at::zeros({}, f32.dtype(at::kDouble));
  group_sq_sum_ = at::zeros({static_cast<int64_t>(groups_.size())}, f32.dtype(at::kDouble));
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      all_indices_.push_back(param_group_.size());
      const size_t k = param_group_.size();  // the parameter's index (params_ order)
      if (shards_ && shards_->owns(k)) owned_indices_.push_back(k);
      param_group_.push_back(g);
      adamw_.group_sq_sums.push_back(group_sq_sum_.select(0, static_cast<int64_t>(g)));
    }
  }
  for (const auto& g : groups_) {
    auto append = [](std::vector<at::Tensor>& to, const std::vector<at::Tensor>& from) {
      to.insert(to.end(), from.begin(), from.end());
    };
    append(adamw_.params, g.params);
    append(adamw_.grads, g.grads);
    append(adamw_.exp_avg, g.exp_avg);
    append(adamw_.exp_avg_sq, g.exp_avg_sq);
    append(adamw_.steps, g.steps);
    adamw_.lrs.insert(adamw_.lrs.end(), g.params.size(), g.lr);
  }
  if (mixed) adamw_.working = params_;
  if (options_.device.is_cuda() && options_.cuda_graphs) {
    runner_ = MakeCudaGraphStepRunner(options_.device.has_index() ? options_.device.index() : 0);
  }
  if (!runner_) runner_ = std::make_unique<EagerStepRunner>();
  // What every graph reads or updates in place: weights, master weights and the optimizer's
  // state (Note [Static input check], engine/step_runner.h). The per-bucket input buffers are
  // left out: they are made as buckets are first used.
  runner_->WatchStaticInputs([this] {
    std::vector<at::Tensor> inputs = model_->parameters();
    for (const std::vector<at::Tensor>* list :
         {&params_, &adamw_.params, &adamw_.grads, &adamw_.exp_avg, &adamw_.exp_avg_sq}) {
      inputs.insert(inputs.end(), list->begin(), list->end());
    }
    return inputs;
  });
  dispatch_ = std::make_unique<RegionDispatcher>(
      runner_.get(), [this](const BucketKey& exact, const std::string& reason) {
        if (options_.observer) options_.observer->OnEagerFallback(exact.region, reason);
      });
}

void Trainer::CheckPeers() const {
  const std::string lost = options_.data_parallel->LostPeer();
  if (lost.empty()) return;
  throw EngineError(EngineError::Code::kUnavailable,
                    "data parallel rank " + std::to_string(options_.data_parallel->rank()) +
                        ": a peer was lost: " + lost + "; the job ends");
}

Trainer::~Trainer() = default;

void StageTrainExample(TrainExample& example, const at::Device& device,
                       at::ScalarType compute_dtype) {
  at::Tensor& tiles = example.tiles;
  if (!tiles.defined() || !tiles.is_cpu()) return;
  const bool pin = device.is_cuda();
  if (tiles.scalar_type() == compute_dtype && (!pin || tiles.is_pinned())) return;
  at::Tensor staged =
      at::empty(tiles.sizes(), at::TensorOptions().dtype(compute_dtype).pinned_memory(pin));
  staged.copy_(tiles);
  tiles = staged;
}

int64_t Trainer::graph_pool_bytes() const { return runner_->pool_bytes(); }

void Trainer::ValidateExample(const TrainExample& e) const {
  const VlmConfig& cfg = model_->cfg;
  std::string error = CheckTiles(cfg, e.tiles, "tiles");
  if (error.empty())
    error = CheckPromptIds(cfg, e.input_ids.data(), e.input_ids.size(), TileCount(e.tiles),
                           "input_ids");
  if (error.empty()) error = CheckTargetIds(cfg, e.targets, e.input_ids.size(), "targets");
  if (!error.empty()) throw EngineError::InvalidArgument("a training example's " + error);
  if (TileCount(e.tiles) > options_.max_tiles_per_example) {
    throw EngineError::InvalidArgument("an example has " + std::to_string(TileCount(e.tiles)) +
                                       " image tiles; the trainer allows " +
                                       std::to_string(options_.max_tiles_per_example) +
                                       " (max_tiles_per_example)");
  }
  if (static_cast<int64_t>(e.input_ids.size()) > cfg.lm_max_position_embeddings) {
    throw EngineError::InvalidArgument("an example of " + std::to_string(e.input_ids.size()) +
                                       " tokens is longer than lm_max_position_embeddings (" +
                                       std::to_string(cfg.lm_max_position_embeddings) + ")");
  }
}

std::unique_ptr<Trainer::MicroBuffers> Trainer::MakeBuffers(const BucketKey& key) const {
  auto buf = std::make_unique<MicroBuffers>();
  auto i64 = at::TensorOptions().dtype(at::kLong).device(options_.device);
  buf->key = key;
  buf->ids = at::zeros({key.batch, key.seq}, i64);
  buf->targets = at::full({key.batch, key.seq}, -100, i64);
  if (options_.max_tiles_per_example > 0) {
    const int64_t s = model_->cfg.vit_img_size;
    buf->tiles =
        at::zeros({key.batch * options_.max_tiles_per_example, 3, s, s},
                  at::TensorOptions().dtype(options_.compute_dtype).device(options_.device));
  }
  return buf;
}

Trainer::MicroBuffers& Trainer::BuffersFor(const BucketKey& key) {
  auto it = buffers_.find(key);
  if (it != buffers_.end()) return *it->second;
  return *buffers_.emplace(key, MakeBuffers(key)).first->second;
}

std::vector<at::Tensor> Trainer::RunMicro(MicroBuffers& buf, bool direct, bool reduce) {
  at::AutoGradMode grad_mode(true);
  // A graph encodes the whole static tile buffer. An eager run on CUDA does too, so that both take
  // the same kernels (cuBLAS picks its algorithms by shape) and compute the same values (float32
  // parameters equal after 20 steps on an H100); on the CPU it encodes only the tiles in use.
  at::Tensor tiles = buf.tiles;
  if (tiles.defined() && !runner_->captures() && !options_.device.is_cuda())
    tiles = buf.real_tiles > 0 ? tiles.narrow(0, 0, buf.real_tiles) : at::Tensor();
  // Note [Weights broadcast in the forward]: the weights the previous step's AdamW left current
  // on their owners only go out now, behind the vision encoder and the first blocks.
  LanguageModelImpl::BlockHook before_block;
  if (direct && shards_ && forward_chunk_ < broadcast_chunks_.size()) {
    {
      at::NoGradGuard no_grad;
      for (size_t c = forward_chunk_; c < broadcast_chunks_.size(); ++c) StartBroadcastChunk(c);
    }
    // Each chunk before the first block it holds (its broadcasts are the only collectives
    // pending in the forward, in chunk order).
    before_block = [this, waited = size_t{0}](int64_t block) mutable {
      size_t ready = waited;
      while (ready < forward_wait_blocks_.size() && forward_wait_blocks_[ready] <= block) ++ready;
      if (ready == waited) return;
      options_.data_parallel->FinishOldest(ready - waited);
      waited = ready;
    };
  }
  at::Tensor rows = tiles.defined() ? model_->EncodeImages(tiles) : at::Tensor();
  at::Tensor hidden = model_->decoder->Forward(model_->Embed(buf.ids, rows), before_block);
  at::Tensor targets = buf.targets.reshape({-1});
  // Cross entropy in float32 whatever the compute dtype.
  at::Tensor ce = model_->decoder->CrossEntropySum(hidden, targets, -100);
  // Mean over counted targets (nanoVLM's reduction), guarded against a batch with none, divided
  // by the step's number of micro-batches.
  at::Tensor count = targets.ne(-100).sum().clamp_min(1).to(at::kFloat);
  at::Tensor loss = ce / count / micro_batches_;
  // Note [Micro-batches without a gradient]: a micro-batch that no trained parameter reaches (an
  // eager run without images while only the vision encoder and projector train) has a loss
  // without a graph: its gradient is zero, so it adds nothing. BeginStep refuses a step where
  // this holds for every micro-batch.
  const bool learns = loss.requires_grad();
  if (data_parallel_) {  // Note [Overlapped all-reduce] in engine/gradient_reducer.cc
    dp_loss_sum_.add_(loss.detach());
    reducer_->Backward(loss, learns,
                       reduce ? GradientReducer::Mode::kReduce : GradientReducer::Mode::kAccumulate,
                       master_grads_, grad_sq_sum_, dp_loss_sum_);
    if (direct) {  // bf16 reduction: AdamW on the averaged bf16 gradients, in this graph
      AdamWTensors t = adamw_;
      t.grads = reducer_->TakeReducedGradients();
      std::vector<at::Tensor> opt = RunFusedAdamW(t, /*direct=*/true);
      return {loss.detach(), opt[0], opt[1]};
    }
    return {loss.detach()};
  }
  if (!mixed_precision()) {
    if (learns) loss.backward();  // accumulates into the persistent float32 .grad tensors
    return {loss.detach()};
  }
  // Note [Transient bf16 gradients]: the bf16 working parameters have no persistent .grad. With
  // .grad undefined, autograd's AccumulateGrad steals each freshly computed gradient instead of
  // adding it into an existing buffer, which took one bf16 add kernel per parameter per micro-step
  // plus zeroing the buffers afterwards. Those gradients live only until they are added into the
  // float32 accumulators, then go back to the allocator; inside a capture they are graph-pool
  // blocks whose addresses the capture fixes and every replay reuses, and none outlives the capture
  // (the only outputs are the returned tensors). A parameter that gets no gradient (not reached by
  // this loss) is skipped. The list of parameters that get one depends only on the model and the
  // trained groups, not on the batch's values (a graph always encodes its whole tile buffer), so
  // the adds a capture records stay right on every replay. Eager runs rebuild the list each time:
  // a micro-batch without tiles leaves the vision encoder without gradients.
  for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
  if (learns) loss.backward();
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;  // one per parameter, undefined where none came (= zero)
  grads.reserve(params_.size());
  for (at::Tensor& p : params_) {
    grads.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  if (direct) {  // Note [Optimizer inside the micro-step]
    AdamWTensors t = adamw_;
    t.grads = std::move(grads);
    std::vector<at::Tensor> opt = RunFusedAdamW(t, /*direct=*/true);
    return {loss.detach(), opt[0], opt[1]};
  }
  if (fused_) {
    // The kernel also leaves the squared norm of the accumulated gradients, group by group, for
    // the optimizer's clipping and Note [Unreached groups].
    group_sq_sum_.zero_();
    std::vector<std::vector<at::Tensor>> accumulators(groups_.size()), by_group(groups_.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      accumulators[param_group_[i]].push_back(master_grads_[i]);
      by_group[param_group_[i]].push_back(grads[i]);
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      AccumulateGradients(accumulators[g], by_group[g],
                          group_sq_sum_.select(0, static_cast<int64_t>(g)));
    }
    grad_sq_sum_.copy_(group_sq_sum_.sum());
  } else {
    std::vector<at::Tensor> accumulators, defined;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      accumulators.push_back(master_grads_[i]);
      defined.push_back(grads[i]);
    }
    if (!defined.empty()) at::_foreach_add_(accumulators, defined);
  }
  return {loss.detach()};
}

void Trainer::Warmup() {
  if (warmed_up_) return;
  warmed_up_ = true;
  if (!runner_->captures()) return;
  const auto t0 = Clock::now();
  // The optimizer's warm-up runs (its own graph, or the end of each micro-step's graph, Note
  // [Optimizer inside the micro-step]) see zero gradients and zero learning rates, which leave the
  // weights unchanged; the state they touch (step counters) is reset after the captures.
  std::vector<at::Tensor> saved_lr;
  for (auto& g : groups_) {
    saved_lr.push_back(g.lr.clone());
    g.lr.zero_();
  }
  double seconds = 0;
  if (!direct_) {
    seconds = runner_->Capture(kOptimizerKey, [this] { return RunOptimizer(); });
    ++captures_;
    if (options_.observer) options_.observer->OnCapture(kOptimizerKey, seconds);
    if (options_.log_captures)
      LogDebug(LogFormat("captured train   optimizer  in %7.1f ms", seconds * 1e3));
  }
  // Micro-step graphs: warm-up inputs have every target -100, so the loss and its gradients are 0.
  for (const auto& key :
       options_.exact_shapes ? std::vector<BucketKey>{} : options_.buckets.All(Region::kTrain)) {
    MicroBuffers& buf = BuffersFor(key);
    // Data parallel: this graph all-reduces (the step's last micro-batch); with gradient
    // accumulation the earlier micro-batches' graph, which only accumulates, is captured too.
    // bf16 reduction with gradient accumulation: every micro-batch accumulates (FinishStep
    // reduces), so the all-reducing graph would never run.
    if (!(reduce_bf16() && !direct_)) {
      seconds =
          runner_->Capture(key, [this, &buf] { return RunMicro(buf, direct_, data_parallel_); });
      ++captures_;
      if (options_.observer) options_.observer->OnCapture(key, seconds);
      if (options_.log_captures) {
        LogDebug(
            LogFormat("captured train   %-10s in %7.1f ms", key.Label().c_str(), seconds * 1e3));
      }
    }
    if (data_parallel_ && options_.grad_accum_steps > 1) {
      seconds = runner_->Capture(AccumulatingGraph(key),
                                 [this, &buf] { return RunMicro(buf, false, /*reduce=*/false); });
      ++captures_;
      if (options_.observer) options_.observer->OnCapture(key, seconds);
    }
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    groups_[i].lr.copy_(saved_lr[i]);
    at::_foreach_zero_(groups_[i].steps);
    at::_foreach_zero_(groups_[i].exp_avg);
    at::_foreach_zero_(groups_[i].exp_avg_sq);
  }
  // The model's .grad tensors in float32 mode.
  if (!master_grads_.empty()) at::_foreach_zero_(master_grads_);
  dp_loss_sum_.zero_();
  SynchronizeDevice(options_.device);
  if (options_.log_captures) {
    LogInfo(LogFormat("train capture summary: %lld graphs in %.2f s, graph pool %.1f MiB",
                      static_cast<long long>(captures_),
                      std::chrono::duration<double>(Clock::now() - t0).count(),
                      runner_->pool_bytes() / 1048576.0));
  }
}

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
// thread runs a decode step between them (server/scheduler.h, Note [Interleaving bound]), so one
// micro-batch's forward + backward (the last one with the optimizer part) is the most a decode
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
