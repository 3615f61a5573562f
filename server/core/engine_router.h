// server/core/engine_router.h: the engines of one server (one per GPU, each with its scheduler and
// GPU thread) behind one gRPC + HTTP front, and the routing of each request to one of them.
//
// clang-format off
//   EngineRouter router({{"cuda:0", "0"}, {"cuda:1", "1"}}, &metrics, scheduler_options,
//                       [] { /* every engine failed */ });
//   for (size_t i = 0; i < router.size(); ++i)               // one after another: no two CUDA
//     router.Start(i, [&] { return WarmedUpEngine(i); });    // graph captures overlap
//   Scheduler& s = router.Pick();                            // least-loaded serving engine
//   auto session = GenerationSession(router, ...);           // picks, submits (generation.h)
//   router.RunOnGpuThread("Forward", [&](Engine& e) { ... }, accepted);   // one engine's thread
//   std::vector<EngineState> states = router.States();       // /health
// clang-format on
//
// Note [Data-parallel routing]: every engine serves the same model with the same config on its
// own device (config key data_parallel_size), so any engine may take any request. Each new
// Generate or Forward goes to the serving engine with the least load, counted as sequences
// running in it plus requests and work items waiting in its queue (Scheduler::Load), as vLLM's
// data-parallel balancer counts them; ties go round robin, so a trickle of requests spreads over
// every engine too. One exception, for Generate on busy engines: when every engine runs or holds
// at least one prefill batch's worth of requests (buckets.max_prefill_batch, as the engine
// rounds it to a bucket), an engine whose last prefill group is still filling (requests wait
// there, not a whole prefill batch, and its free slots take them all) takes the request first,
// the fullest group first. So requests arriving together are prefilled together, in full
// buckets, as one engine would admit them (Note [Batching policy], server/core/scheduler.h): spread
// by load alone, the 32 requests that follow 32 sequences ending together (a closed-loop load)
// landed on every engine in turn, and each engine prefilled more, smaller groups (at 4 x H200, 132
// prefills a second per GPU of 8 requests on average, against 48 of 26 on one GPU), each pausing
// its decoding. The imbalance this allows is one prefill batch: a group starts on the least-loaded
// engine. Below that load, spreading wins (each request on a GPU of its own, whose decode step
// costs about the same at any small batch), so requests go by load alone. A request stays on its
// engine to the end. Requests are validated on the first engine (Engine::Validate is a pure check
// of the config every engine shares). An engine that stopped is skipped from then on. A device
// fault (Note [Device faults], server/core/scheduler.h) is sticky for the whole process, so when
// one engine's GPU fails the router stops every engine with that error (StopForProcessFault): every
// request fails UNAVAILABLE, and on_every_engine_failed runs (the server restarts). With no engine
// left, Pick throws UNAVAILABLE naming each device's error. A submission refused by a scheduler
// that stopped between the pick and the submission is tried on the next serving engine.
//
// A Train job runs on every serving engine, one data-parallel rank per engine
// (server/train/train_ranks.h); a publish or rollback changes every engine
// (server/train/weights_publisher.h).
//
// Thread rules: the constructor, Start, StopAccepting and Stop from the owning (main) thread; Start
// every engine before requests arrive. Pick, RunOnGpuThread, States, serving_engines, engine() and
// scheduler(i) are safe from any thread. Errors: ServerError UNAVAILABLE (no engine serves, or
// shutting down) and what the chosen scheduler throws (RESOURCE_EXHAUSTED when its queue is full).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "server/core/metrics.h"
#include "server/core/scheduler.h"

namespace vlmgraph::server {

// One engine as the server names it.
struct EngineSlot {
  std::string device;  // "cuda:1", "cpu": what the engine is built on
  std::string gpu;     // the metrics' gpu label: the CUDA device index, or the engine's index on CPU
};

// One engine's state, for /health.
struct EngineState {
  std::string device;
  std::string gpu;
  bool healthy = false;  // serving (false: its device failed, or the server is shutting down)
  int64_t running = 0;   // sequences running
  int64_t waiting = 0;   // requests and work items queued
  std::string error;     // the device error when it failed, else ""
};

class EngineRouter {
 public:
  // One scheduler per slot, with `options` (its device set from the slot) and the series
  // metrics->ForGpu(slot.gpu) (metrics may be null: tests). `on_every_engine_failed` (may be
  // empty) is called once, on the failing engine's GPU thread, when the last serving engine's
  // device fails (after options.on_device_fault, which is called for each engine).
  EngineRouter(std::vector<EngineSlot> slots, Metrics* metrics, SchedulerOptions options,
               std::function<void()> on_every_engine_failed = nullptr);
  ~EngineRouter();  // Stop()
  EngineRouter(const EngineRouter&) = delete;
  EngineRouter& operator=(const EngineRouter&) = delete;

  size_t size() const { return schedulers_.size(); }
  const EngineSlot& slot(size_t i) const { return slots_[i]; }
  Scheduler& scheduler(size_t i) const { return *schedulers_[i]; }
  // Starts engine i's GPU thread and waits until `make_engine` (build + warm-up) returned;
  // rethrows what it threw.
  void Start(size_t i, const Scheduler::EngineStartup& make_engine);

  // The first engine: for Validate and the model's accessors (thread-safe, the same for every
  // engine). Valid from its Start until Stop, also after its device failed
  // (a failed engine is never destroyed: Note [Device faults], server/core/scheduler.h).
  Engine& engine() const { return *engines_.front(); }

  // The serving scheduler with the least load (Note [Data-parallel routing]). Throws ServerError
  // UNAVAILABLE when none serves.
  Scheduler& Pick();
  // Picks and queues `request` (Scheduler::SubmitGenerate), trying the next engine when the
  // picked one failed in between. `*chosen` is set to the scheduler it went to.
  std::shared_ptr<GenerationStream> SubmitGenerate(ValidatedRequest request,
                                                   Clock::time_point accepted,
                                                   Scheduler** chosen);
  // Picks an engine and runs `work` on its GPU thread (Scheduler::RunOnGpuThread): Forward. Work
  // that an engine's device fault kept from running is tried on the next serving engine.
  void RunOnGpuThread(const std::string& rpc, const std::function<void(Engine&)>& work,
                      Clock::time_point accepted = Clock::now());

  // Engines serving now.
  int64_t serving_engines() const;
  std::vector<EngineState> States() const;

  // Every scheduler: StopAccepting / Stop.
  void StopAccepting();
  void Stop();

 private:
  // Indices of serving engines by load, least first; ties rotate with next_.
  std::vector<size_t> ByLoad();
  // Indices of serving engines in the order a Generate request tries them: on busy engines,
  // those whose last prefill group is filling (the fullest first); then ByLoad's order (Note
  // [Data-parallel routing]).
  std::vector<size_t> ForGenerate();
  void OnDeviceFault(size_t i, const std::string& error);
  [[noreturn]] void ThrowNoEngine() const;

  const std::vector<EngineSlot> slots_;
  std::vector<std::unique_ptr<Scheduler>> schedulers_;
  std::vector<Engine*> engines_;  // set by Start
  std::function<void()> on_every_engine_failed_;
  std::atomic<uint64_t> next_{0};  // round robin among equal loads
  std::atomic<bool> every_engine_failed_{false};
};

// The metrics' gpu label of `device` ("cuda:3" -> "3"), or `index` for a device without an
// index (the CPU).
std::string GpuLabel(const std::string& device, size_t index);

}  // namespace vlmgraph::server
