// Note [Unreached groups] (engine/trainer.cc): a parameter group that no example of a step reaches
// (the vision encoder and the projector in a text-only step) is left alone by AdamW, as
// torch.optim.AdamW leaves a parameter whose gradient is None: its master weights, moments and
// step counters are exactly those of the step before, while the language model moves; the next
// step with images moves it again from there. CPU float32 (the ATen optimizer) here; the graphed
// bf16 trainer with the fused kernel on a GPU; data-parallel ranks in trainer_test's Gloo tests.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "base/safetensors.h"
#include "engine/trainer.h"
#include "model/checkpoint.h"
#include "tests/test_util.h"
#include "tests/trainer_fixtures.h"

namespace vlmgraph {
namespace {

using namespace trainer_fixtures;

// exp_avg.*, exp_avg_sq.* and step.* of every trained parameter, through SaveCheckpoint.
std::map<std::string, at::Tensor> OptimizerState(Trainer& t, const std::string& dir) {
  testing::RemoveFlatDirectory(dir);
  t.SaveCheckpoint(dir);
  std::map<std::string, at::Tensor> out;
  for (auto& [name, tensor] : ReadSafetensors(dir + "/optimizer.safetensors").tensors)
    out[name] = tensor.to(at::kCPU).clone();
  testing::RemoveFlatDirectory(dir);
  return out;
}

bool InGroup(const std::string& name, const char* prefix) {
  return name.find(prefix) != std::string::npos;
}

// Three steps: images, text only, images. Returns nothing; checks as the file's comment says.
void ExpectUnreachedGroupsStay(const TrainOptions& o, const std::string& tag) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  const VlmConfig cfg = m->cfg;
  Trainer t(m, o);
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("vlmgraph_unreached_" + tag + "_" + std::to_string(::getpid())))
                              .string();
  ASSERT_FALSE(t.Step(FixtureBatch()).skipped);
  const auto masters1 = Masters(t);
  const auto state1 = OptimizerState(t, dir);

  ASSERT_FALSE(t.Step({TextOnly(cfg, 0), TextOnly(cfg, 1)}).skipped);
  const auto masters2 = Masters(t);
  const auto state2 = OptimizerState(t, dir);
  int frozen = 0, moved = 0;
  for (const auto& [name, w] : masters2) {
    const bool unreached = name.rfind("vision_encoder.", 0) == 0 || name.rfind("MP.", 0) == 0;
    if (unreached) {
      EXPECT_TRUE(at::equal(w, masters1.at(name))) << tag << ": " << name << " moved";
      ++frozen;
    } else if (!at::equal(w, masters1.at(name))) {
      ++moved;
    }
  }
  EXPECT_GT(frozen, 0) << tag;
  EXPECT_GT(moved, 0) << tag << ": the language model did not learn";
  for (const auto& [name, v] : state2) {
    const bool unreached = InGroup(name, ".vision_encoder.") || InGroup(name, ".MP.");
    if (unreached) {
      EXPECT_TRUE(at::equal(v, state1.at(name))) << tag << ": " << name << " changed";
    } else if (name.rfind("step.", 0) == 0) {
      EXPECT_EQ(v.item<float>(), 2.f) << tag << ": " << name;
    }
  }
  EXPECT_EQ(state2.at("step.MP.proj.weight").item<float>(), 1.f) << tag;

  // Images again: the vision encoder and projector move on from where they stayed.
  ASSERT_FALSE(t.Step(FixtureBatch()).skipped);
  const auto masters3 = Masters(t);
  const auto state3 = OptimizerState(t, dir);
  EXPECT_FALSE(at::equal(masters3.at("MP.proj.weight"), masters2.at("MP.proj.weight"))) << tag;
  EXPECT_EQ(state3.at("step.MP.proj.weight").item<float>(), 2.f) << tag;
  int language = 0;
  for (const auto& [name, v] : state3) {
    if (name.rfind("step.decoder.", 0) != 0) continue;
    EXPECT_EQ(v.item<float>(), 3.f) << tag << ": " << name;
    ++language;
  }
  EXPECT_GT(language, 0) << tag;
}

TEST(Trainer, GroupsNoExampleReachesStayAsTheyWere) {
  TrainOptions o = FixtureOptions(at::kCPU, /*graphs=*/false);
  ExpectUnreachedGroupsStay(o, "cpu_float32");
  o.grad_accum_steps = 2;  // two micro-batches, neither with an image
  ExpectUnreachedGroupsStay(o, "cpu_float32_accumulated");
}

TEST(Trainer, GroupsNoExampleReachesStayAsTheyWere_CUDA) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  TrainOptions o = FixtureOptions(at::Device(at::kCUDA, 0), /*graphs=*/true);
  ExpectUnreachedGroupsStay(o, "cuda_float32_graphed");
  o.compute_dtype = at::kBFloat16;  // the fused kernel inside the micro-step's graph
  ExpectUnreachedGroupsStay(o, "cuda_bf16_graphed");
  o.grad_accum_steps = 2;  // the fused kernel in the optimizer's graph, after accumulation
  ExpectUnreachedGroupsStay(o, "cuda_bf16_graphed_accumulated");
}

}  // namespace
}  // namespace vlmgraph
