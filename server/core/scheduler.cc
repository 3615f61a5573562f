#include "server/core/scheduler.h"

#include <algorithm>

#include "base/log.h"
#include "base/thread_name.h"
#include "engine/device.h"
#include "server/core/status.h"

namespace vlmgraph::server {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::exception_ptr ShuttingDown() {
  return std::make_exception_ptr(
      ServerError(grpc::StatusCode::UNAVAILABLE, "server is shutting down"));
}

std::exception_ptr Cancelled() {
  return std::make_exception_ptr(
      ServerError(grpc::StatusCode::CANCELLED, "request cancelled by the client"));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// GenerationStream

GenerationStream::Update GenerationStream::Wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [this] { return done_ || !tokens_.empty(); });
  Update u;
  u.tokens.swap(tokens_);
  u.logprobs.swap(logprobs_);
  u.prompt_logprobs = std::move(prompt_logprobs_);
  prompt_logprobs_ = nullptr;
  u.done = done_;
  u.reason = reason_;
  u.error = error_;
  return u;
}

void GenerationStream::SetListener(std::function<void()> listener) {
  bool changed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    listener_ = std::move(listener);
    changed = done_ || !tokens_.empty();
  }
  if (changed) Notify();
}

void GenerationStream::Notify() {
  std::function<void()> listener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    listener = listener_;
  }
  if (listener) listener();
}

bool GenerationStream::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void GenerationStream::Push(TokenEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    tokens_.push_back(event.token);
    if (event.logprob) logprobs_.push_back(std::move(*event.logprob));
    if (event.prompt_logprobs) prompt_logprobs_ = std::move(event.prompt_logprobs);
    if (event.finished) {
      done_ = true;
      reason_ = event.reason;
    }
  }
  cv_.notify_all();
  Notify();
}

void GenerationStream::Fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
  Notify();
}

// ---------------------------------------------------------------------------------------------
// Scheduler: submission (any thread)

Scheduler::Scheduler(EngineMetrics* metrics, SchedulerOptions options)
    : metrics_(metrics), options_(options) {}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Start(const EngineStartup& make_engine) {
  std::promise<void> ready;
  std::future<void> started = ready.get_future();
  thread_ = std::thread([this, make_engine, &ready] { Loop(make_engine, &ready); });
  try {
    started.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

void Scheduler::StopAccepting() {
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = false;
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_ = false;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::string Scheduler::device_fault() const {
  std::lock_guard<std::mutex> lock(mu_);
  return device_fault_;
}

void Scheduler::StopForProcessFault(const std::string& fault) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_ || stopping_ || !device_fault_.empty()) return;
    device_fault_ = fault;
    accepting_ = false;
    stopping_ = true;
  }
  cv_.notify_all();
  if (metrics_) metrics_->SetHealthy(false);
  LogError("the device" + (options_.device.empty() ? std::string() : " " + options_.device) +
           " stops serving: " + fault);
}

bool Scheduler::serving() const {
  std::lock_guard<std::mutex> lock(mu_);
  return started_ && accepting_ && !stopping_ && device_fault_.empty();
}

std::exception_ptr Scheduler::FaultError() const {
  return std::make_exception_ptr(
      ServerError(grpc::StatusCode::UNAVAILABLE, FaultMessage(device_fault())));
}

std::string Scheduler::FaultMessage(const std::string& fault) const {
  return "the GPU failed (" + fault + ")" +
         (options_.device.empty() ? std::string() : " on " + options_.device) +
         "; the server restarts (such a CUDA error stops every GPU of the process): retry the "
         "request";
}

bool Scheduler::DeviceFailed() {
  std::string fault;
  try {
    fault = options_.device_fault ? options_.device_fault(*engine_) : engine_->DeviceFault();
  } catch (const std::exception& e) {
    fault = e.what();
  }
  if (fault.empty()) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!device_fault_.empty()) return true;
    device_fault_ = fault;
    accepting_ = false;
    stopping_ = true;
  }
  if (metrics_) metrics_->SetHealthy(false);
  LogError("the device" + (options_.device.empty() ? std::string() : " " + options_.device) +
           " failed and cannot run work until the server restarts: " + fault);
  if (options_.on_device_fault) options_.on_device_fault(fault);
  return true;
}

