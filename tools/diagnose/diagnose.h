// tools/diagnose/diagnose.h: the measurements behind `vlmgraph-diagnose`: do CUDA graphs pay off
// for this model, these buckets and this device? Every section runs unless switched off (people
// forget opt-in flags), and no figure compares a first step with an average.
//
//   DiagnoseOptions opt;                              // all sections on
//   nlohmann::json report = RunDiagnostics(make_engine, make_trainer, opt);
//   std::cout << FormatDiagnostics(report);           // one table per section
//
// Sections of the JSON report:
//   environment   device, dtype, whether graphs are available, model size
//   baseline      per region and bucket: median step time eager vs graphed over a warmed run, peak
//                 device memory, speedup (graph columns null where graphs are unavailable)
//   sweeps        vary-batch and vary-sequence runs through shapes on and between buckets:
//                 captures after warm-up (must be 0), eager fallbacks, padding waste
//   capture       per bucket capture time and graph-pool growth; whole-region vs per-block
//   dispatch      host time per decode step to pick the bucket, copy inputs and launch the replay
//   bucket_advice padding waste and capture memory of the current and of a suggested seq bucket set
//                 for a request-shape sample (a log, or a synthetic distribution)
// Thread rules: call from the thread that may drive engines (it builds and drives them).
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/trainer.h"

namespace vlmgraph {

struct DiagnoseOptions {
  bool baseline = true, sweeps = true, capture = true, dispatch = true, advice = true,
       training = true;
  bool quick = false;                   // fewer buckets, shapes and iterations (CI)
  int iters = 20;                       // timed runs per figure (median)
  int warmup = 3;                       // untimed runs first
  std::vector<int64_t> prompt_lengths;  // request-shape sample for bucket advice; empty = synthetic
  std::string shapes_source = "synthetic lognormal";
};

using EngineByGraphs = std::function<std::unique_ptr<Engine>(bool graphs)>;
using TrainerByGraphs = std::function<std::unique_ptr<Trainer>(bool graphs)>;

// `make_engine(graphs)` builds a fresh engine from the deployment's model and config, with or
// without graphs; `make_trainer` likewise (may be empty: no training rows).
nlohmann::json RunDiagnostics(const EngineByGraphs& make_engine,
                              const TrainerByGraphs& make_trainer, const DiagnoseOptions& options);

// Human-readable tables of a RunDiagnostics report.
std::string FormatDiagnostics(const nlohmann::json& report);

// Padded tokens / real tokens when each length pads to the smallest bucket >= it (lengths above
// the largest bucket count as unpadded and are reported separately by callers).
double PaddingWaste(const std::vector<int64_t>& lengths, const std::vector<int64_t>& buckets);

// The k bucket sizes minimising total padded tokens for `lengths` (exact dynamic programme over the
// distinct lengths; the largest bucket is the largest length). Sorted ascending.
std::vector<int64_t> SuggestBuckets(std::vector<int64_t> lengths, int k);

}  // namespace vlmgraph
