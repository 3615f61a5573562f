#include "server/generation.h"

#include <exception>

#include "server/status.h"

namespace vlmgraph::server {
namespace {

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Cancels the stream's sequence unless it finished: covers every early exit.
class CancelUnlessDone {
 public:
  CancelUnlessDone(Scheduler* scheduler, std::shared_ptr<GenerationStream> stream)
      : scheduler_(scheduler), stream_(std::move(stream)) {}
  ~CancelUnlessDone() {
    if (!done_) scheduler_->Cancel(stream_);
  }
  void set_done() { done_ = true; }

 private:
  Scheduler* scheduler_;
  std::shared_ptr<GenerationStream> stream_;
  bool done_ = false;
};

}  // namespace

GenerationOutcome RunGeneration(Scheduler& scheduler, Metrics* metrics, ValidatedRequest request,
                                Clock::time_point accepted, TextStream* text,
                                const std::function<bool(const GenerationDelta&)>& write,
                                const std::function<bool()>& is_cancelled) {
  auto stream = scheduler.SubmitGenerate(std::move(request), accepted);
  CancelUnlessDone guard(&scheduler, stream);

  GenerationOutcome out;
  Clock::time_point last_write = accepted;
  auto send = [&](GenerationDelta& delta) {
    if (!write(delta))
      throw ServerError(grpc::StatusCode::CANCELLED, "client went away mid-stream");
    const auto now = Clock::now();
    const int64_t k = static_cast<int64_t>(delta.token_ids.size());
    if (k == 0) return;
    if (out.generated_tokens == 0) {
      out.time_to_first_token_seconds = std::chrono::duration<double>(now - accepted).count();
      if (metrics) {
        metrics->ObserveTimeToFirstToken(out.time_to_first_token_seconds);
        for (int64_t i = 1; i < k; ++i) metrics->ObserveInterTokenLatency(0);
      }
    } else if (metrics) {
      const double gap =
          std::chrono::duration<double>(now - last_write).count() / static_cast<double>(k);
      for (int64_t i = 0; i < k; ++i) metrics->ObserveInterTokenLatency(gap);
    }
    last_write = now;
    out.generated_tokens += k;
    if (metrics) metrics->AddGeneratedTokens(k);
  };

  while (true) {
    GenerationStream::Update u = stream->Wait(kGenerationPollInterval);
    if (is_cancelled()) throw ServerError(grpc::StatusCode::CANCELLED, "cancelled by the client");
    if (!u.tokens.empty()) {
      GenerationDelta delta;
      for (int64_t t : u.tokens) {
        delta.token_ids.push_back(t);
        if (!text) continue;
        TextStream::Delta d = text->Push(t);
        delta.text += d.text;
        if (d.stopped) {
          // A stop string matched: this token ends the generation; the engine's sequence is
          // cancelled by the guard's early exit below (set_done is not called for it).
          out.stop_string_matched = true;
          break;
        }
      }
      send(delta);
      if (out.stop_string_matched) {
        out.reason = FinishReason::kStopToken;
        break;  // the guard cancels the sequence
      }
    }
    if (u.error) std::rethrow_exception(u.error);
    if (u.done) {
      out.reason = u.reason;
      guard.set_done();
      if (text) {
        GenerationDelta last;
        last.text = text->Finish();
        if (!last.text.empty()) send(last);
      }
      break;
    }
  }
  out.queue_seconds = stream->queue_seconds();
  out.total_seconds = SecondsSince(accepted);
  return out;
}

}  // namespace vlmgraph::server
