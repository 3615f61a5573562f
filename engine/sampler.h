// engine/sampler.h: choosing the sampled rows' next tokens from logits, for a whole batch at once,
// on the logits' device. (Greedy rows take ops::ArgmaxRows; the engine overwrites the sampled
// rows with SampleRowsInto.)
//
// Formula, as upstream nanoVLM's generate (models/utils.py top_k_top_p_filtering, then
// torch.multinomial(softmax(filtered / temperature))):
// - top_k > 0 keeps the logits >= the k-th largest (ties with it included);
// - top_p < 1 then keeps, in descending order of the top-k-filtered logits, each token whose
//   preceding softmax mass (over the top-k-kept tokens, before the temperature) is <= top_p: the
//   smallest set whose mass exceeds top_p, and always the most likely token;
// - the token is drawn from softmax(kept logits / temperature) by the Gumbel-max trick,
//   argmax over kept tokens of logit / temperature + G, with G standard Gumbel noise
//   (Gumbel 1954; e.g. Huijben et al., "A Review of the Gumbel-max Trick", TPAMI 2022), which
//   samples that distribution exactly. The noise is counter-based (engine/sampler_formulas.h): a
//   row's token depends only on its logits, its parameters, its seed and the index of the draw in
//   its sequence, not on what else is batched with it, so a seeded request repeats its tokens.
//
// Cost: one pass of batched ops for all sampled rows, whatever their number: one copy of their
// parameters, a gather of their logits, when a row filters a stable descending sort and one
// kernel for the kept prefixes (NucleusPrefix), the draw (two kernels), a scatter of the tokens.
//
// Thread rules: the engine's GPU thread only (it queues work on the current stream).
// Errors: c10::Error for a bad shape, dtype or row index.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "engine/engine_types.h"

namespace vlmgraph {

// One sampled row: which row of the logits, its request's parameters (temperature, top_k, top_p,
// seed; `greedy` is not looked at) and the index of this token among the tokens its sequence has
// generated (0 for the first), which selects the noise.
struct SamplingDraw {
  int64_t row = 0;
  const SamplingParams* params = nullptr;
  int64_t draw = 0;
};

// Overwrites tokens[d.row] (tokens: (B) int64, logits' device) with a token sampled from
// logits[d.row] (logits: (B, V) float32 or bfloat16) for every d in `draws` (rows distinct).
// Queued on the current stream without waiting for the device.
void SampleRowsInto(const at::Tensor& logits, const std::vector<SamplingDraw>& draws,
                    const at::Tensor& tokens);

// Per-row draw parameters, each (R) on the candidates' device, contiguous: temperature and top_p
// float32; top_k (0 = off, else <= C), seed (the uint64's bits) and draw int64.
struct SamplingRows {
  at::Tensor temperature, top_p, top_k, seed, draw;
};

// The kept prefix of each row r of `sorted` (R, C) float32 or bfloat16, sorted in descending
// order, written to kept[r] (int64):
// - top-k: n_k = C when top_k[r] == 0, else the number of entries >= sorted[r, top_k[r] - 1];
// - top-p (top_p[r] < 1): the first j in [1, n_k) whose preceding mass exceeds the share top_p of
//   the top-k mass, sum_{i<j} e_i > top_p[r] * sum_{i<n_k} e_i with e_i = exp(sorted[r, i] -
//   sorted[r, 0]) (float32 exponentials, float64 sums), else n_k.
// That is upstream's rule (entry j removed when the softmax of the top-k-filtered logits puts
// more than top_p on the entries before it) with the softmax renormalised instead of recomputed.
// CPU and CUDA sum in different orders, so they can differ where a row's boundary is within
// float64 rounding of top_p's share (not seen in practice).
void NucleusPrefix(const at::Tensor& sorted, const SamplingRows& rows, const at::Tensor& kept);

// The draw itself, for each row r of `candidates` (R, C) float32 or bfloat16: the candidate id with
// the largest float(candidates[r, j]) / temperature[r] + SamplingGumbel(seed[r], draw[r], id) over
// the kept candidates j (equal scores: the lower id), written to out[r] (int64).
// - ids undefined: candidate j is token j and every candidate is kept (no filtering; `kept`
//   must be undefined too).
// - ids (R, C) int64: the token of each candidate, and kept (R) int64 the number of leading
//   candidates kept (NucleusPrefix), in [1, C].
void GumbelMaxDraw(const at::Tensor& candidates, const at::Tensor& ids, const at::Tensor& kept,
                   const SamplingRows& rows, const at::Tensor& out);

}  // namespace vlmgraph
