// engine/data_parallel.cc: see data_parallel.h.
#include "engine/data_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#ifndef VLMGRAPH_HAVE_GLOO
#define VLMGRAPH_HAVE_GLOO 0
#endif
#ifndef VLMGRAPH_HAVE_NCCL
#define VLMGRAPH_HAVE_NCCL 0
#endif

#if VLMGRAPH_HAVE_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if VLMGRAPH_HAVE_NCCL
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

namespace vlmgraph {
namespace {

std::string LogSeconds(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", seconds);
  return buf;
}

std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3));
}

}  // namespace

struct DataParallelGroup::State {
  c10::intrusive_ptr<c10d::TCPStore> tcp_store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::vector<c10::intrusive_ptr<c10d::Work>> started;  // StartAllReduceSum .. FinishAllReduces
  // The step watchdog (ArmStepWatchdog): its thread, started on the first Arm.
  std::mutex watchdog_mu;
  std::condition_variable watchdog_cv;
  std::optional<std::chrono::steady_clock::time_point> armed_at;
  bool watchdog_stop = false;
  std::thread watchdog;
  // Heartbeats (Note [Heartbeats]): their own store client and thread.
  c10::intrusive_ptr<c10d::Store> heartbeat_store;
  std::thread heartbeat;
  mutable std::mutex lost_mu;
  std::string lost_peer;
};

// Note [Heartbeats]: a rank killed with SIGKILL says nothing to the others. Gloo notices when the
// next collective's socket fails; NCCL may not notice at all (a kernel waits for the dead peer's
// data for ever; once c10d aborts the communicator, a replayed graph's collectives return at once
// without reducing, so training would go on with local gradients only). So, as torchrun's agents
// keep heartbeats, each rank's thread bumps "<group>/heartbeat/<rank>" in the store every
// heartbeat_seconds and reads every other rank's counter; one that has not moved for
// timeout_seconds, or a store that fails (rank 0, which serves it, died), marks the peer lost.
// The Trainer checks LostPeer before and after every step; an NCCL group also ends the process as
// its step watchdog does (the device may be running a collective that never completes).

bool DataParallelGroup::BackendAvailable(const std::string& backend) {
  if (backend == "gloo") return VLMGRAPH_HAVE_GLOO != 0;
  if (backend == "nccl") return VLMGRAPH_HAVE_NCCL != 0;
  return false;
}

DataParallelGroup::DataParallelGroup(DataParallelOptions options)
    : options_(std::move(options)), state_(std::make_unique<State>()) {}

DataParallelGroup::~DataParallelGroup() { Leave(); }

void DataParallelGroup::Leave() {
  {
    std::lock_guard<std::mutex> lock(state_->watchdog_mu);
    state_->watchdog_stop = true;
  }
  state_->watchdog_cv.notify_all();
  if (state_->watchdog.joinable()) state_->watchdog.join();
  if (state_->heartbeat.joinable()) state_->heartbeat.join();
}

std::string DataParallelGroup::LostPeer() const {
  std::lock_guard<std::mutex> lock(state_->lost_mu);
  return state_->lost_peer;
}

