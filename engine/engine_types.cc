#include "engine/engine_types.h"

namespace vlmgraph {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStopToken:
      return "stop_token";
    case FinishReason::kContextFull:
      return "context_full";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

int64_t EngineCounters::TotalCaptures() const {
  int64_t n = 0;
  for (const auto& [k, v] : captures) n += v;
  return n;
}

int64_t EngineCounters::TotalReplays() const {
  int64_t n = 0;
  for (const auto& [k, v] : replays) n += v;
  return n;
}

}  // namespace vlmgraph
