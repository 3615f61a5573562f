// CPU-only build: no CUDA graph runner, no device memory statistics.
#include "engine/device.h"
#include "engine/step_runner.h"

namespace vlmgraph {

void SynchronizeDevice(const at::Device&) {}
MemoryStats DeviceMemory(const at::Device&) { return {}; }
void ResetPeakDeviceMemory(const at::Device&) {}
bool BuiltWithCudaGraphs() { return false; }
std::unique_ptr<StepRunner> MakeCudaGraphStepRunner(int) { return nullptr; }

}  // namespace vlmgraph
