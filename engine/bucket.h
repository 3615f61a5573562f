// engine/bucket.h: shape buckets and the padding rule.
//
// Every region runs at a padded shape taken from a configured list, so each shape can be captured
// into a CUDA graph once, ahead of time. A request is padded up to the smallest bucket that fits.
//
//   BucketSpec spec;                     // defaults below
//   spec.Validate();
//   auto b = spec.PickPrefill(3, 70);    // -> {batch 4, seq 128}
//
// Regions and their bucket keys:
//   vision  (tiles)           ViT + projector over `tiles` image tiles
//   prefill (batch, seq)      LM over `batch` prompts right-padded to `seq` tokens; batch from the
//                             batch_sizes entries up to max_prefill_batch
//   decode  (batch, context)  one token for cache rows [0, batch), attending to [0, context)
//   train   (batch, seq)      forward + backward + optimizer step
// Thread rules: value types, no shared state.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace vlmgraph {

enum class Region { kVision = 0, kPrefill = 1, kDecode = 2, kTrain = 3 };
constexpr int kNumRegions = 4;
const char* RegionName(Region r);  // "vision", "prefill", "decode", "train"

// What to do with a shape larger than every bucket.
enum class OversizePolicy { kEager, kReject };

struct BucketKey {
  Region region = Region::kPrefill;
  int64_t batch = 0;  // sequences (vision: 0)
  int64_t seq = 0;    // prefill/train: tokens per row; decode: attention context; vision: 0
  int64_t tiles = 0;  // vision: image tiles; else 0

  // Stable label for logs and metrics: "b4xs128", "b8xc1024", "t2".
  std::string Label() const;
  bool operator<(const BucketKey& o) const;
  bool operator==(const BucketKey& o) const;
};

struct BucketSpec {
  // Decode batch buckets, and prefill batch buckets up to max_prefill_batch. The largest entry is
  // the number of KV-cache slots. Empty: the engine derives it on a CUDA device from its free
  // memory after loading the weights (engine/bucket_sizing.h, Note [Decode slots from device
  // memory]), bounded by the two fields below; Validate() leaves an empty list empty.
  std::vector<int64_t> batch_sizes = {1, 2, 4, 8, 16, 32};
  double gpu_memory_utilization = 0.9;  // derived batch_sizes: fraction of device memory to use
  int64_t max_decode_batch = 256;       // derived batch_sizes: at most this many slots
  // Prefill batch buckets are the batch_sizes entries <= this: prefill activations (and the graph
  // pool) grow with batch x seq, while a decode row costs little.
  int64_t max_prefill_batch = 32;
  std::vector<int64_t> seq_lens = {64, 128, 256, 512};  // prefill token buckets
  std::vector<int64_t> context_lens = {512, 1024};      // decode KV windows; max = KV cache length
  std::vector<int64_t> tile_counts = {1, 2, 4};         // vision tile buckets
  std::vector<int64_t> train_batch_sizes = {8};         // training step buckets
  std::vector<int64_t> train_seq_lens = {256};
  OversizePolicy oversize = OversizePolicy::kEager;

  // Sorts and de-duplicates each list; throws std::invalid_argument naming the list when one is
  // empty (batch_sizes may be: derived later) or has a value < 1, when max(seq_lens) >
  // max(context_lens), when no batch_sizes entry is <= max_prefill_batch, or when
  // gpu_memory_utilization is outside (0, 1] or max_decode_batch < 1.
  void Validate();

  // Only once batch_sizes is set (not empty).
  int64_t max_batch() const { return batch_sizes.back(); }  // decode slots
  std::vector<int64_t> prefill_batch_sizes() const;         // entries <= max_prefill_batch
  int64_t max_prefill() const;                              // largest prefill batch bucket
  int64_t max_seq() const { return seq_lens.back(); }
  int64_t max_context() const { return context_lens.back(); }
  int64_t max_tiles() const { return tile_counts.back(); }

  // Smallest bucket >= n in `list`, or nullopt when n exceeds every bucket.
  static std::optional<int64_t> Smallest(const std::vector<int64_t>& list, int64_t n);

  std::optional<BucketKey> PickPrefill(int64_t batch, int64_t seq) const;
  std::optional<BucketKey> PickDecode(int64_t batch, int64_t context) const;
  std::optional<BucketKey> PickVision(int64_t tiles) const;
  std::optional<BucketKey> PickTrain(int64_t batch, int64_t seq) const;

  // Every bucket of a region, in the order start-up capture uses (largest first, so later, smaller
  // captures reuse the shared pool's blocks).
  std::vector<BucketKey> All(Region region) const;
};

}  // namespace vlmgraph
