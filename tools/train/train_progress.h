// tools/train/train_progress.h: what vlmgraph-train's rank 0 reports of a step, as a terminal line,
// a progress bar and a metrics record (tools/train/metrics_log.h). Pure formatting: values in,
// text or JSON out.
//
//   StepReport s;  s.step = 120;  s.total_steps = 1000;  s.loss = 1.23;  ...
//   std::cout << ProgressLine(s) << "\n";
//   // step 120/1000 loss 1.230000 lr language=5e-05,projector=0.00512 grad_norm 0.8123
//   //   tokens/s 51234 step_s 0.161 eta 12m03s
//   metrics.Write(MetricsRecord(s));
//
// Thread rules: pure functions.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/bucket.h"
#include "engine/evaluator.h"
#include "engine/learning_rates.h"
#include "model/config.h"

namespace vlmgraph::train {

struct StepReport {
  int64_t step = 0, total_steps = 0;
  double loss = 0;
  double grad_norm = 0;  // before clipping; NaN / inf for a skipped step
  bool skipped = false;
  // The rate each part took this step, and which parts train (configured rate > 0): only those
  // are reported.
  LearningRates learning_rates;
  LearningRates configured_rates;
  double tokens_per_second = 0;  // real (unpadded) tokens of the step over all ranks / step_seconds
  double step_seconds = 0;       // wall time of the step, waiting for its examples included
  double eta_seconds = 0;
  double elapsed_seconds = 0;  // since the job (or its resume) started
  double unix_time_seconds = 0;
  int64_t examples_seen = 0;   // the data order's position after the step (global)
  double epoch = 0;            // examples_seen / training examples
  std::optional<double> mfu;   // model FLOPs utilisation, 0..1; unset when no peak is known
  std::optional<EvalLoss> eval;  // the validation loss after this step, when evaluated
};

// "language=5e-05,projector=0.00512": each trained part's rate, in the order language, vision,
// projector; "0" when no part trains.
std::string LearningRateText(const LearningRates& rates, const LearningRates& configured);

// The line printed per train.log_every steps when stdout is not a terminal.
std::string ProgressLine(const StepReport& s);
// The terminal's bar ("\r[####....] 120/1000 loss 1.2345 lr 5.0e-05 51234 tok/s ETA 12m03s").
std::string ProgressBar(const StepReport& s);
// "eval step 120/1000 eval_loss 1.234567 (64 examples, 5123 tokens, 0.84 s)".
std::string EvalLine(int64_t step, int64_t total_steps, const EvalLoss& eval);

// The metrics file's record of a step (docs/training.md, "Metrics file").
nlohmann::json MetricsRecord(const StepReport& s);
// The record of an evaluation with no step of its own (step 0, before training).
nlohmann::json EvalRecord(int64_t step, double unix_time_seconds, const EvalLoss& eval);

// Model FLOPs of one rank's step (model/flops.h, PaLM's formula): each micro-batch's bucket
// (batch x seq, padding counted) plus `tiles` image tiles in all. 0 for an empty list.
double StepFlops(const VlmConfig& cfg, const std::vector<BucketKey>& micro_batches, int64_t tiles);

// "12m03s", "1h05m"; "?" for a negative or non-finite time.
std::string Duration(double seconds);

}  // namespace vlmgraph::train
