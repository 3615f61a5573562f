// Submitted steps (Trainer::Submit / Wait, Note [Submitted steps] in engine/trainer_step.cc): a
// loop that submits step i + 1 before waiting for step i computes what Step() computes, bit for bit
// (losses, norms, weights), across buckets, learning-rate changes and gradient accumulation; the
// calls that need the trainer at rest refuse while a submitted step is unfinished; a bad batch is
// refused before anything is queued. *_CUDA: the same on graphed bf16 and float32 steps, whose
// inputs go up beside the step before (Note [Uploads beside the step]).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "engine/trainer.h"
#include "model/checkpoint.h"
#include "tests/test_util.h"
#include "tests/trainer_fixtures.h"

namespace vlmgraph {
namespace {

using namespace trainer_fixtures;

// Six steps of changing shape (batch buckets 2 and 4, one with two micro-batches), the rate
// scaled before each.
std::vector<std::vector<TrainExample>> Batches(const VlmConfig& cfg) {
  std::vector<std::vector<TrainExample>> out;
  out.push_back(FixtureBatch());
  out.push_back({Variant(cfg, 0), Variant(cfg, 1), FixtureBatch()[0], FixtureBatch()[1]});
  out.push_back({Variant(cfg, 1)});
  std::vector<TrainExample> wide = FixtureBatch();  // 6 rows: two micro-batches of the bucket 4
  for (int64_t r = 0; r < 4; ++r) wide.push_back(Variant(cfg, r % 2));
  out.push_back(wide);
  out.push_back(FixtureBatch());
  out.push_back({Variant(cfg, 0), FixtureBatch()[1]});
  return out;
}

double Scale(size_t step) { return 1.0 - 0.1 * static_cast<double>(step); }

// Step() against Submit one ahead + Wait on two trainers of the same options.
void ExpectSubmittedEqualsStep(const TrainOptions& o) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  const auto batches = Batches(m->cfg);
  Trainer stepped(m, o), submitted(m, o);
  std::vector<TrainStepResult> want;
  for (size_t i = 0; i < batches.size(); ++i) {
    stepped.SetLearningRateScale(Scale(i));
    want.push_back(stepped.Step(batches[i]));
  }
  std::vector<TrainStepResult> got;
  submitted.SetLearningRateScale(Scale(0));
  submitted.Submit(batches[0]);
  for (size_t i = 0; i < batches.size(); ++i) {
    if (i + 1 < batches.size()) {
      submitted.SetLearningRateScale(Scale(i + 1));  // applies to step i + 1, not to step i
      submitted.Submit(batches[i + 1]);
      EXPECT_EQ(submitted.submitted_steps(), 2u);
    }
    got.push_back(submitted.Wait());
  }
  EXPECT_EQ(submitted.submitted_steps(), 0u);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].step, want[i].step) << "step " << i;
    EXPECT_EQ(got[i].loss, want[i].loss) << "step " << i;
    // The fused kernels sum the squared norm with float64 atomics: its last bits follow the
    // blocks' order (the same in Step() twice). Without clipping it moves no weight.
    EXPECT_NEAR(got[i].grad_norm, want[i].grad_norm, 1e-12 * want[i].grad_norm) << "step " << i;
    EXPECT_EQ(got[i].skipped, want[i].skipped) << "step " << i;
    EXPECT_EQ(got[i].learning_rates, want[i].learning_rates) << "step " << i;
    EXPECT_EQ(got[i].buckets, want[i].buckets) << "step " << i;
    EXPECT_EQ(got[i].target_tokens, want[i].target_tokens) << "step " << i;
    EXPECT_GT(got[i].seconds, 0) << "step " << i;
  }
  EXPECT_EQ(submitted.steps(), stepped.steps());
  const ParamDiff d = MaxParamDiff(submitted, stepped);
  EXPECT_EQ(d.max_abs, 0.0) << d.name;
  const auto a = Masters(submitted), b = Masters(stepped);
  for (const auto& [name, w] : b) EXPECT_TRUE(at::equal(a.at(name), w)) << name;
}

TEST(Trainer, SubmittedStepsEqualSteps) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    TrainOptions o = FixtureOptions(at::kCPU, false);
    o.compute_dtype = dtype;
    o.max_grad_norm = 0.5;  // ATen's norm on the CPU: the same bits every time
    ExpectSubmittedEqualsStep(o);
  }
}

TEST(Trainer, SubmitAndWaitRefuseWhatTheyCannotDo) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  Trainer t(m, FixtureOptions(at::kCPU, false));
  EXPECT_THROW(t.Wait(), std::logic_error);  // nothing submitted
  t.Submit(FixtureBatch());
  t.Submit(FixtureBatch());
  // A third unfinished step, and the calls that need the trainer at rest.
  EXPECT_THROW(t.Submit(FixtureBatch()), std::logic_error);
  EXPECT_THROW(t.Step(FixtureBatch()), std::logic_error);
  EXPECT_THROW(t.BeginStep(FixtureBatch()), std::logic_error);
  EXPECT_THROW(t.GatherOptimizerState(), std::logic_error);
  EXPECT_THROW(t.SaveCheckpoint("/nonexistent/refused-before-writing"), std::logic_error);
  EXPECT_EQ(t.submitted_steps(), 2u);
  EXPECT_EQ(t.Wait().step, 1);
  // A bad batch is refused before anything is queued: the submitted step before it completes.
  std::vector<TrainExample> bad = FixtureBatch();
  bad[0].targets.pop_back();
  EXPECT_THROW(t.Submit(bad), EngineError);
  EXPECT_EQ(t.submitted_steps(), 1u);
  EXPECT_FALSE(t.step_in_progress());
  EXPECT_EQ(t.Wait().step, 2);
  EXPECT_THROW(t.Wait(), std::logic_error);
  // At rest again: the synchronous calls work.
  EXPECT_EQ(t.Step(FixtureBatch()).step, 3);
  // A step begun with BeginStep blocks Submit until it ends.
  t.BeginStep(FixtureBatch());
  EXPECT_THROW(t.Submit(FixtureBatch()), std::logic_error);
  EXPECT_TRUE(t.RunNextMicroBatch());
  EXPECT_EQ(t.StepResult().step, 4);
}

// Graphed steps on one GPU: the tile and id uploads run on their own stream into staging buffers
// (Note [Uploads beside the step]); a copy that raced the step before, or a staging buffer
// overwritten before it was read, changes a loss or a weight (a staging buffer written before the
// work queued on its block was done changed the second step's loss from 6.861 to 6.576 on an
// H200). No clipping: the fused kernels' float64 norm is summed with atomics, so its last bits,
// and a clipped step's weights, vary between two runs of the same steps.
TEST(Trainer, SubmittedGraphedStepsEqualSteps_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    TrainOptions o = FixtureOptions(at::kCUDA, true);
    o.compute_dtype = dtype;
    o.max_grad_norm = 0;
    ExpectSubmittedEqualsStep(o);
  }
}

}  // namespace
}  // namespace vlmgraph
