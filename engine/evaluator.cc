#include "engine/evaluator.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "engine/device.h"
#include "model/prompt_check.h"

namespace vlmgraph {
namespace {

void CheckExample(const VlmConfig& cfg, const TrainExample& e, size_t index) {
  const std::string field = "validation example " + std::to_string(index) + ": ";
  std::string error = CheckTiles(cfg, e.tiles, "tiles");
  if (error.empty())
    error = CheckPromptIds(cfg, e.input_ids.data(), e.input_ids.size(), TileCount(e.tiles),
                           "input_ids");
  if (error.empty()) error = CheckTargetIds(cfg, e.targets, e.input_ids.size(), "targets");
  if (!error.empty()) throw EngineError::InvalidArgument(field + error);
  if (e.input_ids.empty()) throw EngineError::InvalidArgument(field + "input_ids: empty");
}

}  // namespace

EvalLoss EvaluateLoss(VisionLanguageModel& model, const std::vector<TrainExample>& examples,
                      const EvalOptions& options) {
  return EvaluateLoss(
      model, static_cast<int64_t>(examples.size()),
      [&examples](int64_t i) { return examples[static_cast<size_t>(i)]; }, options);
}

EvalLoss EvaluateLoss(VisionLanguageModel& model, int64_t count,
                      const std::function<TrainExample(int64_t index)>& example,
                      const EvalOptions& options) {
  if (options.micro_batch_size < 1)
    throw EngineError::InvalidArgument("micro_batch_size must be >= 1");
  if (count < 0) throw EngineError::InvalidArgument("count must be >= 0");
  const auto started = std::chrono::steady_clock::now();
  const VlmConfig& cfg = model->cfg;
  at::NoGradGuard no_grad;
  const at::ScalarType dtype = model->decoder->token_embedding->weight.scalar_type();
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  // Summed on the device, read once: no host synchronisation per micro-batch.
  at::Tensor loss_sum =
      at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(options.device));
  int64_t target_tokens = 0;
  for (int64_t begin = 0; begin < count; begin += options.micro_batch_size) {
    const int64_t end = std::min(count, begin + options.micro_batch_size);
    std::vector<TrainExample> micro;
    for (int64_t i = begin; i < end; ++i) {
      micro.push_back(example(i));
      CheckExample(cfg, micro.back(), static_cast<size_t>(i));
    }
    const int64_t rows = end - begin;
    int64_t seq = 0;
    for (const TrainExample& e : micro)
      seq = std::max<int64_t>(seq, static_cast<int64_t>(e.input_ids.size()));
    at::Tensor ids = at::zeros({rows, seq}, i64);
    at::Tensor targets = at::full({rows, seq}, -100, i64);
    std::vector<at::Tensor> tiles;
    for (int64_t r = 0; r < rows; ++r) {
      const TrainExample& e = micro[static_cast<size_t>(r)];
      const int64_t n = static_cast<int64_t>(e.input_ids.size());
      ids[r].narrow(0, 0, n).copy_(at::tensor(e.input_ids, i64));
      targets[r].narrow(0, 0, n).copy_(at::tensor(e.targets, i64));
      for (int64_t t : e.targets) target_tokens += t != -100;
      if (e.tiles.defined() && e.tiles.size(0) > 0) tiles.push_back(e.tiles);
    }
    // Tiles of row 0 first, then row 1, ... (the model's order), in the model's dtype.
    at::Tensor rows_embedded;
    if (!tiles.empty()) {
      rows_embedded = model->EncodeImages(at::cat(tiles).to(options.device, dtype));
    }
    at::Tensor hidden =
        model->decoder->Forward(model->Embed(ids.to(options.device), rows_embedded));
    loss_sum.add_(
        model->decoder->CrossEntropySum(hidden, targets.reshape({-1}).to(options.device), -100)
            .to(at::kDouble));
  }
  // {loss sum, targets, examples}: float64 holds integers exactly up to 2^53.
  at::Tensor sums =
      at::stack({loss_sum, at::full({}, static_cast<double>(target_tokens), loss_sum.options()),
                 at::full({}, static_cast<double>(count), loss_sum.options())});
  const std::shared_ptr<DataParallelGroup>& group = options.data_parallel;
  if (group && group->world_size() > 1) {
    const std::string lost = group->LostPeer();
    if (!lost.empty()) throw EngineError(EngineError::Code::kUnavailable, lost);
    group->ArmStepWatchdog();  // a collective whose peer died never completes (NCCL)
    try {
      group->StartAllReduceSum(sums);
      group->FinishAllReduces();
      sums = sums.cpu();  // waits for the all-reduce
    } catch (...) {
      group->DisarmStepWatchdog();
      throw;
    }
    group->DisarmStepWatchdog();
  } else {
    sums = sums.cpu();
  }
  EvalLoss out;
  out.loss_sum = sums[0].item<double>();
  out.target_tokens = static_cast<int64_t>(sums[1].item<double>());
  out.examples = static_cast<int64_t>(sums[2].item<double>());
  out.loss = out.target_tokens > 0 ? out.loss_sum / static_cast<double>(out.target_tokens)
                                   : std::numeric_limits<double>::quiet_NaN();
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return out;
}

}  // namespace vlmgraph