void DataParallelGroup::StartHeartbeats() {
  State& st = *state_;
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(store_port());
  so.isServer = false;
  so.numWorkers = static_cast<int>(options_.world_size);
  so.waitWorkers = false;
  so.timeout = Millis(options_.timeout_seconds);
  st.heartbeat_store = c10::make_intrusive<c10d::PrefixStore>(
      options_.group_name + "/heartbeat",
      c10::make_intrusive<c10d::TCPStore>(options_.store_host, so));
  st.heartbeat = std::thread([this, &st] {
    using Clock = std::chrono::steady_clock;
    const auto period = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(options_.heartbeat_seconds));
    const auto limit = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(options_.timeout_seconds));
    std::vector<int64_t> seen(options_.world_size, -1);
    std::vector<Clock::time_point> moved(options_.world_size, Clock::now());
    int store_failures = 0;
    std::unique_lock<std::mutex> lock(st.watchdog_mu);
    while (!st.watchdog_stop) {
      lock.unlock();
      std::string lost;
      try {
        st.heartbeat_store->add(std::to_string(options_.rank), 1);
        store_failures = 0;
        const auto now = Clock::now();
        for (int64_t r = 0; r < options_.world_size && lost.empty(); ++r) {
          if (r == options_.rank) continue;
          const int64_t count = st.heartbeat_store->add(std::to_string(r), 0);
          if (count != seen[r]) {
            seen[r] = count;
            moved[r] = now;
          } else if (now - moved[r] > limit) {
            lost = "rank " + std::to_string(r) + " sent no heartbeat for " +
                   LogSeconds(options_.timeout_seconds) + " (it died or hangs)";
          }
        }
      } catch (const std::exception& e) {
        // A store that fails twice in a row: one failure may be rank 0 leaving at the end of a
        // job while this rank is about to Leave too.
        if (++store_failures >= 2) {
          lost = "the store at " + options_.store_host + ":" + std::to_string(store_port()) +
                 " failed (rank 0 died?): " + e.what();
        }
      }
      if (!lost.empty()) {
        lock.lock();
        if (st.watchdog_stop) return;  // Leave() came first: the job ended
        lock.unlock();
        {
          std::lock_guard<std::mutex> l(st.lost_mu);
          st.lost_peer = lost;
        }
        if (options_.backend == "nccl") {
          std::fprintf(stderr,
                       "data parallel rank %lld: UNAVAILABLE: %s; ending the process "
                       "(status %d)\n",
                       static_cast<long long>(options_.rank), lost.c_str(), kHangExitStatus);
          std::fflush(stderr);
          std::_Exit(kHangExitStatus);
        }
        return;
      }
      lock.lock();
      st.watchdog_cv.wait_for(lock, period);
    }
  });
}

void DataParallelGroup::ArmStepWatchdog() {
  if (options_.backend != "nccl" || options_.world_size == 1) return;
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.watchdog_mu);
  st.armed_at = std::chrono::steady_clock::now();
  if (st.watchdog.joinable()) return;
  const auto limit = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(options_.timeout_seconds + 5));
  st.watchdog = std::thread([&st, limit, rank = options_.rank, timeout = options_.timeout_seconds] {
    std::unique_lock<std::mutex> lock(st.watchdog_mu);
    while (!st.watchdog_stop) {
      if (!st.armed_at) {
        st.watchdog_cv.wait(lock);
        continue;
      }
      const auto deadline = *st.armed_at + limit;
      if (std::chrono::steady_clock::now() < deadline) {
        st.watchdog_cv.wait_until(lock, deadline);
        continue;
      }
      std::fprintf(stderr,
                   "data parallel rank %lld: UNAVAILABLE: a step did not finish within "
                   "timeout_seconds (%g s): a rank died or hangs; ending the process (status %d)\n",
                   static_cast<long long>(rank), timeout, kHangExitStatus);
      std::fflush(stderr);
      std::_Exit(kHangExitStatus);
    }
  });
}

void DataParallelGroup::DisarmStepWatchdog() {
  std::lock_guard<std::mutex> lock(state_->watchdog_mu);
  state_->armed_at.reset();
}

