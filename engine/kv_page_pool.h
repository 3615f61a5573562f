// engine/kv_page_pool.h: which pages of the paged KV cache (model/kv_cache.h) are free.
//
// The engine gives each admitted sequence the pages its prompt and its max_new_tokens can fill
// and takes them back when the sequence ends (Note [KV pages per sequence], engine/engine.h).
// Page 0 is the cache's scratch page and is never handed out.
//
//   KvPagePool pool(/*num_pages=*/1001);          // pages 1..1000 free
//   std::vector<int32_t> pages = pool.Take(3);    // {1, 2, 3}; empty when fewer are free
//   pool.Give(pages);
//
// Thread rules: not synchronised; the engine's GPU thread owns it. free_pages() and
// used_pages() are also published by the engine for other threads (Engine::Memory).
// Errors: Give throws std::logic_error for a page that is not taken (a double free).
#pragma once

#include <cstdint>
#include <vector>

namespace vlmgraph {

class KvPagePool {
 public:
  KvPagePool() = default;
  // Pages 1 .. num_pages - 1 free; num_pages counts the scratch page.
  explicit KvPagePool(int64_t num_pages);

  // `n` free pages, lowest ids first while the pool is fresh, or {} (nothing taken) when fewer
  // than n are free.
  std::vector<int32_t> Take(int64_t n);
  void Give(const std::vector<int32_t>& pages);

  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t used_pages() const { return capacity() - free_pages(); }
  // Pages a sequence can ever hold: num_pages - 1.
  int64_t capacity() const { return static_cast<int64_t>(taken_.size()) - 1; }

 private:
  std::vector<int32_t> free_;  // a stack: the page freed last is taken first (warm in L2)
  std::vector<bool> taken_;    // by page id; taken_[0] (scratch) stays false
};

}  // namespace vlmgraph