void Scheduler::CheckAccepting() const {
  if (!device_fault_.empty()) {
    throw ServerError(grpc::StatusCode::UNAVAILABLE, FaultMessage(device_fault_));
  }
  if (!accepting_) throw ServerError(grpc::StatusCode::UNAVAILABLE, "server is shutting down");
  CheckQueueLimit();
}

void Scheduler::CheckQueueLimit() const {
  const int64_t depth = static_cast<int64_t>(pending_.size() + work_.size());
  if (depth >= options_.max_queue_size) {
    throw ServerError(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      "request queue is full (" + std::to_string(depth) +
                          " waiting, batching.max_queue_size = " +
                          std::to_string(options_.max_queue_size) + "); retry later");
  }
}

std::shared_ptr<GenerationStream> Scheduler::SubmitGenerate(ValidatedRequest request,
                                                            Clock::time_point accepted) {
  auto stream = std::make_shared<GenerationStream>(accepted);
  stream->request_.emplace(std::move(request));
  {
    std::lock_guard<std::mutex> lock(mu_);
    CheckAccepting();
    pending_.push_back(stream);
    if (metrics_) metrics_->SetQueueDepth(static_cast<int64_t>(pending_.size()));
  }
  cv_.notify_all();
  return stream;
}

void Scheduler::Cancel(const std::shared_ptr<GenerationStream>& stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels_.push_back(stream);
  }
  cv_.notify_all();
}

void Scheduler::RunOnGpuThread(const std::string& rpc, const std::function<void(Engine&)>& work,
                               Clock::time_point accepted, Admission admission) {
  Enqueue(
      rpc,
      [&work](Engine& engine) {
        work(engine);
        return true;
      },
      accepted, admission);
}

void Scheduler::RunPiecesOnGpuThread(const std::string& rpc,
                                     const std::function<bool(Engine&)>& piece,
                                     Clock::time_point accepted, Admission admission) {
  Enqueue(rpc, piece, accepted, admission);
}

void Scheduler::Enqueue(const std::string& rpc, std::function<bool(Engine&)> fn,
                        Clock::time_point accepted, Admission admission) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> result = done->get_future();
  const bool cleanup = admission == Admission::kCleanup;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!device_fault_.empty()) {
      throw ServerError(grpc::StatusCode::UNAVAILABLE, FaultMessage(device_fault_));
    }
    if (stopping_) throw ServerError(grpc::StatusCode::UNAVAILABLE, "server is shutting down");
    if (admission == Admission::kNew) {
      CheckAccepting();
    } else if (admission == Admission::kInFlight) {
      CheckQueueLimit();
    }
    work_.push_back(WorkItem{rpc, std::move(fn), accepted, cleanup, false, done});
  }
  cv_.notify_all();
  // Rethrows the work's exception; Stop() fails queued items, so this returns. `fn` may refer to
  // the caller's locals: this returns only after its last call.
  result.get();
}

int64_t Scheduler::QueueDepth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(pending_.size() + work_.size());
}

int64_t Scheduler::Load() const { return QueueDepth() + running_count_.load(); }

Scheduler::LoadView Scheduler::View() const {
  LoadView v;
  {
    std::lock_guard<std::mutex> lock(mu_);
    v.waiting = static_cast<int64_t>(pending_.size());
    v.work = static_cast<int64_t>(work_.size());
    // Under mu_: the GPU thread moves requests from pending_ into running_count_ under it too.
    v.running = running_count_.load();
  }
  v.slots = slots_.load();
  v.prefill_batch = prefill_batch_.load();
  return v;
}

// ---------------------------------------------------------------------------------------------
// Scheduler: the GPU thread

int64_t Scheduler::AdmissibleNow() const {
  // Up to the free slots, in queue order while KV pages last (Note [KV pages per sequence],
  // engine/engine.h): a request that does not fit waits at the head for pages to come back.
  std::vector<const ValidatedRequest*> queue;
  const size_t limit = static_cast<size_t>(engine_->FreeSlots());
  for (const auto& stream : pending_) {
    if (queue.size() == limit) break;
    if (stream->request_) queue.push_back(&*stream->request_);
  }
  return engine_->AdmissibleCount(queue);
}

