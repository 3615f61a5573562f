#include "engine/sampler.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <limits>

namespace vlmgraph {

at::Tensor TopKTopPFilter(const at::Tensor& logits, int64_t top_k, double top_p) {
  const double neg_inf = -std::numeric_limits<double>::infinity();
  at::Tensor out = logits;
  const int64_t k = std::min<int64_t>(top_k, logits.size(-1));
  if (k > 0) {
    at::Tensor kth = std::get<0>(at::topk(out, k)).select(-1, k - 1);
    out = out.masked_fill(out < kth, neg_inf);
  }
  if (top_p < 1.0) {
    auto [sorted, order] = at::sort(out, -1, /*descending=*/true);
    at::Tensor cum = at::softmax(sorted, -1).cumsum(-1);
    at::Tensor remove_sorted = cum > top_p;
    // Shift right so the token that crosses the threshold stays; the first is always kept.
    remove_sorted = at::cat({at::zeros_like(remove_sorted.narrow(-1, 0, 1)),
                             remove_sorted.narrow(-1, 0, remove_sorted.size(-1) - 1)},
                            -1);
    at::Tensor remove = at::zeros_like(remove_sorted).scatter(-1, order, remove_sorted);
    out = out.masked_fill(remove, neg_inf);
  }
  return out;
}

at::Tensor SampleToken(const at::Tensor& logits, const SamplingParams& params,
                       at::Generator& generator) {
  at::Tensor filtered = TopKTopPFilter(logits.to(at::kFloat), params.top_k, params.top_p);
  at::Tensor probs = at::softmax(filtered / params.temperature, -1);
  at::Tensor noise = at::empty_like(probs).exponential_(1.0, generator);
  return (probs / noise).argmax(-1);
}

at::Generator MakeGenerator(const at::Device& device, uint64_t seed) {
  at::Generator g;
  if (device.is_cuda()) {
    g = at::globalContext().defaultGenerator(device).clone();
  } else {
    g = at::make_generator<at::CPUGeneratorImpl>(seed);
  }
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_current_seed(seed);
  return g;
}

}  // namespace vlmgraph
