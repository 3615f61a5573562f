// The fused CUDA decoder path (model/fused_ops.h) computes the reference formulas: hidden states of
// Forward, Prefill and Decode and the KV cache it writes match the unfused ATen path.
#include "model/fused_ops.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "model/vision_language_model.h"
#include "tests/test_util.h"

#if VLMGRAPH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

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
    // k = 2560 takes two passes of the CUDA-core GEMV's in-flight weight loads and four k splits
    // of the tensor-core GEMV (sm_90), k = 1100 two splits, the second ending in a partial
    // 32-column chunk, as k = 1000 does unsplit; n = 7 leaves idle warps; n = 2200 has more
    // 16-column tiles than an H100 or H200 has SMs (the RMSNorm prologue then takes cuBLAS).
    for (int64_t k : {64, 960, 1000, 1100, 2560}) {
      for (int64_t n : {7, 960, 2200}) {
        // 1-4: CUDA-core GEMV; 5-8: tensor-core GEMV in bf16 (k = 2560 split over a cluster on
        // sm_90; cuBLAS in float32); 9: cuBLAS.
        for (int64_t rows : {1, 2, 3, 4, 5, 6, 8, 9}) {
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

// add_into_residual: with cuBLAS (more rows than the GEMV takes) the output is the residual's
// memory, the same sums as a new output; with the CUDA-core GEMV (4 rows) a new tensor, the
// residual left as it was. Both ops, float32 and bf16.
TEST(FusedOps, LinearAddsIntoTheResidualInPlaceAboveTheGemvRows_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  constexpr int64_t kMaxGemvRowsForTest = 8;  // cuda::kMaxGemvRows
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto opt = at::dtype(dtype).device(at::kCUDA);
    for (int64_t rows : {4, 16, 256}) {
      SCOPED_TRACE(::testing::Message() << c10::toString(dtype) << " rows " << rows);
      at::Tensor x = at::randn({rows, 576}, opt), w = at::randn({960, 576}, opt) * 0.05;
      at::Tensor gu = at::randn({rows, 2 * 576}, opt);
      at::Tensor r = at::randn({rows, 960}, opt);
      for (bool silu : {false, true}) {
        at::Tensor want = silu ? ops::SiluMulLinear(gu, w, r) : ops::Linear(x, w, r);
        at::Tensor residual = r.clone();
        at::Tensor got = silu ? ops::SiluMulLinear(gu, w, residual, /*add_into_residual=*/true)
                              : ops::Linear(x, w, residual, /*add_into_residual=*/true);
        EXPECT_LT(MaxAbsDiff(got, want), dtype == at::kFloat ? 1e-5 : 1e-2) << "silu " << silu;
        if (rows > kMaxGemvRowsForTest) {
          EXPECT_EQ(got.data_ptr(), residual.data_ptr()) << "silu " << silu;
        } else {
          EXPECT_NE(got.data_ptr(), residual.data_ptr()) << "silu " << silu;
          EXPECT_TRUE(at::equal(residual, r)) << "silu " << silu;
        }
      }
    }
  }
}

// A decode attention shape: query and KV heads, head_dim, rows, window, cache positions per row.
struct DecodeAttentionCase {
  int64_t nh, nkv, d, batch, kv_len, max_seq;
};
// Random decode attention inputs of shape c on the GPU: qkv (batch, (nh + 2 nkv) d), RoPE's
// inverse frequencies (d / 2) float32, and a paged KV cache of batch + 1 rows of max_seq positions
// (rounded up to pages of 16) whose page table maps the rows to the pages in a random order, so
// that a row's neighbouring positions are pages apart (Note [Paged KV layout]).
struct DecodeAttentionInputs {
  at::Tensor qkv, inv_freq, cache_k, cache_v, page_table;
};
constexpr int64_t kTestPageSize = 16;
DecodeAttentionInputs MakeDecodeAttentionInputs(const DecodeAttentionCase& c,
                                                at::ScalarType dtype) {
  auto opt = at::dtype(dtype).device(at::kCUDA);
  DecodeAttentionInputs in;
  in.qkv = at::randn({c.batch, (c.nh + 2 * c.nkv) * c.d}, opt);
  in.inv_freq =
      1.0 / at::pow(10000.0,
                    at::arange(0, c.d, 2, at::dtype(at::kFloat).device(at::kCUDA)) / double(c.d));
  const int64_t per_row = KvPagesFor(c.max_seq, kTestPageSize);
  const int64_t pages = (c.batch + 1) * per_row + 1;  // page 0: scratch
  in.cache_k = at::randn({pages, c.nkv, kTestPageSize, c.d}, opt);
  in.cache_v = at::randn_like(in.cache_k);
  in.page_table = (at::randperm(pages - 1, at::kInt) + 1)
                      .view({c.batch + 1, per_row})
                      .to(at::kCUDA)
                      .contiguous();
  return in;
}

// The rows of a paged cache (pages, nkv, page_size, d) as a contiguous (rows, nkv, positions, d)
// tensor, through page_table (rows, pages_per_row).
at::Tensor Unpage(const at::Tensor& paged, const at::Tensor& page_table) {
  const int64_t rows = page_table.size(0), per_row = page_table.size(1);
  return paged.index_select(0, page_table.reshape({-1}).to(at::kLong))
      .view({rows, per_row, paged.size(1), paged.size(2), paged.size(3)})
      .permute({0, 2, 1, 3, 4})
      .reshape({rows, paged.size(1), per_row * paged.size(2), paged.size(3)});
}

// Reference decode attention: RopeKvWrite (rotate, write the cache) then softmax(q K^T / sqrt(D)) V
// per row over positions [0, min(pos + 1, kv_len)), in float64.
at::Tensor ReferenceDecodeAttention(const at::Tensor& qkv, const at::Tensor& inv_freq,
                                    const at::Tensor& positions, at::Tensor& ck, at::Tensor& cv,
                                    const at::Tensor& page_table, int64_t kv_len, int64_t nh) {
  const int64_t b = qkv.size(0), nkv = ck.size(1), d = ck.size(3);
  ops::RopeKvOutput r = ops::RopeKvWrite(qkv.view({b, 1, -1}), inv_freq, 1.0, positions, {}, nh,
                                         nkv, ck, cv, page_table, /*want_k=*/false);
  at::Tensor q = r.q.view({b, nh, d}).to(at::kDouble);
  const at::Tensor k_rows = Unpage(ck, page_table), v_rows = Unpage(cv, page_table);
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = std::min<int64_t>(positions[i].item<int64_t>() + 1, kv_len);
    at::Tensor keys = k_rows[i].narrow(1, 0, len).to(at::kDouble).repeat_interleave(nh / nkv, 0);
    at::Tensor values = v_rows[i].narrow(1, 0, len).to(at::kDouble).repeat_interleave(nh / nkv, 0);
    at::Tensor scores = at::matmul(keys, q[i].unsqueeze(-1)).squeeze(-1) / std::sqrt(double(d));
    rows.push_back(at::matmul(at::softmax(scores, -1).unsqueeze(1), values).reshape({nh * d}));
  }
  return at::stack(rows);
}

TEST(FusedOps, RopeDecodeAttentionMatchesReference_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  using Case = DecodeAttentionCase;
  // 460m heads (15 / 5, D 64), tiny-like heads (D 16), D 128 with 16 query heads per KV head;
  // windows of one split (48) up to 16 splits of 64 keys (1024) and a window shorter than the
  // cache (positions past kv_len are clipped). From 4 rows with at most 4 query heads per KV head
  // the warps kernel runs in float32 and for D 16, the tensor-core kernel in bf16 for D 64 and 128
  // (9, 40, 64, 80, 256 and 544 rows: rows of one block written directly, rows of several blocks
  // combined, a last block of a partial round, a last tile of a few keys; blocks of 4 warps, and
  // of 2 from 4 blocks per SM (256 rows of 3 KV heads, 544 of 1); D 128 with 4 query heads per KV
  // head over two blocks); 160 rows with 16 query heads per KV head keep the split-key kernel.
  const Case cases[] = {
      {15, 5, 64, 3, 48, 64},    {15, 5, 64, 9, 1024, 1024}, {4, 2, 16, 2, 512, 600},
      {16, 1, 128, 2, 256, 256}, {15, 5, 64, 1, 512, 1024},  {15, 5, 64, 40, 1024, 1024},
      {9, 3, 64, 64, 300, 320},  {4, 2, 16, 80, 512, 600},   {16, 1, 128, 160, 200, 256},
      {9, 3, 64, 256, 512, 512}, {8, 2, 128, 24, 700, 768},  {4, 1, 128, 544, 96, 128}};
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message()
                   << c10::toString(dtype) << " nh " << c.nh << " nkv " << c.nkv << " d " << c.d
                   << " batch " << c.batch << " kv_len " << c.kv_len);
      at::manual_seed(c.batch * 1000 + c.kv_len);
      auto longs = at::dtype(at::kLong).device(at::kCUDA);
      const auto [qkv, inv_freq, ck, cv, table] = MakeDecodeAttentionInputs(c, dtype);
      // First and last positions of the window, one split boundary, random ones.
      at::Tensor positions = at::randint(0, c.kv_len, {c.batch}, longs);
      positions[0] = c.kv_len - 1;
      if (c.batch > 1) positions[1] = 0;
      if (c.batch > 2) positions[2] = std::min<int64_t>(c.kv_len - 1, 32);
      if (c.max_seq > c.kv_len) positions[c.batch - 1] = c.kv_len + 3;  // beyond the window
      at::Tensor ref_k = ck.clone(), ref_v = cv.clone();
      at::Tensor want =
          ReferenceDecodeAttention(qkv, inv_freq, positions, ref_k, ref_v, table, c.kv_len, c.nh);
      at::Tensor semaphores = at::zeros({c.batch + 1, c.nkv}, longs.dtype(at::kInt));
      for (int round = 0; round < 2; ++round) {  // the semaphores must be reusable
        at::Tensor got = ops::RopeDecodeAttention(qkv, inv_freq, 1.0, positions, ck, cv, table,
                                                  semaphores, c.kv_len, c.nh);
        EXPECT_LT(MaxAbsDiff(got, want), dtype == at::kFloat ? 1e-4 : 2e-2) << "round " << round;
        const double cache_tol = dtype == at::kFloat ? 1e-5 : 2e-2;  // same rounding, maybe FMA
        EXPECT_LT(MaxAbsDiff(ck, ref_k), cache_tol) << "keys written to the cache";
        EXPECT_LT(MaxAbsDiff(cv, ref_v), cache_tol) << "values written to the cache";
        EXPECT_EQ(semaphores.abs().sum().item<int64_t>(), 0);
      }
    }
  }
}