int64_t Scheduler::ToAdmit(Clock::time_point now) const {
  if (pending_.empty()) return 0;
  const int64_t admissible = AdmissibleNow();
  if (admissible == 0) return 0;
  // A full admission (every free slot, or one whole prefill batch) gains nothing by waiting, nor
  // does one that KV pages cut short: more requests would not join it.
  const int64_t free = engine_->FreeSlots();
  const int64_t batch = prefill_batch_.load();
  const int64_t full = batch > 0 ? std::min(free, batch) : free;
  const int64_t pending = static_cast<int64_t>(pending_.size());
  if (pending >= full || admissible < std::min(pending, free)) return admissible;
  const bool waited =
      now - pending_.front()->accepted() >= std::chrono::microseconds(options_.max_queue_delay_us);
  return waited ? admissible : 0;
}

void Scheduler::Loop(const EngineStartup& make_engine, std::promise<void>* ready) {
  // "vlmg-cuda:1", "vlmg-cpu": the engine's GPU thread in top -H and bench/thread_cpu.py.
  NameCurrentThread("vlmg-" + (options_.device.empty() ? std::string("engine") : options_.device));
  try {
    // Everything this thread runs is for its engine's device (Note [Data-parallel routing]).
    if (!options_.device.empty()) BindThreadToDevice(at::Device(options_.device));
    owned_engine_ = make_engine();
    engine_ = owned_engine_.get();
    slots_ = engine_->options().buckets.max_batch();
    prefill_batch_ = engine_->options().buckets.max_prefill();
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      accepting_ = false;
      stopping_ = true;
    }
    ready->set_exception(std::current_exception());
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = true;
  }
  ready->set_value();
  Serve();
  FailEverything();
  engine_ = nullptr;  // engine() is valid from Start() to Stop() only
  if (!device_fault().empty()) {
    // Its destructor would call into the failed CUDA context; the process is about to exit.
    (void)owned_engine_.release();
  }
  owned_engine_.reset();
}

void Scheduler::Serve() {
  std::vector<TokenEvent> events;
  while (true) {
    std::vector<std::shared_ptr<GenerationStream>> cancels, admit;
    std::deque<WorkItem> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (!stopping_ && cancels_.empty() && work_.empty() && engine_->ActiveSequences() == 0 &&
             ToAdmit(Clock::now()) == 0) {
        // Idle, or holding requests back to batch them: sleep until the oldest one's delay ends
        // (or a second passes, to refresh the memory gauges) unless something arrives first.
        const auto deadline = pending_.empty()
                                  ? Clock::now() + std::chrono::seconds(1)
                                  : pending_.front()->accepted() +
                                        std::chrono::microseconds(options_.max_queue_delay_us);
        if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && pending_.empty()) {
          lock.unlock();
          UpdateGauges(/*force=*/true);
          lock.lock();
        }
      }
      if (stopping_) break;
      cancels.swap(cancels_);
      work.swap(work_);
      if (const int64_t n = ToAdmit(Clock::now()); n > 0) {
        for (int64_t i = 0; i < n; ++i) {
          admit.push_back(std::move(pending_.front()));
          pending_.pop_front();
        }
        running_count_ += n;  // counted as running through their prefill (Load), until Admit
      }
      if (metrics_) metrics_->SetQueueDepth(static_cast<int64_t>(pending_.size() + work_.size()));
    }
    for (const auto& stream : cancels) CancelOnGpuThread(stream);
    // On a device fault the items and requests taken from the queue go back, for FailEverything.
    auto give_back = [&] {
      std::lock_guard<std::mutex> lock(mu_);
      work_.insert(work_.begin(), std::make_move_iterator(work.begin()),
                   std::make_move_iterator(work.end()));
      pending_.insert(pending_.begin(), std::make_move_iterator(admit.begin()),
                      std::make_move_iterator(admit.end()));
    };
    while (!work.empty()) {
      WorkItem item = std::move(work.front());
      work.pop_front();
      if (metrics_ && !item.cleanup && !item.started)
        metrics_->ObserveQueueTime(item.rpc, Seconds(Clock::now() - item.accepted));
      item.started = true;
      bool finished = true;
      try {
        finished = item.fn(*engine_);
        if (finished) item.done->set_value();
      } catch (...) {
        // On a failed device the item fails as its requests do: UNAVAILABLE (retryable).
        const bool dead = DeviceFailed();
        item.done->set_exception(dead ? FaultError() : std::current_exception());
        if (dead) return give_back();
      }
      if (!finished) {
        // Its next piece runs in the next iteration, after admission and a decode step (Note
        // [Interleaving bound]); Stop() fails it there if the thread stops first.
        std::lock_guard<std::mutex> lock(mu_);
        work_.push_back(std::move(item));
      }
    }
    if (!admit.empty() && !Admit(std::move(admit), &events)) return;
    if (engine_->ActiveSequences() > 0) {
      try {
        engine_->Step(&events);
      } catch (...) {
        // A failed decode step leaves no sequence in a known state: end them all with the error
        // (UNAVAILABLE when the device failed for good).
        LogError("decode step failed; ending every running sequence");
        const bool dead = DeviceFailed();
        const std::exception_ptr error = dead ? FaultError() : std::current_exception();
        for (auto& [id, stream] : running_) stream->Fail(error);
        running_.clear();
        CountRunning();
        events.clear();
        if (dead) return;
        engine_->CancelAll();  // every slot, owned or not
      }
    }
    Route(&events);
    UpdateGauges(/*force=*/false);
  }
}

