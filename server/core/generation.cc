#include "server/core/generation.h"

#include <exception>

namespace vlmgraph::server {

GenerationSession::GenerationSession(EngineRouter& router, Metrics* metrics,
                                     ValidatedRequest request, Clock::time_point accepted,
                                     TextStream* text, std::function<void()> on_update)
    : metrics_(metrics),
      text_(text),
      accepted_(accepted),
      stream_(router.SubmitGenerate(std::move(request), accepted, &scheduler_)),
      last_delta_(accepted) {
  if (on_update) stream_->SetListener(std::move(on_update));
}

GenerationSession::~GenerationSession() {
  stream_->SetListener(nullptr);
  if (!engine_done_) scheduler_->Cancel(stream_);
}

void GenerationSession::Cancel() { scheduler_->Cancel(stream_); }

void GenerationSession::Record(const GenerationDelta& delta) {
  const auto now = Clock::now();
  const int64_t k = static_cast<int64_t>(delta.token_ids.size());
  if (k == 0) return;
  if (out_.generated_tokens == 0) {
    out_.time_to_first_token_seconds = std::chrono::duration<double>(now - accepted_).count();
    if (metrics_) {
      metrics_->ObserveTimeToFirstToken(out_.time_to_first_token_seconds);
      for (int64_t i = 1; i < k; ++i) metrics_->ObserveInterTokenLatency(0);
    }
  } else if (metrics_) {
    const double gap =
        std::chrono::duration<double>(now - last_delta_).count() / static_cast<double>(k);
    for (int64_t i = 0; i < k; ++i) metrics_->ObserveInterTokenLatency(gap);
  }
  last_delta_ = now;
  out_.generated_tokens += k;
  if (metrics_) metrics_->AddGeneratedTokens(k);
}

GenerationSession::Taken GenerationSession::Take(std::chrono::milliseconds timeout) {
  Taken taken;
  if (finished_) {
    taken.finished = true;
    taken.outcome = out_;
    return taken;
  }
  GenerationStream::Update u = stream_->Wait(timeout);
  if (!u.tokens.empty()) {
    GenerationDelta delta;
    delta.prompt_logprobs = std::move(u.prompt_logprobs);
    for (size_t i = 0; i < u.tokens.size(); ++i) {
      const int64_t t = u.tokens[i];
      delta.token_ids.push_back(t);
      if (i < u.logprobs.size()) delta.logprobs.push_back(std::move(u.logprobs[i]));
      if (!text_) continue;
      TextStream::Delta d = text_->Push(t);
      delta.text += d.text;
      if (d.stopped) {
        // A stop string matched: this token ends the generation; the engine's sequence is
        // cancelled (the engine has not ended it).
        out_.stop_string_matched = true;
        break;
      }
    }
    Record(delta);
    taken.deltas.push_back(std::move(delta));
    if (out_.stop_string_matched) {
      out_.reason = FinishReason::kStopToken;
      scheduler_->Cancel(stream_);
      engine_done_ = true;  // cancelled just now
      u.done = true;
      u.error = nullptr;
    }
  }
  if (u.error) {
    engine_done_ = true;  // the scheduler ended it (failed or cancelled)
    finished_ = true;
    taken.finished = true;
    taken.error = u.error;
    return taken;
  }
  if (u.done) {
    engine_done_ = true;
    if (!out_.stop_string_matched) {
      out_.reason = u.reason;
      if (text_) {
        GenerationDelta last;
        last.text = text_->Finish();
        if (!last.text.empty()) taken.deltas.push_back(std::move(last));
      }
    }
    out_.queue_seconds = stream_->queue_seconds();
    out_.total_seconds = SecondsSince(accepted_);
    finished_ = true;
    taken.finished = true;
    taken.outcome = out_;
  }
  return taken;
}

}  // namespace vlmgraph::server