// The out projection that combines the attention's partial states itself gives, to the bit, what
// the attention kernel's own combine followed by the plain GEMV gives, and the attention still
// writes the new key and value: 1 to 4 rows, windows of 5 to 16 splits (more than the combine's
// first round of 8), positions at both ends of the window and past it, with and without the
// residual. More rows than the CUDA-core GEMV takes are refused (with 3 or 4 rows it is correct,
// only slower than the attention kernel's own combine: DecodeAttentionCombinesInLinear).
TEST(FusedOps, AttentionCombineLinearEqualsLinearOfAttention_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  using Case = DecodeAttentionCase;
  const Case cases[] = {{15, 5, 64, 1, 512, 1024}, {15, 5, 64, 4, 1024, 1024},
                        {15, 5, 64, 3, 160, 256},  {4, 2, 16, 2, 512, 600},
                        {16, 1, 128, 2, 256, 256}, {15, 5, 64, 1, 20, 64}};
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const Case& c : cases) {
      for (bool residual : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << c10::toString(dtype) << " nh " << c.nh << " nkv " << c.nkv << " d " << c.d
                     << " batch " << c.batch << " kv_len " << c.kv_len << " residual " << residual);
        at::manual_seed(c.batch * 7 + c.kv_len);
        auto opt = at::dtype(dtype).device(at::kCUDA);
        auto longs = at::dtype(at::kLong).device(at::kCUDA);
        const auto [qkv, inv_freq, ck, cv, table] = MakeDecodeAttentionInputs(c, dtype);
        at::Tensor positions = at::randint(0, c.kv_len, {c.batch}, longs);
        positions[0] = c.kv_len - 1;
        if (c.batch > 1) positions[1] = 0;
        if (c.batch > 2 && c.max_seq > c.kv_len) positions[2] = c.kv_len + 3;
        at::Tensor w = at::randn({c.nh * c.d + 16, c.nh * c.d}, opt) * 0.05;
        at::Tensor res = residual ? at::randn({c.batch, w.size(0)}, opt) : at::Tensor();
        at::Tensor sem = at::zeros({c.batch + 1, c.nkv}, longs.dtype(at::kInt));
        at::Tensor ck2 = ck.clone(), cv2 = cv.clone();
        at::Tensor want = ops::Linear(ops::RopeDecodeAttention(qkv, inv_freq, 1.0, positions, ck,
                                                               cv, table, sem, c.kv_len, c.nh),
                                      w, res);
        ops::DecodeAttentionPartials parts = ops::RopeDecodeAttentionPartials(
            qkv, inv_freq, 1.0, positions, ck2, cv2, table, sem, c.kv_len, c.nh);
        at::Tensor got = ops::AttentionCombineLinear(parts, w, res);
        EXPECT_TRUE(at::equal(got, want)) << MaxAbsDiff(got, want);
        EXPECT_TRUE(at::equal(ck2, ck)) << "keys written to the cache";
        EXPECT_TRUE(at::equal(cv2, cv)) << "values written to the cache";
        EXPECT_EQ(sem.abs().sum().item<int64_t>(), 0);
      }
    }
  }
  auto opt = at::dtype(at::kBFloat16).device(at::kCUDA);
  at::Tensor qkv5 = at::randn({5, 25 * 64}, opt), ck = at::randn({21, 5, 16, 64}, opt);
  at::Tensor table5 = at::arange(1, 21, at::dtype(at::kInt).device(at::kCUDA)).view({5, 4});
  at::Tensor pos5 = at::full({5}, 3, at::dtype(at::kLong).device(at::kCUDA));
  at::Tensor sem = at::zeros({5, 5}, at::dtype(at::kInt).device(at::kCUDA));
  EXPECT_THROW(
      ops::AttentionCombineLinear(ops::RopeDecodeAttentionPartials(
                                      qkv5, at::rand({32}, at::dtype(at::kFloat).device(at::kCUDA)),
                                      1.0, pos5, ck, at::randn_like(ck), table5, sem, 64, 15),
                                  at::randn({960, 960}, opt)),
      c10::Error);
}

