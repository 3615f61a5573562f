// engine/device.h: the device services the engine needs beyond ATen ops. The CUDA implementation
// lives in engine/cuda/ (built when VLMGRAPH_WITH_CUDA); engine/device_cpu_only.cc provides the
// CPU-only build's version. CPU headers never include CUDA headers.
#pragma once

#include <ATen/core/TensorBody.h>
#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/engine_types.h"

namespace vlmgraph {

// Waits for all work queued on `device` (no-op on CPU).
void SynchronizeDevice(const at::Device& device);

// Makes `device` the calling thread's current CUDA device (c10::cuda::set_device), as
// torch.cuda.set_device does for a process: whatever runs on the thread without a device of its
// own (a stream, an event, a handle, a kernel launched outside a device guard) then lands on the
// engine's GPU. The server calls it first on each engine's GPU thread. No-op for a CPU device or
// a CUDA device without an index.
void BindThreadToDevice(const at::Device& device);

// The calling thread's current CUDA device index (-1 in a build without CUDA or with no device).
int CurrentDeviceIndex();

// "" while `device` can run work; else the CUDA error that left its context unusable (a
// device-side assert, an illegal memory access, a launch failure: CUDA keeps reporting such
// "sticky" errors to every later call, so only a new process recovers). Waits for the device's
// queued work. A failure that leaves the context usable (out of memory, a bad argument) gives "".
// CPU devices: always "".
std::string DeviceFault(const at::Device& device);

// A point in the current stream of a device, for waiting on part of the queued work only (the
// engine waits for decode step N while step N + 1 is already queued behind it). Record() marks
// the work queued so far; Synchronize() blocks the calling thread until that work is done. On a
// CPU device both do nothing: CPU work has finished when the call that queued it returns.
// Thread rules: the engine's GPU thread; not copyable.
class DeviceEvent {
 public:
  explicit DeviceEvent(const at::Device& device);
  ~DeviceEvent();
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  void Record();
  void Synchronize();
  // Synchronize with a deadline: polls until the recorded work is done (true) or timeout_seconds
  // have passed (false; the work stays queued). For work that may never finish, such as a
  // collective whose peer died (Trainer, Note [A rank that dies]).
  bool WaitFor(double timeout_seconds);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Host -> device uploads that run beside the computation queued before them, as a PyTorch
// DataLoader's pinned batches copied on a side CUDA stream do (NVIDIA's data_prefetcher in
// apex/examples/imagenet). CUDA: Upload queues the copies on a stream of its own, into device
// staging tensors it keeps per destination, after that stream waited for the previous Upload's
// staging tensors to be read (so one upload can run while the step before still computes); the
// current stream then waits for the copies and copies each staging tensor into its destination
// (device to device, ~10 us for 12 MiB). So the transfer itself leaves the current stream free;
// only the device copy is on its path. CPU device: plain copies, in order.
// `host` tensors: pinned host memory for an asynchronous transfer (a pageable one is copied
// synchronously by the driver); each pair the same shape and dtype; `device` tensors may be views
// (narrow) of a larger buffer. Not for use inside a CUDA graph capture.
// Thread rules: the thread that queues the device's work; not copyable.
class DeviceUploader {
 public:
  explicit DeviceUploader(const at::Device& device);
  ~DeviceUploader();
  DeviceUploader(const DeviceUploader&) = delete;
  DeviceUploader& operator=(const DeviceUploader&) = delete;
  void Upload(const std::vector<at::Tensor>& host, const std::vector<at::Tensor>& device);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Allocated and reserved bytes of the CUDA caching allocator on `device` (zeros on CPU).
MemoryStats DeviceMemory(const at::Device& device);

// Free and total bytes of `device` as the driver reports them (cudaMemGetInfo): free excludes
// what any process holds, this one's caching allocator included. Zeros on CPU.
struct DeviceCapacity {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};
DeviceCapacity DeviceMemoryCapacity(const at::Device& device);

// The device's name as the driver reports it ("NVIDIA H100 80GB HBM3"); "cpu" for a CPU device.
std::string DeviceName(const at::Device& device);

// Restarts the peak counters of DeviceMemory (no-op on CPU).
void ResetPeakDeviceMemory(const at::Device& device);

// Gives back what the allocators cache but no live tensor uses, after a job that owned its own
// CUDA graphs and tensors (a Train job) is destroyed. Waits for the device's queued work.
//   - CUDA: c10's CUDA caching allocator (emptyCache): its free blocks, and the private memory
//     pools of destroyed CUDA graphs, which it otherwise keeps reserved until an allocation fails
//     (c10/cuda/CUDACachingAllocator.cpp, releasePool / release_cached_blocks); the graphs of
//     live engines keep theirs.
//   - CUDA: the pinned host allocator (at::getHostAllocator(kCUDA)->empty_cache(),
//     ATen/core/CachingHostAllocator.h): its free pinned blocks, and the per-capture private pool
//     that every CUDAGraph::capture_begin creates; release_pool only marks a destroyed graph's
//     pool freeable, so without this each capture keeps about 40 KiB of host heap for good.
//   - glibc (any device): malloc_trim(0) returns free pages of every arena to the system
//     (malloc(3)), so RSS does not keep the peak of the job's host buffers.
// Thread rules: the engine's GPU thread, with no capture under way.
void ReleaseCachedMemory(const at::Device& device);

// True when this build has the CUDA graph sources compiled in.
bool BuiltWithCudaGraphs();

// NucleusPrefix and GumbelMaxDraw (engine/sampler.h) for CUDA tensors, already checked there, on
// the current stream. Throw c10::Error in a CPU-only build or when a launch fails.
struct SamplingRows;
void NucleusPrefixCuda(const at::Tensor& sorted, const SamplingRows& rows, const at::Tensor& kept);
void GumbelMaxDrawCuda(const at::Tensor& candidates, const at::Tensor& ids, const at::Tensor& kept,
                       const SamplingRows& rows, const at::Tensor& out);

}  // namespace vlmgraph