bool Scheduler::Admit(std::vector<std::shared_ptr<GenerationStream>> batch,
                      std::vector<TokenEvent>* events) {
  // Every request was validated before it was queued (ValidatedRequest).
  std::vector<std::shared_ptr<GenerationStream>> ok;
  std::vector<ValidatedRequest> requests;
  const auto now = Clock::now();
  for (auto& stream : batch) {
    if (stream->done()) continue;  // cancelled between queueing and admission
    const double waited = Seconds(now - stream->accepted());
    stream->queue_seconds_ = waited;
    if (metrics_) metrics_->ObserveQueueTime("Generate", waited);
    requests.push_back(std::move(*stream->request_));
    stream->request_.reset();
    ok.push_back(std::move(stream));
  }
  if (ok.empty()) return true;
  try {
    const std::vector<SequenceId> ids = engine_->Admit(std::move(requests), events);
    for (size_t i = 0; i < ids.size() && i < ok.size(); ++i) {
      ok[i]->id_ = ids[i];
      running_[ids[i]] = ok[i];
    }
    CountRunning();
  } catch (...) {
    const bool dead = DeviceFailed();
    const std::exception_ptr error = dead ? FaultError() : std::current_exception();
    for (auto& stream : ok) stream->Fail(error);
    return !dead;
  }
  return true;
}

void Scheduler::Route(std::vector<TokenEvent>* events) {
  for (TokenEvent& ev : *events) {
    auto it = running_.find(ev.id);
    if (it == running_.end()) {
      // A sequence nobody owns (its admission failed half-way): free its slot.
      if (!ev.finished) engine_->Cancel(ev.id);
      continue;
    }
    it->second->Push(ev);
    if (ev.finished) running_.erase(it);
  }
  CountRunning();
  events->clear();
}

void Scheduler::CancelOnGpuThread(const std::shared_ptr<GenerationStream>& stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(pending_.begin(), pending_.end(), stream);
    if (it != pending_.end()) pending_.erase(it);
    if (metrics_) metrics_->SetQueueDepth(static_cast<int64_t>(pending_.size() + work_.size()));
  }
  if (stream->id_ >= 0 && running_.erase(stream->id_) > 0) engine_->Cancel(stream->id_);
  CountRunning();
  stream->Fail(Cancelled());
}

void Scheduler::FailEverything() {
  std::deque<std::shared_ptr<GenerationStream>> pending;
  std::deque<WorkItem> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(pending_);
    work.swap(work_);
    cancels_.clear();
  }
  const std::exception_ptr error = device_fault().empty() ? ShuttingDown() : FaultError();
  for (auto& stream : pending) stream->Fail(error);
  for (auto& item : work) item.done->set_exception(error);
  for (auto& [id, stream] : running_) {
    engine_->Cancel(id);
    stream->Fail(error);
  }
  running_.clear();
  CountRunning();
  UpdateGauges(/*force=*/true);
}

void Scheduler::UpdateGauges(bool force) {
  if (!metrics_) return;
  const auto now = Clock::now();
  if (!force && now - last_gauges_ < std::chrono::milliseconds(250)) return;
  last_gauges_ = now;
  metrics_->SetQueueDepth(QueueDepth());
  metrics_->SetActiveSequences(engine_->ActiveSequences());
  metrics_->SetMemory(engine_->Memory());
}

}  // namespace vlmgraph::server
