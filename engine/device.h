// engine/device.h: the device services the engine needs beyond ATen ops. The CUDA implementation
// lives in engine/cuda/ (built when VLMGRAPH_WITH_CUDA); engine/device_cpu_only.cc provides the
// CPU-only build's version. CPU headers never include CUDA headers.
#pragma once

#include <ATen/core/TensorBody.h>
#include <c10/core/Device.h>

#include "engine/engine_types.h"

namespace vlmgraph {

// Waits for all work queued on `device` (no-op on CPU).
void SynchronizeDevice(const at::Device& device);

// Allocated and reserved bytes of the CUDA caching allocator on `device` (zeros on CPU).
MemoryStats DeviceMemory(const at::Device& device);

// Restarts the peak counters of DeviceMemory (no-op on CPU).
void ResetPeakDeviceMemory(const at::Device& device);

// True when this build has the CUDA graph sources compiled in.
bool BuiltWithCudaGraphs();

}  // namespace vlmgraph
