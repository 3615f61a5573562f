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

using trainer_internal::AccumulatingGraph;
using trainer_internal::Clock;
using trainer_internal::kOptimizerKey;

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

}  // namespace vlmgraph
