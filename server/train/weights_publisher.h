// server/train/weights_publisher.h: the one place that changes the served weights after start-up: a
// Train job's publish, through the publish gate (server/train/publish_gate.h), and the rollback to
// the weights served before the last publish, on every engine of the server
// (server/core/engine_router.h).
//
// clang-format off
//   WeightsPublisher publisher({&router.scheduler(0), &router.scheduler(1)}, &gate, &metrics);
//   PublishReport r = publisher.Publish({&rank0->weights(), &rank1->weights()}, "Train");
//                                                            // any thread (a Train job's publish)
//   RollbackReport b = publisher.Rollback();                 // any thread: RollbackWeights RPC,
//                                                            // POST /v1/admin/rollback
//   PublishReport r = publisher.Publish(engine, weights);    // GPU thread, one engine (tests)
// clang-format on
//
// Publishing into one engine, on its GPU thread (one work item between decode steps):
//   1. refuses weights with a NaN or infinite element (reason non_finite_weights; always, with
//      the gate on or off);
//   2. keeps a host copy of every served tensor the candidate replaces, scores the served weights
//      on the gate's held-out prompts, copies the candidate into the served tensors in place (same
//      tensors, so captured inference graphs stay valid; rounded to the served dtype), scores them
//      again and asks the gate (Note [Publish gate]);
//   3. refused: copies the kept tensors back (bit for bit) and throws FAILED_PRECONDITION with the
//      measured losses, counted in vlmgraph_train_publish_refused_total{reason}; accepted: the
//      kept copy becomes the engine's rollback copy, replacing the one before it.
// All of it runs inside one work item between decode steps, so no request ever sees a candidate
// that is then refused.
//
// Note [Publishing on several engines]: a data-parallel Train job (server/train/train_ranks.h)
// holds the same weights on every rank, each on its engine's device; Publish(candidates) publishes
// rank i's weights into engine i. The first engine with a candidate runs steps 1-3 above; once its
// gate accepted, every other engine copies its candidate in (keeping its own rollback copy), all of
// them at once, each in one work item on its own GPU thread. So each engine switches atomically
// between two of its decode steps, as a one-engine server does, but not at the same instant as the
// others: for the few milliseconds between the first engine's switch and the last one's, a new
// request may be served the old weights or the new ones depending on the engine the router picks; a
// request that is running when its engine switches decodes its next tokens with the new weights
// (its KV cache was computed with the old ones), on one engine as on several. If an engine fails to
// take its copy (its device failed, the server stops), every engine that switched is restored from
// its kept copy before the error is thrown, so the engines never serve different weights after a
// publish call returns. Engines without a candidate (null: their device failed before the job) are
// left alone; they serve nothing.
//
// Note [Rollback]: one level. Rollback() restores, on every engine the last accepted publish
// changed, the weights served before it (only the tensors that publish changed) and drops the
// copies, so a second Rollback() without a publish in between is FAILED_PRECONDITION. The engines
// are restored one after another, each in one work item; a rollback that fails half-way (queue
// full, shutting down) keeps the copies, so a retry restores every engine (restoring is
// idempotent). The copies live in host memory: 2 bytes per published bf16 parameter (4 for
// float32) per engine, e.g. 270 MB for SmolLM2-135M in bf16; the restore is one host-to-device
// copy per tensor (tens of milliseconds) between decode steps.
//
// Thread rules: Publish(candidates), Rollback() and can_rollback() are safe from any thread;
// Publish(candidates) and Rollback() queue work items on the engines' GPU threads and wait for
// them (Scheduler::RunOnGpuThread), and are serialised with each other. Publish(engine, ...) and
// RollbackOnGpuThread(engine) act on the first engine's state on its GPU thread (one-engine use
// and tests); do not mix them with the any-thread calls. The caller checks the `publish` scope
// first (ApiKeys::Authorize(authorization, Scope::kPublish, "RollbackWeights"),
// server/core/auth.h). Errors (ServerError): FAILED_PRECONDITION from Publish (refused; the served
// weights are unchanged) and from Rollback (nothing to roll back: no publish since start-up or
// since the last rollback); RESOURCE_EXHAUSTED (a scheduler's queue is full) and UNAVAILABLE (the
// server is shutting down, or the engine's device failed). Engine errors propagate; Publish
// restores the served weights before it rethrows one.
#pragma once

#include <ATen/Tensor.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "server/core/metrics.h"
#include "server/core/scheduler.h"
#include "server/train/publish_gate.h"

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
  int64_t tensors = 0;  // served tensors restored (on each engine)
  int64_t bytes = 0;    // their size in the served dtype
  double seconds = 0;   // from the call to the restored weights (queue wait included)
};

class WeightsPublisher {
 public:
  // `schedulers`: one per engine of the server, in the router's order (EngineRouter::scheduler),
  // needed by the any-thread calls only (entries may be null when only the GPU-thread methods are
  // used, e.g. in tests). `gate` (null = no gate: any finite weights are published) and `metrics`
  // (may be null) are not owned and must outlive the publisher.
  WeightsPublisher(std::vector<Scheduler*> schedulers, const PublishGate* gate, Metrics* metrics);
  // One engine.
  WeightsPublisher(Scheduler* scheduler, const PublishGate* gate, Metrics* metrics)
      : WeightsPublisher(std::vector<Scheduler*>{scheduler}, gate, metrics) {}
  WeightsPublisher(const WeightsPublisher&) = delete;
  WeightsPublisher& operator=(const WeightsPublisher&) = delete;

  // Any thread: publishes candidates[i] into engine i (Note [Publishing on several engines]);
  // `candidates` has one entry per engine, null for an engine to leave alone (at least one is
  // set). The report is the gated engine's. `rpc` labels the queue-time metric
  // (vlmgraph_queue_time_seconds{rpc}); `received` is when the request arrived.
  PublishReport Publish(const std::vector<const NamedWeights*>& candidates, const std::string& rpc,
                        Clock::time_point received = Clock::now());

  // GPU thread: publishes `candidate` into `engine`, the first engine (see the file comment).
  // Names the engine's model does not have are ignored.
  PublishReport Publish(Engine& engine, const NamedWeights& candidate);

  // Any thread: restores every engine's weights from before the last publish (Note [Rollback]),
  // each in a work item on its GPU thread. `rpc` labels the queue-time metric
  // (vlmgraph_queue_time_seconds{rpc}); `received` is when the call arrived.
  RollbackReport Rollback(const std::string& rpc = "RollbackWeights",
                          Clock::time_point received = Clock::now());
  // GPU thread: restores the first engine's weights from before the last publish.
  RollbackReport RollbackOnGpuThread(Engine& engine);

  // Whether a Rollback() now would find weights to restore. Any thread.
  bool can_rollback() const { return can_rollback_.load(); }

 private:
  // Steps 1-3 of the file comment on `engine` (its GPU thread): the candidate is served when this
  // returns; *kept gets the tensors it replaced. `gated`: scores and judges (else only copies).
  PublishReport PublishInto(Engine& engine, const NamedWeights& candidate, bool gated,
                            NamedWeights* kept);

  const std::vector<Scheduler*> schedulers_;
  const PublishGate* gate_;
  Metrics* metrics_;
  // Serialises the any-thread calls: they change several engines one work item at a time.
  std::mutex mu_;
  // Per engine: host copies of the served tensors the last accepted publish replaced (empty: none
  // to restore). Under mu_ for the any-thread calls; the GPU-thread methods use entry 0.
  std::vector<NamedWeights> previous_;
  std::atomic<bool> can_rollback_{false};
};

}  // namespace vlmgraph::server
