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
  const std::vector<int64_t> lengths = {5, 14};  // row 1 crosses from its first page to its second
  const int64_t steps = 4, max_len = 32;
  std::vector<at::Tensor> prompts;
  for (int64_t len : lengths)
    prompts.push_back(at::randint(0, cfg.lm_base_vocab_size, {1, len}, at::kLong));
  // Rows on scattered pages (Note [Paged KV layout]): a random order of the pages, the last
  // row's entries past its first page left on scratch, which nothing here reads or writes.
  KVCache cache = KVCache::AllocatePaged(cfg, 3, max_len, 3 * 2 + 1,
                                         m->decoder->token_embedding->weight.options());
  ASSERT_EQ(cache.pages_per_row(), 2);
  cache.page_table.copy_(at::tensor({5, 2, 6, 1, 3, 0}, at::kInt).view({3, 2}));
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
  KVCache c = KVCache::Allocate(cfg, 4, 120, at::dtype(at::kFloat));
  ASSERT_EQ(c.key.size(), static_cast<size_t>(cfg.lm_n_blocks));
  EXPECT_EQ(c.rows(), 4);
  EXPECT_EQ(c.page_size(), kDefaultKvPageSize);
  EXPECT_EQ(c.pages_per_row(), 8);  // 120 positions in pages of 16
  EXPECT_EQ(c.max_seq_len(), 128);
  EXPECT_EQ(c.num_pages(), 4 * 8 + 1);  // and the scratch page
  EXPECT_EQ(c.key[0].sizes(), (std::vector<int64_t>{33, cfg.lm_n_kv_heads, 16, cfg.lm_head_dim()}));
  EXPECT_EQ(c.bytes(), 2 * cfg.lm_n_blocks * 33 * cfg.lm_n_kv_heads * 16 * cfg.lm_head_dim() * 4);
  // Allocate gives every row pages of its own; AllocatePaged leaves every row on scratch.
  EXPECT_EQ(c.page_table[1][0].item<int>(), 9);
  EXPECT_EQ(std::get<0>(at::_unique(c.page_table)).size(0), 32);
  KVCache p = KVCache::AllocatePaged(cfg, 4, 120, 10, at::dtype(at::kFloat));
  EXPECT_EQ(p.num_pages(), 10);
  EXPECT_EQ(p.page_table.abs().sum().item<int64_t>(), 0);
  EXPECT_THROW(KVCache::Allocate(cfg, 4, 120, at::dtype(at::kFloat), 24), std::invalid_argument);
  EXPECT_THROW(KVCache::AllocatePaged(cfg, 4, 120, 1, at::dtype(at::kFloat)),
               std::invalid_argument);
}

}  // namespace
}  // namespace vlmgraph