std::shared_ptr<DataParallelGroup> DataParallelGroup::Join(const DataParallelOptions& options) {
  if (options.world_size < 1)
    throw EngineError::InvalidArgument("data parallel: world_size must be >= 1");
  if (options.rank < 0 || options.rank >= options.world_size) {
    throw EngineError::InvalidArgument("data parallel: rank " + std::to_string(options.rank) +
                                       " outside [0, " + std::to_string(options.world_size) + ")");
  }
  if (!(options.timeout_seconds > 0))
    throw EngineError::InvalidArgument("data parallel: timeout_seconds must be > 0");
  if (options.bucket_bytes <= 0)
    throw EngineError::InvalidArgument("data parallel: bucket_bytes must be > 0");
  if (options.reduce_dtype && *options.reduce_dtype != at::kFloat &&
      *options.reduce_dtype != at::kBFloat16) {
    throw EngineError::InvalidArgument("data parallel: reduce_dtype must be float32 or bfloat16");
  }
  if (options.store_port < 0 || options.store_port > 65535 ||
      (options.store_port == 0 && (options.rank != 0 || options.launcher_store))) {
    throw EngineError::InvalidArgument(
        "data parallel: store_port must lie in [1, 65535] (0 only on rank 0)");
  }
  if (options.backend != "gloo" && options.backend != "nccl")
    throw EngineError::InvalidArgument(
        "data parallel: backend must be \"gloo\" or \"nccl\", not \"" + options.backend + "\"");
  if (!BackendAvailable(options.backend)) {
    throw EngineError::InvalidArgument(
        "data parallel: this build has no " + options.backend + " backend (" +
        (options.backend == "gloo"
             ? std::string("install Debian's libgloo-dev and rebuild")
             : std::string("a CUDA build with the nccl.h of the nvidia-nccl wheel")) +
        ")");
  }
  std::shared_ptr<DataParallelGroup> group(new DataParallelGroup(options));
  const std::string where = "data parallel rank " + std::to_string(options.rank) + " of " +
                            std::to_string(options.world_size) + " (store " + options.store_host +
                            ":" + std::to_string(options.store_port) + ")";
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(options.store_port);
    so.isServer = options.rank == 0 && !options.launcher_store;
    so.numWorkers = static_cast<int>(options.world_size);
    so.waitWorkers = false;  // the backend's rendezvous below waits for every rank
    so.timeout = Millis(options.timeout_seconds);
    group->state_->tcp_store = c10::make_intrusive<c10d::TCPStore>(options.store_host, so);
    if (so.isServer && options.on_store_serving)
      options.on_store_serving(group->state_->tcp_store->getPort());
    auto store =
        c10::make_intrusive<c10d::PrefixStore>(options.group_name, group->state_->tcp_store);
    const int rank = static_cast<int>(options.rank), size = static_cast<int>(options.world_size);
#if VLMGRAPH_HAVE_GLOO
    if (options.backend == "gloo") {
      auto o = c10d::ProcessGroupGloo::Options::create();
      o->timeout = Millis(options.timeout_seconds);
      // A store on loopback means every rank is on this host: gloo talks over loopback too.
      // Otherwise the address of this host's name, as c10d's default device.
      const bool loopback = options.store_host == "127.0.0.1" ||
                            options.store_host == "localhost" || options.store_host == "::1";
      o->devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                    : c10d::ProcessGroupGloo::createDefaultDevice());
      group->state_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, o);
    }
#endif
#if VLMGRAPH_HAVE_NCCL
    if (options.backend == "nccl") {
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(options.device_index));
      // A dead peer must not take this process down (c10d's default tears it down).
      setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = Millis(options.timeout_seconds);
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, o);
      // Note [A rank's device]: the group's collectives without tensors (the barrier below) run
      // on the bound device. Unbound, c10d guesses it from the process-wide "global rank", the
      // rank of the first group the process made: in-process ranks (the Train RPC on a
      // multi-GPU server) would all guess one GPU, and NCCL refuses them ("Duplicate GPU
      // detected"). torch.distributed.init_process_group(device_id=...) binds it the same way.
      nccl->setBoundDeviceId(
          at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(options.device_index)));
      group->state_->backend = nccl;
    }
#endif
    group->Barrier();  // every rank has joined (or the timeout threw)
    if (options.world_size > 1) group->StartHeartbeats();
  } catch (const EngineError&) {
    throw;
  } catch (const c10::Error& e) {
    throw EngineError(EngineError::Code::kUnavailable,
                      where + ": joining failed: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw EngineError(EngineError::Code::kUnavailable, where + ": joining failed: " + e.what());
  }
  return group;
}

