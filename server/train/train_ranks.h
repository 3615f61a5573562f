// server/train/train_ranks.h: the ranks of one Train job: one TrainBackend
// (server/train/train_session.h) per serving engine of the server (server/core/engine_router.h),
// joined in one data-parallel group (engine/data_parallel.h) when there are several.
//
// clang-format off
//   TrainRanks ranks(router, options, &metrics, 60);          // a Train handler: every rank created
//   TrainStepResult r = ranks.Step(batch, received, &queue);  // each rank its shard, all at once
//   ranks.OnFirstRank("Train", [&](TrainBackend& job) { job.Save(dir); }, received, admission);
//   publisher.Publish(ranks.Weights(), "Train", received);    // rank i's weights into engine i
//   // ~TrainRanks: every rank destroyed on its GPU thread
// clang-format on
//
// Note [In-process ranks]: a server with data_parallel_size N (N engines, one per GPU) trains a
// Train job on every engine that serves when the job starts, as N ranks of one DataParallelGroup
// in the one process: rank r is a TrainBackend on engine r, created, stepped and destroyed on
// that engine's GPU thread (Scheduler), as a one-engine job is on its only engine.
// - Rendezvous: rank 0 serves a TCPStore on 127.0.0.1 on a port the kernel chooses (store_port 0)
//   and reports it (DataParallelOptions::on_store_serving); only then are ranks 1..N-1 queued on
//   their engines, with that port. The group's name is unique per job, and each job has its own
//   store, so jobs never mix. Backend: NCCL for CUDA engines, gloo on the CPU; timeouts
//   (rendezvous, every collective, the heartbeats) are train.data_parallel_timeout_seconds.
// - Concurrency: every call runs its work on every rank at once (one helper thread per rank waits
//   for its engine's work item) and returns when all are done. A rank's GPU thread blocks only in
//   the job's collectives: Join (until every rank joined), the Trainer's first broadcast, and the
//   last micro-batch of each step (the gradient all-reduce), each until the slowest rank's engine
//   reaches the same point; between the pieces of a step each engine decodes its own requests as
//   a one-engine server does (Note [Interleaving bound] in server/core/scheduler.h). No GPU thread
//   ever waits for work that another GPU thread has queued behind it: the only cross-engine waits
//   are the job's collectives, which every rank enters in the same order, so they cannot deadlock.
// - The split: each global batch is split over the ranks by ShardForRank, vlmgraph-train's rule
//   (the contiguous split gradient accumulation uses); each rank splits its shard into train-bucket
//   micro-batches as one engine does (Note [Micro-batches] in engine/trainer_step.cc). N ranks thus
//   take the step that one engine takes when it accumulates the N shards: the loss, the gradient
//   norm and the weights are the global batch's (every rank holds the same weights after each
//   step), and the token counts are summed over the ranks. A batch with fewer examples than
//   ranks (or one whose split leaves a rank none, e.g. 5 over 4) is INVALID_ARGUMENT.
// - Faults: a rank whose work fails (an exception, a device error) ends the job on every rank: its
//   own rank is destroyed at once (Leave, then its trainer and group), which makes its peers'
//   pending gloo collectives fail (their sockets close), else they fail after the timeout; the
//   call then throws the first rank's error, its code kept (status.h: UNAVAILABLE for a peer that
//   died or timed out, INTERNAL for a bug, INVALID_ARGUMENT for a bad batch), its message naming
//   the rank and its device. The engines keep serving and the next job creates its ranks afresh.
//   On CUDA a collective whose peer never joins cannot be cancelled (Note [A rank that dies] in
//   engine/trainer_step.cc): the other ranks' steps fail after the timeout, and their engines may
//   stay blocked behind the collective on the device, or the NCCL heartbeat ends the process
//   (status 3), until the container's restart policy restarts it (not yet measured on GPUs).
// - Ending: every rank leaves the group (stops its heartbeats) before any is destroyed, so rank 0
//   taking the store with it is not taken for a lost peer; after a failure they all leave at once,
//   so the job's final autosave cannot be taken for a hang.
// With one serving engine there is no group and everything runs as a one-engine job.
//
// Thread rules: one thread (the Train handler) drives a TrainRanks; it queues work on the engines'
// GPU threads and waits for it. Errors: ServerError as above; FAILED_PRECONDITION when the build
// lacks the backend; what the backends throw (TrainBackend's errors).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/data_parallel.h"
#include "server/core/engine_router.h"
#include "server/core/metrics.h"
#include "server/core/scheduler.h"
#include "server/train/train_session.h"
#include "server/train/weights_publisher.h"