// Training: RotaryDifferentiable is bit-identical to ApplyRotary's ATen ops forward and backward,
// float32 and bf16, GQA shapes (3 query heads per KV head).
TEST(FusedOps, RotaryDifferentiableEqualsApplyRotaryAndItsGradients_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::manual_seed(3);
  VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
  cfg.lm_attn_scaling = 0.9;  // the scaled cos/sin path
  RotaryEmbedding rope(cfg);
  rope->to(at::kCUDA);
  const int64_t b = 2, t = 7, nq = 6, nk = 2, d = cfg.lm_head_dim();
  at::Tensor positions =
      at::arange(t, at::TensorOptions().dtype(at::kLong).device(at::kCUDA)).expand({b, t}) + 3;
  auto [cos, sin] = rope->forward(positions);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto opt = at::TensorOptions().dtype(dtype).device(at::kCUDA);
    at::Tensor q0 = at::randn({b, t, nq, d}, opt), k0 = at::randn({b, t, nk, d}, opt);
    at::Tensor gq = at::randn({b, nq, t, d}, opt), gk = at::randn({b, nk, t, d}, opt);
    at::Tensor q1 = q0.clone().requires_grad_(), k1 = k0.clone().requires_grad_();
    auto [rq, rk] = ApplyRotary(q1.transpose(1, 2), k1.transpose(1, 2), cos, sin);
    ((rq * gq).sum() + (rk * gk).sum()).backward();
    at::Tensor q2 = q0.clone().requires_grad_(), k2 = k0.clone().requires_grad_();
    auto [fq, fk] = ops::RotaryDifferentiable(q2, k2, cos, sin);
    ((fq.transpose(1, 2) * gq).sum() + (fk.transpose(1, 2) * gk).sum()).backward();
    EXPECT_TRUE(at::equal(fq.transpose(1, 2), rq)) << dtype;
    EXPECT_TRUE(at::equal(fk.transpose(1, 2), rk)) << dtype;
    EXPECT_TRUE(at::equal(q2.grad(), q1.grad()))
        << dtype << " " << MaxAbsDiff(q2.grad(), q1.grad());
    EXPECT_TRUE(at::equal(k2.grad(), k1.grad()))
        << dtype << " " << MaxAbsDiff(k2.grad(), k1.grad());
  }
}

