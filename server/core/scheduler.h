// server/core/scheduler.h: the bounded request queue and the one GPU thread that drives the Engine.
//
// Every engine call happens on the scheduler's GPU thread (engine.h's thread rule). RPC handlers
// (gRPC threads) validate and convert requests, then:
// clang-format off
//   Scheduler scheduler(&metrics, options);
//   scheduler.Start([&] {                                                  // on the GPU thread
//     auto engine = BuildEngine(cfg);
//     engine->Warmup();
//     return engine;
//   });
//   auto stream = scheduler.SubmitGenerate(std::move(request), accepted);  // throws when full
//   GenerationStream::Update u;
//   while (!(u = stream->Wait(50ms)).done) Send(u.tokens);                 // tokens as they decode
//   scheduler.Cancel(stream);                                              // the client went away
//   scheduler.RunOnGpuThread("Forward", [&](Engine& e) { ... });           // Forward, saves
//   scheduler.RunPiecesOnGpuThread("Train", [&](Engine& e) {               // a Train step:
//     return job->RunNextMicroBatch();                                     //   true when done
//   });
// clang-format on
//
// Note [Batching policy]: the GPU thread loops over
//   1. cancellations (Engine::Cancel frees the KV slot at once),
//   2. queued work items (Forward, training steps, checkpoint saves), in arrival order; an item
//      in pieces (RunPiecesOnGpuThread: a Train step, one micro-batch per piece) runs one piece
//      and, unless that was its last, goes back to the end of the queue for the next iteration,
//   3. admission: waiting Generate requests are admitted (vision + prefill in bucket-sized groups,
//      first token) when the engine has free slots and either as many requests wait as one
//      admission can take (the free slots, or one largest prefill batch when more are free) or
//      the oldest has waited max_queue_delay_us, so a burst of requests lands in full prefill
//      buckets (Triton's max_queue_delay, which also starts a preferred batch size at once);
//   4. one decode step for every active sequence (continuous batching: a finished sequence frees
//      its slot, and the next iteration's admission refills it, so long generations never block
//      short ones).
// The queue is bounded: more than max_queue_size waiting requests (Generate and work items
// together) -> RESOURCE_EXHAUSTED. After StopAccepting() submissions fail with UNAVAILABLE.
//
// Note [Interleaving bound]: between two decode steps the GPU thread runs at most one piece of
// each work item that was queued before the first of them, so a running Generate waits for at
// most the work items ahead of it, and a Train step never for more than one of its micro-batches:
// its forward + backward at the size of a train bucket (the last one also runs the optimizer
// step and the step's one host synchronisation). On the GPU that is one replay of a captured
// micro-step, 40-150 ms today (docs/design/training.md); on the CPU one eager micro-step of a
// bucket's size. A batch wider than the largest train bucket is split into micro-batches that
// fit it (engine/trainer.h, Note [Micro-batches]); an example longer than every bucket still
// runs as one eager micro-batch, bounded by limits.max_train_batch_tokens. Not split: a job's
// first step also captures the job's graphs in its first piece, once per job (seconds for
// nanovlm-460m), and creating a job, saving a checkpoint and publishing are one item each.
//
// Note [Device faults]: after any engine call fails, the GPU thread asks the engine whether its
// device still works (Engine::DeviceFault). A CUDA error that leaves the context unusable (a
// device-side assert, an illegal memory access) cannot be recovered inside the process: the
// scheduler stops accepting (serving() turns false, vlmgraph_engine_healthy{gpu} 0), fails
// everything queued or running with UNAVAILABLE naming the error and the device, stops its loop
// (it never retries on a dead device) and calls SchedulerOptions::on_device_fault once. Such an
// error is sticky for the whole process, not for one GPU (CUDA: "any further CUDA work will
// return the same error; the process must be terminated"): on 2 H100s, a device-side assert on
// cuda:1 made the next synchronise on cuda:0 return cudaErrorAssert too
// (DataParallelGpus.AFaultOnOneGpuStopsEveryEngine_CUDA). So with several engines
// (server/core/engine_router.h) the router stops every other engine at once with the same error
// (StopForProcessFault): their requests fail UNAVAILABLE at once instead of at their next
// kernel, and the server's main shuts down with a non-zero exit status, so the container's
// restart policy brings up a fresh process (as vLLM's API server exits when its engine dies).
// One server process per GPU behind a load balancer keeps the other GPUs serving. A failed
// decode step that leaves the device usable ends the running sequences with the error and frees
// every slot.
//
// Thread rules: Submit*, Cancel, RunOnGpuThread, QueueDepth, Load, serving and engine() (for the Engine's
// thread-safe methods only) are safe from any thread; Start and Stop from the owning (main)
// thread. The engine is built, warmed up, driven and destroyed on the GPU thread. Errors reach
// handlers as exception_ptrs (Update::error) or exceptions (RunOnGpuThread), never as statuses; the
// RPC guard converts them.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "engine/engine.h"
#include "server/core/metrics.h"

