// engine/cuda/cuda_device.cc: CUDA implementations of engine/device.h.
#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <thread>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "engine/cuda/sampler_kernels.h"
#include "engine/device.h"
#include "engine/sampler.h"

namespace vlmgraph {

void SynchronizeDevice(const at::Device& device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::device_synchronize();
}

void BindThreadToDevice(const at::Device& device) {
  if (device.is_cuda() && device.has_index()) c10::cuda::set_device(device.index());
}

int CurrentDeviceIndex() {
  return c10::cuda::device_count() > 0 ? static_cast<int>(c10::cuda::current_device()) : -1;
}

std::string DeviceFault(const at::Device& device) {
  if (!device.is_cuda()) return "";
  c10::cuda::CUDAGuard guard(device);
  const cudaError_t error = cudaDeviceSynchronize();
  if (error == cudaSuccess) return "";
  (void)cudaGetLastError();  // clears a non-sticky error; a sticky one stays
  // A sticky error fails every later call too; a non-sticky one was cleared above.
  if (cudaDeviceSynchronize() == cudaSuccess) return "";
  return std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
}

// CUDA: an event without timing, recorded on the device's current stream. CPU: nothing.
struct DeviceEvent::Impl {
  at::Device device;
  std::optional<at::cuda::CUDAEvent> event;  // CUDA devices only
};

DeviceEvent::DeviceEvent(const at::Device& device) : impl_(new Impl{device, std::nullopt}) {
  if (device.is_cuda()) impl_->event.emplace(cudaEventDisableTiming);
}

DeviceEvent::~DeviceEvent() = default;

void DeviceEvent::Record() {
  if (!impl_->event) return;
  c10::cuda::CUDAGuard guard(impl_->device);
  impl_->event->record();  // the current stream of the guarded device
}

void DeviceEvent::Synchronize() {
  if (impl_->event) impl_->event->synchronize();
}

bool DeviceEvent::WaitFor(double timeout_seconds) {
  if (!impl_->event) return true;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_seconds));
  // Spins, yielding the core to other threads between polls, as cudaEventSynchronize does by
  // default (cudaDeviceScheduleAuto) for Synchronize(): a poll that slept 10-50 us between
  // queries left the device idle for about 0.1 ms after each data-parallel training step (2 x
  // H100 trace: Linux's timer slack rounds such sleeps up), against none for a one-GPU step.
  while (!impl_->event->query()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

struct DeviceUploader::Impl {
  at::Device device;
  std::optional<c10::cuda::CUDAStream> stream;  // from c10's pool, on the first CUDA upload
  // uploaded: on the upload stream after the last Upload's transfers; released: on the current
  // stream after the last Upload's staging tensors were copied out. Not created until recorded
  // (block() on an uncreated event waits for nothing).
  at::cuda::CUDAEvent uploaded{cudaEventDisableTiming}, released{cudaEventDisableTiming};
  // A staging tensor per destination storage: as many elements as that storage, so that a view
  // of the destination has its twin at the same offset and strides.
  std::map<const void*, at::Tensor> staging;
};

DeviceUploader::DeviceUploader(const at::Device& device) : impl_(new Impl{device}) {}
DeviceUploader::~DeviceUploader() = default;

void DeviceUploader::Upload(const std::vector<at::Tensor>& host,
                            const std::vector<at::Tensor>& device) {
  TORCH_CHECK(host.size() == device.size(), "DeviceUploader::Upload: ", host.size(),
              " host tensors for ", device.size(), " destinations");
  for (size_t i = 0; i < host.size(); ++i) {
    TORCH_CHECK(host[i].sizes().equals(device[i].sizes()) &&
                    host[i].scalar_type() == device[i].scalar_type(),
                "DeviceUploader::Upload: host tensor ", i, " ", host[i].sizes(), " ",
                host[i].scalar_type(), " does not match its destination ", device[i].sizes(), " ",
                device[i].scalar_type());
  }
  Impl& m = *impl_;
  if (!m.device.is_cuda()) {
    for (size_t i = 0; i < host.size(); ++i) device[i].copy_(host[i]);
    return;
  }
  c10::cuda::CUDAGuard guard(m.device);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
  if (!m.stream) m.stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false);
  std::vector<at::Tensor> views;
  views.reserve(device.size());
  bool allocated = false;
  for (const at::Tensor& dst : device) {
    const void* key = dst.storage().data();
    auto it = m.staging.find(key);
    if (it == m.staging.end()) {
      allocated = true;
      const int64_t elements =
          static_cast<int64_t>(dst.storage().nbytes()) / static_cast<int64_t>(dst.element_size());
      at::Tensor staging = at::empty({elements}, dst.options());
      // Written on the upload stream: the caching allocator must not hand its block to another
      // tensor while that stream may still use it.
      c10::cuda::CUDACachingAllocator::recordStream(staging.storage().data_ptr(), *m.stream);
      it = m.staging.emplace(key, staging).first;
    }
    views.push_back(it->second.as_strided(dst.sizes(), dst.strides(), dst.storage_offset()));
  }
  m.released.block(*m.stream);  // the last upload's staging tensors were read
  if (allocated) {
    // A new staging tensor's block may have served a tensor that the current stream's queued
    // work still uses (the caching allocator reuses blocks in the order of their stream): the
    // upload stream must not write it before that work is done.
    at::cuda::CUDAEvent queued(cudaEventDisableTiming);
    queued.record(current);
    queued.block(*m.stream);
  }
  {
    c10::cuda::CUDAStreamGuard on_upload_stream(*m.stream);
    // Pinned sources: asynchronous DMA; the caching host allocator keeps each block until the
    // upload stream is past its copy.
    for (size_t i = 0; i < host.size(); ++i) views[i].copy_(host[i], /*non_blocking=*/true);
    m.uploaded.record(*m.stream);
  }
  m.uploaded.block(current);
  for (size_t i = 0; i < host.size(); ++i) device[i].copy_(views[i], /*non_blocking=*/true);
  m.released.record(current);
}