// Training: RmsNormDifferentiable against RMSNormImpl's reference ATen chain (eval mode): output,
// input gradient and weight gradient, on rows that span several backward blocks.
TEST(FusedOps, RmsNormDifferentiableMatchesReferenceAndItsGradients_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::manual_seed(5);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t hidden : {64, 960, 1000}) {
      RMSNorm norm(hidden, 1e-5);
      norm->to(at::kCUDA, dtype);
      {
        at::NoGradGuard ng;
        norm->weight.copy_(at::rand({hidden}) + 0.5);
      }
      auto opt = at::TensorOptions().dtype(dtype).device(at::kCUDA);
      at::Tensor x0 = at::randn({3, 700, hidden}, opt) * 2, g = at::randn({3, 700, hidden}, opt);
      norm->eval();
      at::Tensor x1 = x0.clone().requires_grad_();
      at::Tensor y1 = norm->forward(x1);
      (y1 * g).sum().backward();
      at::Tensor w_grad_ref = norm->weight.grad().clone();
      norm->weight.mutable_grad() = at::Tensor();
      norm->train();
      at::Tensor x2 = x0.clone().requires_grad_();
      at::Tensor y2 = norm->forward(x2);
      (y2 * g).sum().backward();
      auto rel = [](const at::Tensor& a, const at::Tensor& b) {
        return MaxAbsDiff(a, b) / b.abs().max().item<double>();
      };
      // float32: rounding of a different summation order. bf16: a normalised value or a gradient
      // element one bf16 rounding step (2^-8 relative) apart; the weight gradient sums 2100 rows.
      const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
      EXPECT_LT(rel(y2, y1), tol) << dtype << " " << hidden;
      EXPECT_LT(rel(x2.grad(), x1.grad()), tol) << dtype << " " << hidden;
      EXPECT_LT(rel(norm->weight.grad(), w_grad_ref), tol) << dtype << " " << hidden;
    }
  }
}