namespace vlmgraph::server {

using Clock = std::chrono::steady_clock;

struct SchedulerOptions {
  int64_t max_queue_delay_us = 2000;
  int64_t max_queue_size = 256;  // waiting requests and work items of this scheduler
  // The engine's device as users name it ("cuda:1", "cpu"): the GPU thread's current device
  // (BindThreadToDevice, before the engine is made), and in logs and in the error a device fault
  // gives its requests. May be empty.
  std::string device;
  // Called once, on the GPU thread, with the error when the device fails for good (Note [Device
  // faults]). May be empty.
  std::function<void(const std::string& error)> on_device_fault;
  // How the GPU thread asks whether the device still works after a failed engine call: "" = it
  // does. Empty: Engine::DeviceFault. (Tests inject faults through it.)
  std::function<std::string(Engine&)> device_fault;
};

// One Generate request's channel from the GPU thread to its RPC handler.
class GenerationStream {
 public:
  struct Update {
    std::vector<int64_t> tokens;  // new since the previous Wait
    // One per token when the request asked for logprobs (LogprobsParams::tokens), else empty.
    std::vector<TokenLogprob> logprobs;
    // The prompt's logprobs, in the update with the first token when the request asked
    // (LogprobsParams::prompt); else null.
    std::shared_ptr<const std::vector<TokenLogprob>> prompt_logprobs;
    bool done = false;            // no more tokens will come
    FinishReason reason = FinishReason::kNone;
    std::exception_ptr error;  // set when the request failed (done is true)
  };

  explicit GenerationStream(Clock::time_point accepted) : accepted_(accepted) {}

  // Blocks until tokens arrive, the stream ends, or `timeout` passes (empty update). A zero
  // timeout takes what has arrived without blocking.
  Update Wait(std::chrono::milliseconds timeout);

  // Called after every change (tokens, end, failure), from the thread that made it (the GPU
  // thread, or the canceller's), outside the stream's lock; it must not block and must not call
  // Wait itself (post the work elsewhere: event-driven transports, server/http/http_server.h). Set
  // once, before the change it should see; a change made before it was set is signalled at once.
  void SetListener(std::function<void()> listener);

  Clock::time_point accepted() const { return accepted_; }
  // Seconds from acceptance to admission (prefill start); 0 before admission.
  double queue_seconds() const { return queue_seconds_.load(); }

 private:
  friend class Scheduler;
  bool done();
  void Push(TokenEvent& event);  // moves its logprobs
  void Fail(std::exception_ptr error);
  void Notify();

