// model/kv_cache.h: the decoder's key/value cache in fixed-size pages, with a page table per row.
//
// Keys and values of every decoder block live in pages of `page_size` token positions (vLLM's
// PagedAttention blocks: Kwon et al. 2023, "Efficient Memory Management for Large Language Model
// Serving with PagedAttention"). A "row" is one sequence's view of the cache: page_table[row, j]
// names the page that holds the row's positions [j * page_size, (j + 1) * page_size). Every
// tensor is allocated once, so every CUDA graph that reads the cache sees fixed addresses; only
// the page table's entries change, between graph replays, when a row changes owner.
//
// Note [Paged KV layout] (the contract of every kernel, the engine and the adapters built on it):
//   key[l], value[l]   (num_pages, n_kv_heads, page_size, head_dim) in the model's dtype; keys are
//                      stored after RoPE. A (page, KV head) is one contiguous page_size x head_dim
//                      tile: 2 KiB at 16 positions of head_dim 64 in bfloat16.
//   page_table         (rows, pages_per_row) int32 on the cache's device; position p of row r is
//                      key[l][page_table[r, p / page_size], :, p % page_size, :].
//   page 0             the scratch page: never given to a sequence. Every entry that names no page
//                      of the row's own holds 0. The CUDA kernels skip writes there (a padding
//                      row, a prefill's padded positions past what the row reserved), so scratch
//                      stays zero; the CPU path writes them to scratch. Reads of it are masked.
//   page_size          a power of two, at least 16 (the tensor-core attention's key tile), 16 by
//                      default (vLLM's default block size).
// Positions are read and written only through the page table: kernels compute the page of each
// 16-key tile (model/cuda/decode_attention*.cu, fused_kernels.cu); the CPU path gathers a row's
// pages (model/language_model.cc).
//
//   // Every row with pages of its own (single-shot generation, tests): rows x pages_per_row + 1.
//   KVCache cache = KVCache::Allocate(cfg, /*rows=*/9, /*max_seq_len=*/1024, opts);
//   // A pool of pages for a caller that maps them (the engine): every row starts on scratch.
//   KVCache pool = KVCache::AllocatePaged(cfg, /*rows=*/257, /*max_seq_len=*/4096,
//                                         /*num_pages=*/40000, opts);
//
// Thread rules: plain data; whoever owns it (the engine's GPU thread) serialises access.
#pragma once

#include <ATen/Tensor.h>

#include <vector>

#include "model/config.h"

namespace vlmgraph {

// Token positions per KV page unless a caller picks another (Note [Paged KV layout]).
constexpr int64_t kDefaultKvPageSize = 16;

struct KVCache {
  std::vector<at::Tensor> key;    // per block: (num_pages, n_kv_heads, page_size, head_dim)
  std::vector<at::Tensor> value;  // per block: (num_pages, n_kv_heads, page_size, head_dim)
  at::Tensor page_table;          // (rows, pages_per_row) int32; 0 = the scratch page
  // (rows, n_kv_heads) int32, zero between kernels: the fused decode attention's split counters
  // (ops::RopeDecodeAttention), shared by every block since blocks run one after another.
  at::Tensor attention_semaphores;

  // Rows with pages of their own: page_table[r, j] = 1 + r * pages_per_row + j, num_pages =
  // rows * pages_per_row + 1. Throws std::invalid_argument on a page_size that is not a power of
  // two >= 16, or rows / max_seq_len < 1.
  static KVCache Allocate(const VlmConfig& cfg, int64_t rows, int64_t max_seq_len,
                          const at::TensorOptions& options, int64_t page_size = kDefaultKvPageSize);
  // `num_pages` pages (the scratch page included, so >= 2) and a page table of zeros: the caller
  // maps rows to pages. Same errors as Allocate.
  static KVCache AllocatePaged(const VlmConfig& cfg, int64_t rows, int64_t max_seq_len,
                               int64_t num_pages, const at::TensorOptions& options,
                               int64_t page_size = kDefaultKvPageSize);

  int64_t rows() const { return page_table.defined() ? page_table.size(0) : 0; }
  int64_t pages_per_row() const { return page_table.defined() ? page_table.size(1) : 0; }
  int64_t num_pages() const { return key.empty() ? 0 : key[0].size(0); }
  int64_t page_size() const { return key.empty() ? 0 : key[0].size(2); }
  // The longest sequence a row can hold: pages_per_row x page_size.
  int64_t max_seq_len() const { return pages_per_row() * page_size(); }
  int64_t bytes() const;
};

// Pages that hold `tokens` positions: ceil(tokens / page_size).
inline int64_t KvPagesFor(int64_t tokens, int64_t page_size) {
  return (tokens + page_size - 1) / page_size;
}

}  // namespace vlmgraph