// Training: BiasAdd has exactly the values and gradients of ATen's `x + bias`, through the kernel
// (n a multiple of 16 bytes' elements; contiguous and transposed x) and through the fallback.
TEST(FusedOps, BiasAddEqualsATenAddAndItsGradients_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::manual_seed(7);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t n : {64, 3072, 36}) {
      for (bool transposed : {false, true}) {
        auto opt = at::TensorOptions().dtype(dtype).device(at::kCUDA);
        at::Tensor x0 = transposed ? at::randn({n, 5, 33}, opt).transpose(0, 2)
                                   : at::randn({5, 33, n}, opt);  // (33 or 5, 5 or 33, n)
        at::Tensor b0 = at::randn({n}, opt), g = at::randn(x0.sizes(), opt);
        at::Tensor x1 = x0.detach().clone().requires_grad_(), b1 = b0.clone().requires_grad_();
        at::Tensor y1 = x1 + b1;
        (y1 * g).sum().backward();
        at::Tensor x2 = x0.detach().clone().requires_grad_(), b2 = b0.clone().requires_grad_();
        at::Tensor y2 = ops::BiasAdd(x2, b2);
        (y2 * g).sum().backward();
        EXPECT_TRUE(at::equal(y2, y1)) << dtype << " n=" << n << " t=" << transposed;
        EXPECT_TRUE(at::equal(x2.grad(), x1.grad())) << dtype << " n=" << n;
        EXPECT_TRUE(at::equal(b2.grad(), b1.grad()))
            << dtype << " n=" << n << " " << MaxAbsDiff(b2.grad(), b1.grad());
      }
    }
  }
}

