// server/train/train_ranks.cc: see train_ranks.h (Note [In-process ranks]).
#include "server/train/train_ranks.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "base/log.h"
#include "engine/device.h"
#include "server/core/status.h"
#include "server/train/graphed_trainer.h"

namespace vlmgraph::server {
namespace {

// Each job's group has a name of its own (its store is its own too).
std::string NextGroupName() {
  static std::atomic<int64_t> jobs{0};
  return "vlmgraph-train-rpc-" + std::to_string(::getpid()) + "-" + std::to_string(++jobs);
}

std::string WhatOf(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

// The first failing rank's error, its code kept, its message naming the rank.
ServerError RankError(std::exception_ptr error, size_t rank, size_t ranks,
                      const std::string& device) {
  const grpc::Status status = StatusFromException(error);
  return ServerError(status.error_code(), "training rank " + std::to_string(rank) + " of " +
                                              std::to_string(ranks) + " (engine on " + device +
                                              "): " + status.error_message() +
                                              "; the job ended on every rank");
}

}  // namespace

TrainRanks::TrainRanks(EngineRouter& router, const TrainJobOptions& options, Metrics* metrics,
                       double timeout_seconds)
    : router_(router),
      learns_from_text_(options.trainer.learning_rates.language > 0) {
  for (size_t i = 0; i < router.size(); ++i) {
    if (!router.scheduler(i).serving()) continue;
    Rank r;
    r.engine = i;
    r.scheduler = &router.scheduler(i);
    r.device = router.slot(i).device;
    ranks_.push_back(std::move(r));
  }
  if (ranks_.empty()) {  // its scheduler refuses the work below with the reason
    Rank r;
    r.scheduler = &router.scheduler(0);
    r.device = router.slot(0).device;
    ranks_.push_back(std::move(r));
  }
  auto observer = [&](size_t r, Engine& engine) -> EngineObserver* {
    if (engine.observer() != nullptr) return engine.observer();
    return metrics ? &metrics->ForGpu(router.slot(ranks_[r].engine).gpu) : nullptr;
  };
  const size_t n = ranks_.size();
  if (n == 1) {
    ranks_[0].scheduler->RunOnGpuThread("Train", [&](Engine& engine) {
      ranks_[0].job = MakeTrainBackend(engine, options, observer(0, engine));
    });
    return;
  }

  const bool cuda = at::Device(ranks_[0].device).is_cuda();
  const std::string backend = cuda ? "nccl" : "gloo";
  if (!DataParallelGroup::BackendAvailable(backend)) {
    throw ServerError(
        grpc::StatusCode::FAILED_PRECONDITION,
        "this server trains on its " + std::to_string(n) +
            " engines as data-parallel ranks, and its build has no " + backend + " backend (" +
            (cuda ? std::string("a CUDA build with the nccl.h of the nvidia-nccl wheel")
                  : std::string("install Debian's libgloo-dev and rebuild")) +
            ")");
  }
  const std::string group_name = NextGroupName();
  // Rank 0 serves the store on a port of the kernel's choice; the others are queued once it is
  // known (Note [In-process ranks]).
  std::promise<int64_t> port_promise;
  std::future<int64_t> port = port_promise.get_future();
  std::once_flag port_once;
  auto create = [&, timeout_seconds](size_t r, int64_t store_port) {
    return [&, r, store_port, timeout_seconds](size_t, Engine& engine) {
      DataParallelOptions o;
      o.rank = static_cast<int64_t>(r);
      o.world_size = static_cast<int64_t>(n);
      o.store_host = "127.0.0.1";
      o.store_port = store_port;
      o.timeout_seconds = timeout_seconds;
      o.backend = backend;
      o.device_index = engine.options().device.is_cuda() ? engine.options().device.index() : 0;
      o.group_name = group_name;
      if (r == 0) {
        o.on_store_serving = [&](int64_t p) {
          std::call_once(port_once, [&] { port_promise.set_value(p); });
        };
      }
      ranks_[r].group = DataParallelGroup::Join(o);
      TrainJobOptions rank_options = options;
      rank_options.trainer.data_parallel = ranks_[r].group;
      ranks_[r].job = MakeTrainBackend(engine, rank_options, observer(r, engine));
      return true;
    };
  };
  std::vector<std::exception_ptr> errors(n);
  std::mutex first_mu;
  std::optional<size_t> first;  // the first rank to fail
  auto run = [&](size_t r, int64_t store_port) {
    try {
      ranks_[r].scheduler->RunOnGpuThread(
          "Train", [&](Engine& engine) { create(r, store_port)(r, engine); }, Clock::now());
    } catch (...) {
      errors[r] = std::current_exception();
      {
        std::lock_guard<std::mutex> lock(first_mu);
        if (!first) first = r;
      }
      if (r == 0) std::call_once(port_once, [&] { port_promise.set_exception(errors[0]); });
      EndRank(r, /*leave_only=*/false);  // its peers' rendezvous or broadcast fails
    }
  };
  std::vector<std::thread> threads;
  threads.emplace_back(run, 0, 0);
  int64_t store_port = 0;
  try {
    store_port = port.get();
  } catch (...) {
    threads[0].join();
    EndAll();
    throw RankError(errors[0], 0, n, ranks_[0].device);
  }
  for (size_t r = 1; r < n; ++r) threads.emplace_back(run, r, store_port);
  for (auto& t : threads) t.join();
  if (first) {
    EndAll();
    throw RankError(errors[*first], *first, n, ranks_[*first].device);
  }
  LogInfo("Train job runs on " + std::to_string(n) + " engines as data-parallel ranks (" + backend +
          ", group " + group_name + ")");
}

TrainRanks::~TrainRanks() { EndAll(); }

int64_t TrainRanks::steps() const { return ranks_[0].job ? ranks_[0].job->steps() : 0; }

void TrainRanks::EndRank(size_t r, bool leave_only) {
  Rank& rank = ranks_[r];
  auto end = [&](Engine* engine) {
    if (rank.group) rank.group->Leave();
    if (leave_only) return;
    rank.job.reset();
    rank.group.reset();
    // The job's graphs, weights and optimizer state are gone: give their cached device, pinned
    // and heap memory back (engine/device.h).
    if (engine != nullptr) ReleaseCachedMemory(engine->options().device);
  };
  try {
    rank.scheduler->RunOnGpuThread(
        "Train", [&](Engine& engine) { end(&engine); }, Clock::now(),
        Scheduler::Admission::kCleanup);
  } catch (...) {
    end(nullptr);  // the GPU thread has stopped: nothing else touches the model now
  }
}

void TrainRanks::EndAll() noexcept {
  const size_t n = ranks_.size();
  if (n == 1) {
    EndRank(0, /*leave_only=*/false);
    return;
  }
  LeaveAll();
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r) {
    if (!ranks_[r].job && !ranks_[r].group) continue;
    threads.emplace_back([this, r] { EndRank(r, /*leave_only=*/false); });
  }
  for (auto& t : threads) t.join();
}

void TrainRanks::LeaveAll() noexcept {
  // No rank's work runs now (every call waits for all of its ranks), so this thread may stop
  // the groups' heartbeat and watchdog threads (collectives are not touched).
  for (Rank& rank : ranks_) {
    if (rank.group) rank.group->Leave();
  }
}

void TrainRanks::OnEveryRank(const std::string& rpc,
                             const std::function<bool(size_t, Engine&)>& piece,
                             Clock::time_point received, Scheduler::Admission admission,
                             bool pieces) {
  const size_t n = ranks_.size();
  auto run_one = [&](size_t r) {
    Scheduler& s = *ranks_[r].scheduler;
    if (pieces) {
      s.RunPiecesOnGpuThread(
          rpc, [&](Engine& engine) { return piece(r, engine); }, received, admission);
    } else {
      s.RunOnGpuThread(
          rpc, [&](Engine& engine) { piece(r, engine); }, received, admission);
    }
  };
  if (n == 1) {
    run_one(0);
    return;
  }
  std::vector<std::exception_ptr> errors(n);
  std::mutex first_mu;
  std::optional<size_t> first;
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        run_one(r);
      } catch (...) {
        errors[r] = std::current_exception();
        {
          std::lock_guard<std::mutex> lock(first_mu);
          if (!first) first = r;
        }
        // Its peers may wait for it in a collective: ending it makes theirs fail.
        EndRank(r, /*leave_only=*/false);
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) {
    // The job is over: no rank may take the ones ended above for lost peers meanwhile (an NCCL
    // rank would end the process), e.g. during the job's final autosave.
    LeaveAll();
    LogError("Train job: rank " + std::to_string(*first) +
             " failed: " + LogSafe(WhatOf(errors[*first]), 512) + "; ending the job on every rank");
    throw RankError(errors[*first], *first, n, ranks_[*first].device);
  }
}

