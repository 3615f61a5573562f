// engine/step_runner.h: runs one region at one bucket, by CUDA graph replay or eagerly.
//
// A region function reads the engine's static input tensors (fixed addresses) and returns its
// output tensors. EagerStepRunner calls it every time. CudaGraphStepRunner (engine/cuda/) warms it
// up on a side stream, captures it once per bucket into a graph in one shared memory pool, keeps
// the returned tensors as the bucket's static outputs, and later only replays.
//
// Note [Graph memory pool]: all graphs of one runner allocate from one private pool (the first
// graph's pool, passed to every later capture_begin). Blocks freed at the end of one capture can
// be reused by later captures, so intermediates are shared; the static outputs stay referenced by
// the runner and are never reused by another graph. A graph's outputs are overwritten by its own
// next replay: the engine consumes them before replaying that bucket again. The first graph owns
// the pool and must outlive the others, so graphs are destroyed in reverse capture order.
//
// Thread rules: used only from the engine's GPU thread.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "engine/bucket.h"

namespace vlmgraph {

enum class RunKind { kEager, kReplay, kCaptureAndReplay };

using RegionFn = std::function<std::vector<at::Tensor>()>;

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // Captures `fn` for `key` if this runner captures and `key` has no graph yet. Returns seconds
  // spent (0 when nothing was captured).
  virtual double Capture(const BucketKey& key, const RegionFn& fn) = 0;
  // Runs the region at `key`: replays its graph (capturing first when `capture_if_missing`) or
  // calls fn. `outputs` receives the region's outputs (for graphs: the static output tensors).
  virtual RunKind Run(const BucketKey& key, const RegionFn& fn, bool capture_if_missing,
                      std::vector<at::Tensor>* outputs) = 0;
  virtual bool Has(const BucketKey& key) const = 0;
  virtual bool captures() const = 0;
  virtual int64_t graph_count() const = 0;
  // Device bytes reserved by the graph pool (0 for eager).
  virtual int64_t pool_bytes() const = 0;
};

class EagerStepRunner : public StepRunner {
 public:
  double Capture(const BucketKey&, const RegionFn&) override { return 0; }
  RunKind Run(const BucketKey&, const RegionFn& fn, bool,
              std::vector<at::Tensor>* outputs) override {
    *outputs = fn();
    return RunKind::kEager;
  }
  bool Has(const BucketKey&) const override { return false; }
  bool captures() const override { return false; }
  int64_t graph_count() const override { return 0; }
  int64_t pool_bytes() const override { return 0; }
};

// Returns a CUDA graph runner on `device` when this build has CUDA graph support
// (VLMGRAPH_WITH_CUDA) and the device is CUDA; otherwise nullptr.
std::unique_ptr<StepRunner> MakeCudaGraphStepRunner(int device_index);

}  // namespace vlmgraph
