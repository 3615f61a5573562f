// engine/optimizer_shards.h: which rank owns the optimizer work of each trained parameter under
// ZeRO stage 1 (DataParallelOptions::shard_optimizer; Note [Sharded optimizer] in
// engine/trainer_optimizer.cc).
//
// The unit of ownership is a whole parameter, as PyTorch's ZeroRedundancyOptimizer partitions
// (torch/distributed/optim/zero_redundancy_optimizer.py, _partition_parameters): the largest
// parameters first, each to the rank that owns the fewest elements so far (ties: the lowest
// rank). No tensor is split, so a gradient is reduced to its owner and a weight broadcast from it
// in place, with no flat buffer and no copy.
//
//   OptimizerShards shards({4096, 64, 4096, 64}, /*world_size=*/2, /*rank=*/1);
//   shards.owner(0);   // 0;  shards.owner(2) == 1: 4096 + 64 elements per rank
//   shards.Owned(grads);  // rank 1's entries of a one-per-parameter list
//
// Thread rules: immutable after construction. Errors: std::invalid_argument for a world_size or
// rank out of range.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

#include "engine/fused_optimizer.h"

namespace vlmgraph {

class OptimizerShards {
 public:
  // numels[k]: parameter k's element count, in the optimizer's parameter order.
  OptimizerShards(const std::vector<int64_t>& numels, int64_t world_size, int64_t rank);

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  int64_t owner(size_t k) const { return owners_.at(k); }
  bool owns(size_t k) const { return owners_.at(k) == rank_; }
  // One per parameter: its owner rank (the roots of DataParallelGroup::StartReduceSum and
  // StartBroadcast).
  const std::vector<int64_t>& owners() const { return owners_; }
  // The owners of parameters `indices`, in that order.
  std::vector<int64_t> Owners(const std::vector<size_t>& indices) const;
  // The parameters this rank owns, ascending.
  const std::vector<size_t>& owned() const { return owned_; }
  // Elements owned by `rank`.
  int64_t numel_of(int64_t rank) const { return load_.at(rank); }

  // The entries of a one-per-parameter list that this rank owns, in owned() order.
  std::vector<at::Tensor> Owned(const std::vector<at::Tensor>& all) const;
  // The same for every per-parameter list of `t` (empty lists stay empty).
  AdamWTensors Owned(const AdamWTensors& t) const;

 private:
  int64_t world_size_, rank_;
  std::vector<int64_t> owners_;
  std::vector<size_t> owned_;
  std::vector<int64_t> load_;
};

}  // namespace vlmgraph
