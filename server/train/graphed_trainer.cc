#include "server/train/graphed_trainer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "engine/trainer.h"
#include "model/checkpoint.h"
#include "server/core/status.h"

namespace vlmgraph::server {

at::ScalarType TrainComputeDtype(const EngineOptions& engine) {
  return engine.device.is_cuda() ? engine.dtype : at::kFloat;
}

namespace {

vlmgraph::TrainOptions ToEngineTrainOptions(const Engine& engine, const TrainJobOptions& job,
                                            EngineObserver* observer) {
  vlmgraph::TrainOptions t = job.trainer;
  // A part trains only when its rate is above 0 (Note [Learning rates]).
  if (!t.learning_rates.AnyTrained()) {
    throw InvalidArgument(
        "config: nothing to train: every part is frozen (its learning rate is 0, or it is not in "
        "trainable_parts)");
  }
  const EngineOptions& e = engine.options();
  t.device = e.device;
  t.compute_dtype = TrainComputeDtype(e);
  if (t.max_tiles_per_example > e.max_tiles_per_request) {
    throw InvalidArgument(
        "config.max_tiles_per_example: " + std::to_string(t.max_tiles_per_example) +
        " exceeds the server's max_tiles_per_request (" + std::to_string(e.max_tiles_per_request) +
        ")");
  }
  t.cuda_graphs = engine.graphs_enabled();
  t.buckets = e.buckets;
  t.log_captures = false;
  t.observer = observer;  // the job's graph captures (its own graphs, at its first step)
  return t;
}

// The weights a job starts from: the serving model's, or the checkpoint of options.resume_from,
// which must have the serving model's parameters (names and shapes).
VisionLanguageModel SourceModel(Engine& engine, const TrainJobOptions& options) {
  if (options.resume_from.empty()) return engine.model();
  VisionLanguageModel loaded{nullptr};
  try {
    loaded = LoadModel(options.resume_from);
  } catch (const std::exception& e) {
    throw InvalidArgument("config.resume_from: " + std::string(e.what()));
  }
  auto want = engine.model()->named_parameters();
  auto have = loaded->named_parameters();
  for (const auto& p : want) {
    const at::Tensor* t = have.find(p.key());
    if (t == nullptr || !t->sizes().equals(p.value().sizes())) {
      throw InvalidArgument("config.resume_from: " + options.resume_from +
                            " is not a checkpoint of the served model (parameter " + p.key() +
                            (t == nullptr ? " is missing)" : " has another shape)"));
    }
  }
  if (have.size() != want.size()) {
    throw InvalidArgument("config.resume_from: " + options.resume_from +
                          " has parameters the served model lacks");
  }
  return loaded;
}

class GraphedTrainer final : public TrainBackend {
 public:
  GraphedTrainer(Engine& engine, const TrainJobOptions& options, EngineObserver* observer)
      : options_(options),
        source_(SourceModel(engine, options)),
        trainer_(source_, ToEngineTrainOptions(engine, options, observer)) {
    source_ = VisionLanguageModel(nullptr);  // the trainer copied it; a loaded one is freed
    if (options.resume_from.empty()) return;
    const std::string state = options.resume_from + "/optimizer.safetensors";
    try {
      trainer_.LoadOptimizerState(state);
    } catch (const std::exception& e) {  // missing file, other trained parts, bad tensors
      throw InvalidArgument("config.resume_from: cannot load the AdamW state " + state + ": " +
                            e.what() + " (resume with the trainable_parts of the saved job)");
    }
  }

  void BeginStep(std::vector<TrainExample> batch) override {
    // A batch with more examples than the largest train bucket is split into micro-batches that
    // fit it (engine/trainer.h); only an example longer than every bucket fits none.
    const BucketSpec& buckets = trainer_.options().buckets;
    int64_t longest = 0;
    for (const auto& e : batch) longest = std::max<int64_t>(longest, e.input_ids.size());
    const int64_t rows = static_cast<int64_t>(batch.size());
    const bool exact = options_.trainer.exact_shapes;
    const bool fits =
        !exact &&
        buckets.PickTrain(std::min(rows, buckets.train_batch_sizes.back()), longest).has_value();
    if (!exact && !fits && buckets.oversize == OversizePolicy::kReject) {
      throw InvalidArgument("batch: an example of " + std::to_string(longest) +
                            " tokens fits no train bucket (buckets.train_seq_lens) and "
                            "buckets.oversize is reject; send shorter examples");
    }
    trainer_.BeginStep(std::move(batch));
  }
  // The Trainer reports the step to the observer itself.
  bool RunNextMicroBatch() override { return trainer_.RunNextMicroBatch(); }
  TrainStepResult StepResult() override { return trainer_.StepResult(); }

  void Save(const std::string& directory) override {
    RequireFiniteWeights("save");
    trainer_.SaveCheckpoint(directory);
  }
  int64_t checkpoint_bytes() const override { return trainer_.checkpoint_bytes(); }
  void GatherOptimizerState() override { trainer_.GatherOptimizerState(); }

  const std::vector<std::pair<std::string, at::Tensor>>& weights() const override {
    return trainer_.master_weights();
  }

  int64_t steps() const override { return trainer_.steps(); }

 private:
  // FAILED_PRECONDITION naming the first trained weight with a NaN or inf element: such weights
  // are never written (Note [Skipped steps] keeps them finite unless a finite update overflows,
  // e.g. a learning rate of 1e30; WeightsPublisher refuses to serve them).
  void RequireFiniteWeights(const char* what) const {
    at::NoGradGuard no_grad;
    for (const auto& [name, master] : trainer_.master_weights()) {
      if (!at::isfinite(master).all().item<bool>()) {
        throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                          std::string("cannot ") + what + " the job's weights: " + name +
                              " has NaN or infinite values (lower the learning rate or weight "
                              "decay and start a new job)");
      }
    }
  }

  const TrainJobOptions options_;
  VisionLanguageModel source_;  // only while trainer_ is built
  vlmgraph::Trainer trainer_;
};

}  // namespace

std::unique_ptr<TrainBackend> MakeTrainBackend(Engine& engine, const TrainJobOptions& options,
                                               EngineObserver* observer) {
  return std::make_unique<GraphedTrainer>(engine, options, observer);
}

}  // namespace vlmgraph::server
