// tools/train/metrics_log.h: vlmgraph-train's metrics file, one JSON object per line (JSON Lines),
// for plotting (scripts/train_plot.py draws it to PNG and converts it to TensorBoard events).
//
//   MetricsLog log = MetricsLog::Open("runs/run1/metrics.jsonl", /*start_step=*/0);
//   log.Write({{"step", 1}, {"loss", 2.31}, {"learning_rate", {{"language", 5e-5}}}});
//
// Each Write appends one line and flushes it to the operating system, so a reader (train_plot.py
// --follow, `tail -f`) sees every step as soon as it is written, and a job that is killed loses at
// most the line being written. Open keeps the lines of the steps up to `start_step` and drops
// the rest (TensorBoard's purge_step): a resumed job appends after its checkpoint's step, and the
// steps a killed job logged after its last save, which the resumed job takes again, are not
// logged twice; a fresh job (start_step 0) starts the file anew. A line that is not a JSON object
// with an integer "step" (a torn last line) is dropped too. The parent directory is made if
// missing.
//
// Records (written by tools/train/train_run.cc; docs/training.md, "Metrics file"): "step",
// "time" (Unix seconds), "loss", "learning_rate" ({part: rate} of the trained parts),
// "grad_norm", "tokens_per_second", "mfu" (when known), "eval_loss" (when evaluated), ...
// Non-finite numbers are written as null (JSON has no NaN).
//
// Thread rules: one thread. Errors: std::runtime_error naming the file and the system's reason,
// from Open and Write.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace vlmgraph::train {

class MetricsLog {
 public:
  static MetricsLog Open(const std::string& path, int64_t start_step);
  MetricsLog(MetricsLog&&) = default;
  MetricsLog& operator=(MetricsLog&&) = default;

  // Appends `record` as one line and flushes it.
  void Write(const nlohmann::json& record);
  const std::string& path() const { return path_; }
  // Lines kept from an earlier run (steps <= start_step).
  int64_t kept_lines() const { return kept_lines_; }

 private:
  MetricsLog() = default;
  struct Close {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::string path_;
  std::unique_ptr<std::FILE, Close> file_;
  int64_t kept_lines_ = 0;
};

}  // namespace vlmgraph::train
