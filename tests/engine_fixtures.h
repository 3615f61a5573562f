// tests/engine_fixtures.h: the small bucket set the engine tests run the tiny checkpoint in
// (tests/fixtures/nanovlm-tiny): 4 decode slots, prompts up to 32 tokens, KV windows of 32 and 64.
#pragma once

#include "engine/bucket.h"

namespace vlmgraph {
namespace testing {

inline BucketSpec SmallBuckets() {
  BucketSpec b;
  b.batch_sizes = {1, 2, 4};
  b.seq_lens = {8, 16, 32};
  b.context_lens = {32, 64};
  b.tile_counts = {1, 2};
  b.Validate();
  return b;
}

}  // namespace testing
}  // namespace vlmgraph
