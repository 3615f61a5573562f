// Sampler tests (engine/sampler.h): the kept sets against upstream nanoVLM's filter, the
// distribution of the draws, independence from the batch, ties at the k-th logit; *_CUDA: the
// CUDA kernel draws the CPU loop's tokens.
#include "engine/sampler.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "tests/test_util.h"

namespace vlmgraph {
namespace {

// Upstream nanoVLM's top_k_top_p_filtering (models/utils.py) for one row (V): the logits it
// keeps, the rest at -inf. The reference the sampler's kept sets are held to.
at::Tensor UpstreamFilter(const at::Tensor& logits, int64_t top_k, double top_p) {
  at::Tensor out = logits.clone();
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const int64_t k = std::min<int64_t>(top_k, logits.size(-1));
  if (k > 0) {
    at::Tensor kth = std::get<0>(at::topk(out, k)).select(-1, k - 1);
    out = out.masked_fill(out < kth, neg_inf);
  }
  if (top_p < 1.0) {
    auto [sorted, order] = at::sort(out, -1, /*descending=*/true);
    at::Tensor cum = at::softmax(sorted, -1).cumsum(-1);
    at::Tensor remove_sorted = cum > top_p;
    remove_sorted = at::cat({at::zeros_like(remove_sorted.narrow(-1, 0, 1)),
                             remove_sorted.narrow(-1, 0, remove_sorted.size(-1) - 1)},
                            -1);
    at::Tensor remove = at::zeros_like(remove_sorted).scatter(-1, order, remove_sorted);
    out = out.masked_fill(remove, neg_inf);
  }
  return out;
}

SamplingParams Params(double temperature, int64_t top_k, double top_p, uint64_t seed) {
  SamplingParams p;
  p.greedy = false;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

// Tokens drawn for `draws` from `logits` on its device, as host values (-1 for rows not drawn).
std::vector<int64_t> Draw(const at::Tensor& logits, const std::vector<SamplingDraw>& draws) {
  at::Tensor tokens = at::full({logits.size(0)}, -1, logits.options().dtype(at::kLong));
  SampleRowsInto(logits, draws, tokens);
  at::Tensor host = tokens.cpu();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

// Each parameter set's empirical token frequencies over `n` draws (one row per draw, all in one
// call) against softmax(upstream-filtered logits / temperature).
TEST(Sampler, DrawsFollowTheFilteredDistributionForEveryParameterSet) {
  const at::Tensor logits = at::log(at::tensor({0.35, 0.25, 0.15, 0.12, 0.08, 0.05}, at::kFloat));
  const std::vector<SamplingParams> sets = {
      Params(1.0, 0, 1.0, 1), Params(0.5, 3, 1.0, 2), Params(2.0, 0, 0.7, 3),
      Params(1.0, 4, 0.6, 4), Params(3.0, 2, 0.5, 5),  // top-p inside top-k: one token
      Params(1.0, 6, 1.0, 6),                          // top_k == V: no filter
  };
  const int64_t n = 6000;
  for (const SamplingParams& p : sets) {
    at::Tensor batch = logits.unsqueeze(0).expand({n, -1}).contiguous();
    std::vector<SamplingDraw> draws;
    for (int64_t i = 0; i < n; ++i) draws.push_back({i, &p, i});
    const std::vector<int64_t> got = Draw(batch, draws);
    std::vector<double> freq(6, 0.0);
    for (int64_t t : got) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, 6);
      freq[static_cast<size_t>(t)] += 1.0 / n;
    }
    const at::Tensor want =
        at::softmax(UpstreamFilter(logits, p.top_k, p.top_p) / p.temperature, -1);
    for (int64_t t = 0; t < 6; ++t) {
      const double w = want[t].item<double>();
      if (w == 0.0) {
        EXPECT_EQ(freq[static_cast<size_t>(t)], 0.0)
            << "token " << t << " is filtered out (T " << p.temperature << ", top_k " << p.top_k
            << ", top_p " << p.top_p << ")";
      } else {
        EXPECT_NEAR(freq[static_cast<size_t>(t)], w, 0.025)
            << "token " << t << " (T " << p.temperature << ", top_k " << p.top_k << ", top_p "
            << p.top_p << ")";
      }
    }
  }
}

// Random rows of a larger vocabulary: every drawn token is in upstream's kept set, and over many
// draws every kept token of a small kept set shows up.
TEST(Sampler, DrawnTokensStayInUpstreamsKeptSet) {
  at::manual_seed(3);
  const int64_t rows = 8, vocab = 300, n = 400;
  const at::Tensor logits = at::randn({rows, vocab}) * 2.0;
  const std::vector<SamplingParams> sets = {Params(1.0, 5, 1.0, 10), Params(0.7, 0, 0.3, 11),
                                            Params(1.5, 20, 0.8, 12), Params(1.0, 1, 1.0, 13)};
  for (const SamplingParams& p : sets) {
    for (int64_t r = 0; r < rows; ++r) {
      const at::Tensor kept = at::isfinite(UpstreamFilter(logits[r], p.top_k, p.top_p));
      at::Tensor batch = logits[r].unsqueeze(0).expand({n, -1}).contiguous();
      std::vector<SamplingDraw> draws;
      for (int64_t i = 0; i < n; ++i) draws.push_back({i, &p, i});
      std::set<int64_t> seen;
      for (int64_t t : Draw(batch, draws)) {
        ASSERT_TRUE(kept[t].item<bool>()) << "row " << r << " drew filtered token " << t;
        seen.insert(t);
      }
      const int64_t kept_count = kept.sum().item<int64_t>();
      if (kept_count <= 5) EXPECT_EQ(static_cast<int64_t>(seen.size()), kept_count) << r;
    }
  }
}

// NucleusPrefix keeps as many of a sorted row's entries as upstream's filter keeps of the row.
TEST(Sampler, NucleusPrefixKeepsUpstreamsCount) {
  at::manual_seed(8);
  const int64_t rows = 6, vocab = 2000;
  const at::Tensor logits = (at::randn({rows, vocab}) * 2.5).to(at::kBFloat16).to(at::kFloat);
  const at::Tensor sorted = std::get<0>(at::sort(logits, /*stable=*/true, -1, true)).contiguous();
  for (auto [top_k, top_p] : std::vector<std::pair<int64_t, float>>{
           {0, 0.9f}, {0, 0.5f}, {40, 1.f}, {40, 0.9f}, {300, 0.95f}, {1, 0.9f}, {0, 1.f}}) {
    const SamplingRows p{at::ones({rows}), at::full({rows}, top_p),
                         at::full({rows}, top_k, at::kLong), at::zeros({rows}, at::kLong),
                         at::zeros({rows}, at::kLong)};
    at::Tensor kept = at::empty({rows}, at::kLong);
    NucleusPrefix(sorted, p, kept);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(kept[r].item<int64_t>(),
                at::isfinite(UpstreamFilter(logits[r], top_k, top_p)).sum().item<int64_t>())
          << "row " << r << ", top_k " << top_k << ", top_p " << top_p;
    }
  }
}

// top_k keeps every logit equal to the k-th largest, as upstream's `logits < kth` does.
TEST(Sampler, TopKKeepsTiesWithTheKthLogit) {
  const at::Tensor logits = at::tensor({0.f, 3.f, 1.f, 1.f, 1.f, -2.f});
  const SamplingParams p = Params(100.0, 2, 1.0, 5);  // nearly flat over the kept tokens
  const int64_t n = 2000;
  at::Tensor batch = logits.unsqueeze(0).expand({n, -1}).contiguous();
  std::vector<SamplingDraw> draws;
  for (int64_t i = 0; i < n; ++i) draws.push_back({i, &p, i});
  std::vector<int64_t> count(6, 0);
  for (int64_t t : Draw(batch, draws)) count[static_cast<size_t>(t)]++;
  EXPECT_EQ(count[0] + count[5], 0);
  for (int64_t t : {1, 2, 3, 4}) EXPECT_GT(count[static_cast<size_t>(t)], 350) << t;
}

// A row's token depends on its logits, parameters, seed and draw index only: the same draw alone,
// at another row of a larger batch next to other requests, or repeated, gives the same token;
// another draw index or seed gives a different stream; greedy rows are left alone.
TEST(Sampler, ATokenDependsOnItsSeedAndDrawNotOnTheBatch) {
  at::manual_seed(4);
  const int64_t vocab = 1000;
  const at::Tensor logits = at::randn({5, vocab});
  const SamplingParams a = Params(1.0, 0, 0.95, 77), b = Params(0.8, 40, 1.0, 78);
  std::vector<int64_t> alone, in_batch, other_draws, other_seed;
  const SamplingParams a2 = Params(1.0, 0, 0.95, 79);
  for (int64_t d = 0; d < 24; ++d) {
    alone.push_back(Draw(logits.narrow(0, 2, 1), {{0, &a, d}})[0]);
    const std::vector<int64_t> got = Draw(logits, {{4, &b, 3}, {2, &a, d}, {0, &b, 9}});
    in_batch.push_back(got[2]);
    EXPECT_EQ(got[1], -1);  // not drawn: untouched
    EXPECT_EQ(got[3], -1);
    other_draws.push_back(Draw(logits.narrow(0, 2, 1), {{0, &a, d + 100}})[0]);
    other_seed.push_back(Draw(logits.narrow(0, 2, 1), {{0, &a2, d}})[0]);
  }
  EXPECT_EQ(in_batch, alone);
  EXPECT_NE(other_draws, alone);
  EXPECT_NE(other_seed, alone);
  EXPECT_GE(std::set<int64_t>(alone.begin(), alone.end()).size(), 10u) << "draws too uniform";
}

TEST(Sampler, TopKOneIsTheArgmax) {
  at::manual_seed(5);
  const at::Tensor logits = at::randn({16, 500});
  const SamplingParams p = Params(2.0, 1, 1.0, 3);
  std::vector<SamplingDraw> draws;
  for (int64_t i = 0; i < 16; ++i) draws.push_back({i, &p, i});
  const std::vector<int64_t> got = Draw(logits, draws);
  const at::Tensor want = logits.argmax(-1);
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], want[i].item<int64_t>());
}

