#include "engine/optimizer_shards.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace vlmgraph {

OptimizerShards::OptimizerShards(const std::vector<int64_t>& numels, int64_t world_size,
                                 int64_t rank)
    : world_size_(world_size), rank_(rank) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("OptimizerShards: rank " + std::to_string(rank) +
                                " outside a world of " + std::to_string(world_size));
  }
  owners_.assign(numels.size(), 0);
  load_.assign(static_cast<size_t>(world_size), 0);
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), size_t{0});
  // Largest first; equal sizes in parameter order, so every rank computes the same owners.
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  for (size_t k : order) {
    const auto least = std::min_element(load_.begin(), load_.end());  // first: lowest rank
    owners_[k] = least - load_.begin();
    *least += numels[k];
  }
  for (size_t k = 0; k < owners_.size(); ++k) {
    if (owners_[k] == rank_) owned_.push_back(k);
  }
}

std::vector<int64_t> OptimizerShards::Owners(const std::vector<size_t>& indices) const {
  std::vector<int64_t> out;
  out.reserve(indices.size());
  for (size_t k : indices) out.push_back(owners_.at(k));
  return out;
}

std::vector<at::Tensor> OptimizerShards::Owned(const std::vector<at::Tensor>& all) const {
  if (all.empty()) return {};
  if (all.size() != owners_.size())
    throw std::invalid_argument("OptimizerShards::Owned: one entry per parameter");
  std::vector<at::Tensor> out;
  out.reserve(owned_.size());
  for (size_t k : owned_) out.push_back(all[k]);
  return out;
}

AdamWTensors OptimizerShards::Owned(const AdamWTensors& t) const {
  AdamWTensors out;
  out.params = Owned(t.params);
  out.grads = Owned(t.grads);
  out.exp_avg = Owned(t.exp_avg);
  out.exp_avg_sq = Owned(t.exp_avg_sq);
  out.working = Owned(t.working);
  out.steps = Owned(t.steps);
  out.lrs = Owned(t.lrs);
  out.group_sq_sums = Owned(t.group_sq_sums);
  return out;
}

}  // namespace vlmgraph
