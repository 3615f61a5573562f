// Decode batch buckets sized from device memory (engine/bucket_sizing.h): the KV cache's bytes per
// slot, the bucket list, what fits on 24 and 80 GiB cards, the utilisation bound and the error
// when nothing fits. Pure arithmetic, no device.
#include "engine/bucket_sizing.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/bucket.h"
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

TEST(BucketSizing, KvCacheBytesPerSlotIsTwoLayersKvHeadsHeadDimContextDtype) {
  const VlmConfig m460 = VlmConfig::Preset("nanovlm-460m");
  EXPECT_EQ(KvCacheBytesPerSlot(m460, 4096, 2), int64_t{160} << 20);  // 2 x 32 x 5 x 64 x 4096 x 2
  EXPECT_EQ(KvCacheBytesPerSlot(m460, 1024, 4), int64_t{80} << 20);
  EXPECT_EQ(KvCacheBytesPerSlot(SmolLm2Shape(), 4096, 2), int64_t{90} << 20);
  // The formula is the KV cache's real size: a cache of N rows is N slots' worth.
  const VlmConfig tiny = VlmConfig::Preset("nanovlm-tiny");
  const KVCache cache = KVCache::Allocate(tiny, 3, 48, at::TensorOptions().dtype(at::kBFloat16));
  EXPECT_EQ(cache.bytes(), 3 * KvCacheBytesPerSlot(tiny, 48, 2));
}

TEST(BucketSizing, DecodeBucketsArePowersOfTwoThenTheSlots) {
  EXPECT_EQ(DecodeBatchBuckets(256), (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 128, 256}));
  EXPECT_EQ(DecodeBatchBuckets(100), (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 96}));
  EXPECT_EQ(DecodeBatchBuckets(12), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(DecodeBatchBuckets(6), (std::vector<int64_t>{1, 2, 4, 6}));
  EXPECT_EQ(DecodeBatchBuckets(1), (std::vector<int64_t>{1}));
  EXPECT_THROW(DecodeBatchBuckets(0), std::invalid_argument);
}

TEST(BucketSizing, An80GiBCardServes256SlotsOf460mAndASmallerCardFewer) {
  const VlmConfig m460 = VlmConfig::Preset("nanovlm-460m");
  const BucketSpec b = DeployBuckets();
  // 80 GiB, 2 GiB in use after loading: 0.9 x 80 - 2 - 10.6 (pool) - 0.14 (buffers) = 59.3 GiB
  // for the KV cache = 378 slots of 160 MiB, capped at 256.
  DecodeSizing s = SizeDecodeBatches(m460, b, 2, {80 * kGiB, 78 * kGiB});
  EXPECT_EQ(s.slots_that_fit, 378);
  EXPECT_EQ(s.slots, 256);
  EXPECT_EQ(s.batch_sizes, DecodeBatchBuckets(256));
  EXPECT_EQ(s.kv_bytes_per_slot, int64_t{160} << 20);
  // 24 GiB, 1.5 GiB in use: 9.36 GiB for the KV cache = 59 rows = 58 slots + the spare row.
  s = SizeDecodeBatches(m460, b, 2, {24 * kGiB, 24 * kGiB - 3 * kGiB / 2});
  EXPECT_EQ(s.slots_that_fit, 58);
  EXPECT_EQ(s.batch_sizes, (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 56}));
  // The SmolLM2-135M shape: 90 MiB per slot, a smaller pool: 144 slots fit in 24 GiB.
  s = SizeDecodeBatches(SmolLm2Shape(), b, 2, {24 * kGiB, 24 * kGiB - 3 * kGiB / 2});
  EXPECT_EQ(s.slots_that_fit, 144);
  EXPECT_EQ(s.batch_sizes, (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 128, 144}));
  // A higher cap lets a big card take more.
  BucketSpec wide = b;
  wide.max_decode_batch = 1024;
  s = SizeDecodeBatches(SmolLm2Shape(), wide, 2, {80 * kGiB, 78 * kGiB});
  EXPECT_GT(s.slots, 256);
  EXPECT_EQ(s.slots, s.slots_that_fit / 8 * 8);
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
                           (s.slots + 1) * KvCacheBytesPerSlot(m460, 4096, 2);
      EXPECT_LE(used, utilisation * total) << utilisation << " of " << total;
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

}  // namespace
}  // namespace vlmgraph
