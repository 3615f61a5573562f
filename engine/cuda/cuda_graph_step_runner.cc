// engine/cuda/cuda_graph_step_runner.cc: StepRunner that captures one CUDA graph per bucket and
// replays it. See Notes [Graph memory pool], [Capture guard] and [Static input check] in
// engine/step_runner.h.
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/step_runner.h"
#include "base/log.h"

namespace vlmgraph {
namespace {

// Note [Capture guard] (engine/step_runner.h): Begin() begins the capture of `graph` on the
// current stream into `pool`; End() ends it; a guard destroyed between the two (an exception in
// the region) ends the capture and undoes the allocators' state, so the process can go on using
// the device. The CUDAGraph object must be destroyed after the guard.
class CaptureGuard {
 public:
  CaptureGuard(at::cuda::CUDAGraph* graph, at::cuda::MempoolId_t pool, c10::DeviceIndex device)
      : graph_(graph), pool_(pool), device_(device) {}
  CaptureGuard(const CaptureGuard&) = delete;
  CaptureGuard& operator=(const CaptureGuard&) = delete;
  ~CaptureGuard() {
    if (active_) Abort();
  }

  void Begin() {
    stream_ = c10::cuda::getCurrentCUDAStream(device_).stream();
    // Thread-local mode (Note [Capture mode], engine/step_runner.h): other GPU threads of the
    // process go on allocating and synchronising while this one captures.
    graph_->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
    active_ = true;
  }

  void End() {
    if (Status() == cudaStreamCaptureStatusInvalidated) {
      Abort();
      throw std::runtime_error(
          "CUDA graph capture was invalidated by an operation the region ran (a synchronising "
          "call such as .item() or a host copy, or an operation unsupported in capture)");
    }
    graph_->capture_end();
    active_ = false;
  }

 private:
  cudaStreamCaptureStatus Status() const {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &status) != cudaSuccess) {
      (void)cudaGetLastError();
      return cudaStreamCaptureStatusNone;
    }
    return status;
  }

  // Ends the capture without keeping a graph; never throws (it runs during unwinding).
  void Abort() noexcept {
    active_ = false;
    const cudaStreamCaptureStatus status = Status();
    if (status == cudaStreamCaptureStatusActive) {
      // Intact: CUDAGraph::capture_end ends it and the allocators' pool routing; the CUDAGraph's
      // destructor then releases its hold on the pool. The partial graph is never replayed.
      try {
        graph_->capture_end();
        return;
      } catch (const std::exception& e) {
        LogError(std::string("ending an abandoned CUDA graph capture: ") + e.what());
        return;
      }
    }
    // Invalidated: CUDAGraph::capture_end would throw at cudaStreamEndCapture before undoing the
    // allocators' state, so end the stream's capture and undo that state here (as capture_end
    // and CUDAGraph::reset would: endAllocateToPool, then releasePool for capture_begin's hold).
    if (status == cudaStreamCaptureStatusInvalidated) {
      cudaGraph_t partial = nullptr;
      (void)cudaStreamEndCapture(stream_, &partial);
      if (partial != nullptr) (void)cudaGraphDestroy(partial);
    }
    (void)cudaGetLastError();  // capture errors are not sticky; clear the last one
    try {
      c10::cuda::CUDACachingAllocator::endAllocateToPool(device_, pool_);
      at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool_);
      c10::cuda::CUDACachingAllocator::releasePool(device_, pool_);
      at::getHostAllocator(at::kCUDA)->release_pool(pool_);
    } catch (const std::exception& e) {
      LogError(std::string("releasing an abandoned CUDA graph capture's pool: ") + e.what());
    }
  }

  at::cuda::CUDAGraph* graph_;
  at::cuda::MempoolId_t pool_;
  c10::DeviceIndex device_;
  cudaStream_t stream_ = nullptr;
  bool active_ = false;
};

// Note [Warm-up in the graph's pool]: a capture's warm-up runs allocate from the runner's private
// pool as the capture does (routed for the warm-up's stream only), so the blocks they free are the
// ones the capture then takes: the region's intermediates exist once, in the pool, instead of once
// more in the general pool's cache beside it (where the warm-up left them, reserved but unused,
// for as long as the process ran: peak reserved 1.70x peak allocated for nanovlm-460m's training
// step at 8 x 1024). PyTorch's CUDA graph trees warm up in the graph's pool for the same reason.
// The routing holds the pool (the allocator's use count) until after capture_begin took its own
// hold, so a first capture never finds the pool released.
class WarmupInPool {
 public:
  WarmupInPool(c10::DeviceIndex device, at::cuda::MempoolId_t pool, cudaStream_t stream)
      : device_(device), pool_(pool) {
    c10::cuda::CUDACachingAllocator::beginAllocateToPool(
        device, pool, [stream](cudaStream_t s) { return s == stream; });
  }
  WarmupInPool(const WarmupInPool&) = delete;
  WarmupInPool& operator=(const WarmupInPool&) = delete;
  // Stops routing (a pool takes one routing at a time: call before capture_begin); keeps the hold.
  void StopRouting() {
    if (routing_) c10::cuda::CUDACachingAllocator::endAllocateToPool(device_, pool_);
    routing_ = false;
  }
  ~WarmupInPool() {
    try {
      StopRouting();
      c10::cuda::CUDACachingAllocator::releasePool(device_, pool_);
    } catch (const std::exception& e) {
      LogError(std::string("releasing a CUDA graph warm-up's hold on its pool: ") + e.what());
    }
  }

 private:
  c10::DeviceIndex device_;
  at::cuda::MempoolId_t pool_;
  bool routing_ = true;
};

