#include "tools/train/train_progress.h"

#include <cmath>
#include <cstdio>

#include "model/flops.h"

namespace vlmgraph::train {
namespace {

// The parts in the order they are reported: the language model first (it trains in most jobs).
constexpr std::pair<const char*, double LearningRates::*> kReportOrder[] = {
    {"language", &LearningRates::language},
    {"vision", &LearningRates::vision},
    {"projector", &LearningRates::projector}};

std::string Number(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4g", v);
  return text;
}

}  // namespace

std::string LearningRateText(const LearningRates& rates, const LearningRates& configured) {
  std::string out;
  for (const auto& [name, field] : kReportOrder) {
    if (configured.*field <= 0) continue;
    out += (out.empty() ? "" : ",") + std::string(name) + "=" + Number(rates.*field);
  }
  return out.empty() ? "0" : out;
}

std::string ProgressLine(const StepReport& s) {
  char line[512];
  std::snprintf(line, sizeof(line),
                "step %lld/%lld loss %.6f lr %s grad_norm %.4g tokens/s %.0f step_s %.3f eta %s%s",
                static_cast<long long>(s.step), static_cast<long long>(s.total_steps), s.loss,
                LearningRateText(s.learning_rates, s.configured_rates).c_str(), s.grad_norm,
                s.tokens_per_second, s.step_seconds, Duration(s.eta_seconds).c_str(),
                s.skipped ? " skipped" : "");
  return line;
}

std::string ProgressBar(const StepReport& s) {
  const int width = 24;
  const int filled =
      s.total_steps > 0 ? static_cast<int>(width * s.step / s.total_steps) : width;
  // The first trained part's rate: the schedule's shape, whichever part it is.
  double lr = 0;
  for (const auto& [name, field] : kReportOrder) {
    if (s.configured_rates.*field > 0) {
      lr = s.learning_rates.*field;
      break;
    }
  }
  char line[256];
  std::snprintf(line, sizeof(line), "\r[%s%s] %lld/%lld loss %.4f lr %.2e  %.0f tok/s  ETA %s   ",
                std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                static_cast<long long>(s.step), static_cast<long long>(s.total_steps), s.loss, lr,
                s.tokens_per_second, Duration(s.eta_seconds).c_str());
  return line;
}

std::string EvalLine(int64_t step, int64_t total_steps, const EvalLoss& eval) {
  char line[256];
  std::snprintf(line, sizeof(line),
                "eval step %lld/%lld eval_loss %.6f (%lld examples, %lld tokens, %.2f s)",
                static_cast<long long>(step), static_cast<long long>(total_steps), eval.loss,
                static_cast<long long>(eval.examples), static_cast<long long>(eval.target_tokens),
                eval.seconds);
  return line;
}

nlohmann::json MetricsRecord(const StepReport& s) {
  nlohmann::json rates = nlohmann::json::object();
  for (const auto& [name, field] : kReportOrder) {
    if (s.configured_rates.*field > 0) rates[name] = s.learning_rates.*field;
  }
  nlohmann::json j = {{"step", s.step},
                      {"time", s.unix_time_seconds},
                      {"epoch", s.epoch},
                      {"examples", s.examples_seen},
                      {"loss", s.loss},
                      {"learning_rate", rates},
                      {"grad_norm", s.grad_norm},
                      {"tokens_per_second", s.tokens_per_second},
                      {"step_seconds", s.step_seconds},
                      {"elapsed_seconds", s.elapsed_seconds}};
  if (s.skipped) j["skipped"] = true;
  if (s.mfu) j["mfu"] = *s.mfu;
  if (s.eval) {
    j["eval_loss"] = s.eval->loss;
    j["eval_tokens"] = s.eval->target_tokens;
    j["eval_examples"] = s.eval->examples;
    j["eval_seconds"] = s.eval->seconds;
  }
  return j;
}

nlohmann::json EvalRecord(int64_t step, double unix_time_seconds, const EvalLoss& eval) {
  return {{"step", step},
          {"time", unix_time_seconds},
          {"eval_loss", eval.loss},
          {"eval_tokens", eval.target_tokens},
          {"eval_examples", eval.examples},
          {"eval_seconds", eval.seconds}};
}

double StepFlops(const VlmConfig& cfg, const std::vector<BucketKey>& micro_batches,
                 int64_t tiles) {
  double flops = 0;
  for (const BucketKey& key : micro_batches) {
    if (key.batch > 0 && key.seq > 0) flops += TrainFlopsPerStep(cfg, key.batch, key.seq, 0).total();
  }
  if (flops > 0 && tiles > 0) {  // the towers' part grows with the tiles alone
    flops += TrainFlopsPerStep(cfg, 1, 1, tiles).total() - TrainFlopsPerStep(cfg, 1, 1, 0).total();
  }
  return flops;
}

std::string Duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof(text), "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  } else {
    std::snprintf(text, sizeof(text), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  }
  return text;
}

}  // namespace vlmgraph::train
