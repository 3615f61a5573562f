// engine/engine_logprobs.cc: the Engine's logprobs for the requests that ask (LogprobsParams):
// decode steps' and first tokens' from the regions' logits, prompts' from the prefill's hidden
// states (Note [Logprobs off the graph], engine/logprobs.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <memory>

#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "engine/logprobs.h"

namespace vlmgraph {

void Engine::QueueLogprobs(const std::vector<Sequence*>& fed, const at::Tensor& logits,
                           const at::Tensor& tokens, QueuedStep* step) {
  int64_t top = 0;
  for (const Sequence* s : fed) {
    if (!s->logprobs.tokens) continue;
    step->logprob_slots.push_back(s->slot);
    top = std::max(top, s->logprobs.top);
  }
  if (step->logprob_slots.empty()) return;  // the step launches nothing more
  const bool cuda = options_.device.is_cuda();
  // The rows' indices go to the device from pinned memory, without waiting for queued steps.
  at::Tensor rows_host = at::tensor(step->logprob_slots, at::kLong);
  if (cuda) rows_host = rows_host.pin_memory();
  const at::Tensor rows = rows_host.to(options_.device, /*non_blocking=*/cuda);
  step->logprobs = LogprobsOfRows(logits.index_select(0, rows), tokens.index_select(0, rows), top)
                       .To(at::kCPU, /*pinned=*/cuda);
}

void Engine::AttachPrefillLogprobs(const std::vector<const GenerateRequest*>& group,
                                   const DispatchResult& r, const std::vector<int64_t>& tokens,
                                   TokenEvent* events) {
  std::vector<int64_t> rows, row_tokens, tops;
  for (size_t k = 0; k < group.size(); ++k) {
    if (!group[k]->logprobs.tokens) continue;
    rows.push_back(static_cast<int64_t>(k));
    row_tokens.push_back(tokens[k]);
    tops.push_back(group[k]->logprobs.top);
  }
  if (!rows.empty()) {
    const at::Tensor index = at::tensor(rows, at::kLong).to(options_.device);
    const at::Tensor chosen = at::tensor(row_tokens, at::kLong).to(options_.device);
    const int64_t top = *std::max_element(tops.begin(), tops.end());
    std::vector<TokenLogprob> first = ToTokenLogprobs(
        LogprobsOfRows(r.outputs[0].index_select(0, index), chosen, top).To(at::kCPU), tops);
    for (size_t j = 0; j < rows.size(); ++j) events[rows[j]].logprob = std::move(first[j]);
  }
  VisionLanguageModelImpl* m = model_.get();
  const int64_t chunk = PromptLogprobChunkPositions(m->cfg.lm_vocab_size, kPromptLogprobChunkBytes);
  for (size_t k = 0; k < group.size(); ++k) {
    const GenerateRequest& request = *group[k];
    if (!request.logprobs.prompt) continue;
    const at::Tensor hidden = r.outputs[1].select(0, static_cast<int64_t>(k));  // (S, H)
    events[k].prompt_logprobs = std::make_shared<const std::vector<TokenLogprob>>(
        PromptLogprobs([m](const at::Tensor& h) { return m->decoder->Logits(h); }, hidden,
                       request.input_ids, request.logprobs.prompt_top, chunk));
  }
}

}  // namespace vlmgraph
