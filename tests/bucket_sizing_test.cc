// KV pages and decode batch buckets sized from device memory (engine/bucket_sizing.h): the KV
// cache's bytes per token, the bucket list, what fits on 24 and 80 GiB cards, the utilisation bound
// and the error when nothing fits; and the page pool (engine/kv_page_pool.h). No device.
#include "engine/bucket_sizing.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/bucket.h"
#include "engine/kv_page_pool.h"
#include "model/config.h"
#include "model/kv_cache.h"

namespace vlmgraph {
namespace {

// nanovlm-460m with deploy/config.yaml's buckets.
BucketSpec DeployBuckets() {
  BucketSpec b;
  b.batch_sizes = {};
  b.seq_lens = {128, 256, 512, 1024, 2048};
  b.context_lens = {1024, 2048, 4096};
  b.tile_counts = {1, 2, 4, 8, 17};
  b.Validate();
  return b;
}

// SmolLM2-135M's language model shape (the nanoVLM-222M decoder) with the default vision side.
VlmConfig SmolLm2Shape() {
  VlmConfig c = VlmConfig::Preset("nanovlm-460m");
  c.lm_hidden_dim = 576;
  c.lm_inter_dim = 1536;
  c.lm_n_heads = 9;
  c.lm_n_kv_heads = 3;
  c.lm_n_blocks = 30;
  return c;
}

constexpr int64_t kGiB = int64_t{1} << 30;

TEST(BucketSizing, KvCacheBytesIsTwoLayersKvHeadsHeadDimTokensDtype) {
  const VlmConfig m460 = VlmConfig::Preset("nanovlm-460m");
  EXPECT_EQ(KvCacheBytes(m460, 4096, 2), int64_t{160} << 20);  // 2 x 32 x 5 x 64 x 4096 x 2
  EXPECT_EQ(KvCacheBytes(m460, 1024, 4), int64_t{80} << 20);
  EXPECT_EQ(KvCacheBytes(SmolLm2Shape(), 4096, 2), int64_t{90} << 20);
  // The formula is the KV cache's real size: 3 rows of 48 positions are 3 x 3 pages of 16, and
  // the scratch page.
  const VlmConfig tiny = VlmConfig::Preset("nanovlm-tiny");
  const KVCache cache = KVCache::Allocate(tiny, 3, 48, at::TensorOptions().dtype(at::kBFloat16));
  EXPECT_EQ(cache.bytes(), KvCacheBytes(tiny, (3 * 3 + 1) * 16, 2));
}

TEST(BucketSizing, DecodeBucketsArePowersOfTwoThenTheSlots) {
  EXPECT_EQ(DecodeBatchBuckets(256), (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 128, 256}));
  EXPECT_EQ(DecodeBatchBuckets(100), (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 96}));
  EXPECT_EQ(DecodeBatchBuckets(12), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(DecodeBatchBuckets(6), (std::vector<int64_t>{1, 2, 4, 6}));
  EXPECT_EQ(DecodeBatchBuckets(1), (std::vector<int64_t>{1}));
  EXPECT_THROW(DecodeBatchBuckets(0), std::invalid_argument);
}

// Paged (Note [Decode slots from device memory]): the cache gets what memory leaves, in pages of
// 16 tokens, up to what the slots can fill at the longest context, and the decode rows are
// max_decode_batch whenever one sequence of the longest context fits, since a sequence takes only
// the pages it can fill.
TEST(BucketSizing, PagesFromMemoryUpToWhatTheSlotsFillAndRowsUpToTheCap) {
  const VlmConfig m460 = VlmConfig::Preset("nanovlm-460m");
  const BucketSpec b = DeployBuckets();
  // 80 GiB, 2 GiB in use after loading: 0.9 x 80 - 2 - 10.6 (pool) - 0.14 (buffers) = 59.3 GiB
  // for the KV cache would be 379 sequences of 4096 tokens; 256 slots use 256 x 256 pages.
  DecodeSizing s = SizeDecodeBatches(m460, b, 2, {80 * kGiB, 78 * kGiB});
  EXPECT_EQ(s.kv_page_size, 16);
  EXPECT_EQ(s.kv_bytes_per_page, int64_t{640} << 10);
  EXPECT_GT(s.kv_budget_bytes / s.kv_bytes_per_page, 379 * 256);
  EXPECT_EQ(s.kv_pages, 256 * 256 + 1);
  EXPECT_EQ(s.kv_tokens, 256 * 4096);
  EXPECT_EQ(s.full_context_sequences, 256);
  EXPECT_EQ(s.slots, 256);
  EXPECT_EQ(s.batch_sizes, DecodeBatchBuckets(256));
  // 24 GiB, 1.5 GiB in use: 9.36 GiB, memory binds: 59 sequences of the longest context, and
  // still 256 rows.
  s = SizeDecodeBatches(m460, b, 2, {24 * kGiB, 24 * kGiB - 3 * kGiB / 2});
  EXPECT_EQ(s.kv_pages, s.kv_budget_bytes / s.kv_bytes_per_page);
  EXPECT_EQ(s.kv_tokens, (s.kv_pages - 1) * 16);
  EXPECT_EQ(s.full_context_sequences, 59);
  EXPECT_EQ(s.batch_sizes, DecodeBatchBuckets(256));
  // The SmolLM2-135M shape: 90 MiB per 4096 tokens, a smaller pool: 145 in 24 GiB.
  s = SizeDecodeBatches(SmolLm2Shape(), b, 2, {24 * kGiB, 24 * kGiB - 3 * kGiB / 2});
  EXPECT_EQ(s.full_context_sequences, 145);
  // A higher cap: 1,024 rows on an 80 GiB card (1,024 chat-length streams; 1,024 x 4096 tokens
  // would not fit).
  BucketSpec wide = b;
  wide.max_decode_batch = 1024;
  s = SizeDecodeBatches(SmolLm2Shape(), wide, 2, {80 * kGiB, 78 * kGiB});
  EXPECT_EQ(s.slots, 1024);
  EXPECT_EQ(s.batch_sizes, DecodeBatchBuckets(1024));
  EXPECT_LT(s.full_context_sequences, 1024);
  EXPECT_EQ(s.kv_pages, s.kv_budget_bytes / s.kv_bytes_per_page);
  // Pages of 32 tokens halve the page count, not the tokens.
  const DecodeSizing s32 = SizeDecodeBatches(SmolLm2Shape(), wide, 2, {80 * kGiB, 78 * kGiB}, 32);
  EXPECT_EQ(s32.kv_pages, s.kv_pages / 2);
}

TEST(BucketSizing, WeightsKvCachePoolAndBuffersStayWithinTheUtilisation) {
  const VlmConfig m460 = VlmConfig::Preset("nanovlm-460m");
  for (double utilisation : {0.5, 0.9, 1.0}) {
    for (int64_t total : {12 * kGiB, 24 * kGiB, 40 * kGiB, 80 * kGiB, 141 * kGiB}) {
      BucketSpec b = DeployBuckets();
      b.gpu_memory_utilization = utilisation;
      const int64_t in_use = kGiB + total / 100;
      DecodeSizing s;
      try {
        s = SizeDecodeBatches(m460, b, 2, {total, total - in_use});
      } catch (const std::invalid_argument&) {
        continue;  // nothing fits (12 GiB at 0.5): the next test checks the message
      }
      const int64_t used = in_use + s.graph_pool_bytes + s.buffer_bytes +
                           s.kv_pages * KvCacheBytes(m460, s.kv_page_size, 2);
      EXPECT_LE(used, utilisation * total) << utilisation << " of " << total;
      EXPECT_GE(s.full_context_sequences, 1);
      EXPECT_LE(s.slots, b.max_decode_batch);
      EXPECT_EQ(s.slots, s.batch_sizes.back());
    }
  }
}

TEST(BucketSizing, NoSlotThatFitsIsAnErrorNamingTheKeys) {
  BucketSpec b = DeployBuckets();
  try {
    SizeDecodeBatches(VlmConfig::Preset("nanovlm-460m"), b, 2, {16 * kGiB, 4 * kGiB});
    FAIL() << "sized";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("buckets.gpu_memory_utilization"), std::string::npos) << what;
    EXPECT_NE(what.find("context_lens"), std::string::npos) << what;
  }
}

// Pages 1..N-1 (0 is scratch), lowest first while fresh, all or nothing, a freed page handed out
// again first, and a double free refused.
TEST(KvPagePool, TakesAllOrNothingAndRefusesADoubleFree) {
  KvPagePool pool(6);
  EXPECT_EQ(pool.capacity(), 5);
  EXPECT_EQ(pool.Take(2), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(pool.free_pages(), 3);
  EXPECT_TRUE(pool.Take(4).empty());
  EXPECT_EQ(pool.free_pages(), 3) << "a refused Take takes nothing";
  const std::vector<int32_t> rest = pool.Take(3);
  EXPECT_EQ(rest, (std::vector<int32_t>{3, 4, 5}));
  EXPECT_EQ(pool.used_pages(), 5);
  pool.Give({2, 1});
  EXPECT_EQ(pool.Take(1), (std::vector<int32_t>{2}));
  EXPECT_THROW(pool.Give({2, 2}), std::logic_error);
  EXPECT_THROW(pool.Give({0}), std::logic_error);
  EXPECT_THROW(pool.Give({6}), std::logic_error);
}

}  // namespace
}  // namespace vlmgraph
