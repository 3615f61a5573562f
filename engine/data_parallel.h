// engine/data_parallel.h: data-parallel ranks over c10d, PyTorch's distributed runtime.
//
// A DataParallelGroup is one rank's membership in a group of `world_size` ranks that train the
// same model on different shards of each global batch (PyTorch DDP's scheme: Li et al. 2020,
// "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"). The ranks meet
// through a c10d::TCPStore served by rank 0 (so ranks may live on different hosts) and talk
// through a c10d backend:
//   - "gloo": ProcessGroupGloo, CPU tensors (builds with Debian's libgloo-dev headers;
//     VLMGRAPH_HAVE_GLOO);
//   - "nccl": ProcessGroupNCCL, CUDA tensors, one GPU per rank (builds with the nccl.h of the
//     nvidia-nccl wheel that torch installs; VLMGRAPH_HAVE_NCCL).
// A backend the build lacks is refused by Join with a message naming the package.
//
//   DataParallelOptions o;  o.rank = r;  o.world_size = 2;  o.store_port = 29500;
//   std::shared_ptr<DataParallelGroup> group = DataParallelGroup::Join(o);  // blocks for all ranks
//   TrainOptions t;  t.data_parallel = group;                              // engine/trainer.h
//   Trainer trainer(model, t);        // starts from rank 0's weights (broadcast)
//   trainer.Step(ShardForRank(global_batch, group->rank(), group->world_size()));
//
// Gradient averaging: the Trainer packs its gradients into buckets of at most bucket_bytes (DDP's
// bucket_cap_mb, 25 MB by default) and all-reduces each with StartAllReduceSum while the backward
// runs (Note [Overlapped all-reduce] in engine/gradient_reducer.cc). Broadcast packs its tensors
// into buckets of the same size, one flat tensor per bucket (a tensor larger than a bucket goes
// alone, in place). Every rank must pass tensors of the same shapes in the same order.
//
// Thread rules: a group is used by one thread at a time (the thread that drives its Trainer);
// every rank must call the same collectives in the same order. Groups of one process may run on
// different threads (the tests run 2 ranks as 2 threads).
// Errors: EngineError(kUnavailable) when the store cannot be reached or a rank does not join
// within timeout_seconds, and when a collective fails or times out (a rank died or hangs): the
// group is then unusable; EngineError(kInvalidArgument) for bad options or a backend not built.
// NCCL: eager collectives (Join, Broadcast, Barrier) wait at most timeout_seconds;
// a captured one that never completes (its peer died) is detected by the Trainer's deadline (Note
// [A rank that dies] in engine/trainer_step.cc). Unless the environment sets it, Join sets
// TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up, do not tear the process down), so the caller decides
// how to end.
#pragma once

#include <ATen/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_types.h"

