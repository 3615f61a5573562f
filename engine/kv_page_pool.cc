#include "engine/kv_page_pool.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace vlmgraph {

KvPagePool::KvPagePool(int64_t num_pages) : taken_(static_cast<size_t>(num_pages), false) {
  free_.reserve(static_cast<size_t>(num_pages));
  for (int64_t p = num_pages - 1; p >= 1; --p) free_.push_back(static_cast<int32_t>(p));
}

std::vector<int32_t> KvPagePool::Take(int64_t n) {
  if (n < 0 || n > free_pages()) return {};
  std::vector<int32_t> pages(free_.end() - n, free_.end());
  free_.resize(free_.size() - static_cast<size_t>(n));
  // The stack's top is its end: reverse so a fresh pool hands out 1, 2, 3, ...
  std::reverse(pages.begin(), pages.end());
  for (int32_t p : pages) taken_[static_cast<size_t>(p)] = true;
  return pages;
}

void KvPagePool::Give(const std::vector<int32_t>& pages) {
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
    const int32_t p = *it;
    if (p <= 0 || p >= static_cast<int32_t>(taken_.size()) || !taken_[static_cast<size_t>(p)]) {
      throw std::logic_error("KvPagePool::Give: page " + std::to_string(p) + " is not taken");
    }
    taken_[static_cast<size_t>(p)] = false;
    free_.push_back(p);
  }
}

}  // namespace vlmgraph
