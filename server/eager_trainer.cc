#include "server/eager_trainer.h"

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <limits>
#include <unordered_set>

#include "model/checkpoint.h"
#include "server/status.h"

namespace vlmgraph::server {
namespace {

using Clock = std::chrono::steady_clock;

// Parameters of `module`, each once (tied weights appear under two names).
std::vector<at::Tensor> UniqueParameters(torch::nn::Module& module,
                                         std::unordered_set<const void*>* seen) {
  std::vector<at::Tensor> out;
  for (auto& p : module.parameters()) {
    if (seen->insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

class EagerTrainer final : public TrainBackend {
 public:
  EagerTrainer(Engine& engine, const TrainOptions& options, EngineObserver* observer)
      : model_(engine.model()),
        buckets_(engine.options().buckets),
        device_(engine.options().device),
        dtype_(engine.options().dtype),
        options_(options),
        observer_(observer) {
    std::unordered_set<const void*> seen;
    std::vector<torch::optim::OptimizerParamGroup> groups;
    auto add = [&](torch::nn::Module& part, bool train, double lr) {
      std::vector<at::Tensor> params = UniqueParameters(part, &seen);
      if (!train || lr <= 0) return;
      for (auto& p : params) p.set_requires_grad(true);
      trained_.insert(trained_.end(), params.begin(), params.end());
      auto opts = std::make_unique<torch::optim::AdamWOptions>(lr);
      opts->betas({options.beta1, options.beta2})
          .eps(options.eps)
          .weight_decay(options.weight_decay);
      groups.emplace_back(std::move(params), std::move(opts));
    };
    // The decoder first: its group's learning rate is the one reported per step.
    add(*model_->decoder, options.train_language, options.language_learning_rate);
    add(*model_->vision_encoder, options.train_vision, options.vision_learning_rate);
    add(*model_->MP, options.train_projector, options.projector_learning_rate);
    if (trained_.empty()) {
      throw InvalidArgument(
          "config: nothing to train (every part is frozen or has learning rate 0)");
    }
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        std::move(groups), torch::optim::AdamWOptions(options.language_learning_rate)
                               .betas({options.beta1, options.beta2})
                               .eps(options.eps)
                               .weight_decay(options.weight_decay));
  }

  ~EagerTrainer() override {
    for (auto& p : trained_) {
      p.set_requires_grad(false);
      p.mutable_grad() = at::Tensor();
    }
    model_->eval();
  }

  TrainStepStats Step(const std::vector<TrainExampleData>& batch) override {
    const auto t0 = Clock::now();
    int64_t rows = static_cast<int64_t>(batch.size()), longest = 0, real_tokens = 0;
    for (const auto& ex : batch) {
      longest = std::max<int64_t>(longest, ex.input_ids.size());
      real_tokens += ex.input_ids.size();
    }
    TrainStepStats stats;
    stats.bucket = BucketKey{Region::kTrain, rows, longest, 0};
    if (options_.padding == TrainPadding::kPadToBucket) {
      if (auto key = buckets_.PickTrain(rows, longest)) {
        stats.bucket = *key;
      } else if (buckets_.oversize == OversizePolicy::kReject) {
        throw InvalidArgument(
            "batch: " + std::to_string(rows) + " examples of up to " + std::to_string(longest) +
            " tokens fit no train bucket (buckets.train_batch_sizes x train_seq_lens) and "
            "buckets.oversize is reject; send smaller batches or add buckets");
      } else if (observer_) {
        observer_->OnEagerFallback(Region::kTrain, "no bucket fits " + stats.bucket.Label());
      }
    }
    const int64_t b = stats.bucket.batch, t = stats.bucket.seq;
    const int64_t pad = model_->cfg.image_token_id == 0 ? 1 : 0;  // never the image token
    at::Tensor ids = at::full({b, t}, pad, at::kLong);
    at::Tensor targets = at::full({b, t}, -100, at::kLong);
    std::vector<at::Tensor> tiles;
    for (int64_t i = 0; i < rows; ++i) {
      const auto& ex = batch[static_cast<size_t>(i)];
      const int64_t n = static_cast<int64_t>(ex.input_ids.size());
      ids[i].narrow(0, 0, n).copy_(at::tensor(ex.input_ids, at::kLong));
      targets[i].narrow(0, 0, n).copy_(at::tensor(ex.target_ids, at::kLong));
      if (ex.tiles.defined() && ex.tiles.numel() > 0) tiles.push_back(ex.tiles);
    }
    at::Tensor all_tiles = tiles.empty() ? at::Tensor() : at::cat(tiles, 0).to(device_, dtype_);

    at::AutoGradMode grad(true);
    model_->train();
    optimizer_->zero_grad();
    ForwardOutput out = model_->Forward(ids.to(device_), all_tiles, targets.to(device_));
    out.loss.backward();
    const double max_norm = options_.max_grad_norm > 0 ? options_.max_grad_norm
                                                       : std::numeric_limits<double>::infinity();
    stats.grad_norm = torch::nn::utils::clip_grad_norm_(trained_, max_norm);
    optimizer_->step();
    model_->eval();

    stats.loss = out.loss.item<double>();
    stats.loss_tokens = targets.ne(-100).sum().item<int64_t>();
    stats.step = ++steps_;
    stats.learning_rate = optimizer_->param_groups()[0].options().get_lr();
    stats.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    stats.mode = RunKind::kEager;
    if (observer_) {
      observer_->OnStep(stats.bucket, /*graphed=*/false, stats.seconds);
      observer_->OnTokens(Region::kTrain, real_tokens, b * t);
    }
    return stats;
  }

  void Save(const std::string& directory) override { SaveModel(model_, directory); }

  int64_t steps() const override { return steps_; }

 private:
  VisionLanguageModel model_;  // the engine's model (shared module)
  const BucketSpec buckets_;
  const at::Device device_;
  const at::ScalarType dtype_;
  const TrainOptions options_;
  EngineObserver* observer_;
  std::vector<at::Tensor> trained_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  int64_t steps_ = 0;
};

}  // namespace

std::unique_ptr<TrainBackend> MakeEagerTrainer(Engine& engine, const TrainOptions& options,
                                               EngineObserver* observer) {
  return std::make_unique<EagerTrainer>(engine, options, observer);
}

}  // namespace vlmgraph::server
