// bench/synthetic.h: synthetic inputs for the benchmarks and vlmgraph-diagnose, where timing
// does not depend on the values.
//
//   std::vector<TrainExample> batch = SyntheticTrainBatch(cfg, 8, 256, 1);
//
// Thread rules: stateless; deterministic (fixed seeds).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/trainer.h"
#include "model/config.h"

namespace vlmgraph {

// `batch` training examples of exactly `seq` tokens: up to `tiles` random image tiles (their image
// tokens first), then text with next-token targets (-100 on image tokens and the last position).
// For benchmarks and diagnostics, where timing does not depend on the values.
std::vector<TrainExample> SyntheticTrainBatch(const VlmConfig& cfg, int64_t batch, int64_t seq,
                                              int64_t tiles);

// `n` prompt lengths, deterministic: exp(N(log(median), sigma)), clamped to [1, max_len].
std::vector<int64_t> SyntheticPromptLengths(int64_t n, double median, double sigma,
                                            int64_t max_len);

}  // namespace vlmgraph
