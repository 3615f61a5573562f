// vlmgraph-diagnose's core: bucket advice maths, and a quick CPU run producing every section.
#include "tools/diagnose/diagnose.h"

#include <gtest/gtest.h>

#include <random>

#include "bench/synthetic.h"
#include "model/checkpoint.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

// Brute force over every k-subset of distinct lengths that contains the maximum.
double BestWasteBruteForce(const std::vector<int64_t>& lengths, int k) {
  std::vector<int64_t> values(lengths);
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  const int n = static_cast<int>(values.size());
  double best = 1e300;
  for (int mask = 0; mask < (1 << n); ++mask) {
    if (__builtin_popcount(mask) != k || !(mask & (1 << (n - 1)))) continue;
    std::vector<int64_t> set;
    for (int i = 0; i < n; ++i)
      if (mask & (1 << i)) set.push_back(values[i]);
    best = std::min(best, PaddingWaste(lengths, set));
  }
  return best;
}

TEST(Diagnose, SuggestedBucketsAreOptimal) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 30; ++trial) {
    std::vector<int64_t> lengths;
    for (int i = 0; i < 40; ++i)
      lengths.push_back(std::uniform_int_distribution<int64_t>(1, 12)(rng) * 10);
    for (int k : {1, 2, 3}) {
      const auto suggested = SuggestBuckets(lengths, k);
      ASSERT_LE(suggested.size(), static_cast<size_t>(k));
      EXPECT_EQ(suggested.back(), *std::max_element(lengths.begin(), lengths.end()));
      EXPECT_NEAR(PaddingWaste(lengths, suggested), BestWasteBruteForce(lengths, k), 1e-12);
    }
  }
}

TEST(Diagnose, PaddingWasteCountsPaddedOverReal) {
  EXPECT_DOUBLE_EQ(PaddingWaste({10, 20}, {16, 32}), (16.0 + 32.0) / 30.0);
  EXPECT_DOUBLE_EQ(PaddingWaste({16, 32}, {16, 32}), 1.0);
  const auto synthetic = SyntheticPromptLengths(1000, 100, 0.5, 400);
  EXPECT_EQ(synthetic, SyntheticPromptLengths(1000, 100, 0.5, 400));  // deterministic
  EXPECT_LE(*std::max_element(synthetic.begin(), synthetic.end()), 400);
}

TEST(Diagnose, QuickCpuRunHasEverySectionWithSaneValues) {
  BucketSpec b;
  b.batch_sizes = {1, 2, 4};
  b.seq_lens = {8, 16, 32};
  b.context_lens = {64};
  b.tile_counts = {1, 2};
  b.train_batch_sizes = {2};
  b.train_seq_lens = {16};
  b.Validate();
  EngineByGraphs make_engine = [&](bool graphs) {
    EngineOptions o;
    o.buckets = b;
    o.cuda_graphs = graphs;
    o.log_captures = false;
    return std::make_unique<Engine>(LoadModel(testing::TinyCheckpointDir()), o);
  };
  TrainerByGraphs make_trainer = [&](bool graphs) {
    VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
    TrainOptions o;
    o.buckets = b;
    o.cuda_graphs = graphs;
    o.log_captures = false;
    return std::make_unique<Trainer>(m, o);
  };
  DiagnoseOptions opt;
  opt.quick = true;
  opt.iters = 3;
  opt.warmup = 1;
  const nlohmann::json r = RunDiagnostics(make_engine, make_trainer, opt);
  for (const char* section :
       {"environment", "baseline", "sweeps", "capture", "dispatch", "bucket_advice"}) {
    EXPECT_TRUE(r.contains(section)) << section;
  }
  EXPECT_FALSE(r["environment"]["graphs_available"].get<bool>());
  bool saw_train = false;
  for (const auto& row : r["baseline"]["rows"]) {
    EXPECT_GT(row["eager_ms"].get<double>(), 0.0);
    EXPECT_TRUE(row["graph_ms"].is_null());  // CPU: graph rows marked unavailable
    saw_train = saw_train || row["region"] == "train";
  }
  EXPECT_TRUE(saw_train);
  EXPECT_EQ(r["sweeps"]["captures_after_warmup"].get<int64_t>(), 0);
  EXPECT_EQ(r["sweeps"]["unexpected_eager_fallbacks"].get<int64_t>(), 0);
  for (const auto& row : r["sweeps"]["vary_batch"])
    EXPECT_GE(row["padding_waste"].get<double>(), 1.0);
  const auto& advice = r["bucket_advice"];
  EXPECT_LE(advice["suggested"]["padding_waste"].get<double>(),
            advice["current"]["padding_waste"].get<double>() + 1e-12);
  const std::string table = FormatDiagnostics(r);
  EXPECT_NE(table.find("== baseline"), std::string::npos);
  EXPECT_NE(table.find("== bucket advice"), std::string::npos);
}

}  // namespace
}  // namespace vlmgraph