int64_t DataParallelGroup::store_port() const {
  return state_->tcp_store ? state_->tcp_store->getPort() : options_.store_port;
}

namespace {

// Runs one collective and waits for it; a failure or timeout becomes kUnavailable.
void Wait(const std::string& what, int64_t rank, std::chrono::milliseconds timeout,
          const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
  try {
    c10::intrusive_ptr<c10d::Work> work = start();
    // With a timeout, NCCL's wait blocks the host until the collective is done or the timeout
    // passed (then it aborts the communicator and throws); gloo's collectives carry their own.
    work->wait(timeout);
  } catch (const c10::Error& e) {
    throw EngineError(EngineError::Code::kUnavailable,
                      "data parallel rank " + std::to_string(rank) + ": " + what +
                          " failed (a rank died, hangs or left): " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw EngineError(
        EngineError::Code::kUnavailable,
        "data parallel rank " + std::to_string(rank) + ": " + what + " failed: " + e.what());
  }
}

// Packs `tensors` in order into buckets of at most `cap` bytes (one dtype and device each; a
// tensor larger than `cap` alone) and calls `run` with each bucket's flat tensor, copying the
// result back when the bucket was packed.
void ForEachBucket(const std::vector<at::Tensor>& tensors, int64_t cap,
                   const std::function<void(at::Tensor&)>& run) {
  std::vector<at::Tensor> bucket;
  int64_t bucket_bytes = 0;
  auto flush = [&] {
    if (bucket.empty()) return;
    if (bucket.size() == 1) {
      run(bucket[0]);  // in place
    } else {
      std::vector<at::Tensor> flat_parts;
      flat_parts.reserve(bucket.size());
      for (const auto& t : bucket) flat_parts.push_back(t.view(-1));
      at::Tensor flat = at::cat(flat_parts);
      run(flat);
      int64_t offset = 0;
      for (auto& t : bucket) {
        t.view(-1).copy_(flat.narrow(0, offset, t.numel()));
        offset += t.numel();
      }
    }
    bucket.clear();
    bucket_bytes = 0;
  };
  for (const auto& t : tensors) {
    if (!t.defined() || !t.is_contiguous())
      throw EngineError::InvalidArgument(
          "data parallel: collectives take defined, contiguous tensors");
    const int64_t bytes = static_cast<int64_t>(t.nbytes());
    if (!bucket.empty() && (bucket[0].scalar_type() != t.scalar_type() ||
                            bucket[0].device() != t.device() || bucket_bytes + bytes > cap)) {
      flush();
    }
    bucket.push_back(t);
    bucket_bytes += bytes;
  }
  flush();
}

}  // namespace

void DataParallelGroup::Broadcast(const std::vector<at::Tensor>& tensors, int64_t root) {
  if (options_.world_size == 1) return;
  at::NoGradGuard no_grad;
  ForEachBucket(tensors, options_.bucket_bytes, [&](at::Tensor& flat) {
    std::vector<at::Tensor> one{flat};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    Wait("broadcast", rank(), Millis(options_.timeout_seconds),
         [&] { return state_->backend->broadcast(one, o); });
  });
}

void DataParallelGroup::Barrier() {
  if (!state_->backend) return;
  c10d::BarrierOptions o;
  // Note [A rank's device] (Join): NCCL's barrier all-reduces on this rank's own GPU.
  if (options_.backend == "nccl") o.device_ids = {options_.device_index};
  Wait("barrier", rank(), Millis(options_.timeout_seconds),
       [&] { return state_->backend->barrier(o); });
}

void DataParallelGroup::StartAllReduceSum(const at::Tensor& tensor) {
  StartAllReduceSum(std::vector<at::Tensor>{tensor});
}

void DataParallelGroup::StartAllReduceSum(const std::vector<at::Tensor>& tensors) {
  if (options_.world_size == 1 || tensors.empty()) return;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.is_contiguous())
      throw EngineError::InvalidArgument(
          "data parallel: collectives take defined, contiguous tensors");
  }
  std::vector<at::Tensor> list = tensors;
  try {
    if (list.size() == 1) {
      c10d::AllreduceOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      state_->started.push_back(state_->backend->allreduce(list, o));
    } else {
      c10d::AllreduceCoalescedOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      state_->started.push_back(state_->backend->allreduce_coalesced(list, o));
    }
  } catch (const c10::Error& e) {
    throw EngineError(EngineError::Code::kUnavailable,
                      "data parallel rank " + std::to_string(rank()) +
                          ": all-reduce failed to start: " + e.what_without_backtrace());
  }
}

