// Training: AdamW steps reproduce upstream nanoVLM's losses; gradient accumulation, frozen groups,
// learning-rate changes and checkpoint/resume behave; *_CUDA: graphed steps equal eager steps.
#include "engine/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/checkpoint.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

using testing::TinyReference;

std::vector<int64_t> Row(const at::Tensor& t, int64_t r) {
  at::Tensor row = t[r].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

std::vector<TrainExample> FixtureBatch() {
  const auto& ref = TinyReference().tensors;
  std::vector<TrainExample> out;
  for (int64_t r = 0; r < 2; ++r) {
    out.push_back(
        {Row(ref.at("input_ids"), r), Row(ref.at("targets"), r), ref.at("images").narrow(0, r, 1)});
  }
  return out;
}

nlohmann::json AdamwReference() {
  std::ifstream in(testing::TinyCheckpointDir() + "/reference.json");
  return nlohmann::json::parse(in)["adamw"];
}

TrainOptions FixtureOptions(at::Device device, bool graphs) {
  const auto j = AdamwReference();
  TrainOptions o;
  o.device = device;
  o.cuda_graphs = graphs;
  o.lr = j["lr"].get<double>();
  o.beta1 = j["betas"][0].get<double>();
  o.beta2 = j["betas"][1].get<double>();
  o.eps = j["eps"].get<double>();
  o.weight_decay = j["weight_decay"].get<double>();
  o.buckets.train_batch_sizes = {2, 4};
  o.buckets.train_seq_lens = {16, 32};
  o.log_captures = false;
  return o;
}

void ExpectUpstreamLosses(Trainer& t) {
  const auto want = AdamwReference()["losses_before_each_step"];
  for (size_t i = 0; i < want.size(); ++i) {
    TrainStepResult r = t.Step(FixtureBatch());
    EXPECT_NEAR(r.loss, want[i].get<double>(), 1e-5) << "step " << i;
  }
}

std::map<std::string, at::Tensor> Params(Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : t.model()->named_parameters())
    out[p.key()] = p.value().detach().to(at::kCPU).clone();
  return out;
}

TEST(Trainer, FourAdamWStepsReproduceUpstreamLosses) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  Trainer t(m, FixtureOptions(at::kCPU, false));
  ExpectUpstreamLosses(t);
  EXPECT_EQ(t.steps(), 4);
}

TEST(Trainer, PaddedBucketsDoNotChangeTheLoss) {
  // The batch of 2 x 16 runs in bucket 4 x 32: padding rows and columns carry target -100.
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  TrainOptions o = FixtureOptions(at::kCPU, false);
  o.buckets.train_batch_sizes = {4};
  o.buckets.train_seq_lens = {32};
  Trainer t(m, o);
  const TrainStepResult r = t.Step(FixtureBatch());
  EXPECT_EQ(r.buckets.at(0).Label(), "b4xs32");
  EXPECT_EQ(r.padded_tokens, 128);
  EXPECT_EQ(r.target_tokens, 22);
  EXPECT_NEAR(r.loss, AdamwReference()["losses_before_each_step"][0].get<double>(), 1e-5);
}

TEST(Trainer, GradientAccumulationAveragesMicroBatchMeans) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  TrainOptions o = FixtureOptions(at::kCPU, false);
  o.grad_accum_steps = 2;
  Trainer t(m, o);
  // nanoVLM: each micro-batch's mean loss / accumulation steps, summed.
  at::NoGradGuard ng;
  const auto batch = FixtureBatch();
  double want = 0;
  for (const auto& e : batch) {
    at::Tensor ids = at::tensor(e.input_ids, at::kLong).view({1, -1});
    at::Tensor tg = at::tensor(e.targets, at::kLong).view({1, -1});
    want += m->Forward(ids, e.tiles, tg).loss.item<double>() / 2;
  }
  EXPECT_NEAR(t.Step(batch).loss, want, 1e-5);
}

