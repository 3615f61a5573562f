// server/weights_publisher.h: the one place that changes the served weights after start-up: a
// Train job's publish, through the publish gate (server/publish_gate.h), and the rollback to the
// weights served before the last publish.
//
// clang-format off
//   WeightsPublisher publisher(&scheduler, &gate, &metrics);    // main, after the engine is ready
//   PublishReport r = publisher.Publish(engine, job->weights()); // GPU thread (a Train work item)
//   RollbackReport b = publisher.Rollback();                     // any thread: RollbackWeights RPC,
//                                                                // POST /v1/admin/rollback
// clang-format on
//
// Publish(engine, candidate) on the GPU thread:
//   1. refuses weights with a NaN or infinite element (reason non_finite_weights; always, with
//      the gate on or off);
//   2. keeps a host copy of every served tensor the candidate replaces, scores the served weights
//      on the gate's held-out prompts, copies the candidate into the served tensors in place (same
//      tensors, so captured inference graphs stay valid; rounded to the served dtype), scores them
//      again and asks the gate (Note [Publish gate]);
//   3. refused: copies the kept tensors back (bit for bit) and throws FAILED_PRECONDITION with the
//      measured losses, counted in vlmgraph_train_publish_refused_total{reason}; accepted: the
//      kept copy becomes the rollback copy, replacing the one before it.
// All of it runs inside one work item between decode steps, so no request ever sees a candidate
// that is then refused.
//
// Note [Rollback]: one level. Rollback() restores the weights served before the last accepted
// publish (only the tensors that publish changed) and drops the copy, so a second Rollback()
// without a publish in between is FAILED_PRECONDITION. The copy lives in host memory: 2 bytes per
// published bf16 parameter (4 for float32), e.g. 270 MB for SmolLM2-135M in bf16; the restore is
// one host-to-device copy per tensor (tens of milliseconds) between decode steps.
//
// Thread rules: Publish and RollbackOnGpuThread only on the scheduler's GPU thread (they drive the
// engine). Rollback() and can_rollback() are safe from any thread: Rollback queues a work item on
// the GPU thread and waits for it (Scheduler::RunOnGpuThread, admission kNew), so it is
// serialised with every publish and engine step. The caller checks the `publish` scope first
// (ApiKeys::Authorize(authorization, Scope::kPublish, "RollbackWeights"), server/auth.h).
// Errors (ServerError): FAILED_PRECONDITION from Publish (refused, or a server with several
// engines; the served weights are unchanged) and from Rollback (nothing to roll back: no publish since start-up or since the last
// rollback); from Rollback also RESOURCE_EXHAUSTED (the scheduler's queue is full) and UNAVAILABLE
// (the server is shutting down). Engine errors propagate; Publish restores the served weights
// before it rethrows one.
#pragma once

#include <ATen/Tensor.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "server/metrics.h"
#include "server/publish_gate.h"
#include "server/scheduler.h"

namespace vlmgraph::server {

// (parameter name as Engine::model()->named_parameters() names it, tensor): a job's weights.
using NamedWeights = std::vector<std::pair<std::string, at::Tensor>>;

struct PublishReport {
  bool gated = false;         // the gate scored the weights (train.publish_gate on)
  HeldOutScore served;        // the weights served before (zero when !gated)
  HeldOutScore candidate;     // the published weights (zero when !gated)
  double max_abs_weight = 0;  // largest |weight| published
  int64_t tensors = 0;        // served tensors replaced
};

struct RollbackReport {
  int64_t tensors = 0;  // served tensors restored
  int64_t bytes = 0;    // their size in the served dtype
  double seconds = 0;   // from the call to the restored weights (queue wait included)
};

class WeightsPublisher {
 public:
  // `gate` (null = no gate: any finite weights are published) and `metrics` (may be null) are not
  // owned and must outlive the publisher; `scheduler` is needed by Rollback() only (may be null
  // when only the GPU-thread methods are used, e.g. in tests). `served_engines`: the engines of
  // the server (server/engine_router.h); with more than one, Publish refuses (FAILED_PRECONDITION):
  // it changes the first engine only, and every engine must serve the same weights.
  WeightsPublisher(Scheduler* scheduler, const PublishGate* gate, Metrics* metrics,
                   int64_t served_engines = 1);
  WeightsPublisher(const WeightsPublisher&) = delete;
  WeightsPublisher& operator=(const WeightsPublisher&) = delete;

  // GPU thread: publishes `candidate` into `engine`'s served weights (see the file comment).
  // Names the engine's model does not have are ignored.
  PublishReport Publish(Engine& engine, const NamedWeights& candidate);

  // Any thread: queues RollbackOnGpuThread on the scheduler's GPU thread and waits for it.
  // `rpc` labels the queue-time metric (vlmgraph_queue_time_seconds{rpc}); `received` is when the
  // call arrived.
  RollbackReport Rollback(const std::string& rpc = "RollbackWeights",
                          Clock::time_point received = Clock::now());
  // GPU thread: restores the weights served before the last publish (Note [Rollback]).
  RollbackReport RollbackOnGpuThread(Engine& engine);

  // Whether a Rollback() now would find weights to restore. Any thread.
  bool can_rollback() const { return can_rollback_.load(); }

 private:
  Scheduler* scheduler_;
  const PublishGate* gate_;
  Metrics* metrics_;
  const int64_t served_engines_;
  // GPU thread only: host copies of the served tensors the last accepted publish replaced.
  NamedWeights previous_;
  std::atomic<bool> can_rollback_{false};
};

}  // namespace vlmgraph::server