namespace {

void CheckRooted(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& roots,
                 int64_t world_size) {
  if (tensors.size() != roots.size())
    throw EngineError::InvalidArgument("data parallel: one root per tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined() || !tensors[i].is_contiguous())
      throw EngineError::InvalidArgument(
          "data parallel: collectives take defined, contiguous tensors");
    if (roots[i] < 0 || roots[i] >= world_size)
      throw EngineError::InvalidArgument("data parallel: root rank " + std::to_string(roots[i]) +
                                         " outside 0 .. " + std::to_string(world_size - 1));
  }
}

}  // namespace

void DataParallelGroup::StartRooted(const std::vector<at::Tensor>& tensors,
                                    const std::vector<int64_t>& roots, bool reduce) {
  if (options_.world_size == 1 || tensors.empty()) return;
  CheckRooted(tensors, roots, options_.world_size);
  c10d::Backend& backend = *state_->backend;
  auto one = [&](size_t i) {
    std::vector<at::Tensor> list{tensors[i]};
    if (reduce) {
      c10d::ReduceOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      o.rootRank = roots[i];
      return backend.reduce(list, o);
    }
    c10d::BroadcastOptions o;
    o.rootRank = roots[i];
    return backend.broadcast(list, o);
  };
  try {
    if (backend.supportsCoalescing() && tensors.size() > 1) {
      backend.startCoalescing();
      for (size_t i = 0; i < tensors.size(); ++i) one(i);
      state_->started.push_back(backend.endCoalescing());
    } else {
      for (size_t i = 0; i < tensors.size(); ++i) state_->started.push_back(one(i));
    }
  } catch (const c10::Error& e) {
    throw EngineError(EngineError::Code::kUnavailable,
                      "data parallel rank " + std::to_string(rank()) + ": " +
                          (reduce ? "reduce" : "broadcast") +
                          " failed to start: " + e.what_without_backtrace());
  }
}

void DataParallelGroup::StartReduceSum(const std::vector<at::Tensor>& tensors,
                                       const std::vector<int64_t>& roots) {
  StartRooted(tensors, roots, /*reduce=*/true);
}

void DataParallelGroup::StartBroadcast(const std::vector<at::Tensor>& tensors,
                                       const std::vector<int64_t>& roots) {
  StartRooted(tensors, roots, /*reduce=*/false);
}

void DataParallelGroup::FinishAllReduces() { FinishOldest(state_->started.size()); }

void DataParallelGroup::FinishOldest(size_t count) {
  std::vector<c10::intrusive_ptr<c10d::Work>>& started = state_->started;
  count = std::min(count, started.size());
  std::vector<c10::intrusive_ptr<c10d::Work>> oldest(started.begin(), started.begin() + count);
  started.erase(started.begin(), started.begin() + count);
  for (auto& work : oldest) {
    // NCCL: the current stream waits for the collective (no host block, so this is legal inside
    // a capture); gloo: the host waits, up to the group's timeout.
    Wait("all-reduce", rank(), std::chrono::milliseconds(0) /* no host deadline */,
         [&] { return work; });
  }
}

}  // namespace vlmgraph
