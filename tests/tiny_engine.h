// tests/tiny_engine.h: the engine the server's request tests validate against: nanovlm-tiny with
// random weights on the CPU, longest context 32 tokens, max_new_tokens_limit 100 (what
// ToEngineOptions gives from limits.max_new_tokens: the suites' TestLimits() use 100). Built once
// per test binary; Validate is safe from any thread.
#pragma once

#include <memory>

#include "engine/engine.h"
#include "model/config.h"
#include "model/vision_language_model.h"

namespace vlmgraph::testing {

inline const Engine& TinyServingEngine() {
  static const std::unique_ptr<Engine> engine = [] {
    EngineOptions o;
    o.buckets.batch_sizes = {1};
    o.buckets.seq_lens = {16};
    o.buckets.context_lens = {32};
    o.buckets.tile_counts = {1};
    o.buckets.train_batch_sizes = {1};
    o.buckets.train_seq_lens = {16};
    o.log_captures = false;
    o.max_new_tokens_limit = 100;
    return std::make_unique<Engine>(VisionLanguageModel(VlmConfig::Preset("nanovlm-tiny")), o);
  }();
  return *engine;
}

}  // namespace vlmgraph::testing