TrainStepResult TrainRanks::Step(std::vector<TrainExample> batch, Clock::time_point received,
                                 double* queue_seconds) {
  const size_t n = ranks_.size();
  for (const Rank& r : ranks_) {
    if (!r.job) {
      throw ServerError(grpc::StatusCode::UNAVAILABLE,
                        "the job's ranks ended after a failure; start a new job");
    }
  }
  std::vector<std::vector<TrainExample>> shards(n);
  if (n > 1 && !learns_from_text_) {
    // A rank of several does not refuse a shard nothing learns from (its micro-batches add zero
    // gradients), so the batch is checked whole here, as one engine checks it.
    bool image = false;
    for (const auto& e : batch) image = image || (e.tiles.defined() && e.tiles.size(0) > 0);
    if (!image) {
      throw InvalidArgument(
          "no trained parameter can learn from this batch: the job does not train the language "
          "model, and no example has an image; send examples with images, or train the language "
          "model too (with a learning rate above 0)");
    }
  }
  if (n == 1) {
    shards[0] = std::move(batch);
  } else {
    const int64_t examples = static_cast<int64_t>(batch.size());
    try {
      for (size_t r = 0; r < n; ++r)
        shards[r] = ShardForRank(batch, static_cast<int64_t>(r), static_cast<int64_t>(n));
    } catch (const EngineError&) {
      throw InvalidArgument("batch: this server trains on " + std::to_string(n) +
                            " engines (data_parallel_size), each on a contiguous share of "
                            "ceil(examples / " +
                            std::to_string(n) + ") examples, and a batch of " +
                            std::to_string(examples) + " leaves an engine none: send at least " +
                            std::to_string(n) + " examples (a multiple of " + std::to_string(n) +
                            " always works)");
    }
  }
  std::vector<TrainStepResult> results(n);
  std::vector<double> queued(n, 0);
  std::vector<char> begun(n, 0);
  OnEveryRank(
      "Train",
      [&](size_t r, Engine&) {
        TrainBackend& job = *ranks_[r].job;
        if (!begun[r]) {
          begun[r] = 1;
          queued[r] = SecondsSince(received);
          job.BeginStep(std::move(shards[r]));
        }
        if (!job.RunNextMicroBatch()) return false;
        results[r] = job.StepResult();
        return true;
      },
      received, Scheduler::Admission::kInFlight, /*pieces=*/true);
  TrainStepResult out = std::move(results[0]);
  *queue_seconds = queued[0];
  for (size_t r = 1; r < n; ++r) {
    const TrainStepResult& s = results[r];
    out.target_tokens += s.target_tokens;
    out.real_tokens += s.real_tokens;
    out.padded_tokens += s.padded_tokens;
    out.seconds = std::max(out.seconds, s.seconds);
    out.all_reduce_seconds = std::max(out.all_reduce_seconds, s.all_reduce_seconds);
    if (s.kind == RunKind::kEager) out.kind = RunKind::kEager;
    if (s.kind == RunKind::kCaptureAndReplay && out.kind != RunKind::kEager)
      out.kind = RunKind::kCaptureAndReplay;
    *queue_seconds = std::max(*queue_seconds, queued[r]);
  }
  return out;
}

