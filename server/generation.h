// server/generation.h: one accepted generation request, from submission to its last token, for
// every API (gRPC Generate, OpenAI chat and text completions). The transports differ only in how
// they write a delta.
//
//   GenerationOutcome r = RunGeneration(
//       scheduler, metrics, std::move(request), accepted, text_stream.get(),   // text: optional
//       [&](const GenerationDelta& d) { return writer->Write(ToProto(d)); },   // false: gone
//       [&] { return context->IsCancelled(); });
//
// The request is validated (Engine::Validate makes a ValidatedRequest). Deltas come in order; each
// carries the new token ids and, with a TextStream, their new text (stop strings already applied:
// the text ends before a stop string, and the generation is cancelled in the engine when one
// matches). Records time to first token, inter-token latency and generated tokens in `metrics`.
//
// Errors: ServerError CANCELLED when `is_cancelled` turns true or `write` returns false (the
// sequence is cancelled in the engine first); what the scheduler throws (RESOURCE_EXHAUSTED,
// UNAVAILABLE) and what the engine reported for the request. Thread rules: call from the
// request's own thread (an RPC or HTTP handler); it blocks until the generation ends.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/engine_types.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/text_stream.h"

namespace vlmgraph::server {

struct GenerationDelta {
  std::vector<int64_t> token_ids;  // new since the previous delta; empty only in the last delta,
                                   // which carries text held back until the end
  std::string text;                // their text (empty without a TextStream, or held back)
};

struct GenerationOutcome {
  // kLength (max_new_tokens), kStopToken (a stop token, or a stop string when
  // stop_string_matched), kContextFull.
  FinishReason reason = FinishReason::kNone;
  bool stop_string_matched = false;
  int64_t generated_tokens = 0;
  double queue_seconds = 0;                // acceptance -> prefill start
  double time_to_first_token_seconds = 0;  // acceptance -> first delta written
  double total_seconds = 0;                // acceptance -> end
};

// How often a waiting request checks `is_cancelled`.
inline constexpr std::chrono::milliseconds kGenerationPollInterval{50};

GenerationOutcome RunGeneration(Scheduler& scheduler, Metrics* metrics, ValidatedRequest request,
                                Clock::time_point accepted, TextStream* text,
                                const std::function<bool(const GenerationDelta&)>& write,
                                const std::function<bool()>& is_cancelled);

}  // namespace vlmgraph::server
