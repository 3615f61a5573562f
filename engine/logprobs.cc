#include "engine/logprobs.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <iterator>
#include <tuple>

namespace vlmgraph {

LogprobRows LogprobRows::To(at::Device device, bool pinned) const {
  auto copy = [&](const at::Tensor& t) {
    at::Tensor out =
        at::empty(t.sizes(), at::TensorOptions().dtype(t.dtype()).device(device).pinned_memory(
                                 pinned && device.is_cpu()));
    out.copy_(t, /*non_blocking=*/pinned);
    return out;
  };
  return {copy(chosen), copy(top_logprobs), copy(top_ids)};
}

LogprobRows LogprobsOfRows(const at::Tensor& logits, const at::Tensor& tokens, int64_t top) {
  TORCH_CHECK(logits.dim() == 2 && tokens.dim() == 1 && tokens.size(0) == logits.size(0),
              "LogprobsOfRows: logits (n, V) and tokens (n) expected");
  TORCH_CHECK(top >= 0 && top <= logits.size(1), "LogprobsOfRows: top must lie in [0, V]");
  const at::Tensor lp = at::log_softmax(logits.to(at::kFloat), /*dim=*/1);  // (n, V)
  LogprobRows out;
  out.chosen = lp.gather(1, tokens.view({-1, 1})).view({-1});
  if (top > 0) {
    std::tie(out.top_logprobs, out.top_ids) = lp.topk(top, /*dim=*/1);
  } else {
    out.top_logprobs = at::empty({logits.size(0), 0}, lp.options());
    out.top_ids = at::empty({logits.size(0), 0}, tokens.options());
  }
  return out;
}

std::vector<TokenLogprob> ToTokenLogprobs(const LogprobRows& host,
                                          const std::vector<int64_t>& top_per_row) {
  const int64_t n = host.chosen.size(0);
  TORCH_CHECK(static_cast<int64_t>(top_per_row.size()) == n,
              "ToTokenLogprobs: one top count per row expected");
  const at::Tensor chosen = host.chosen.contiguous();
  const at::Tensor values = host.top_logprobs.contiguous();
  const at::Tensor ids = host.top_ids.contiguous();
  const int64_t k = values.size(1);
  const float* chosen_p = chosen.data_ptr<float>();
  const float* values_p = values.data_ptr<float>();
  const int64_t* ids_p = ids.data_ptr<int64_t>();
  std::vector<TokenLogprob> out(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    TokenLogprob& t = out[static_cast<size_t>(r)];
    t.logprob = chosen_p[r];
    const int64_t keep = std::min(k, top_per_row[static_cast<size_t>(r)]);
    t.top.reserve(static_cast<size_t>(keep));
    for (int64_t j = 0; j < keep; ++j) t.top.emplace_back(ids_p[r * k + j], values_p[r * k + j]);
  }
  return out;
}

int64_t PromptLogprobChunkPositions(int64_t vocab, int64_t max_chunk_bytes) {
  const int64_t row_bytes = std::max<int64_t>(1, vocab) * static_cast<int64_t>(sizeof(float));
  return std::max<int64_t>(1, max_chunk_bytes / row_bytes);
}

std::vector<TokenLogprob> PromptLogprobs(const std::function<at::Tensor(const at::Tensor&)>& head,
                                         const at::Tensor& hidden, const std::vector<int64_t>& ids,
                                         int64_t top, int64_t chunk_positions) {
  const int64_t positions = static_cast<int64_t>(ids.size()) - 1;  // each predicts the next id
  std::vector<TokenLogprob> out;
  if (positions <= 0) return out;
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) >= positions + 1,
              "PromptLogprobs: hidden (T >= prompt length, H) expected");
  TORCH_CHECK(chunk_positions >= 1, "PromptLogprobs: chunk_positions must be >= 1");
  out.reserve(static_cast<size_t>(positions));
  const at::Tensor next =
      at::tensor(std::vector<int64_t>(ids.begin() + 1, ids.end()), at::kLong).to(hidden.device());
  for (int64_t start = 0; start < positions; start += chunk_positions) {
    const int64_t n = std::min(chunk_positions, positions - start);
    const at::Tensor logits = head(hidden.narrow(0, start, n));  // (n, V)
    const int64_t k = std::min<int64_t>(top, logits.size(1));
    const LogprobRows rows = LogprobsOfRows(logits, next.narrow(0, start, n), k).To(at::kCPU);
    std::vector<TokenLogprob> part = ToTokenLogprobs(rows, std::vector<int64_t>(n, k));
    std::move(part.begin(), part.end(), std::back_inserter(out));
  }
  return out;
}

}  // namespace vlmgraph
