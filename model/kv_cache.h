// model/kv_cache.h: a static, preallocated key/value cache for the decoder.
//
// One tensor pair per decoder block, each (rows, lm_n_kv_heads, max_seq_len, head_dim) in the
// model's dtype. A "row" holds one sequence; the row's valid length lives outside (the engine keeps
// it per sequence), so one allocation serves every decode position and every CUDA graph that reads
// it sees fixed addresses. Keys are stored after RoPE.
//
//   vlmgraph::KVCache cache = vlmgraph::KVCache::Allocate(cfg, /*rows=*/9, /*max_seq_len=*/1024,
//                                                          at::dtype(at::kBFloat16).device(at::kCUDA));
//
// Thread rules: plain data; whoever owns it (the engine's GPU thread) serialises access.
#pragma once

#include <ATen/Tensor.h>

#include <vector>

#include "model/config.h"

namespace vlmgraph {

struct KVCache {
  std::vector<at::Tensor> key;    // per block: (rows, n_kv_heads, max_seq_len, head_dim)
  std::vector<at::Tensor> value;  // per block: (rows, n_kv_heads, max_seq_len, head_dim)
  // (rows, n_kv_heads) int32, zero between kernels: the fused decode attention's split counters
  // (ops::RopeDecodeAttention), shared by every block since blocks run one after another.
  at::Tensor attention_semaphores;

  static KVCache Allocate(const VlmConfig& cfg, int64_t rows, int64_t max_seq_len,
                          const at::TensorOptions& options);
  int64_t rows() const { return key.empty() ? 0 : key[0].size(0); }
  int64_t max_seq_len() const { return key.empty() ? 0 : key[0].size(2); }
  int64_t bytes() const;
};

}  // namespace vlmgraph
