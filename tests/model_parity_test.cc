// Parity of the LibTorch nanoVLM against upstream nanoVLM's own outputs on the nanovlm-tiny
// checkpoint (tests/fixtures/nanovlm-tiny/reference.*): image embeddings, logits, loss, greedy
// generation; on CPU in float32, and on the GPU in float32 and bfloat16.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "model/checkpoint.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

using testing::MaxAbsDiff;
using testing::TinyReference;

nlohmann::json ReferenceJson() {
  std::ifstream in(testing::TinyCheckpointDir() + "/reference.json");
  return nlohmann::json::parse(in);
}

struct Parity {
  double image_embd_err, logits_err, loss_err;
  at::Tensor generated;
};

Parity RunParity(at::Device device, at::ScalarType dtype) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  m->to(device, dtype);
  m->eval();
  at::NoGradGuard no_grad;
  const auto& ref = TinyReference().tensors;
  at::Tensor ids = ref.at("input_ids").to(device);
  at::Tensor targets = ref.at("targets").to(device);
  at::Tensor images = ref.at("images").to(device, dtype);
  Parity p;
  at::Tensor image_rows = m->EncodeImages(images);
  p.image_embd_err =
      MaxAbsDiff(image_rows.view(ref.at("image_embeddings").sizes()), ref.at("image_embeddings"));
  ForwardOutput out = m->Forward(ids, images, targets);
  p.logits_err = MaxAbsDiff(out.logits, ref.at("logits"));
  p.loss_err = std::abs(out.loss.item<double>() - ReferenceJson()["loss"].get<double>());
  const auto j = ReferenceJson();
  p.generated = m->GenerateGreedy(ids, images, j["generate"]["max_new_tokens"].get<int64_t>(),
                                  j["eos_token_id"].get<int64_t>())
                    .to(at::kCPU);
  return p;
}

TEST(ModelParity, Float32CpuMatchesUpstream) {
  Parity p = RunParity(at::kCPU, at::kFloat);
  EXPECT_LT(p.image_embd_err, 1e-4);
  EXPECT_LT(p.logits_err, 1e-4);
  EXPECT_LT(p.loss_err, 1e-5);
  EXPECT_TRUE(at::equal(p.generated, TinyReference().tensors.at("generated_ids")))
      << "got " << p.generated << "\nwant " << TinyReference().tensors.at("generated_ids");
}

TEST(ModelParity, Float32MatchesUpstream_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  Parity p = RunParity(at::kCUDA, at::kFloat);
  std::printf("[parity cuda f32] image_embd %.3g logits %.3g loss %.3g\n", p.image_embd_err,
              p.logits_err, p.loss_err);
  EXPECT_LT(p.image_embd_err, 1e-4);
  EXPECT_LT(p.logits_err, 1e-4);
  EXPECT_LT(p.loss_err, 1e-5);
  EXPECT_TRUE(at::equal(p.generated, TinyReference().tensors.at("generated_ids")));
}

// bf16 keeps 8 mantissa bits: relative error ~4e-3 per op. Over 2+2 blocks the tiny model's logits
// (magnitude ~0.5) stay within 0.05 and the loss within 0.01 of float32 upstream.
TEST(ModelParity, BFloat16WithinTolerance_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  Parity p = RunParity(at::kCUDA, at::kBFloat16);
  std::printf("[parity cuda bf16] image_embd %.3g logits %.3g loss %.3g\n", p.image_embd_err,
              p.logits_err, p.loss_err);
  EXPECT_LT(p.image_embd_err, 0.05);
  EXPECT_LT(p.logits_err, 0.05);
  EXPECT_LT(p.loss_err, 0.01);
}

TEST(ModelParity, ForwardRejectsImageTokenCountMismatch) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  const auto& ref = TinyReference().tensors;
  at::Tensor one_image = ref.at("images").narrow(0, 0, 1);
  try {
    m->Forward(ref.at("input_ids"), one_image);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("8 image tokens"), std::string::npos) << e.what();
  }
}

TEST(ModelParity, ForwardRejectsTokenOutsideVocabulary) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  at::Tensor ids = at::full({1, 4}, 5000, at::kLong);
  EXPECT_THROW(m->Forward(ids, {}), std::invalid_argument);
}

}  // namespace
}  // namespace vlmgraph
