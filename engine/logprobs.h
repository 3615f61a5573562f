// engine/logprobs.h: log-probabilities of tokens and of the most likely alternatives, from logits
// rows or from a prompt's hidden states, for the requests that ask (LogprobsParams,
// engine/engine_types.h).
//
//   LogprobRows rows = LogprobsOfRows(logits, tokens, /*top=*/5);   // on the logits' device
//   std::vector<TokenLogprob> host = ToTokenLogprobs(rows.To(at::kCPU), {5, 0});
//   std::vector<TokenLogprob> prompt = PromptLogprobs(head, hidden, ids, /*top=*/5,
//       PromptLogprobChunkPositions(vocab, kPromptLogprobChunkBytes));
//
// Formula: logprob(t) = log_softmax(logits)[t] over the whole vocabulary, computed in float32 from
// the raw logits (before temperature, top-k and top-p: vLLM's default "raw_logprobs"; OpenAI
// documents the logprob of a token, not of the sampling distribution). The most likely tokens are
// at::topk's, in descending order (ties in any order).
//
// Note [Logprobs off the graph]: a decode step's region (engine.cc, MakeRegionFn) is the same
// whether or not a row asks for logprobs, so its CUDA graphs are unchanged and a step whose rows
// ask for none launches nothing more than before. When some rows ask, the engine computes their
// logprobs eagerly right after the region, from its logits output (valid until the runner's next
// run, Note [Graph memory pool] in engine/step_runner.h) and the step's tokens: one gather of
// those rows, a log_softmax, a gather and a topk, queued on the stream, and copied to pinned host
// memory before the step's token copy is recorded, so overlapped steps stay overlapped. Prompt
// logprobs (echo) need the logits of every prompt position, which the prefill region does not
// make (only the last position's): they are computed from the region's hidden-state output, for
// the requests that ask only, in chunks of positions whose float32 logits stay within a bound, so
// a long prompt never holds (T, V) float32 at once.
//
// Thread rules: the engine's GPU thread (work is queued on the current stream). Errors: c10::Error
// for shapes that do not match.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/engine_types.h"

namespace vlmgraph {

// Log-probabilities of n rows.
struct LogprobRows {
  at::Tensor chosen;        // (n) float32: the logprob of each row's token
  at::Tensor top_logprobs;  // (n, k) float32, each row descending
  at::Tensor top_ids;       // (n, k) int64, the tokens of top_logprobs
  // The same tensors copied to `device` (non_blocking: from a CUDA device into pinned memory,
  // valid once the stream has reached the copy).
  LogprobRows To(at::Device device, bool pinned = false) const;
};

// log_softmax(float32(logits)) at `tokens` and its `top` largest entries per row. logits (n, V)
// float32 or bfloat16; tokens (n) int64 on the same device; top in [0, V].
LogprobRows LogprobsOfRows(const at::Tensor& logits, const at::Tensor& tokens, int64_t top);

// Host rows (LogprobRows::To(kCPU)) as TokenLogprobs; row r keeps its first top_per_row[r]
// alternatives (<= the rows' k).
std::vector<TokenLogprob> ToTokenLogprobs(const LogprobRows& host,
                                          const std::vector<int64_t>& top_per_row);

// Positions per chunk of PromptLogprobs: the most whose float32 logits (positions x vocab) fit in
// max_chunk_bytes, at least 1.
int64_t PromptLogprobChunkPositions(int64_t vocab, int64_t max_chunk_bytes);

// The logprob of each prompt token from the second on, and its `top` most likely tokens:
// position p's logits, head(hidden[p]), give token ids[p + 1]. hidden (T, H) in the model dtype,
// final-normed (what the decoder's Prefill returns), T >= ids.size(); head maps (P, H) to (P, V)
// logits. Runs in chunks of `chunk_positions` positions (>= 1; PromptLogprobChunkPositions), each
// copied to the host before the next (so it synchronises). Returns ids.size() - 1 entries.
std::vector<TokenLogprob> PromptLogprobs(const std::function<at::Tensor(const at::Tensor&)>& head,
                                         const at::Tensor& hidden, const std::vector<int64_t>& ids,
                                         int64_t top, int64_t chunk_positions);

// The largest float32 logits block that the engine's prompt logprobs hold at once: 64 MiB (341
// positions of a 49,218-token vocabulary).
inline constexpr int64_t kPromptLogprobChunkBytes = int64_t{64} << 20;

}  // namespace vlmgraph