MemoryStats DeviceMemory(const at::Device& device) {
  MemoryStats m;
  if (!device.is_cuda()) return m;
  const auto idx = device.has_index() ? device.index() : c10::cuda::current_device();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(idx);
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  m.allocated_bytes = stats.allocated_bytes[kAll].current;
  m.reserved_bytes = stats.reserved_bytes[kAll].current;
  m.peak_allocated_bytes = stats.allocated_bytes[kAll].peak;
  m.peak_reserved_bytes = stats.reserved_bytes[kAll].peak;
  return m;
}

std::string DeviceName(const at::Device& device) {
  if (!device.is_cuda()) return "cpu";
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.has_index() ? device.index()
                                                                   : c10::cuda::current_device()));
  return prop.name;
}

DeviceCapacity DeviceMemoryCapacity(const at::Device& device) {
  DeviceCapacity c;
  if (!device.is_cuda()) return c;
  c10::cuda::CUDAGuard guard(device);
  size_t free_bytes = 0, total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  c.free_bytes = static_cast<int64_t>(free_bytes);
  c.total_bytes = static_cast<int64_t>(total_bytes);
  return c;
}

void ResetPeakDeviceMemory(const at::Device& device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index()
                                                                     : c10::cuda::current_device());
}

void ReleaseCachedMemory(const at::Device& device) {
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    c10::cuda::device_synchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    at::getHostAllocator(at::kCUDA)->empty_cache();
  }
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

bool BuiltWithCudaGraphs() { return true; }

namespace {
cuda::SamplerArgs MakeSamplerArgs(const at::Tensor& x, const SamplingRows& rows) {
  return {x.data_ptr(),
          x.scalar_type() == at::kBFloat16,
          rows.temperature.data_ptr<float>(),
          rows.top_p.data_ptr<float>(),
          rows.top_k.data_ptr<int64_t>(),
          rows.seed.data_ptr<int64_t>(),
          rows.draw.data_ptr<int64_t>(),
          x.size(0),
          x.size(1)};
}
}  // namespace

void NucleusPrefixCuda(const at::Tensor& sorted, const SamplingRows& rows, const at::Tensor& kept) {
  c10::cuda::CUDAGuard guard(sorted.device());
  const cudaError_t e = cuda::LaunchNucleusPrefix(
      MakeSamplerArgs(sorted, rows), kept.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(e == cudaSuccess, "NucleusPrefix: launch failed: ", cudaGetErrorString(e));
}

void GumbelMaxDrawCuda(const at::Tensor& candidates, const at::Tensor& ids, const at::Tensor& kept,
                       const SamplingRows& rows, const at::Tensor& out) {
  c10::cuda::CUDAGuard guard(candidates.device());
  const int64_t n = candidates.size(0), cols = candidates.size(1);
  const int64_t chunks = (cols + cuda::kDrawChunk - 1) / cuda::kDrawChunk;
  at::Tensor partial_scores = at::empty({n * chunks}, candidates.options().dtype(at::kFloat));
  at::Tensor partial_ids = at::empty({n * chunks}, out.options());
  const cudaError_t e = cuda::LaunchGumbelMaxDraw(
      MakeSamplerArgs(candidates, rows), ids.defined() ? ids.data_ptr<int64_t>() : nullptr,
      kept.defined() ? kept.data_ptr<int64_t>() : nullptr, partial_scores.data_ptr<float>(),
      partial_ids.data_ptr<int64_t>(), out.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(e == cudaSuccess, "GumbelMaxDraw: launch failed: ", cudaGetErrorString(e));
}

}  // namespace vlmgraph
