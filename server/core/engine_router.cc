#include "server/core/engine_router.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <stdexcept>

#include "base/log.h"
#include "server/core/status.h"

namespace vlmgraph::server {

std::string GpuLabel(const std::string& device, size_t index) {
  const size_t colon = device.find(':');
  if (colon != std::string::npos && colon + 1 < device.size() &&
      std::all_of(device.begin() + static_cast<std::ptrdiff_t>(colon) + 1, device.end(),
                  [](unsigned char c) { return std::isdigit(c) != 0; })) {
    return device.substr(colon + 1);
  }
  return std::to_string(index);
}

namespace {

// Indices of the serving schedulers, sorted by rank(view, the least load among them); ties keep
// the order rotated to start at `start` (round robin).
template <typename Rank>
std::vector<size_t> RankServing(const std::vector<std::unique_ptr<Scheduler>>& schedulers,
                                size_t start, Rank rank) {
  const size_t n = schedulers.size();
  std::vector<std::pair<size_t, Scheduler::LoadView>> serving;  // (rotated position, view)
  int64_t least = INT64_MAX;
  for (size_t k = 0; k < n; ++k) {
    const Scheduler& s = *schedulers[(start + k) % n];
    if (!s.serving()) continue;
    serving.emplace_back(k, s.View());
    least = std::min(least, serving.back().second.load());
  }
  std::vector<std::pair<std::pair<int64_t, int64_t>, size_t>> ranked;
  for (const auto& [k, view] : serving) ranked.push_back({rank(view, least), k});
  std::sort(ranked.begin(), ranked.end());
  std::vector<size_t> order;
  for (const auto& [key, k] : ranked) order.push_back((start + k) % n);
  return order;
}

}  // namespace

EngineRouter::EngineRouter(std::vector<EngineSlot> slots, Metrics* metrics,
                           SchedulerOptions options, std::function<void()> on_every_engine_failed)
    : slots_(std::move(slots)), on_every_engine_failed_(std::move(on_every_engine_failed)) {
  if (slots_.empty()) throw std::invalid_argument("EngineRouter needs at least one engine");
  engines_.assign(slots_.size(), nullptr);
  for (size_t i = 0; i < slots_.size(); ++i) {
    SchedulerOptions o = options;
    o.device = slots_[i].device;
    o.on_device_fault = [this, i, each = options.on_device_fault](const std::string& error) {
      if (each) each(error);
      OnDeviceFault(i, error);
    };
    schedulers_.push_back(
        std::make_unique<Scheduler>(metrics ? &metrics->ForGpu(slots_[i].gpu) : nullptr, o));
  }
}

EngineRouter::~EngineRouter() { Stop(); }

void EngineRouter::Start(size_t i, const Scheduler::EngineStartup& make_engine) {
  schedulers_.at(i)->Start(make_engine);
  engines_[i] = &schedulers_[i]->engine();
}

void EngineRouter::OnDeviceFault(size_t i, const std::string& error) {
  LogError("engine " + std::to_string(i) + " (" + slots_[i].device +
           ") stopped after a device fault: " + error);
  // Note [Device faults] (server/core/scheduler.h): the error is sticky for the whole process, so
  // every other engine stops too, now rather than at its next kernel.
  for (size_t j = 0; j < size(); ++j) {
    if (j != i) {
      schedulers_[j]->StopForProcessFault(error + " (raised on " + slots_[i].device +
                                          "; sticky for every GPU of the process)");
    }
  }
  const int64_t left = serving_engines();
  LogError(std::to_string(left) + " of " + std::to_string(size()) + " engines serve");
  if (left == 0 && !every_engine_failed_.exchange(true) && on_every_engine_failed_) {
    on_every_engine_failed_();
  }
}

int64_t EngineRouter::serving_engines() const {
  int64_t n = 0;
  for (const auto& s : schedulers_) n += s->serving() ? 1 : 0;
  return n;
}

std::vector<size_t> EngineRouter::ByLoad() {
  return RankServing(
      schedulers_, static_cast<size_t>(next_.fetch_add(1) % size()),
      [](const Scheduler::LoadView& v, int64_t) { return std::make_pair(v.load(), int64_t{0}); });
}

void EngineRouter::ThrowNoEngine() const {
  std::string why;
  bool faulted = false;
  for (size_t i = 0; i < size(); ++i) {
    const std::string fault = schedulers_[i]->device_fault();
    faulted = faulted || !fault.empty();
    why += (i ? "; " : "") + slots_[i].device + ": " +
           (fault.empty() ? std::string("not serving") : "failed (" + fault + ")");
  }
  if (!faulted) throw ServerError(grpc::StatusCode::UNAVAILABLE, "server is shutting down");
  throw ServerError(grpc::StatusCode::UNAVAILABLE,
                    "no GPU of this server can serve (" + why +
                        "); the server is restarting: retry on another replica");
}

std::vector<size_t> EngineRouter::ForGenerate() {
  // When every engine runs at least one prefill batch's worth, an engine whose last prefill group
  // is still filling comes first, the fullest first; then load.
  return RankServing(schedulers_, static_cast<size_t>(next_.fetch_add(1) % size()),
                     [](const Scheduler::LoadView& v, int64_t least) {
                       const int64_t partial =
                           v.prefill_batch > 0 ? v.waiting % v.prefill_batch : 0;
                       const bool filling = least >= v.prefill_batch && partial > 0 &&
                                            v.waiting < v.slots - v.running;
                       return filling ? std::make_pair(int64_t{0}, -partial)
                                      : std::make_pair(int64_t{1}, v.load());
                     });
}

Scheduler& EngineRouter::Pick() {
  const std::vector<size_t> order = ByLoad();
  if (order.empty()) ThrowNoEngine();
  return *schedulers_[order.front()];
}

std::shared_ptr<GenerationStream> EngineRouter::SubmitGenerate(ValidatedRequest request,
                                                               Clock::time_point accepted,
                                                               Scheduler** chosen) {
  for (size_t i : ForGenerate()) {
    Scheduler& s = *schedulers_[i];
    // A copy per try (ids and a tensor handle): a refused submission consumed its argument. Only
    // a scheduler that failed after ByLoad saw it serving is passed over; other refusals (a full
    // queue) stand.
    try {
      std::shared_ptr<GenerationStream> stream = s.SubmitGenerate(request, accepted);
      *chosen = &s;
      return stream;
    } catch (const ServerError& e) {
      if (e.code() != grpc::StatusCode::UNAVAILABLE || s.device_fault().empty()) throw;
    }
  }
  ThrowNoEngine();
}

void EngineRouter::RunOnGpuThread(const std::string& rpc,
                                  const std::function<void(Engine&)>& work,
                                  Clock::time_point accepted) {
  for (size_t i : ByLoad()) {
    Scheduler& s = *schedulers_[i];
    try {
      return s.RunOnGpuThread(rpc, work, accepted);
    } catch (const ServerError& e) {
      // Refused or failed before it ran by a scheduler whose device failed: `work` never ran.
      if (e.code() != grpc::StatusCode::UNAVAILABLE || s.device_fault().empty()) throw;
    }
  }
  ThrowNoEngine();
}

std::vector<EngineState> EngineRouter::States() const {
  std::vector<EngineState> states;
  for (size_t i = 0; i < size(); ++i) {
    const Scheduler& s = *schedulers_[i];
    EngineState e;
    e.device = slots_[i].device;
    e.gpu = slots_[i].gpu;
    e.healthy = s.serving();
    e.running = s.Running();
    e.waiting = s.QueueDepth();
    e.error = s.device_fault();
    states.push_back(std::move(e));
  }
  return states;
}

void EngineRouter::StopAccepting() {
  for (auto& s : schedulers_) s->StopAccepting();
}

void EngineRouter::Stop() {
  for (auto& s : schedulers_) s->Stop();
}

}  // namespace vlmgraph::server
