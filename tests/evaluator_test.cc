// EvaluateLoss (engine/evaluator.h): the mean cross entropy per target token of a validation set,
// equal to VisionLanguageModel::Forward's losses weighted by their targets; the same for every
// micro-batch size (padding changes nothing); no weight or gradient changes; 2 gloo ranks (threads,
// a store on a port the system picks) with a shard each give the loss of 1 rank on the whole set.
#include "engine/evaluator.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <exception>
#include <thread>

#include "model/checkpoint.h"
#include "tests/test_util.h"
#include "tests/trainer_fixtures.h"

namespace vlmgraph {
namespace {

std::vector<int64_t> Row(const at::Tensor& t, int64_t r) {
  at::Tensor row = t[r].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

// A validation set of different lengths, with and without an image: the fixture's two rows (one
// image tile each), then text-only examples of 5..17 tokens.
std::vector<TrainExample> ValidationSet(const VlmConfig& cfg) {
  const auto& ref = testing::TinyReference().tensors;
  std::vector<TrainExample> out;
  for (int64_t r = 0; r < 2; ++r) {
    out.push_back(
        {Row(ref.at("input_ids"), r), Row(ref.at("targets"), r), ref.at("images").narrow(0, r, 1)});
  }
  for (int64_t k = 0; k < 5; ++k) {
    TrainExample e;
    const int64_t n = 5 + 3 * k;
    for (int64_t i = 0; i < n; ++i) e.input_ids.push_back((k * 37 + i * 11) % cfg.lm_base_vocab_size);
    e.targets.assign(e.input_ids.begin() + 1, e.input_ids.end());
    e.targets.push_back(-100);
    if (k == 2) e.targets[0] = -100;  // a position without a target
    out.push_back(e);
  }
  return out;
}

int64_t Targets(const TrainExample& e) {
  int64_t n = 0;
  for (int64_t t : e.targets) n += t != -100;
  return n;
}

// The reference: each example alone through Forward (mean over its targets), weighted by its
// number of targets.
double ReferenceLoss(VisionLanguageModel& model, const std::vector<TrainExample>& set) {
  at::NoGradGuard no_grad;
  double sum = 0;
  int64_t tokens = 0;
  for (const TrainExample& e : set) {
    const auto opts = at::TensorOptions().dtype(at::kLong);
    at::Tensor ids = at::tensor(e.input_ids, opts).unsqueeze(0);
    at::Tensor targets = at::tensor(e.targets, opts).unsqueeze(0);
    const double loss = model->Forward(ids, e.tiles, targets).loss.item<double>();
    sum += loss * static_cast<double>(Targets(e));
    tokens += Targets(e);
  }
  return sum / static_cast<double>(tokens);
}

TEST(Evaluator, IsTheMeanPerTargetTokenOfForwardAtAnyMicroBatchSize) {
  VisionLanguageModel model = LoadModel(testing::TinyCheckpointDir());
  const std::vector<TrainExample> set = ValidationSet(model->cfg);
  const double want = ReferenceLoss(model, set);
  int64_t tokens = 0;
  for (const TrainExample& e : set) tokens += Targets(e);
  for (int64_t micro : {1, 3, 8}) {
    EvalOptions o;
    o.micro_batch_size = micro;
    const EvalLoss got = EvaluateLoss(model, set, o);
    EXPECT_NEAR(got.loss, want, 1e-5) << "micro_batch_size " << micro;
    EXPECT_EQ(got.target_tokens, tokens);
    EXPECT_EQ(got.examples, static_cast<int64_t>(set.size()));
    EXPECT_NEAR(got.loss_sum, want * static_cast<double>(tokens), 1e-3);
  }
}

TEST(Evaluator, ChangesNoWeightAndMakesNoGradient) {
  VisionLanguageModel model = LoadModel(testing::TinyCheckpointDir());
  std::map<std::string, at::Tensor> before;
  for (const auto& p : model->named_parameters()) before[p.key()] = p.value().detach().clone();
  EvalOptions o;
  o.micro_batch_size = 4;
  EvaluateLoss(model, ValidationSet(model->cfg), o);
  for (const auto& p : model->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), before.at(p.key()))) << p.key();
    EXPECT_FALSE(p.value().grad().defined()) << p.key();
  }
}

TEST(Evaluator, ASetWithoutTargetsIsNaNAndBadExamplesAreNamed) {
  VisionLanguageModel model = LoadModel(testing::TinyCheckpointDir());
  TrainExample none;
  none.input_ids = {1, 2, 3};
  none.targets = {-100, -100, -100};
  EXPECT_TRUE(std::isnan(EvaluateLoss(model, {none}, EvalOptions{}).loss));
  EXPECT_TRUE(std::isnan(EvaluateLoss(model, {}, EvalOptions{}).loss));
  TrainExample bad = none;
  bad.input_ids[1] = model->cfg.lm_vocab_size;  // outside the vocabulary
  try {
    EvaluateLoss(model, {none, bad}, EvalOptions{});
    FAIL() << "an id outside the vocabulary was accepted";
  } catch (const EngineError& e) {
    EXPECT_EQ(e.code(), EngineError::Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("validation example 1"), std::string::npos) << e.what();
  }
}

TEST(Evaluator, TwoRanksWithAShardEachGiveTheLossOfOneRank) {
  if (!DataParallelGroup::BackendAvailable("gloo"))
    GTEST_SKIP() << "built without gloo (Debian libgloo-dev; scripts/install-deps.sh installs it)";
  VisionLanguageModel reference = LoadModel(testing::TinyCheckpointDir());
  const std::vector<TrainExample> set = ValidationSet(reference->cfg);
  EvalOptions one;
  one.micro_batch_size = 2;
  const EvalLoss want = EvaluateLoss(reference, set, one);

  // Rank 0 serves the store on a port the system picks and hands it to rank 1: no fixed port.
  trainer_fixtures::StoreRendezvous store;
  EvalLoss got[2];
  std::exception_ptr errors[2];
  auto rank = [&](int64_t r) {
    try {
      DataParallelOptions d;
      d.rank = r;
      d.world_size = 2;
      d.backend = "gloo";
      d.timeout_seconds = 60;
      d.group_name = "evaluator-test";
      d = store.For(r, d);
      EvalOptions o;
      o.micro_batch_size = 2;
      o.data_parallel = DataParallelGroup::Join(d);
      VisionLanguageModel model = LoadModel(testing::TinyCheckpointDir());
      // Unequal shards: every other example, as vlmgraph-train deals them (4 and 3).
      std::vector<TrainExample> shard;
      for (size_t k = static_cast<size_t>(r); k < set.size(); k += 2) shard.push_back(set[k]);
      got[r] = EvaluateLoss(model, shard, o);
      o.data_parallel->Barrier();
      o.data_parallel->Leave();
    } catch (...) {
      errors[r] = std::current_exception();
    }
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NEAR(got[r].loss, want.loss, 1e-6) << "rank " << r;
    EXPECT_EQ(got[r].target_tokens, want.target_tokens) << "rank " << r;
    EXPECT_EQ(got[r].examples, want.examples) << "rank " << r;
  }
}

}  // namespace
}  // namespace vlmgraph
