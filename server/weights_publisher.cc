#include "server/weights_publisher.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>

#include "base/log.h"
#include "server/status.h"

namespace vlmgraph::server {
namespace {

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string Number(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4g", v);
  return text;
}

// Copies each (name, source) into the served tensor of that name, in place.
void CopyInto(Engine& engine, const NamedWeights& weights) {
  at::NoGradGuard no_grad;
  auto served = engine.model()->named_parameters();
  for (const auto& [name, source] : weights) {
    if (at::Tensor* dst = served.find(name)) dst->copy_(source);
  }
}

}  // namespace

WeightsPublisher::WeightsPublisher(Scheduler* scheduler, const PublishGate* gate, Metrics* metrics,
                                   int64_t served_engines)
    : scheduler_(scheduler), gate_(gate), metrics_(metrics), served_engines_(served_engines) {}

PublishReport WeightsPublisher::Publish(Engine& engine, const NamedWeights& candidate) {
  if (served_engines_ > 1) {
    throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                      "cannot publish: this server serves on " + std::to_string(served_engines_) +
                          " engines (data_parallel_size) and a publish changes the first one "
                          "only, so its engines would serve different weights; the served "
                          "weights are unchanged. Save a checkpoint and serve it, or publish on a "
                          "server with data_parallel_size 1");
  }
  at::NoGradGuard no_grad;
  auto refuse = [&](const std::string& reason, const std::string& message) {
    if (metrics_) metrics_->AddTrainPublishRefused(reason);
    return ServerError(grpc::StatusCode::FAILED_PRECONDITION, message);
  };
  PublishReport report;
  for (const auto& [name, weight] : candidate) {
    if (!at::isfinite(weight).all().item<bool>()) {
      throw refuse("non_finite_weights",
                   "cannot publish the job's weights: " + name +
                       " has NaN or infinite values; the served weights are unchanged (lower the "
                       "learning rate or weight decay and start a new job)");
    }
    if (weight.numel() > 0) {
      report.max_abs_weight = std::max(report.max_abs_weight, weight.abs().max().item<double>());
    }
  }

  // The served tensors the candidate replaces, kept on the host.
  NamedWeights kept;
  auto served = engine.model()->named_parameters();
  for (const auto& [name, weight] : candidate) {
    const at::Tensor* dst = served.find(name);
    if (dst == nullptr) continue;
    at::Tensor host = at::empty(dst->sizes(), dst->options().device(at::kCPU));
    host.copy_(*dst);
    kept.emplace_back(name, std::move(host));
  }
  report.tensors = static_cast<int64_t>(kept.size());

  const bool gated = gate_ != nullptr && gate_->options().enabled;
  report.gated = gated;
  if (gated) report.served = gate_->Score(engine);
  CopyInto(engine, candidate);
  GateVerdict verdict;
  try {
    if (gated) {
      report.candidate = gate_->Score(engine);
      verdict = gate_->Judge(report.served, report.candidate, report.max_abs_weight);
    }
  } catch (...) {
    CopyInto(engine, kept);  // an engine error while scoring: serve what was served
    throw;
  }
  if (!verdict.accepted()) {
    CopyInto(engine, kept);
    throw refuse(verdict.reason,
                 "publish refused by the publish gate (train.publish_gate): " + verdict.message +
                     ". The served weights are unchanged; lower the learning rates or weight "
                     "decay, train fewer steps, or check the data (docs/security.md)");
  }
  previous_ = std::move(kept);
  can_rollback_ = true;
  if (metrics_) metrics_->AddTrainPublish();
  if (gated) {
    LogInfo("publish gate accepted the job's weights: held-out loss " + Number(report.served.loss) +
            " -> " + Number(report.candidate.loss) + " nats/token, largest |weight| " +
            Number(report.max_abs_weight));
  }
  return report;
}

RollbackReport WeightsPublisher::RollbackOnGpuThread(Engine& engine) {
  if (previous_.empty()) {
    throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                      "nothing to roll back: no weights were published since the server started "
                      "or since the last rollback");
  }
  RollbackReport report;
  for (const auto& [name, weight] : previous_) {
    report.bytes += static_cast<int64_t>(weight.nbytes());
  }
  report.tensors = static_cast<int64_t>(previous_.size());
  CopyInto(engine, previous_);
  previous_.clear();
  can_rollback_ = false;
  if (metrics_) metrics_->AddWeightsRollback();
  LogInfo("rolled the served weights back to those before the last publish (" +
          std::to_string(report.tensors) + " tensors)");
  return report;
}

RollbackReport WeightsPublisher::Rollback(const std::string& rpc, Clock::time_point received) {
  if (scheduler_ == nullptr) {
    throw ServerError(grpc::StatusCode::FAILED_PRECONDITION, "rollback needs the scheduler");
  }
  RollbackReport report;
  scheduler_->RunOnGpuThread(
      rpc, [&](Engine& engine) { report = RollbackOnGpuThread(engine); }, received);
  report.seconds = SecondsSince(received);
  return report;
}

}  // namespace vlmgraph::server
