// engine/cuda/cuda_device.cc: CUDA implementations of engine/device.h.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "engine/device.h"

namespace vlmgraph {

void SynchronizeDevice(const at::Device& device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDAGuard guard(device);
  c10::cuda::device_synchronize();
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
