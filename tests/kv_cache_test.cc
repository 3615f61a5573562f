// The decode path (static KV cache, per-row positions, masked attention) must give the logits of a
// full recomputation of the sequence.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/checkpoint.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

void CheckDecodeMatchesRecompute(at::Device device) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  m->to(device);
  at::NoGradGuard no_grad;
  const auto& cfg = m->cfg;
  at::manual_seed(7);
  // Two rows with different prompt lengths share one cache and one decode call.
  const std::vector<int64_t> lengths = {5, 9};
  const int64_t steps = 4, max_len = 32;
  std::vector<at::Tensor> prompts;
  for (int64_t len : lengths)
    prompts.push_back(at::randint(0, cfg.lm_base_vocab_size, {1, len}, at::kLong));
  KVCache cache = KVCache::Allocate(cfg, 3, max_len, m->decoder->token_embedding->weight.options());
  std::vector<at::Tensor> seqs = prompts;
  for (size_t r = 0; r < lengths.size(); ++r) {
    at::Tensor ids = prompts[r].to(device);
    m->decoder->Prefill(m->Embed(ids, {}), &cache,
                        at::full({1}, static_cast<int64_t>(r), at::kLong).to(device));
  }
  for (int64_t s = 0; s < steps; ++s) {
    at::Tensor next = at::randint(0, cfg.lm_base_vocab_size, {2, 1}, at::kLong);
    at::Tensor positions = at::tensor({lengths[0] + s, lengths[1] + s}, at::kLong).to(device);
    const int64_t kv_len = lengths[1] + s + 3;  // wider than needed: the mask must hide the rest
    at::Tensor hidden =
        m->decoder->Decode(m->Embed(next.to(device), {}), &cache, positions, kv_len);
    at::Tensor decode_logits = m->decoder->Logits(hidden.select(1, 0));
    for (int r = 0; r < 2; ++r) {
      seqs[r] = at::cat({seqs[r], next.narrow(0, r, 1)}, 1);
      at::Tensor full = m->Forward(seqs[r].to(device), {}).logits.select(1, seqs[r].size(1) - 1);
      EXPECT_LT(testing::MaxAbsDiff(decode_logits.narrow(0, r, 1), full), 1e-4)
          << "row " << r << " step " << s;
    }
  }
}

TEST(KVCache, DecodeStepMatchesFullRecompute) { CheckDecodeMatchesRecompute(at::kCPU); }

TEST(KVCache, DecodeStepMatchesFullRecompute_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  CheckDecodeMatchesRecompute(at::kCUDA);
}

TEST(KVCache, AllocateGivesStaticShapes) {
  VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
  KVCache c = KVCache::Allocate(cfg, 4, 128, at::dtype(at::kFloat));
  ASSERT_EQ(c.key.size(), static_cast<size_t>(cfg.lm_n_blocks));
  EXPECT_EQ(c.rows(), 4);
  EXPECT_EQ(c.max_seq_len(), 128);
  EXPECT_EQ(c.bytes(), 2 * cfg.lm_n_blocks * 4 * cfg.lm_n_kv_heads * 128 * cfg.lm_head_dim() * 4);
}

}  // namespace
}  // namespace vlmgraph
