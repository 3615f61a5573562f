// engine/sampler.h: choosing the next token from logits, on the logits' device.
//
// Greedy: argmax. Sampling, as upstream nanoVLM's generate (models/utils.py top_k_top_p_filtering):
// keep the top_k largest logits (top_k > 0), then the smallest set whose softmax mass exceeds top_p
// (the first token always kept), then sample from softmax(filtered / temperature). The draw uses
// the exponential-race form of the Gumbel-max trick (argmax p / E with E ~ Exp(1)), which samples
// exactly from p and lets each row use its own seeded generator with no host synchronisation.
//
// Thread rules: the engine's GPU thread only.
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <vector>

#include "engine/engine_types.h"

namespace vlmgraph {

// logits (V) of one row -> filtered logits with removed entries at -inf.
at::Tensor TopKTopPFilter(const at::Tensor& logits, int64_t top_k, double top_p);

// Samples one token id (0-dim int64 tensor on the logits' device) from logits (V) with `params`
// (greedy ignored here), drawing noise from `generator` (same device as logits).
at::Tensor SampleToken(const at::Tensor& logits, const SamplingParams& params,
                       at::Generator& generator);

// A generator for `device` seeded with `seed`.
at::Generator MakeGenerator(const at::Device& device, uint64_t seed);

}  // namespace vlmgraph