// Training: LinearCrossEntropy against the ATen chain it replaces (linear, float32 cast,
// cross_entropy_loss with reduction sum and ignore_index -100): loss and both gradients, with a
// vocabulary that is not a multiple of 8, ignored targets and a non-unit upstream gradient.
TEST(FusedOps, LinearCrossEntropyMatchesATenChainAndItsGradients_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::manual_seed(11);
  const int64_t rows = 300, hidden = 64, vocab = 1066;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto opt = at::TensorOptions().dtype(dtype).device(at::kCUDA);
    at::Tensor h0 = at::randn({rows, hidden}, opt), w0 = at::randn({vocab, hidden}, opt) * 0.3;
    at::Tensor targets =
        at::randint(vocab, {rows}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
    targets.narrow(0, 0, 40).fill_(-100);
    targets.narrow(0, 100, 1).fill_(vocab - 1);
    at::Tensor h1 = h0.clone().requires_grad_(), w1 = w0.clone().requires_grad_();
    at::Tensor l1 = at::cross_entropy_loss(at::linear(h1, w1).to(at::kFloat), targets, {},
                                           at::Reduction::Sum, -100);
    (l1 * 0.37).backward();
    at::Tensor h2 = h0.clone().requires_grad_(), w2 = w0.clone().requires_grad_();
    ASSERT_TRUE(ops::LinearCrossEntropySupported(h2, w2));
    at::Tensor l2 = ops::LinearCrossEntropy(h2, w2, targets, -100);
    (l2 * 0.37).backward();
    EXPECT_EQ(l2.scalar_type(), at::kFloat);
    auto rel = [](const at::Tensor& a, const at::Tensor& b) {
      return MaxAbsDiff(a.to(at::kFloat), b.to(at::kFloat)) /
             b.to(at::kFloat).abs().max().item<double>();
    };
    // float32: summation order. bf16: the logits are rounded to bf16 by differently tiled GEMMs
    // (a few elements one rounding step apart) and the gradients are bf16.
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
    EXPECT_LT(rel(l2, l1), dtype == at::kFloat ? 1e-6 : 1e-3) << dtype;
    EXPECT_LT(rel(h2.grad(), h1.grad()), tol) << dtype;
    EXPECT_LT(rel(w2.grad(), w1.grad()), tol) << dtype;
  }
}

TEST(FusedOps, ArgmaxRowsEqualsATenArgmax_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::manual_seed(5);
  // Widths: the 460m vocabulary (49218: rows after the first start unaligned), 49152, one past
  // the kernel's single round of loads per thread (70000 bf16: 8750 vectors > 1024 threads x 8),
  // the tiny model's 1066, odd widths and widths under one vector.
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t n : {49218, 49152, 70000, 1066, 1001, 8, 3}) {
      at::Tensor x = at::randn({8, n}, at::TensorOptions().device(at::kCUDA)).to(dtype);
      x[1].fill_(0.5);    // all tied: index 0
      x[2][n / 3] = 100;  // the maximum twice: lower index
      x[2][n - 1] = 100;
      x[3][n / 2] = std::numeric_limits<float>::quiet_NaN();  // NaN above every number
      x[4].fill_(-std::numeric_limits<float>::infinity());    // all -inf: index 0
      x[5][n - 1] = 1000;                                     // the last element (tail)
      const at::Tensor got = ops::ArgmaxRows(x);
      EXPECT_TRUE(at::equal(got, x.argmax(-1))) << at::toString(dtype) << " n=" << n << " got "
                                                << got.cpu() << " want " << x.argmax(-1).cpu();
      // One row, and a view of columns [1, n): row stride n, every row starting unaligned.
      EXPECT_TRUE(at::equal(ops::ArgmaxRows(x.narrow(0, 2, 1)), x.narrow(0, 2, 1).argmax(-1)));
      if (n > 1) {
        const at::Tensor v = x.narrow(1, 1, n - 1);
        EXPECT_TRUE(at::equal(ops::ArgmaxRows(v), v.argmax(-1))) << "n=" << n << " view";
      }
      // Into a prefix of a larger buffer (the engine's dec_carry): the rows past it stay.
      at::Tensor buffer = at::full({12}, -7, x.options().dtype(at::kLong));
      ops::ArgmaxRowsInto(x, buffer.narrow(0, 0, 8));
      EXPECT_TRUE(at::equal(buffer.narrow(0, 0, 8), x.argmax(-1))) << "n=" << n << " into";
      EXPECT_EQ(buffer.narrow(0, 8, 4).eq(-7).all().item<bool>(), true);
    }
  }
}

TEST(FusedOps, ArgmaxRowsIntoEqualsATenArgmaxAndRefusesAMismatchedOut) {
  at::manual_seed(6);
  const at::Tensor x = at::randn({5, 33});
  at::Tensor out = at::full({7}, -1, at::kLong);
  ops::ArgmaxRowsInto(x, out.narrow(0, 1, 5));
  EXPECT_TRUE(at::equal(out.narrow(0, 1, 5), x.argmax(-1)));
  EXPECT_EQ(out[0].item<int64_t>(), -1);
  EXPECT_EQ(out[6].item<int64_t>(), -1);
  EXPECT_THROW(ops::ArgmaxRowsInto(x, at::empty({4}, at::kLong)), c10::Error);
  EXPECT_THROW(ops::ArgmaxRowsInto(x, at::empty({5}, at::kInt)), c10::Error);
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