// bf16 logits (the decode graph's) draw what their float32 values draw: same sort, same kept
// sets, same scores.
TEST(Sampler, Bfloat16LogitsDrawAsTheirFloat32Values) {
  at::manual_seed(7);
  const at::Tensor bf16 = (at::randn({8, 3000}) * 3.0).to(at::kBFloat16);  // many equal values
  const at::Tensor f32 = bf16.to(at::kFloat);
  const std::vector<SamplingParams> sets = {Params(1.0, 0, 1.0, 1), Params(0.8, 50, 0.9, 2),
                                            Params(1.3, 0, 0.9, 3), Params(0.6, 7, 1.0, 4)};
  for (const SamplingParams& p : sets) {
    std::vector<SamplingDraw> draws;
    for (int64_t r = 0; r < 8; ++r) draws.push_back({r, &p, 3 * r});
    EXPECT_EQ(Draw(bf16, draws), Draw(f32, draws))
        << "T " << p.temperature << ", top_k " << p.top_k << ", top_p " << p.top_p;
  }
}

TEST(Sampler, RefusesBadRows) {
  const at::Tensor logits = at::zeros({2, 10});
  const SamplingParams p = Params(1.0, 0, 1.0, 1);
  at::Tensor tokens = at::zeros({2}, at::kLong);
  EXPECT_THROW(SampleRowsInto(logits, {{2, &p, 0}}, tokens), c10::Error);
  EXPECT_THROW(SampleRowsInto(logits, {{0, nullptr, 0}}, tokens), c10::Error);
  EXPECT_THROW(SampleRowsInto(logits, {{0, &p, 0}}, at::zeros({3}, at::kLong)), c10::Error);
}

// The CUDA kernel and the CPU loop draw the same tokens from the same logits (model-sized rows,
// bf16 logits as the decode graph gives them), filtered or not.
TEST(Sampler, CudaDrawsEqualCpuDraws_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::manual_seed(6);
  const int64_t rows = 12, vocab = 49218;
  const at::Tensor logits = (at::randn({rows, vocab}) * 3.0).to(at::kBFloat16);
  const std::vector<SamplingParams> sets = {Params(1.0, 0, 1.0, 1), Params(0.8, 50, 0.9, 2),
                                            Params(1.3, 0, 0.9, 3), Params(0.6, 200, 1.0, 4)};
  for (const SamplingParams& p : sets) {
    std::vector<SamplingDraw> draws;
    for (int64_t r = 0; r < rows; ++r) draws.push_back({r, &p, 5 * r + 1});
    const std::vector<int64_t> cpu = Draw(logits, draws);
    const std::vector<int64_t> gpu = Draw(logits.cuda(), draws);
    EXPECT_EQ(gpu, cpu) << "T " << p.temperature << ", top_k " << p.top_k << ", top_p " << p.top_p;
  }
}

}  // namespace
}  // namespace vlmgraph