namespace vlmgraph {

struct DataParallelOptions {
  int64_t rank = 0;        // 0 .. world_size - 1
  int64_t world_size = 1;  // >= 1
  // The TCPStore: rank 0 serves it on store_host:store_port, the others connect there. Port 0 on
  // rank 0 takes any free port (read it back with store_port()).
  std::string store_host = "127.0.0.1";
  int64_t store_port = 29500;
  // The launcher already serves the store at store_host:store_port (torchrun's agent does, and
  // says so with TORCHELASTIC_USE_AGENT_STORE=True): every rank, rank 0 included, connects as a
  // client.
  bool launcher_store = false;
  // Store rendezvous and each collective, seconds (> 0). A rank that dies or hangs makes the
  // others fail with kUnavailable after this long.
  double timeout_seconds = 300;
  std::string backend = "gloo";  // "gloo" (CPU tensors) or "nccl" (CUDA tensors)
  int64_t device_index = 0;      // nccl: this rank's GPU
  // Gradient all-reduce bucket, bytes (> 0): DDP's default bucket_cap_mb = 25.
  int64_t bucket_bytes = 25 * 1024 * 1024;
  // The dtype gradients are all-reduced in (FSDP's MixedPrecision.reduce_dtype; DDP's
  // bf16_compress_hook for bf16): float32 or bfloat16; unset = the trainer's compute dtype.
  // bfloat16 applies to bf16 training with the fused optimizer (CUDA); other trainers reduce in
  // float32 (engine/gradient_reducer.h).
  std::optional<at::ScalarType> reduce_dtype;
  // ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  // Parameter Models", section 5.1; DeepSpeed's zero_optimization.stage 1, PyTorch's
  // ZeroRedundancyOptimizer): each trained parameter has one owner rank
  // (engine/optimizer_shards.h); its gradient is SUM-reduced to the owner only, the owner alone
  // runs AdamW on it, then broadcasts the new weight. Each rank does 1 / world_size of the
  // optimizer's work. The ranks' master weights and AdamW moments of parameters they do not own
  // go stale between steps: Trainer::GatherOptimizerState (every rank) brings them back before a
  // checkpoint or a read of master_weights(). Applies to trainers with the fused optimizer
  // (CUDA) or the ATen one alike. On by default: measured on 4 x H100 (nanovlm-460m bf16,
  // 8 x 1024 per GPU) 2 GPUs 84.64 -> 83.56 ms, 4 GPUs 86.23 -> 84.77 ms per step, the same
  // losses and weights (docs/design/training.md, "Data parallelism").
  bool shard_optimizer = true;
  // With shard_optimizer, in steps of one bf16 micro-batch (AdamW inside the micro-step's graph):
  // the updated weights of the decoder's blocks (and what follows them) are broadcast at the
  // start of the next step, behind the vision encoder's forward, and each rank's forward waits
  // for each chunk of them before the first block it holds: FSDP's forward prefetch of its
  // all-gathers (Note [Weights broadcast in the forward] in
  // engine/trainer_optimizer.cc). Between steps those weights are current on their owners only
  // until Trainer::GatherOptimizerState (every rank) or the next step.
  bool broadcast_in_forward = true;
  // Prefix of every store key, so several groups (jobs) can share one store.
  std::string group_name = "vlmgraph";
  // Peer liveness heartbeat period, seconds (> 0); see DataParallelGroup::LostPeer.
  double heartbeat_seconds = 1;
  // Rank 0 serving the store (not launcher_store): called on Join's thread with the store's port
  // (the chosen one for store_port 0) once the store serves, before Join waits for the other
  // ranks, so that ranks of one process (the server's Train RPC, server/train/train_ranks.h) can
  // pass the port on. May be empty.
  std::function<void(int64_t port)> on_store_serving;
};

class DataParallelGroup {
 public:
  // Connects to (rank 0: serves) the store and creates the backend; blocks until every rank has
  // joined or timeout_seconds passed. Throws EngineError (see the file comment).
  static std::shared_ptr<DataParallelGroup> Join(const DataParallelOptions& options);
  ~DataParallelGroup();
  DataParallelGroup(const DataParallelGroup&) = delete;
  DataParallelGroup& operator=(const DataParallelGroup&) = delete;

  int64_t rank() const { return options_.rank; }
  int64_t world_size() const { return options_.world_size; }
  // The store's port (the chosen one when rank 0 asked for port 0).
  int64_t store_port() const;
  const DataParallelOptions& options() const { return options_; }
  // Whether this build has the backend ("gloo", "nccl").
  static bool BackendAvailable(const std::string& backend);

  // In place: every tensor takes root's values (contiguous tensors, on the backend's device, the
  // same shapes and dtypes in the same order on every rank; buckets as in the file comment).
  void Broadcast(const std::vector<at::Tensor>& tensors, int64_t root = 0);
  // Returns when every rank has called it.
  void Barrier();

  // Gradient buckets reduced while the backward pass still runs (Trainer, Note [Overlapped
  // all-reduce] in engine/trainer.cc). StartAllReduceSum queues an in-place SUM all-reduce of one
  // contiguous tensor and returns at once: NCCL runs it on the backend's stream once the work
  // queued so far on the current stream is done; gloo on its own thread. FinishAllReduces makes
  // the current stream wait for every started one (NCCL; the host does not block) or blocks until
  // they are done (gloo), in start order. Every rank must start the same tensors (shapes, dtypes)
  // in the same order. With NCCL both may run while a CUDA graph is captured on the current
  // stream: the collectives and the wait are then part of the graph, and each replay runs them.
  // StartAllReduceSum may be called from the autograd engine's thread while the thread that
  // drives the group waits in backward(). Errors: EngineError(kUnavailable) (gloo: a rank died or
  // timed out).
  void StartAllReduceSum(const at::Tensor& tensor);
  // The same for several tensors at once, in place, as one coalesced collective (c10d's
  // allreduce_coalesced: NCCL groups them into one launch): each may have its own shape; one
  // dtype and device. Every rank must pass the same list.
  void StartAllReduceSum(const std::vector<at::Tensor>& tensors);
  // The same, for the sharded optimizer (DataParallelOptions::shard_optimizer): in place, every
  // rank's tensors[i] summed into tensors[i] of rank roots[i] only (the other ranks' tensors[i]
  // are left as they were); one coalesced collective with NCCL (c10d's startCoalescing /
  // endCoalescing: one NCCL group), one reduce per tensor with gloo. Every rank must pass the
  // same shapes, dtypes and roots.
  void StartReduceSum(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& roots);
  // In place: tensors[i] of every rank takes rank roots[i]'s values; coalesced as StartReduceSum.
  void StartBroadcast(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& roots);
  // Waits for every collective the Start* calls above started (see StartAllReduceSum).
  void FinishAllReduces();
  // Waits for the `count` oldest of them only (all when fewer are pending); the later ones stay
  // pending for a later Finish call.
  void FinishOldest(size_t count);