void TrainRanks::OnFirstRank(const std::string& rpc, const std::function<void(TrainBackend&)>& work,
                             Clock::time_point received, Scheduler::Admission admission) {
  Rank& rank = ranks_[0];
  rank.scheduler->RunOnGpuThread(
      rpc,
      [&](Engine&) {
        if (!rank.job) {
          throw ServerError(grpc::StatusCode::UNAVAILABLE,
                            "the job's ranks ended after a failure; start a new job");
        }
        work(*rank.job);
      },
      received, admission);
}

void TrainRanks::GatherOptimizerState(const std::string& rpc, Clock::time_point received,
                                      Scheduler::Admission admission) {
  if (ranks_.size() < 2) return;
  OnEveryRank(
      rpc,
      [&](size_t r, Engine&) {
        if (!ranks_[r].job) {
          throw ServerError(grpc::StatusCode::UNAVAILABLE,
                            "the job's ranks ended after a failure; start a new job");
        }
        ranks_[r].job->GatherOptimizerState();
        return true;
      },
      received, admission, /*pieces=*/false);
}

std::vector<const NamedWeights*> TrainRanks::Weights() const {
  std::vector<const NamedWeights*> out(router_.size(), nullptr);
  for (const Rank& r : ranks_) {
    if (!r.job) {
      throw ServerError(grpc::StatusCode::UNAVAILABLE,
                        "the job's ranks ended after a failure; start a new job");
    }
    out[r.engine] = &r.job->weights();
  }
  return out;
}

}  // namespace vlmgraph::server
