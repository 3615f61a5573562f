#include "model/kv_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace vlmgraph {
namespace {

KVCache AllocatePages(const VlmConfig& cfg, int64_t rows, int64_t max_seq_len, int64_t num_pages,
                      const at::TensorOptions& options, int64_t page_size) {
  if (page_size < 16 || (page_size & (page_size - 1)) != 0) {
    throw std::invalid_argument("KV page_size must be a power of two >= 16, got " +
                                std::to_string(page_size));
  }
  if (rows < 1 || max_seq_len < 1 || num_pages < 2) {
    throw std::invalid_argument("KV cache needs rows >= 1, max_seq_len >= 1 and num_pages >= 2");
  }
  KVCache c;
  for (int64_t i = 0; i < cfg.lm_n_blocks; ++i) {
    c.key.push_back(
        at::zeros({num_pages, cfg.lm_n_kv_heads, page_size, cfg.lm_head_dim()}, options));
    c.value.push_back(
        at::zeros({num_pages, cfg.lm_n_kv_heads, page_size, cfg.lm_head_dim()}, options));
  }
  c.page_table = at::zeros({rows, KvPagesFor(max_seq_len, page_size)}, options.dtype(at::kInt));
  c.attention_semaphores = at::zeros({rows, cfg.lm_n_kv_heads}, options.dtype(at::kInt));
  return c;
}

}  // namespace

KVCache KVCache::Allocate(const VlmConfig& cfg, int64_t rows, int64_t max_seq_len,
                          const at::TensorOptions& options, int64_t page_size) {
  const int64_t per_row =
      KvPagesFor(std::max<int64_t>(max_seq_len, 1), std::max<int64_t>(page_size, 1));
  KVCache c = AllocatePages(cfg, rows, max_seq_len, rows * per_row + 1, options, page_size);
  c.page_table.copy_(at::arange(1, rows * per_row + 1, at::kInt).view({rows, per_row}));
  return c;
}

KVCache KVCache::AllocatePaged(const VlmConfig& cfg, int64_t rows, int64_t max_seq_len,
                               int64_t num_pages, const at::TensorOptions& options,
                               int64_t page_size) {
  return AllocatePages(cfg, rows, max_seq_len, num_pages, options, page_size);
}

int64_t KVCache::bytes() const {
  int64_t n = 0;
  for (const auto& t : key) n += static_cast<int64_t>(t.nbytes());
  for (const auto& t : value) n += static_cast<int64_t>(t.nbytes());
  return n;
}

}  // namespace vlmgraph
