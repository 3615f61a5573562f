// tests/synthetic_train_batch.h: a deterministic Train batch for the server tests: `rows` examples
// of `len` token ids (below 200, so they fit every test vocabulary), each predicting its next id
// (the last target ignored, -100).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/trainer.h"

namespace vlmgraph::testing {

inline std::vector<TrainExample> SyntheticTrainBatch(int64_t rows, int64_t len) {
  std::vector<TrainExample> out;
  for (int64_t r = 0; r < rows; ++r) {
    TrainExample d;
    for (int64_t i = 0; i < len; ++i) d.input_ids.push_back((r * 31 + i * 7) % 200);
    d.targets.assign(d.input_ids.begin() + 1, d.input_ids.end());
    d.targets.push_back(-100);
    out.push_back(d);
  }
  return out;
}

}  // namespace vlmgraph::testing
