// engine/step_runner.h: runs one region at one bucket, by CUDA graph replay or eagerly.
//
// A region function reads the engine's static input tensors (fixed addresses) and returns its
// output tensors. EagerStepRunner calls it every time. CudaGraphStepRunner (engine/cuda/) warms it
// up on a side stream, captures it once per bucket into a graph in one shared memory pool, keeps
// the returned tensors as the bucket's static outputs, and later only replays.
//
// Note [Graph memory pool]: all graphs of one runner allocate from one private pool (the
// runner's pool id, passed to every capture_begin). Blocks freed at the end of one capture can be
// reused by later captures, so intermediates are shared. A graph's static outputs stay referenced
// by the runner, so no later capture reuses them; but an output of a graph captured later can sit
// in memory that was an intermediate of a graph captured earlier, and every replay of that
// earlier graph overwrites it. So the contract of every runner is: a run's outputs are valid
// until the runner's next Run or Capture of any bucket. What the engine needs across runs (the
// decode step's tokens, which the next step carries, with a prefill in between) it keeps in
// buffers of its own, written inside the region; the trainer clones its losses. PyTorch states
// the same condition for graphs that share a pool (torch.cuda.graph's `pool` argument: safe when
// they replay in capture order and nothing outlives the next replay). The first graph holds the
// pool, so graphs are destroyed in reverse capture order.
//
// Note [Output lifetime check]: on a GPU, a kept output is overwritten only where the allocator
// happened to place it inside an earlier graph's intermediates: a bug that shows up on some
// bucket layouts, under some interleavings, as garbage (token ids far outside the vocabulary, a
// device-side assert). With checking on, the eager runner makes the contract hold every time:
// it returns copies of the region's outputs, and its next Run or Capture fills the copies it
// returned before with a poison value (NaN, or the type's lowest integer), so CPU tests catch an
// output kept across runs as a NaN or an out-of-range index. Checking is on where the static
// input check is (below: builds without NDEBUG, VLMGRAPH_CHECK_GRAPHS=1), or through
// set_check_output_lifetime / EngineOptions::check_graphs.
//
// Note [Capture guard]: a region that throws between capture_begin and capture_end (a failed
// check, an out-of-memory, a synchronising call that invalidates the capture) must not leave the
// stream capturing: a capture begun in cudaStreamCaptureModeGlobal forbids cudaMalloc and other
// unsafe calls to every thread of the process while it lasts, and c10's caching allocator would go
// on routing the stream's allocations to the graph pool. As torch.cuda.graph's __exit__, the CUDA
// runner always ends the capture: an intact capture through CUDAGraph::capture_end (its partial
// graph is discarded), an invalidated one through cudaStreamEndCapture plus the allocators'
// endAllocateToPool / releasePool that capture_end would have called. The region's exception then
// propagates unchanged, the bucket has no graph, and the next Capture or Run may try again. When
// no graph holds the pool after that, the allocators keep it only as freeable (use count 0), and
// a capture into the same pool id would fail their "use_count > 0" assert: the runner takes a new
// pool id for the next capture.
//
// Note [Capture mode]: captures run in cudaStreamCaptureModeThreadLocal, not PyTorch's default
// global mode. One process drives several GPUs from several threads (one engine per GPU, and a
// Train job's ranks, which capture at the same time), and c10's caching allocator calls cudaMalloc
// without relaxing the mode on a thread that is not capturing: in global mode any thread's capture
// makes every other thread's cudaMalloc, synchronisation and host copies fail. Thread-local mode
// still forbids them on the capturing thread, where they would break the graph.
//
// Note [Static input check]: a graph reads its inputs at the addresses they had at capture. A
// buffer or parameter that is reallocated instead of written in place (a new tensor assigned, or
// set_ / set_data to new storage) leaves replays reading stale memory without any error. With
// WatchStaticInputs the runner records, per graph, the data pointers of the tensors the provider
// returns at capture and, when checking is on, compares them before each replay (vLLM's
// CUDAGraphWrapper does the same in debug mode). Checking is on in builds without NDEBUG, when the
// environment sets VLMGRAPH_CHECK_GRAPHS=1 (GraphChecksByDefault), or after
// set_check_static_inputs(true); it costs one call of the provider and one pointer compare per
// tensor per replay. A moved input throws
// std::logic_error naming the bucket, the input's index and both addresses; nothing is replayed.
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
  // The tensors every region of this runner reads at fixed addresses: static buffers, weights,
  // KV cache (Note [Static input check]). Called on the runner's thread.
  using StaticInputsFn = std::function<std::vector<at::Tensor>()>;

  virtual ~StepRunner() = default;
  // Sets the provider of the static inputs; captures from now on record their addresses.
  virtual void WatchStaticInputs(StaticInputsFn inputs) { (void)inputs; }
  // Turns the replay check of Note [Static input check] on or off (a runner that does not
  // capture ignores it).
  virtual void set_check_static_inputs(bool check) { (void)check; }
  // Turns Note [Output lifetime check] on or off (a runner that replays graphs ignores it).
  virtual void set_check_output_lifetime(bool check) { (void)check; }
  // Captures `fn` for `key` if this runner captures and `key` has no graph yet. Returns seconds
  // spent (0 when nothing was captured). What `fn` throws propagates after the capture is ended
  // (Note [Capture guard]); `key` then has no graph.
  virtual double Capture(const BucketKey& key, const RegionFn& fn) = 0;
  // Runs the region at `key`: replays its graph (capturing first when `capture_if_missing`) or
  // calls fn. `outputs` receives the region's outputs (for graphs: the static output tensors).
  // Throws what Capture throws, and std::logic_error for a moved static input (Note [Static
  // input check]).
  virtual RunKind Run(const BucketKey& key, const RegionFn& fn, bool capture_if_missing,
                      std::vector<at::Tensor>* outputs) = 0;
  virtual bool Has(const BucketKey& key) const = 0;
  virtual bool captures() const = 0;
  virtual int64_t graph_count() const = 0;
  // Device bytes reserved by the graph pool (0 for eager).
  virtual int64_t pool_bytes() const = 0;
};

// Whether the graph checks (Notes [Static input check] and [Output lifetime check]) are on by
// default: in builds without NDEBUG, or when the environment sets VLMGRAPH_CHECK_GRAPHS=1.
bool GraphChecksByDefault();

class EagerStepRunner : public StepRunner {
 public:
  double Capture(const BucketKey&, const RegionFn&) override;
  RunKind Run(const BucketKey&, const RegionFn& fn, bool,
              std::vector<at::Tensor>* outputs) override;
  void set_check_output_lifetime(bool check) override;
  bool Has(const BucketKey&) const override { return false; }
  bool captures() const override { return false; }
  int64_t graph_count() const override { return 0; }
  int64_t pool_bytes() const override { return 0; }

 private:
  void PoisonReturned();

  bool check_output_lifetime_ = GraphChecksByDefault();
  std::vector<at::Tensor> returned_;  // the copies the last Run returned (checking on)
};

// Returns a CUDA graph runner on `device` when this build has CUDA graph support
// (VLMGRAPH_WITH_CUDA) and the device is CUDA; otherwise nullptr.
std::unique_ptr<StepRunner> MakeCudaGraphStepRunner(int device_index);

}  // namespace vlmgraph
