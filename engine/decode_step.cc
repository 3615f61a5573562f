// engine/decode_step.cc: the Engine's decode steps (Engine::Step), queued one ahead when decode
// steps overlap (EngineOptions::overlap_decode_steps; see Step() in engine.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <optional>

#include "engine/device.h"
#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "engine/sampler.h"

namespace vlmgraph {

using engine_internal::DecodeInputs;
using engine_internal::DecodeInputViews;

std::unique_ptr<Engine::QueuedStep> Engine::QueueDecode(bool carry) {
  const auto dispatch_start = Clock::now();
  Buffers& buf = *buffers_;
  std::vector<Sequence*> fed;
  int64_t rows = 0, context = 0;
  for (auto& s : slots_) {
    if (!s) continue;
    // With `carry`, s->queued steps come before this one; without, none does.
    const int64_t ahead = carry ? s->queued : 0;
    // Ends on its token from the step ahead (max_new_tokens reached or context full). A stop
    // token cannot be foreseen; that row runs once more and is dropped.
    if (ahead > 0 && EndByCount(*s, ahead) != FinishReason::kNone) continue;
    fed.push_back(s.get());
    rows = std::max(rows, s->slot + 1);
    context = std::max(context, s->length + ahead + 1);
  }
  if (fed.empty()) return nullptr;
  // Every row in [0, batch) runs; rows with no sequence get a pad token at position 0 of their
  // own (unused) row.
  const BucketKey exact{Region::kDecode, rows, context, 0};
  const std::optional<BucketKey> key = options_.buckets.PickDecode(rows, context);
  const int64_t batch = key ? key->batch : rows;
  const int half = static_cast<int>(decode_launches_ % 2);
  buf.dec_done[half]->Synchronize();  // the step that last used this half has copied its inputs
  const DecodeInputs host = DecodeInputViews(buf.host_dec_in[half], options_.buckets.max_batch());
  int64_t* tokens_p = host.tokens.data_ptr<int64_t>();
  int64_t* positions_p = host.positions.data_ptr<int64_t>();
  bool* carry_p = host.carry.data_ptr<bool>();
  std::fill(tokens_p, tokens_p + batch, model_->cfg.pad_token_id());
  std::fill(positions_p, positions_p + batch, 0);
  std::fill(carry_p, carry_p + batch, false);
  std::vector<SamplingDraw> draws;  // the sampled rows
  for (Sequence* s : fed) {
    const int64_t ahead = carry ? s->queued : 0;
    tokens_p[s->slot] = s->last_token;  // unused when carried
    positions_p[s->slot] = s->length + ahead;
    carry_p[s->slot] = ahead > 0;
    // This step's token is the sequence's (generated + ahead)-th: each step queued ahead of it
    // gives one before it.
    if (!s->sampling.greedy) draws.push_back({s->slot, &s->sampling, s->generated + ahead});
  }
  // Carried rows read dec_carry, which the step ahead (queued_, the last one queued) wrote: its
  // tokens, in stream order.
  buf.dec_in.copy_(buf.host_dec_in[half], /*non_blocking=*/true);
  if (observer_) observer_->OnBatch(Region::kDecode, static_cast<int64_t>(fed.size()));

  auto step = std::make_unique<QueuedStep>();
  step->half = half;
  step->queued_at = dispatch_start;
  // The inputs are in place for either shape: the bucket's region, or the exact one eagerly.
  DispatchResult r = dispatch_->Run(
      key, exact, [this](const BucketKey& k) { return MakeRegionFn(k); },
      [this, &exact] { return MakeRegionFn(exact)(); });
  step->key = r.key;
  step->kind = r.kind;
  if (step->kind == RunKind::kReplay) {
    // Replays return once launched: everything so far was host-side dispatch.
    std::lock_guard<std::mutex> lock(counters_mu_);
    counters_.decode_dispatch_seconds_total += SecondsSince(dispatch_start);
    counters_.decode_steps++;
  }
  if (step->kind == RunKind::kCaptureAndReplay) graph_pool_bytes_ = runner_->pool_bytes();
  // The region left each row's greedy token in dec_carry; sampled rows are overwritten there
  // (from the logits, the region's output, before any other run), so the next step carries them.
  const at::Tensor tokens = buf.dec_carry.narrow(0, 0, batch);
  if (!draws.empty()) SampleRowsInto(r.outputs[0], draws, tokens);
  QueueLogprobs(fed, r.outputs[0], tokens, step.get());
  buf.host_dec_tokens[half].narrow(0, 0, batch).copy_(tokens, /*non_blocking=*/true);
  buf.dec_done[half]->Record();
  // Counted when queued: a step whose tokens are dropped (see Step()) still ran.
  const int64_t real = static_cast<int64_t>(fed.size());
  CountRun(step->key, step->kind, real, key ? key->batch : real, r.bucketed);
  ++decode_launches_;
  for (Sequence* s : fed) {
    s->queued += 1;
    step->rows.emplace_back(s->id, s->slot);
  }
  return step;
}

void Engine::FinishDecode(QueuedStep& step, std::vector<TokenEvent>* events) {
  Buffers& buf = *buffers_;
  buf.dec_done[step.half]->Synchronize();
  const auto now = Clock::now();
  // The step's own time: from when it was queued, or, when it was queued behind another step,
  // from when that one's tokens arrived.
  const double seconds =
      std::chrono::duration<double>(now - std::max(step.queued_at, last_decode_done_)).count();
  last_decode_done_ = now;
  ObserveTime(step.key, step.kind, seconds);
  const int64_t* tokens = buf.host_dec_tokens[step.half].data_ptr<int64_t>();
  std::vector<TokenLogprob> logprobs;  // one per step.logprob_slots entry
  if (!step.logprob_slots.empty()) {
    std::vector<int64_t> tops;
    for (int64_t slot : step.logprob_slots) {
      const Sequence* s = slots_[static_cast<size_t>(slot)].get();
      tops.push_back(s != nullptr ? s->logprobs.top : 0);
    }
    logprobs = ToTokenLogprobs(step.logprobs, tops);
  }
  size_t next_logprob = 0;  // logprob_slots are in the order of step.rows
  for (const auto& [id, slot] : step.rows) {
    const bool has_logprob =
        next_logprob < step.logprob_slots.size() && step.logprob_slots[next_logprob] == slot;
    const size_t logprob_index = next_logprob;
    if (has_logprob) ++next_logprob;
    Sequence* s = slots_[static_cast<size_t>(slot)].get();
    if (s == nullptr || s->id != id) continue;  // cancelled or ended since the step was queued
    s->queued -= 1;
    s->length += 1;  // the fed token is now in the cache
    Emit(*s, tokens[slot], events);
    if (has_logprob) events->back().logprob = std::move(logprobs[logprob_index]);
  }
}

void Engine::Step(std::vector<TokenEvent>* events) {
  if (ActiveSequences() == 0) return;
  at::NoGradGuard no_grad;
  auto drop_queued = [this] {
    queued_.reset();
    for (auto& s : slots_) {
      if (s) s->queued = 0;
    }
  };
  try {
    // A queued step that feeds no active sequence (all cancelled or ended since) returns nothing.
    if (queued_) {
      bool live = false;
      for (const auto& [id, slot] : queued_->rows) {
        const Sequence* s = slots_[static_cast<size_t>(slot)].get();
        live = live || (s != nullptr && s->id == id);
      }
      if (!live) drop_queued();
    }
    if (!queued_) queued_ = QueueDecode(/*carry=*/false);
    if (!queued_) return;  // not reached: an active sequence always has a token left
    std::unique_ptr<QueuedStep> next = overlap_decode_ ? QueueDecode(/*carry=*/true) : nullptr;
    std::unique_ptr<QueuedStep> current = std::move(queued_);
    queued_ = std::move(next);
    FinishDecode(*current, events);
  } catch (...) {
    drop_queued();
    throw;
  }
}

}  // namespace vlmgraph