class CudaGraphStepRunner final : public StepRunner {
 public:
  explicit CudaGraphStepRunner(int device) : device_(static_cast<c10::DeviceIndex>(device)) {
    pool_ = at::cuda::graph_pool_handle();
  }

  ~CudaGraphStepRunner() override {
    // Reverse capture order: later graphs release their hold on the shared pool first.
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) graphs_.erase(*it);
  }

  double Capture(const BucketKey& key, const RegionFn& fn) override {
    if (graphs_.count(key)) return 0;
    try {
      return CaptureNew(key, fn);
    } catch (...) {
      // Note [Capture guard]: the failed capture gave back its hold on the pool. With no graph
      // holding it, the allocators keep the pool only as freeable (use count 0), and a capture
      // into the same id would fail their "use_count > 0" assert (create_or_incref_pool): the
      // next capture gets a pool of its own.
      if (graphs_.empty()) pool_ = at::cuda::graph_pool_handle();
      throw;
    }
  }

  RunKind Run(const BucketKey& key, const RegionFn& fn, bool capture_if_missing,
              std::vector<at::Tensor>* outputs) override {
    RunKind kind = RunKind::kReplay;
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      if (!capture_if_missing) {
        *outputs = fn();
        return RunKind::kEager;
      }
      Capture(key, fn);
      it = graphs_.find(key);
      kind = RunKind::kCaptureAndReplay;
    }
    if (check_static_inputs_ && static_inputs_) CheckStaticInputs(key, it->second);
    c10::cuda::CUDAGuard device_guard(device_);
    it->second.graph->replay();
    *outputs = it->second.outputs;
    return kind;
  }

  void WatchStaticInputs(StaticInputsFn inputs) override { static_inputs_ = std::move(inputs); }
  void set_check_static_inputs(bool check) override { check_static_inputs_ = check; }

  bool Has(const BucketKey& key) const override { return graphs_.count(key) > 0; }
  bool captures() const override { return true; }
  int64_t graph_count() const override { return static_cast<int64_t>(graphs_.size()); }

  int64_t pool_bytes() const override {
    if (graphs_.empty()) return 0;
    int64_t bytes = 0;
    const auto snap = c10::cuda::CUDACachingAllocator::snapshot(pool_, /*include_traces=*/false);
    for (const auto& seg : snap.segments) {
      if (seg.owner_private_pool_id == pool_ && seg.device == device_) {
        bytes += static_cast<int64_t>(seg.total_size);
      }
    }
    return bytes;
  }

 private:
  double CaptureNew(const BucketKey& key, const RegionFn& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    c10::cuda::CUDAGuard device_guard(device_);
    auto caller = c10::cuda::getCurrentCUDAStream(device_);
    auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_);
    // The side stream must see everything the caller queued (buffer fills).
    at::cuda::CUDAEvent ready;
    ready.record(caller);
    ready.block(side);
    Entry entry;
    {
      c10::cuda::CUDAStreamGuard stream_guard(side);
      // Warm-up on the side stream: cuBLAS/cuDNN handles and workspaces, kernel selection and
      // allocator blocks are set up outside the capture, the blocks in the graph's pool (Note
      // [Warm-up in the graph's pool]).
      WarmupInPool warmup(device_, pool_, side.stream());
      for (int i = 0; i < 2; ++i) fn();
      side.synchronize();
      warmup.StopRouting();
      entry.graph = std::make_unique<at::cuda::CUDAGraph>();
      if (static_inputs_) {
        for (const at::Tensor& t : static_inputs_()) {
          entry.input_addresses.push_back(t.defined() ? t.data_ptr() : nullptr);
        }
      }
      CaptureGuard capture(entry.graph.get(), pool_, device_);
      capture.Begin();
      entry.outputs = fn();
      capture.End();
    }
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(caller);
    graphs_.emplace(key, std::move(entry));
    order_.push_back(key);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  struct Entry {
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    std::vector<at::Tensor> outputs;  // static outputs, overwritten by each replay of this graph
    std::vector<const void*> input_addresses;  // static inputs' data pointers at capture
  };

  void CheckStaticInputs(const BucketKey& key, const Entry& entry) const {
    const std::vector<at::Tensor> now = static_inputs_();
    if (now.size() != entry.input_addresses.size()) {
      throw std::logic_error("CUDA graph " + key.Label() + ": captured with " +
                             std::to_string(entry.input_addresses.size()) +
                             " static inputs, now " + std::to_string(now.size()));
    }
    for (size_t i = 0; i < now.size(); ++i) {
      const void* address = now[i].defined() ? now[i].data_ptr() : nullptr;
      if (address == entry.input_addresses[i]) continue;
      char detail[96];
      std::snprintf(detail, sizeof(detail), " was at %p at capture and is at %p now",
                    entry.input_addresses[i], address);
      throw std::logic_error("CUDA graph " + key.Label() + ": static input " + std::to_string(i) +
                             detail +
                             ": a buffer or weight was reallocated instead of written in place "
                             "(copy_ into it); replaying would read stale memory");
    }
  }

  c10::DeviceIndex device_;
  at::cuda::MempoolId_t pool_;
  std::map<BucketKey, Entry> graphs_;
  std::vector<BucketKey> order_;
  StaticInputsFn static_inputs_;
  bool check_static_inputs_ = GraphChecksByDefault();
};

}  // namespace

std::unique_ptr<StepRunner> MakeCudaGraphStepRunner(int device_index) {
  return std::make_unique<CudaGraphStepRunner>(device_index);
}

}  // namespace vlmgraph
