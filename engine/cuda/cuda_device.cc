// engine/cuda/cuda_device.cc: CUDA implementations of engine/device.h.
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "engine/device.h"

namespace vlmgraph {

void SynchronizeDevice(const at::Device& device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::device_synchronize();
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

void ResetPeakDeviceMemory(const at::Device& device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index()
                                                                     : c10::cuda::current_device());
}

bool BuiltWithCudaGraphs() { return true; }

}  // namespace vlmgraph
