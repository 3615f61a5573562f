// engine/bucket_sizing.h: the KV-cache pages and decode batch buckets a device's memory holds.
//
// When the bucket config leaves batch_sizes empty, the engine derives them after the weights are
// on the device, as vLLM sizes its KV cache with gpu_memory_utilization (vllm/worker/worker.py,
// determine_num_available_blocks): a fraction of the device's memory bounds everything this
// process holds there, weights + KV cache + CUDA graph pool, and the KV cache gets what the rest
// leaves.
//
//   DeviceBudget budget{total_bytes, free_bytes};     // cudaMemGetInfo, weights already loaded
//   DecodeSizing s = SizeDecodeBatches(cfg, buckets, /*dtype_bytes=*/2, budget);
//   buckets.batch_sizes = s.batch_sizes;              // {1, 2, 4, ..., 256}
//   LogInfo(s.Summary());
//
// Note [Decode slots from device memory]:
//   budget     = gpu_memory_utilization x total bytes
//   in use     = total - free, read once the weights are on the device (the weights, the CUDA
//                context, and whatever other processes hold)
//   graph pool = EstimateGraphPoolBytes (an estimate: the pool is only known after capture)
//   buffers    = EstimateStaticBufferBytes (prefill staging rows, image tiles)
//   KV budget  = budget - in use - graph pool - buffers
//   KV pages   = KV budget / KvCacheBytes(page_size tokens)   (the scratch page included)
//   slots      = min(max_decode_batch, KV pages - 1)
//   KV pages   = min(KV pages, slots x pages of max(context_lens) + 1)   (what the slots can use)
// The KV cache is paged (Note [Paged KV layout], model/kv_cache.h): a sequence holds the pages its
// prompt and max_new_tokens can fill (Note [KV pages per sequence], engine/engine.h), so the
// slots (decode rows) are not bounded by max(context_lens) x slots of memory: 1,024 chat-length
// streams fit where 256 full-context slots would not. At least one sequence of max(context_lens)
// tokens must fit. The bucket list is the powers of two below `slots`, then `slots` itself
// (rounded down to a multiple of 8 above 8): few decode graphs to capture (one per bucket and
// context bucket), and decode rows are cheap to pad because decode is bound by reading the
// weights, not by the rows.
//
// Thread rules: pure functions of their arguments.
// Errors: SizeDecodeBatches throws std::invalid_argument (naming the keys to change) when not one
// slot fits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/bucket.h"
#include "model/config.h"
#include "model/kv_cache.h"

namespace vlmgraph {

// Bytes of the KV cache that hold `tokens` positions:
//   2 (K and V) x lm_n_blocks x lm_n_kv_heads x head_dim x tokens x dtype_bytes
// as vLLM's CacheEngine.get_cache_block_size counts a block. nanovlm-460m in bfloat16: 40 KiB per
// token, 640 KiB per page of 16, 160 MiB at 4096 tokens (2 x 32 x 5 x 64 x 4096 x 2);
// SmolLM2-135M's shape (30 layers, 3 KV heads): 22.5 KiB per token, 90 MiB at 4096.
int64_t KvCacheBytes(const VlmConfig& cfg, int64_t tokens, int64_t dtype_bytes);

// An upper estimate of the CUDA graph pool that capturing every bucket of `buckets` takes, with
// `decode_batch_sizes` as the decode batch list (batch_sizes may still be empty). The shared
// pool was measured to grow with every captured prefill bucket by about that bucket's
// activations (nanovlm-460m, bfloat16, the per-bucket pool growth of vlmgraph-diagnose in
// docs/benchmarks.md: 31 KiB per prefill token, 27 MiB per vision tile, about 0.7 MiB per decode
// row), so the estimate sums over the buckets:
//   dtype_bytes x (prefill tokens x (8 x lm_hidden_dim + 4 x lm_inter_dim)
//                  + vision patches x (8 x vit_hidden_dim + 4 x vit_inter_dim))
//   + decode rows x 16 x lm_vocab_size     (four float32 logits rows per decode row)
// where prefill tokens = sum of b x s over the prefill buckets, vision patches = sum of tiles x
// patches per tile over tile_counts, and decode rows = sum of b over the decode buckets, once per
// context bucket. For nanovlm-460m in bfloat16 that is 35 KiB per prefill token, 36 MiB per tile
// and 0.75 MiB per decode row; for deploy/config.yaml's buckets 10.6 GiB, where an H100 capture
// took 7.2 GiB (docs/benchmarks.md, "Many users per GPU").
int64_t EstimateGraphPoolBytes(const VlmConfig& cfg, const BucketSpec& buckets,
                               const std::vector<int64_t>& decode_batch_sizes, int64_t dtype_bytes);

// Bytes of the engine's static buffers that do not scale with the decode slots: prefill ids and
// image rows (largest prefill batch x max(seq_lens) tokens) and the tile buffer (max(tile_counts)
// tiles).
int64_t EstimateStaticBufferBytes(const VlmConfig& cfg, const BucketSpec& buckets,
                                  int64_t dtype_bytes);

// Powers of two below `max_batch`, then `max_batch` rounded down to a multiple of 8 when it is
// above 8: 256 -> {1, 2, ..., 256}; 100 -> {1, 2, 4, ..., 64, 96}; 6 -> {1, 2, 4, 6}.
// `max_batch` must be >= 1.
std::vector<int64_t> DecodeBatchBuckets(int64_t max_batch);

// The device's memory as the driver reports it (cudaMemGetInfo), read after the weights are
// loaded.
struct DeviceBudget {
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;
};

// The arithmetic of Note [Decode slots from device memory], for the log and the tests.
struct DecodeSizing {
  int64_t total_bytes = 0;        // the device's memory
  int64_t budget_bytes = 0;       // gpu_memory_utilization x total
  int64_t in_use_bytes = 0;       // total - free
  int64_t graph_pool_bytes = 0;   // EstimateGraphPoolBytes
  int64_t buffer_bytes = 0;       // EstimateStaticBufferBytes
  int64_t kv_budget_bytes = 0;    // what the KV cache may take (may be negative)
  int64_t kv_page_size = 0;       // tokens per page
  int64_t kv_bytes_per_page = 0;  // KvCacheBytes(kv_page_size)
  int64_t kv_pages = 0;           // min(kv_budget / per page, what the slots can use) + scratch
  int64_t kv_tokens = 0;          // (kv_pages - 1) x kv_page_size: what sequences hold at once
  int64_t full_context_sequences = 0;  // kv_tokens / max(context_lens)
  int64_t slots = 0;                   // min(kv_pages - 1, max_decode_batch), rounded as above
  std::vector<int64_t> batch_sizes;

  // One log line: "KV cache and decode batch from device memory: budget 0.90 x 79.1 GiB = ...".
  std::string Summary(double gpu_memory_utilization, int64_t max_decode_batch) const;
};

// Sizes the decode buckets for `buckets` (its seq_lens, context_lens, tile_counts,
// max_prefill_batch, gpu_memory_utilization and max_decode_batch; batch_sizes is ignored) and a
// model of `cfg` whose weights, in a dtype of `dtype_bytes`, are already counted in `device`, with
// KV pages of `page_size` tokens. Throws std::invalid_argument when not one sequence of
// max(context_lens) tokens fits.
DecodeSizing SizeDecodeBatches(const VlmConfig& cfg, const BucketSpec& buckets, int64_t dtype_bytes,
                               const DeviceBudget& device, int64_t page_size = kDefaultKvPageSize);

}  // namespace vlmgraph
