// The fused CUDA decoder path (model/fused_ops.h) computes the reference formulas: hidden states of
// Forward, Prefill and Decode and the KV cache it writes match the unfused ATen path.
#include "model/fused_ops.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "model/vision_language_model.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

using testing::MaxAbsDiff;

struct DecoderOutputs {
  at::Tensor full, prefill, decode, cache_k, cache_v;
};

DecoderOutputs RunDecoder(VisionLanguageModel& m, const at::Tensor& ids, const at::Tensor& next) {
  at::NoGradGuard no_grad;
  auto& d = m->decoder;
  DecoderOutputs o;
  const int64_t b = ids.size(0), t = ids.size(1);
  o.full = d->Forward(m->Embed(ids, {}));
  KVCache cache = KVCache::Allocate(m->cfg, b + 1, 64, d->token_embedding->weight.options());
  // Rows written in reverse order through slots, as the engine does for arbitrary free rows.
  at::Tensor slots = at::arange(b - 1, -1, -1, ids.options());
  o.prefill = d->Prefill(m->Embed(ids, {}), &cache, slots);
  at::Tensor positions =
      at::full({b}, t, ids.options()) - at::arange(b, ids.options());  // per-row lengths
  o.decode = d->Decode(m->Embed(next, {}), &cache, positions, 48);
  o.cache_k = cache.key[0].clone();
  o.cache_v = cache.value.back().clone();
  return o;
}

void CheckFusedMatchesReference(VlmConfig cfg, at::ScalarType dtype, double tol) {
  at::manual_seed(0);
  VisionLanguageModel m(cfg);
  m->to(at::kCUDA, dtype);
  m->decoder->rotary_embd->inv_freq.set_data(m->decoder->rotary_embd->inv_freq.to(at::kFloat));
  at::Tensor ids =
      at::randint(0, cfg.lm_base_vocab_size, {3, 21}, at::dtype(at::kLong).device(at::kCUDA));
  at::Tensor next = at::randint(0, cfg.lm_base_vocab_size, {3, 1}, ids.options());
  ASSERT_FALSE(m->decoder->UsesFusedPath(m->decoder->token_embedding->weight));
  DecoderOutputs ref = RunDecoder(m, ids, next);
  m->decoder->FuseWeights();
  {
    at::NoGradGuard ng;
    ASSERT_TRUE(m->decoder->UsesFusedPath(m->decoder->token_embedding->weight));
  }
  DecoderOutputs got = RunDecoder(m, ids, next);
  EXPECT_LT(MaxAbsDiff(got.full, ref.full), tol);
  EXPECT_LT(MaxAbsDiff(got.prefill, ref.prefill), tol);
  EXPECT_LT(MaxAbsDiff(got.decode, ref.decode), tol);
  EXPECT_LT(MaxAbsDiff(got.cache_k, ref.cache_k), tol);
  EXPECT_LT(MaxAbsDiff(got.cache_v, ref.cache_v), tol);
  std::printf("[fused vs reference] head_dim %lld %s: full %.2e prefill %.2e decode %.2e\n",
              static_cast<long long>(cfg.lm_head_dim()), c10::toString(dtype),
              MaxAbsDiff(got.full, ref.full), MaxAbsDiff(got.prefill, ref.prefill),
              MaxAbsDiff(got.decode, ref.decode));
}

VlmConfig Shallow460m() {
  VlmConfig c = VlmConfig::Preset("nanovlm-460m");  // head_dim 64, 3 query heads per KV head
  c.lm_n_blocks = 2;
  c.vit_n_blocks = 1;
  return c;
}

TEST(FusedOps, TinyFloat32MatchesReference_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  CheckFusedMatchesReference(VlmConfig::Preset("nanovlm-tiny"), at::kFloat, 1e-4);
}

TEST(FusedOps, Default460mShapesFloat32MatchReference_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  CheckFusedMatchesReference(Shallow460m(), at::kFloat, 1e-4);
}

TEST(FusedOps, Default460mShapesBFloat16MatchReference_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  // Both paths round to bf16 at different points; the hidden states (magnitude ~1) agree to a few
  // bf16 ulps.
  CheckFusedMatchesReference(Shallow460m(), at::kBFloat16, 0.1);
}

TEST(FusedOps, SmallBatchGemvMatchesCublas_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t rows : {1, 3, 8, 9}) {  // 9 takes the cuBLAS fallback
      auto opt = at::dtype(dtype).device(at::kCUDA);
      at::Tensor x = at::randn({rows, 2560}, opt), w = at::randn({960, 2560}, opt) * 0.02;
      at::Tensor r = at::randn({rows, 960}, opt);
      const double tol = dtype == at::kFloat ? 1e-4 : 3e-2;
      EXPECT_LT(MaxAbsDiff(ops::Linear(x, w), at::linear(x.to(at::kFloat), w.to(at::kFloat))), tol)
          << rows;
      EXPECT_LT(MaxAbsDiff(ops::Linear(x, w, r),
                           at::addmm(r.to(at::kFloat), x.to(at::kFloat), w.to(at::kFloat).t())),
                tol)
          << rows;
    }
  }
}

TEST(FusedOps, CpuTensorsKeepTheReferencePath) {
  VisionLanguageModel m(VlmConfig::Preset("nanovlm-tiny"));
  m->decoder->FuseWeights();
  at::NoGradGuard ng;
  EXPECT_FALSE(m->decoder->UsesFusedPath(m->decoder->token_embedding->weight));
  // Fusing keeps the parameters' values and names (they become views of the stacked weights).
  auto* attn = m->decoder->blocks[0]->as<DecoderBlock>()->attn.get();
  EXPECT_TRUE(
      at::equal(attn->w_qkv.narrow(0, 0, attn->q_proj->weight.size(0)), attn->q_proj->weight));
  EXPECT_EQ(attn->q_proj->weight.data_ptr(), attn->w_qkv.data_ptr());
}

}  // namespace
}  // namespace vlmgraph
