// engine/continuous_batching.cc: the Engine's continuous batching: slots and KV pages (Note [KV
// pages per sequence], engine.h), admission, a sequence's tokens and its end, Generate.
#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <string>

#include "base/log.h"
#include "engine/device.h"
#include "engine/engine.h"
#include "engine/engine_internal.h"

namespace vlmgraph {

// ---------------------------------------------------------------------------------------------
// Continuous batching.

int64_t Engine::FreeSlots() const { return std::count(slots_.begin(), slots_.end(), nullptr); }

int64_t Engine::ActiveSequences() const {
  return static_cast<int64_t>(slots_.size()) - FreeSlots();
}

int64_t Engine::FreeKvPages() const { return kv_pages_.free_pages(); }

int64_t Engine::KvPagesFor(const ValidatedRequest& request) const {
  return KvPagesForRequest(request.get());
}

int64_t Engine::KvPagesForRequest(const GenerateRequest& r) const {
  const int64_t tokens = std::min<int64_t>(
      static_cast<int64_t>(r.input_ids.size()) + r.sampling.max_new_tokens, max_context());
  return vlmgraph::KvPagesFor(tokens, buffers_->cache.page_size());
}

int64_t Engine::AdmissibleCount(const std::vector<const ValidatedRequest*>& requests) const {
  int64_t slots = FreeSlots(), pages = FreeKvPages(), n = 0;
  for (const ValidatedRequest* r : requests) {
    const int64_t need = KvPagesFor(*r);
    if (n == slots || need > pages) break;
    pages -= need;
    ++n;
  }
  return n;
}

void Engine::Emit(Sequence& seq, int64_t token, std::vector<TokenEvent>* events) {
  seq.generated++;
  seq.last_token = token;
  TokenEvent ev{seq.id, token, false, FinishReason::kNone};
  const auto& stops = seq.sampling.stop_token_ids;
  ev.reason = std::find(stops.begin(), stops.end(), token) != stops.end() ? FinishReason::kStopToken
                                                                          : EndByCount(seq, 0);
  ev.finished = ev.reason != FinishReason::kNone;
  events->push_back(ev);
  if (ev.finished) Free(seq.slot);
}

FinishReason Engine::EndByCount(const Sequence& seq, int64_t ahead) const {
  if (seq.generated + ahead >= seq.sampling.max_new_tokens) return FinishReason::kLength;
  if (seq.length + ahead + 1 > max_context()) return FinishReason::kContextFull;
  return FinishReason::kNone;
}

void Engine::Free(int64_t slot) {
  std::unique_ptr<Sequence>& s = slots_[static_cast<size_t>(slot)];
  if (!s) return;
  if (!s->pages.empty()) {
    // Stream-ordered after every step already queued (an overlapped step may still write this
    // row's last position), before any later step runs the row as padding or a new owner's.
    try {
      buffers_->cache.page_table.select(0, slot).zero_();
    } catch (const std::exception& e) {
      // Only a failed device refuses a fill; it fails the next step too, and nothing runs on it.
      LogError(std::string("freeing KV pages: ") + e.what());
    }
    kv_pages_.Give(s->pages);
    kv_pages_used_ = kv_pages_.used_pages();
  }
  s.reset();
}

std::vector<SequenceId> Engine::Admit(std::vector<ValidatedRequest> validated,
                                      std::vector<TokenEvent>* events) {
  std::vector<GenerateRequest> requests;
  requests.reserve(validated.size());
  for (auto& v : validated) requests.push_back(std::move(v.request_));
  if (static_cast<int64_t>(requests.size()) > FreeSlots()) {
    throw EngineError(EngineError::Code::kResourceExhausted,
                      "admitting " + std::to_string(requests.size()) + " sequences but only " +
                          std::to_string(FreeSlots()) + " KV cache slots are free");
  }
  std::vector<int64_t> need;
  int64_t need_total = 0;
  for (const auto& r : requests) {
    need.push_back(KvPagesForRequest(r));
    need_total += need.back();
  }
  if (need_total > FreeKvPages()) {
    throw EngineError(EngineError::Code::kResourceExhausted,
                      "admitting " + std::to_string(requests.size()) + " sequences takes " +
                          std::to_string(need_total) + " KV pages but only " +
                          std::to_string(FreeKvPages()) + " are free");
  }
  at::NoGradGuard no_grad;
  std::vector<Sequence*> seqs;
  std::vector<SequenceId> ids;
  try {
    // Each sequence's pages into its slot's page-table row: one copy for the group, queued
    // before its prefill (Note [KV pages per sequence]).
    KVCache& cache = buffers_->cache;
    at::Tensor rows =
        at::zeros({static_cast<int64_t>(requests.size()), cache.pages_per_row()}, at::kInt);
    std::vector<int64_t> row_slots;
    for (size_t k = 0; k < requests.size(); ++k) {
      const auto& r = requests[k];
      size_t slot = 0;
      while (slots_[slot]) ++slot;  // lowest free row keeps decode batches small
      auto seq = std::make_unique<Sequence>();
      seq->id = next_id_++;
      seq->slot = static_cast<int64_t>(slot);
      seq->length = static_cast<int64_t>(r.input_ids.size());
      seq->sampling = r.sampling;
      seq->logprobs = r.logprobs;
      seq->pages = kv_pages_.Take(need[k]);
      kv_pages_used_ = kv_pages_.used_pages();
      std::copy(seq->pages.begin(), seq->pages.end(),
                rows.data_ptr<int32_t>() + static_cast<int64_t>(k) * cache.pages_per_row());
      row_slots.push_back(seq->slot);
      seqs.push_back(seq.get());
      ids.push_back(seq->id);
      slots_[slot] = std::move(seq);
    }
    // As FillPrefill's inputs: queued without waiting for the decode step in flight.
    cache.page_table.index_copy_(
        0, at::tensor(row_slots, at::kLong).to(options_.device, /*non_blocking=*/true),
        rows.to(options_.device, /*non_blocking=*/true));
    // Group consecutive requests into prefill batches of at most max_prefill() rows whose prompts
    // fit the largest seq bucket. A longer prompt goes alone: no bucket fits it, so Prefill runs it
    // at its exact length, eagerly.
    const auto& b = options_.buckets;
    auto fits = [&](size_t k) {
      return static_cast<int64_t>(requests[k].input_ids.size()) <= b.max_seq();
    };
    size_t i = 0;
    while (i < requests.size()) {
      std::vector<const GenerateRequest*> group;
      std::vector<Sequence*> group_seqs;
      std::vector<int64_t> group_slots;
      const bool alone = !fits(i);
      do {
        group.push_back(&requests[i]);
        group_seqs.push_back(seqs[i]);
        group_slots.push_back(seqs[i]->slot);
        ++i;
      } while (!alone && i < requests.size() &&
               static_cast<int64_t>(group.size()) < b.max_prefill() && fits(i));
      const DispatchResult r = Prefill(group, group_slots, [&] {
        const at::Tensor slots = at::tensor(group_slots, at::kLong).to(options_.device);
        return PrefillExact(ToExactPrompts(group), slots, /*write_cache=*/true);
      });
      std::vector<int64_t> tokens = SampleRows(r.outputs[0], group_seqs);
      const size_t first_event = events->size();
      for (size_t k = 0; k < group_seqs.size(); ++k) Emit(*group_seqs[k], tokens[k], events);
      AttachPrefillLogprobs(group, r, tokens, events->data() + first_event);
    }
  } catch (...) {
    // No caller will own these sequences: give their slots and KV pages back.
    for (SequenceId id : ids) Cancel(id);
    throw;
  }
  return ids;
}

void Engine::CancelAll() {
  for (size_t slot = 0; slot < slots_.size(); ++slot) Free(static_cast<int64_t>(slot));
  queued_.reset();
}

std::string Engine::DeviceFault() const { return vlmgraph::DeviceFault(options_.device); }

void Engine::Cancel(SequenceId id) {
  for (const auto& s : slots_) {
    if (s && s->id == id) return Free(s->slot);
  }
}

std::vector<std::vector<int64_t>> Engine::Generate(std::vector<GenerateRequest> unchecked) {
  std::vector<ValidatedRequest> requests;
  requests.reserve(unchecked.size());
  for (auto& r : unchecked) requests.push_back(Validate(std::move(r)));
  std::vector<std::vector<int64_t>> out(requests.size());
  std::map<SequenceId, size_t> owner;
  size_t next = 0;
  std::vector<TokenEvent> events;
  while (next < requests.size() || ActiveSequences() > 0) {
    std::vector<const ValidatedRequest*> waiting;
    for (size_t k = next; k < requests.size(); ++k) waiting.push_back(&requests[k]);
    const int64_t free = AdmissibleCount(waiting);
    if (next < requests.size() && free > 0) {
      const size_t n = static_cast<size_t>(free);
      std::vector<ValidatedRequest> batch(requests.begin() + next, requests.begin() + next + n);
      std::vector<SequenceId> ids = Admit(std::move(batch), &events);
      for (size_t k = 0; k < ids.size(); ++k) owner[ids[k]] = next + k;
      next += n;
    } else {
      Step(&events);
    }
    for (const auto& ev : events) out[owner.at(ev.id)].push_back(ev.token);
    events.clear();
  }
  return out;
}

}  // namespace vlmgraph
