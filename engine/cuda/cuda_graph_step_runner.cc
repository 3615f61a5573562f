// engine/cuda/cuda_graph_step_runner.cc: StepRunner that captures one CUDA graph per bucket and
// replays it. See Note [Graph memory pool] in engine/step_runner.h.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <map>
#include <memory>
#include <vector>

#include "engine/device.h"
#include "engine/step_runner.h"

namespace vlmgraph {
namespace {

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
      // allocator blocks are set up outside the capture.
      for (int i = 0; i < 2; ++i) fn();
      side.synchronize();
      entry.graph = std::make_unique<at::cuda::CUDAGraph>();
      entry.graph->capture_begin(pool_);
      entry.outputs = fn();
      entry.graph->capture_end();
    }
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(caller);
    graphs_.emplace(key, std::move(entry));
    order_.push_back(key);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
    c10::cuda::CUDAGuard device_guard(device_);
    it->second.graph->replay();
    *outputs = it->second.outputs;
    return kind;
  }

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
  struct Entry {
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    std::vector<at::Tensor> outputs;  // static outputs, overwritten by each replay of this graph
  };
  c10::DeviceIndex device_;
  at::cuda::MempoolId_t pool_;
  std::map<BucketKey, Entry> graphs_;
  std::vector<BucketKey> order_;
};

}  // namespace

std::unique_ptr<StepRunner> MakeCudaGraphStepRunner(int device_index) {
  return std::make_unique<CudaGraphStepRunner>(device_index);
}

}  // namespace vlmgraph
