#include "model/kv_cache.h"

#include <ATen/ATen.h>

namespace vlmgraph {

KVCache KVCache::Allocate(const VlmConfig& cfg, int64_t rows, int64_t max_seq_len,
                          const at::TensorOptions& options) {
  KVCache c;
  for (int64_t i = 0; i < cfg.lm_n_blocks; ++i) {
    c.key.push_back(at::zeros({rows, cfg.lm_n_kv_heads, max_seq_len, cfg.lm_head_dim()}, options));
    c.value.push_back(
        at::zeros({rows, cfg.lm_n_kv_heads, max_seq_len, cfg.lm_head_dim()}, options));
  }
  c.attention_semaphores = at::zeros({rows, cfg.lm_n_kv_heads}, options.dtype(at::kInt));
  return c;
}

int64_t KVCache::bytes() const {
  int64_t n = 0;
  for (const auto& t : key) n += static_cast<int64_t>(t.nbytes());
  for (const auto& t : value) n += static_cast<int64_t>(t.nbytes());
  return n;
}

}  // namespace vlmgraph
