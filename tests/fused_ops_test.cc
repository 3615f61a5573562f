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

TEST(FusedOps, GemvAndItsProloguesMatchTheUnfusedOps_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto opt = at::dtype(dtype).device(at::kCUDA);
    // float32: summation order only; bfloat16: the output's rounding, 2^-8 relative, with margin.
    auto close = [dtype](const at::Tensor& got, const at::Tensor& want) {
      const double scale = std::max(1.0, want.abs().max().item<double>());
      return MaxAbsDiff(got, want) < (dtype == at::kFloat ? 1e-4 : scale / 64);
    };
    // k = 2560 takes two passes of the kernel's in-flight weight loads; n = 7 leaves idle warps.
    for (int64_t k : {64, 960, 2560}) {
      for (int64_t n : {7, 960}) {
        for (int64_t rows : {1, 2, 3, 4, 5, 9}) {  // 5 and 9 take the cuBLAS fallback
          SCOPED_TRACE(::testing::Message()
                       << c10::toString(dtype) << " k " << k << " n " << n << " rows " << rows);
          at::Tensor x = at::randn({rows, k}, opt), w = at::randn({n, k}, opt) * 0.05;
          at::Tensor r = at::randn({rows, n}, opt), g = 1 + 0.1 * at::randn({k}, opt);
          at::Tensor gu = at::randn({rows, 2 * k}, opt);
          at::Tensor xf = x.to(at::kFloat), wf = w.to(at::kFloat), rf = r.to(at::kFloat);
          EXPECT_TRUE(close(ops::Linear(x, w), at::linear(xf, wf)));
          EXPECT_TRUE(close(ops::Linear(x, w, r), at::addmm(rf, xf, wf.t())));
          // The fused prologues see the same rounded inputs as the separate kernels.
          at::Tensor normed = ops::RmsNorm(x, g, 1e-5).to(at::kFloat);
          EXPECT_TRUE(close(ops::RmsNormLinear(x, g, 1e-5, w), at::linear(normed, wf)));
          at::Tensor act = ops::SiluMul(gu).to(at::kFloat);
          EXPECT_TRUE(close(ops::SiluMulLinear(gu, w, r), at::addmm(rf, act, wf.t())));
        }
      }
    }
  }
}

// Reference decode attention: RopeKvWrite (rotate, write the cache) then softmax(q K^T / sqrt(D)) V
// per row over positions [0, min(pos + 1, kv_len)), in float64.
at::Tensor ReferenceDecodeAttention(const at::Tensor& qkv, const at::Tensor& inv_freq,
                                    const at::Tensor& positions, at::Tensor& ck, at::Tensor& cv,
                                    int64_t kv_len, int64_t nh) {
  const int64_t b = qkv.size(0), nkv = ck.size(1), d = ck.size(3);
  ops::RopeKvOutput r = ops::RopeKvWrite(qkv.view({b, 1, -1}), inv_freq, 1.0, positions, {}, nh,
                                         nkv, ck, cv, /*want_k=*/false);
  at::Tensor q = r.q.view({b, nh, d}).to(at::kDouble);
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = std::min<int64_t>(positions[i].item<int64_t>() + 1, kv_len);
    at::Tensor keys = ck[i].narrow(1, 0, len).to(at::kDouble).repeat_interleave(nh / nkv, 0);
    at::Tensor values = cv[i].narrow(1, 0, len).to(at::kDouble).repeat_interleave(nh / nkv, 0);
    at::Tensor scores = at::matmul(keys, q[i].unsqueeze(-1)).squeeze(-1) / std::sqrt(double(d));
    rows.push_back(at::matmul(at::softmax(scores, -1).unsqueeze(1), values).reshape({nh * d}));
  }
  return at::stack(rows);
}

TEST(FusedOps, RopeDecodeAttentionMatchesReference_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  struct Case {
    int64_t nh, nkv, d, batch, kv_len, max_seq;
  };
  // 460m heads (15 / 5, D 64), tiny-like heads (D 16), D 128 with 16 query heads per KV head;
  // windows of one split (48) up to 16 splits of 64 keys (1024) and a window shorter than the
  // cache (positions past kv_len are clipped).
  const Case cases[] = {{15, 5, 64, 3, 48, 64},
                        {15, 5, 64, 9, 1024, 1024},
                        {4, 2, 16, 2, 512, 600},
                        {16, 1, 128, 2, 256, 256},
                        {15, 5, 64, 1, 512, 1024}};
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message()
                   << c10::toString(dtype) << " nh " << c.nh << " nkv " << c.nkv << " d " << c.d
                   << " batch " << c.batch << " kv_len " << c.kv_len);
      at::manual_seed(c.batch * 1000 + c.kv_len);
      auto opt = at::dtype(dtype).device(at::kCUDA);
      auto longs = at::dtype(at::kLong).device(at::kCUDA);
      at::Tensor qkv = at::randn({c.batch, (c.nh + 2 * c.nkv) * c.d}, opt);
      at::Tensor inv_freq =
          1.0 / at::pow(10000.0, at::arange(0, c.d, 2, at::dtype(at::kFloat).device(at::kCUDA)) /
                                     double(c.d));
      at::Tensor ck = at::randn({c.batch + 1, c.nkv, c.max_seq, c.d}, opt), cv = at::randn_like(ck);
      // First and last positions of the window, one split boundary, random ones.
      at::Tensor positions = at::randint(0, c.kv_len, {c.batch}, longs);
      positions[0] = c.kv_len - 1;
      if (c.batch > 1) positions[1] = 0;
      if (c.batch > 2) positions[2] = std::min<int64_t>(c.kv_len - 1, 32);
      if (c.max_seq > c.kv_len) positions[c.batch - 1] = c.kv_len + 3;  // beyond the window
      at::Tensor ref_k = ck.clone(), ref_v = cv.clone();
      at::Tensor want =
          ReferenceDecodeAttention(qkv, inv_freq, positions, ref_k, ref_v, c.kv_len, c.nh);
      at::Tensor semaphores = at::zeros({c.batch + 1, c.nkv}, longs.dtype(at::kInt));
      for (int round = 0; round < 2; ++round) {  // the semaphores must be reusable
        at::Tensor got = ops::RopeDecodeAttention(qkv, inv_freq, 1.0, positions, ck, cv, semaphores,
                                                  c.kv_len, c.nh);
        EXPECT_LT(MaxAbsDiff(got, want), dtype == at::kFloat ? 1e-4 : 2e-2) << "round " << round;
        const double cache_tol = dtype == at::kFloat ? 1e-5 : 2e-2;  // same rounding, maybe FMA
        EXPECT_LT(MaxAbsDiff(ck, ref_k), cache_tol) << "keys written to the cache";
        EXPECT_LT(MaxAbsDiff(cv, ref_v), cache_tol) << "values written to the cache";
        EXPECT_EQ(semaphores.abs().sum().item<int64_t>(), 0);
      }
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
