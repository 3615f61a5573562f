#include "engine/bucket_sizing.h"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace vlmgraph {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

int64_t Sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

std::vector<int64_t> UpTo(const std::vector<int64_t>& list, int64_t max) {
  std::vector<int64_t> out;
  for (int64_t v : list) {
    if (v <= max) out.push_back(v);
  }
  return out;
}

std::string ListText(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

}  // namespace

int64_t KvCacheBytes(const VlmConfig& cfg, int64_t tokens, int64_t dtype_bytes) {
  return 2 * cfg.lm_n_blocks * cfg.lm_n_kv_heads * cfg.lm_head_dim() * tokens * dtype_bytes;
}

int64_t EstimateGraphPoolBytes(const VlmConfig& cfg, const BucketSpec& buckets,
                               const std::vector<int64_t>& decode_batch_sizes,
                               int64_t dtype_bytes) {
  const int64_t prefill_tokens =
      Sum(UpTo(decode_batch_sizes, buckets.max_prefill_batch)) * Sum(buckets.seq_lens);
  const int64_t vision_patches = Sum(buckets.tile_counts) * cfg.vit_num_patches();
  const int64_t decode_rows =
      Sum(decode_batch_sizes) * static_cast<int64_t>(buckets.context_lens.size());
  return dtype_bytes * (prefill_tokens * (8 * cfg.lm_hidden_dim + 4 * cfg.lm_inter_dim) +
                        vision_patches * (8 * cfg.vit_hidden_dim + 4 * cfg.vit_inter_dim)) +
         decode_rows * 16 * cfg.lm_vocab_size;
}

int64_t EstimateStaticBufferBytes(const VlmConfig& cfg, const BucketSpec& buckets,
                                  int64_t dtype_bytes) {
  const int64_t max_seq = *std::max_element(buckets.seq_lens.begin(), buckets.seq_lens.end());
  const int64_t max_tiles =
      *std::max_element(buckets.tile_counts.begin(), buckets.tile_counts.end());
  const int64_t prefill_rows = buckets.max_prefill_batch * max_seq;
  return prefill_rows * (cfg.lm_hidden_dim * dtype_bytes + 8) +
         max_tiles * 3 * cfg.vit_img_size * cfg.vit_img_size * dtype_bytes;
}

std::vector<int64_t> DecodeBatchBuckets(int64_t max_batch) {
  if (max_batch < 1) throw std::invalid_argument("DecodeBatchBuckets: max_batch must be >= 1");
  std::vector<int64_t> out;
  for (int64_t b = 1; b < max_batch; b *= 2) out.push_back(b);
  out.push_back(max_batch > 8 ? max_batch / 8 * 8 : max_batch);
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string DecodeSizing::Summary(double gpu_memory_utilization, int64_t max_decode_batch) const {
  char line[768];
  std::snprintf(line, sizeof(line),
                "KV cache and decode batch from device memory: budget %.2f x %.1f GiB = %.1f GiB; "
                "in use (weights, CUDA context, other processes) %.1f GiB; graph pool estimate "
                "%.1f GiB; buffers %.2f GiB; KV budget %.1f GiB; KV cache %.1f GiB = %lld pages "
                "of %lld tokens (%.2f MiB each) = %lld tokens, %lld sequences of the longest "
                "context; max_decode_batch %lld -> batch_sizes %s",
                gpu_memory_utilization, total_bytes / kGiB, budget_bytes / kGiB,
                in_use_bytes / kGiB, graph_pool_bytes / kGiB, buffer_bytes / kGiB,
                kv_budget_bytes / kGiB, kv_pages * kv_bytes_per_page / kGiB,
                static_cast<long long>(kv_pages), static_cast<long long>(kv_page_size),
                kv_bytes_per_page / kMiB, static_cast<long long>(kv_tokens),
                static_cast<long long>(full_context_sequences),
                static_cast<long long>(max_decode_batch), ListText(batch_sizes).c_str());
  return line;
}

DecodeSizing SizeDecodeBatches(const VlmConfig& cfg, const BucketSpec& buckets, int64_t dtype_bytes,
                               const DeviceBudget& device, int64_t page_size) {
  DecodeSizing s;
  s.total_bytes = device.total_bytes;
  const int64_t max_context =
      *std::max_element(buckets.context_lens.begin(), buckets.context_lens.end());
  s.budget_bytes = static_cast<int64_t>(buckets.gpu_memory_utilization *
                                        static_cast<double>(device.total_bytes));
  s.in_use_bytes = device.total_bytes - device.free_bytes;
  // The pool estimate for the largest list the cap allows: the real list is never longer.
  s.graph_pool_bytes = EstimateGraphPoolBytes(
      cfg, buckets, DecodeBatchBuckets(buckets.max_decode_batch), dtype_bytes);
  s.buffer_bytes = EstimateStaticBufferBytes(cfg, buckets, dtype_bytes);
  s.kv_budget_bytes = s.budget_bytes - s.in_use_bytes - s.graph_pool_bytes - s.buffer_bytes;
  s.kv_page_size = page_size;
  s.kv_bytes_per_page = KvCacheBytes(cfg, page_size, dtype_bytes);
  s.kv_pages = s.kv_budget_bytes > 0 ? s.kv_budget_bytes / s.kv_bytes_per_page : 0;
  s.kv_tokens = std::max<int64_t>(s.kv_pages - 1, 0) * page_size;
  const int64_t pages_per_sequence = KvPagesFor(max_context, page_size);
  s.full_context_sequences = (s.kv_pages - 1) / pages_per_sequence;
  if (s.full_context_sequences < 1) {
    char msg[512];
    std::snprintf(msg, sizeof(msg),
                  "no sequence of the longest context fits the KV cache: "
                  "buckets.gpu_memory_utilization %.2f of %.1f GiB leaves %.2f GiB for the KV "
                  "cache after %.1f GiB in use and a %.1f GiB graph pool estimate, and %lld "
                  "tokens take %.1f MiB (plus one scratch page); lower buckets.context_lens, "
                  "seq_lens, tile_counts or max_prefill_batch, raise gpu_memory_utilization, or "
                  "set buckets.batch_sizes",
                  buckets.gpu_memory_utilization, device.total_bytes / kGiB,
                  s.kv_budget_bytes / kGiB, s.in_use_bytes / kGiB, s.graph_pool_bytes / kGiB,
                  static_cast<long long>(max_context),
                  KvCacheBytes(cfg, pages_per_sequence * page_size, dtype_bytes) / kMiB);
    throw std::invalid_argument(msg);
  }
  s.batch_sizes = DecodeBatchBuckets(std::min(s.kv_pages - 1, buckets.max_decode_batch));
  s.slots = s.batch_sizes.back();
  // No more pages than the slots can ever hold: the rest of the budget stays free (for other
  // processes, and for what the estimates miss: cuBLAS workspaces, allocator rounding).
  s.kv_pages = std::min(s.kv_pages, s.slots * pages_per_sequence + 1);
  s.kv_tokens = (s.kv_pages - 1) * page_size;
  s.full_context_sequences = (s.kv_pages - 1) / pages_per_sequence;
  return s;
}

}  // namespace vlmgraph