TEST(Trainer, FrozenGroupsStayUnchangedAndZeroLearningRateChangesNothing) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  TrainOptions o = FixtureOptions(at::kCPU, false);
  o.train_vision = false;
  Trainer t(m, o);
  auto before = Params(t);
  t.Step(FixtureBatch());
  auto after = Params(t);
  EXPECT_TRUE(at::equal(before.at("vision_encoder.blocks.0.mlp.fc1.weight"),
                        after.at("vision_encoder.blocks.0.mlp.fc1.weight")));
  EXPECT_FALSE(at::equal(before.at("decoder.blocks.0.mlp.up_proj.weight"),
                         after.at("decoder.blocks.0.mlp.up_proj.weight")));
  EXPECT_FALSE(at::equal(before.at("MP.proj.weight"), after.at("MP.proj.weight")));
  t.SetLearningRate(0.0);
  t.Step(FixtureBatch());
  auto frozen = Params(t);
  for (const auto& [name, w] : after) EXPECT_TRUE(at::equal(w, frozen.at(name))) << name;
}

TEST(Trainer, CheckpointResumesExactly) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("vlmgraph_train_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  Trainer a(m, FixtureOptions(at::kCPU, false));
  a.Step(FixtureBatch());
  a.Step(FixtureBatch());
  a.SaveCheckpoint(dir.string());
  const double next_in_memory = a.Step(FixtureBatch()).loss;
  // The saved model loads for inference, and model + optimizer state resume the same trajectory.
  VisionLanguageModel saved = LoadModel(dir.string());
  Trainer b(saved, FixtureOptions(at::kCPU, false));
  b.LoadOptimizerState((dir / "optimizer.safetensors").string());
  EXPECT_EQ(b.steps(), 2);
  EXPECT_NEAR(b.Step(FixtureBatch()).loss, next_in_memory, 1e-6);
  EXPECT_NEAR(b.Step(FixtureBatch()).loss,
              AdamwReference()["losses_before_each_step"][3].get<double>(), 1e-5);
}

TEST(Trainer, RejectsBadExamples) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  Trainer t(m, FixtureOptions(at::kCPU, false));
  auto batch = FixtureBatch();
  batch[0].targets.pop_back();
  EXPECT_THROW(t.Step(batch), EngineError);
  batch = FixtureBatch();
  batch[1].tiles = at::Tensor();
  EXPECT_THROW(t.Step(batch), EngineError);
}

TEST(Trainer, GraphedStepsReproduceUpstreamLosses_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  Trainer t(m, FixtureOptions(at::kCUDA, true));
  t.Warmup();
  const int64_t captures = t.captures();
  EXPECT_EQ(captures, 1 + 2 * 2);  // optimizer + 2 x 2 buckets
  ExpectUpstreamLosses(t);
  EXPECT_EQ(t.captures(), captures);
  EXPECT_EQ(t.replays(), 8);  // 4 steps x (micro + optimizer)
}

TEST(Trainer, GraphedMatchesEagerAfterTwentySteps_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  TrainOptions o = FixtureOptions(at::kCUDA, true);
  o.max_grad_norm = 1.0;
  o.lr_projector = 2e-3;
  o.grad_accum_steps = 2;
  Trainer graphed(m, o);
  o.cuda_graphs = false;
  Trainer eager(m, o);
  for (int i = 0; i < 20; ++i) {
    graphed.SetLearningRate(1e-3 * (1.0 - i / 40.0));  // a schedule: no recapture
    eager.SetLearningRate(1e-3 * (1.0 - i / 40.0));
    auto g = graphed.Step(FixtureBatch());
    auto e = eager.Step(FixtureBatch());
    EXPECT_NEAR(g.loss, e.loss, 1e-5) << i;
    EXPECT_NEAR(g.grad_norm, e.grad_norm, 1e-4) << i;
  }
  auto pg = Params(graphed), pe = Params(eager);
  double worst = 0;
  for (const auto& [name, w] : pe) worst = std::max(worst, testing::MaxAbsDiff(w, pg.at(name)));
  std::printf("[train graphed vs eager] max param diff after 20 steps %.3g\n", worst);
  EXPECT_LT(worst, 1e-5);
  EXPECT_EQ(graphed.captures(), 1 + 4);
}

TEST(Trainer, BFloat16MixedPrecisionLearns_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  TrainOptions o = FixtureOptions(at::kCUDA, true);
  o.compute_dtype = at::kBFloat16;
  Trainer t(m, o);
  const double first = t.Step(FixtureBatch()).loss;
  double last = first;
  for (int i = 0; i < 30; ++i) last = t.Step(FixtureBatch()).loss;
  EXPECT_LT(last, first - 1.0);
  EXPECT_EQ(t.model()->decoder->token_embedding->weight.scalar_type(),
            at::kFloat);  // master weights
}

}  // namespace
}  // namespace vlmgraph