  const Clock::time_point accepted_;
  std::atomic<double> queue_seconds_{0};
  std::optional<ValidatedRequest> request_;  // moved into the engine at admission
  SequenceId id_ = -1;                       // GPU thread only

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int64_t> tokens_;
  std::vector<TokenLogprob> logprobs_;
  std::shared_ptr<const std::vector<TokenLogprob>> prompt_logprobs_;
  bool done_ = false;
  FinishReason reason_ = FinishReason::kNone;
  std::exception_ptr error_;
  std::function<void()> listener_;  // mu_
};

class Scheduler {
 public:
  // Builds and warms up the engine; called on the GPU thread by Start.
  using EngineStartup = std::function<std::unique_ptr<Engine>()>;

  // `metrics` (this engine's series; may be null: tests) must outlive the scheduler.
  Scheduler(EngineMetrics* metrics, SchedulerOptions options);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Starts the GPU thread, which calls `make_engine` (build + warm-up) and then serves. Returns
  // when the engine is ready; rethrows what `make_engine` threw (the thread has then ended).
  void Start(const EngineStartup& make_engine);
  // The engine, from Start() until Stop(). Other threads may only call its thread-safe methods
  // (Validate, Counters, Memory, accessors).
  Engine& engine() const { return *engine_; }
  // New submissions fail with UNAVAILABLE from now on; queued and running work continues.
  void StopAccepting();
  // Ends everything still queued or running (streams and work items fail with UNAVAILABLE
  // "server is shutting down"), then joins the GPU thread. Idempotent.
  void Stop();
  // The device error that stopped the GPU thread (Note [Device faults]), "" if none. Any thread.
  std::string device_fault() const;
  // Note [Device faults]: another engine's GPU failed with an error that is sticky for the whole
  // process. This one stops as if its own had failed with `fault` (everything queued or running
  // fails UNAVAILABLE), without asking its device, and without calling on_device_fault. No-op
  // before Start returned or once stopped. Any thread.
  void StopForProcessFault(const std::string& fault);
  // Whether new work is accepted now: started, no device fault, not stopping. Any thread.
  bool serving() const;
  const SchedulerOptions& options() const { return options_; }

  // Queues a validated request. Throws ServerError RESOURCE_EXHAUSTED (queue full) or
  // UNAVAILABLE (stopping).
  std::shared_ptr<GenerationStream> SubmitGenerate(ValidatedRequest request,
                                                   Clock::time_point accepted);
  // Ends `stream` (queued or running) with CANCELLED; a finished stream is left alone.
  void Cancel(const std::shared_ptr<GenerationStream>& stream);

  // How a work item is admitted to the queue.
  enum class Admission {
    kNew,       // a new call's work: RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE
                // after StopAccepting()
    kInFlight,  // the next step of a call already accepted (a running Train job): queue limit
                // only, so it drains after StopAccepting()
    kCleanup,   // releasing or saving a job's state: refused only once the GPU thread is stopping
  };

  // Runs `work` on the GPU thread between decode steps and waits for it; rethrows what `work`
  // throws. Records vlmgraph_queue_time_seconds{rpc} from `accepted` (when the RPC or message
  // arrived), except for kCleanup items. Throws ServerError as `admission` says.
  void RunOnGpuThread(const std::string& rpc, const std::function<void(Engine&)>& work,
                      Clock::time_point accepted = Clock::now(),
                      Admission admission = Admission::kNew);
  // As RunOnGpuThread, for work in pieces: calls `piece` once per loop iteration, with admission
  // and a decode step between calls (Note [Interleaving bound]), until it returns true (the last
  // piece) or throws (rethrown here; no more calls). Waits for the last piece. The queue time is
  // recorded once, for the first piece. If the scheduler stops between pieces, this throws
  // UNAVAILABLE and `piece` is not called again.
  void RunPiecesOnGpuThread(const std::string& rpc, const std::function<bool(Engine&)>& piece,
                            Clock::time_point accepted = Clock::now(),
                            Admission admission = Admission::kNew);

