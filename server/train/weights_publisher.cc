#include "server/train/weights_publisher.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <thread>

#include "base/log.h"
#include "server/core/status.h"

namespace vlmgraph::server {
namespace {

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

WeightsPublisher::WeightsPublisher(std::vector<Scheduler*> schedulers, const PublishGate* gate,
                                   Metrics* metrics)
    : schedulers_(std::move(schedulers)),
      gate_(gate),
      metrics_(metrics),
      previous_(std::max<size_t>(schedulers_.size(), 1)) {}

PublishReport WeightsPublisher::PublishInto(Engine& engine, const NamedWeights& candidate,
                                            bool gated, NamedWeights* kept_out) {
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

  gated = gated && gate_ != nullptr && gate_->options().enabled;
  report.gated = gated;
  if (gated) report.served = gate_->Score(engine);
  GateVerdict verdict;
  try {
    CopyInto(engine, candidate);
    if (gated) {
      report.candidate = gate_->Score(engine);
      verdict = gate_->Judge(report.served, report.candidate, report.max_abs_weight);
    }
  } catch (...) {
    CopyInto(engine, kept);  // an engine error while copying or scoring: serve what was served
    throw;
  }
  if (!verdict.accepted()) {
    CopyInto(engine, kept);
    throw refuse(verdict.reason,
                 "publish refused by the publish gate (train.publish_gate): " + verdict.message +
                     ". The served weights are unchanged; lower the learning rates or weight "
                     "decay, train fewer steps, or check the data (docs/security.md)");
  }
  if (gated) {
    LogInfo("publish gate accepted the job's weights: held-out loss " + Number(report.served.loss) +
            " -> " + Number(report.candidate.loss) + " nats/token, largest |weight| " +
            Number(report.max_abs_weight));
  }
  *kept_out = std::move(kept);
  return report;
}

PublishReport WeightsPublisher::Publish(Engine& engine, const NamedWeights& candidate) {
  NamedWeights kept;
  PublishReport report = PublishInto(engine, candidate, /*gated=*/true, &kept);
  previous_[0] = std::move(kept);
  can_rollback_ = true;
  if (metrics_) metrics_->AddTrainPublish();
  return report;
}

PublishReport WeightsPublisher::Publish(const std::vector<const NamedWeights*>& candidates,
                                        const std::string& rpc, Clock::time_point received) {
  std::lock_guard<std::mutex> lock(mu_);
  if (candidates.size() != schedulers_.size()) {
    throw std::logic_error("WeightsPublisher::Publish: one candidate per engine");
  }
  std::vector<size_t> engines;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i] == nullptr) continue;
    if (schedulers_[i] == nullptr)
      throw ServerError(grpc::StatusCode::FAILED_PRECONDITION, "publishing needs the schedulers");
    engines.push_back(i);
  }
  if (engines.empty()) throw std::logic_error("WeightsPublisher::Publish: no candidate");
  // The first engine: checked and gated (Note [Publishing on several engines]).
  std::vector<NamedWeights> kept(candidates.size());
  PublishReport report;
  const size_t first = engines.front();
  schedulers_[first]->RunOnGpuThread(
      rpc,
      [&](Engine& engine) {
        report = PublishInto(engine, *candidates[first], /*gated=*/true, &kept[first]);
      },
      received, Scheduler::Admission::kInFlight);
  // The others copy theirs in, at once.
  std::vector<size_t> switched = {first};
  std::vector<std::exception_ptr> errors(candidates.size());
  {
    std::vector<std::thread> threads;
    for (size_t k = 1; k < engines.size(); ++k) {
      const size_t i = engines[k];
      threads.emplace_back([&, i] {
        try {
          schedulers_[i]->RunOnGpuThread(
              rpc,
              [&](Engine& engine) {
                PublishInto(engine, *candidates[i], /*gated=*/false, &kept[i]);
              },
              received, Scheduler::Admission::kInFlight);
        } catch (...) {
          errors[i] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  std::exception_ptr error;
  for (size_t k = 1; k < engines.size(); ++k) {
    if (errors[engines[k]] == nullptr) {
      switched.push_back(engines[k]);
    } else if (error == nullptr) {
      error = errors[engines[k]];
    }
  }
  if (error != nullptr) {
    // Every engine serves what it served before (or its device failed and it serves nothing).
    for (size_t i : switched) {
      try {
        schedulers_[i]->RunOnGpuThread(
            rpc, [&](Engine& engine) { CopyInto(engine, kept[i]); }, Clock::now(),
            Scheduler::Admission::kCleanup);
      } catch (const std::exception& e) {
        LogError("publish: could not restore engine " + std::to_string(i) +
                 " after another engine failed to take the weights: " + LogSafe(e.what(), 512));
      }
    }
    std::rethrow_exception(error);
  }
  for (size_t i = 0; i < previous_.size(); ++i) previous_[i] = std::move(kept[i]);
  can_rollback_ = true;
  if (metrics_) metrics_->AddTrainPublish();
  if (engines.size() > 1) {
    LogInfo("published the job's weights on " + std::to_string(engines.size()) + " engines");
  }
  return report;
}

RollbackReport WeightsPublisher::RollbackOnGpuThread(Engine& engine) {
  if (previous_[0].empty()) {
    throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                      "nothing to roll back: no weights were published since the server started "
                      "or since the last rollback");
  }
  RollbackReport report;
  for (const auto& [name, weight] : previous_[0]) {
    report.bytes += static_cast<int64_t>(weight.nbytes());
  }
  report.tensors = static_cast<int64_t>(previous_[0].size());
  CopyInto(engine, previous_[0]);
  previous_[0].clear();
  can_rollback_ = false;
  if (metrics_) metrics_->AddWeightsRollback();
  LogInfo("rolled the served weights back to those before the last publish (" +
          std::to_string(report.tensors) + " tensors)");
  return report;
}

RollbackReport WeightsPublisher::Rollback(const std::string& rpc, Clock::time_point received) {
  std::lock_guard<std::mutex> lock(mu_);
  bool any = false;
  for (size_t i = 0; i < previous_.size(); ++i) {
    any = any || !previous_[i].empty();
    if (i >= schedulers_.size() || schedulers_[i] == nullptr) {
      throw ServerError(grpc::StatusCode::FAILED_PRECONDITION, "rollback needs the scheduler");
    }
  }
  if (!any) {
    // Answered by the first engine's GPU thread, so a server that is stopping says UNAVAILABLE.
    schedulers_[0]->RunOnGpuThread(
        rpc,
        [](Engine&) {
          throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                            "nothing to roll back: no weights were published since the server "
                            "started or since the last rollback");
        },
        received);
  }
  // Engine by engine; the copies are dropped only once every engine is restored (a retry after a
  // failure restores them all again: Note [Rollback]).
  RollbackReport report;
  int64_t engines = 0;
  for (size_t i = 0; i < previous_.size(); ++i) {
    if (previous_[i].empty()) continue;
    schedulers_[i]->RunOnGpuThread(
        rpc, [&](Engine& engine) { CopyInto(engine, previous_[i]); }, received);
    if (report.tensors == 0) {
      report.tensors = static_cast<int64_t>(previous_[i].size());
      for (const auto& [name, weight] : previous_[i])
        report.bytes += static_cast<int64_t>(weight.nbytes());
    }
    ++engines;
  }
  for (auto& p : previous_) p.clear();
  can_rollback_ = false;
  if (metrics_) metrics_->AddWeightsRollback();
  LogInfo("rolled the served weights back to those before the last publish (" +
          std::to_string(report.tensors) + " tensors" +
          (engines > 1 ? ", on " + std::to_string(engines) + " engines)" : ")"));
  report.seconds = SecondsSince(received);
  return report;
}

}  // namespace vlmgraph::server