  // The step watchdog (NCCL groups; no-op for gloo, whose collectives time out and throw by
  // themselves). A collective whose peer died never completes, and a host thread that then waits
  // for the device (a synchronisation, or CUDA calls that block behind the hung kernel) never
  // returns. Arm before a step's work is queued, Disarm once its host synchronisation returned:
  // a step armed for longer than timeout_seconds + 5 s makes the watchdog's thread log
  // "data parallel rank R: ... UNAVAILABLE ..." and end the process with kHangExitStatus
  // (std::_Exit: nothing waits for the hung device), as c10d's NCCL watchdog takes the process
  // down when a collective times out (TORCH_NCCL_ASYNC_ERROR_HANDLING). The 5 s let a caller that
  // is not blocked (Trainer: Note [A rank that dies]) report the timeout itself first.
  static constexpr int kHangExitStatus = 3;
  void ArmStepWatchdog();
  void DisarmStepWatchdog();

  // Peer liveness (Note [Heartbeats] in data_parallel.cc): every rank bumps its counter in the
  // store every heartbeat_seconds from a thread of its own and reads the others'; a rank whose
  // counter has not moved for timeout_seconds, or a store that cannot be reached, is a lost peer.
  // A collective with a lost peer may hang, or (NCCL, once its communicator is aborted) return
  // without reducing anything, so a step must not trust it. Empty while every peer is alive, else
  // a message naming the lost rank. Thread-safe.
  std::string LostPeer() const;
  // Stops the heartbeat and the step watchdog: call it once every rank is done (after a final
  // Barrier), before the process exits, so that a rank that leaves first (rank 0 takes the store
  // with it) is not taken for a lost one. The destructor calls it. Collectives still work.
  void Leave();

 private:
  struct State;
  explicit DataParallelGroup(DataParallelOptions options);
  void StartHeartbeats();
  void StartRooted(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& roots,
                   bool reduce);
  DataParallelOptions options_;
  std::unique_ptr<State> state_;
};

// The contiguous shard of a global batch that `rank` of `world_size` trains: elements
// [rank * p, min((rank + 1) * p, n)) with p = ceil(n / world_size), the split Trainer::Step uses
// for gradient-accumulation micro-batches, so world_size ranks with grad_accum_steps a take the
// step that one rank takes with grad_accum_steps world_size * a. Throws EngineError
// (kInvalidArgument) when the split leaves a rank no example (n < world_size, or n such that the
// last shards are empty, e.g. 5 over 4 ranks).
template <typename T>
std::vector<T> ShardForRank(const std::vector<T>& batch, int64_t rank, int64_t world_size) {
  const int64_t n = static_cast<int64_t>(batch.size());
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw EngineError(EngineError::Code::kInvalidArgument, "rank must lie in [0, world_size)");
  const int64_t per = (n + world_size - 1) / world_size;
  const int64_t begin = rank * per, end = std::min(n, begin + per);
  if (per == 0 || (world_size - 1) * per >= n) {
    throw EngineError(EngineError::Code::kInvalidArgument,
                      "a global batch of " + std::to_string(n) + " examples leaves a rank of " +
                          std::to_string(world_size) +
                          " none: send at least world_size examples, as many per rank "
                          "(a multiple of world_size)");
  }
  return std::vector<T>(batch.begin() + begin, batch.begin() + end);
}

}  // namespace vlmgraph