  // Generate requests and work items waiting (the queue).
  int64_t QueueDepth() const;
  // What the router balances (server/core/engine_router.h): sequences running in the engine plus
  // requests and work items waiting, as vLLM's data-parallel balancer counts them. Any thread.
  int64_t Load() const;
  // Sequences running in the engine (as of the GPU thread's last change). Any thread.
  int64_t Running() const { return running_count_.load(); }

  // The queue as the router weighs it for a Generate request (Note [Data-parallel routing] in
  // server/core/engine_router.h): one consistent reading of the counts. Any thread.
  struct LoadView {
    int64_t running = 0;        // Running()
    int64_t waiting = 0;        // Generate requests waiting for admission
    int64_t work = 0;           // work items waiting
    int64_t slots = 0;          // the engine's sequence slots (decode rows); 0 before Start
    int64_t prefill_batch = 0;  // the most requests one prefill takes; 0 before Start
    int64_t load() const { return running + waiting + work; }
  };
  LoadView View() const;

 private:
  struct WorkItem {
    std::string rpc;
    std::function<bool(Engine&)> fn;  // true: done; false: call again next iteration
    Clock::time_point accepted;
    bool cleanup = false;
    bool started = false;  // a piece has run (its queue time is recorded)
    std::shared_ptr<std::promise<void>> done;
  };
  void Enqueue(const std::string& rpc, std::function<bool(Engine&)> fn, Clock::time_point accepted,
               Admission admission);

  void Loop(const EngineStartup& make_engine, std::promise<void>* ready);
  void Serve();
  void CheckAccepting() const;  // mu_ held
  // After a failed engine call (GPU thread): true when the device failed for good; then
  // device_fault_ is set, accepting_ is off and on_device_fault has been called.
  bool DeviceFailed();
  void CheckQueueLimit() const;                    // mu_ held
  // How many pending requests to admit now: AdmissibleNow() once waiting gains nothing (a full
  // admission, one that KV pages cut short, or the oldest request's max_queue_delay_us passed),
  // else 0. mu_ held, GPU thread.
  int64_t ToAdmit(Clock::time_point now) const;
  // How many pending requests, from the head, the engine can admit now (slots and KV pages).
  int64_t AdmissibleNow() const;  // mu_ held, GPU thread
  // Admits `batch` into the engine; false when the device failed for good (Note [Device faults]).
  bool Admit(std::vector<std::shared_ptr<GenerationStream>> batch, std::vector<TokenEvent>* events);
  void Route(std::vector<TokenEvent>* events);
  void CancelOnGpuThread(const std::shared_ptr<GenerationStream>& stream);
  void FailEverything();
  void UpdateGauges(bool force);
  std::string FaultMessage(const std::string& fault) const;  // UNAVAILABLE's message
  std::exception_ptr FaultError() const;  // ServerError UNAVAILABLE with device_fault()'s message
  void CountRunning() { running_count_ = static_cast<int64_t>(running_.size()); }  // GPU thread

  std::unique_ptr<Engine> owned_engine_;  // GPU thread: created, used and destroyed there
  Engine* engine_ = nullptr;
  EngineMetrics* metrics_;
  const SchedulerOptions options_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<GenerationStream>> pending_;
  std::deque<WorkItem> work_;
  std::vector<std::shared_ptr<GenerationStream>> cancels_;
  bool accepting_ = true;
  bool stopping_ = false;
  bool started_ = false;      // mu_: the engine is ready
  std::string device_fault_;  // mu_; set once by the GPU thread
  std::atomic<int64_t> running_count_{0};  // running_.size(), for Load from any thread
  // The engine's options().buckets.max_batch() and max_prefill(), for View (set once at Start).
  std::atomic<int64_t> slots_{0};
  std::atomic<int64_t> prefill_batch_{0};

  // GPU thread only.
  std::map<SequenceId, std::shared_ptr<GenerationStream>> running_;
  Clock::time_point last_gauges_{};

  std::thread thread_;
};

}  // namespace vlmgraph::server
