// engine/sampler_formulas.h: the sampler's per-candidate formulas, one definition for its CPU
// loops (engine/sampler.cc) and its CUDA kernels (engine/cuda/sampler_kernels.cu), so that both
// keep the same candidates and draw the same token from the same inputs.
//
// Noise, counter-based: the noise of a token depends only on the request's seed, the index of the
// draw in its sequence (0 for the first generated token) and the token id, never on a generator's
// state, on other rows of the batch or on the order in which draws are made. Philox4x32-10
// (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; ATen's at::Philox4_32):
// key = seed, counter = (id / 4, draw) as (offset, subsequence); the (id % 4)-th of the four
// 32-bit outputs gives U = (bits + 0.5) / 2^32 in (0, 1), and G = -log(-log(U)) is standard
// Gumbel noise, computed in float64 and rounded to float32 once.
#pragma once

// PhiloxRNGEngine.h uses AT_ASSERT without including c10/util/Exception.h: that goes first.
// clang-format off
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>
#include <ATen/core/PhiloxRNGEngine.h>
// clang-format on

#include <cmath>
#include <cstdint>

namespace vlmgraph {

C10_HOST_DEVICE inline float SamplingGumbel(uint64_t seed, uint64_t draw, int64_t id) {
  at::Philox4_32 philox(seed, draw, static_cast<uint64_t>(id) / 4);
  uint32_t bits = philox();
  for (int64_t i = 0; i < id % 4; ++i) bits = philox();
  const double u = (static_cast<double>(bits) + 0.5) * (1.0 / 4294967296.0);
  return static_cast<float>(-log(-log(u)));
}

// A candidate's score in the Gumbel-max draw: logit / temperature + Gumbel noise.
C10_HOST_DEVICE inline float SamplingScore(float logit, float temperature, uint64_t seed,
                                           uint64_t draw, int64_t id) {
  return logit / temperature + SamplingGumbel(seed, draw, id);
}

// The order of candidates in a draw: a higher score wins, equal scores go to the lower token id.
C10_HOST_DEVICE inline bool SamplingBeats(float score, int64_t id, float best_score,
                                          int64_t best_id) {
  return score > best_score || (score == best_score && id < best_id);
}

// The top-k prefix of a row x (cols) sorted in descending order: the number of entries >=
// x[top_k - 1] (ties with the k-th entry are kept, as upstream's `logits < kth` filter keeps
// them), all of them when top_k == 0; by binary search. T: float, or a bfloat16 type that
// converts to float.
template <typename T>
C10_HOST_DEVICE int64_t TopKPrefix(const T* x, int64_t cols, int64_t top_k) {
  if (top_k <= 0) return cols;
  const float kth = static_cast<float>(x[top_k - 1]);
  int64_t lo = top_k, hi = cols;  // x[lo - 1] >= kth; the answer is in [lo, hi]
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<float>(x[mid]) >= kth) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace vlmgraph