namespace vlmgraph::server {

class TrainRanks {
 public:
  // Creates one rank per serving engine of `router` (engine 0 alone when none serves, whose
  // scheduler then refuses), each on its GPU thread, all at once (see the Note). Each rank's
  // trainer reports to its engine's observer (server/core/metrics.h's series of its GPU), or to
  // metrics->ForGpu(its gpu) when the engine has none. `timeout_seconds` (> 0): rendezvous, every
  // collective and the heartbeats.
  TrainRanks(EngineRouter& router, const TrainJobOptions& options, Metrics* metrics,
             double timeout_seconds);
  // Destroys every rank on its GPU thread (admission kCleanup) and gives the job's cached device
  // memory back (engine/device.h), each rank after every rank left the group.
  ~TrainRanks();
  TrainRanks(const TrainRanks&) = delete;
  TrainRanks& operator=(const TrainRanks&) = delete;

  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  // Optimizer steps taken (rank 0's count: every rank's is the same).
  int64_t steps() const;

  // One optimizer step over the global batch `batch` (checked by ToTrainBatch): each rank's shard
  // in pieces on its GPU thread, one micro-batch per piece (Scheduler::RunPiecesOnGpuThread,
  // admission kInFlight). The result is rank 0's (the global loss and gradient norm), with the
  // token counts summed over the ranks and the longest rank's seconds. *queue_seconds: from
  // `received` to the last rank's first piece.
  TrainStepResult Step(std::vector<TrainExample> batch, Clock::time_point received,
                       double* queue_seconds);

  // Runs `work` on rank 0's job on its GPU thread (a save: every rank holds the same weights).
  // UNAVAILABLE when the job's ranks have ended after a failure.
  void OnFirstRank(const std::string& rpc, const std::function<void(TrainBackend&)>& work,
                   Clock::time_point received, Scheduler::Admission admission);

  // Every rank's TrainBackend::GatherOptimizerState on its GPU thread, at once (the sharded
  // optimizer's state before a save or a publish); nothing with one rank.
  void GatherOptimizerState(const std::string& rpc, Clock::time_point received,
                            Scheduler::Admission admission);

  // Each rank's weights(), indexed by engine (router order), null for an engine without a rank:
  // WeightsPublisher::Publish's candidates. UNAVAILABLE when the ranks have ended.
  std::vector<const NamedWeights*> Weights() const;

 private:
  struct Rank {
    size_t engine = 0;  // index in the router
    Scheduler* scheduler = nullptr;
    std::string device;
    std::shared_ptr<DataParallelGroup> group;  // null with one rank
    std::unique_ptr<TrainBackend> job;
  };
  // Runs `piece` for every rank on its GPU thread, all at once (one piece each unless `pieces`:
  // then until it returns true); see the Note for failures. With one rank it runs on this thread
  // and errors pass unchanged.
  void OnEveryRank(const std::string& rpc, const std::function<bool(size_t, Engine&)>& piece,
                   Clock::time_point received, Scheduler::Admission admission, bool pieces);
  // Rank r's GPU thread (or this thread when it has stopped): leave the group, destroy the job
  // and the group, give the cached memory back. `leave_only`: the first half.
  void EndRank(size_t r, bool leave_only);
  // Every rank: leave, then destroy (see ~TrainRanks).
  void EndAll() noexcept;
  // Every rank leaves its group (heartbeats and watchdog stop); from this thread, between calls.
  void LeaveAll() noexcept;

  EngineRouter& router_;
  // The job trains the language model, which learns from every token (else only examples with
  // an image reach a trained parameter).
  const bool learns_from_text_;
  std::vector<Rank> ranks_;
};

}  // namespace vlmgraph::server
