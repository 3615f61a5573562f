// CPU-only build: no CUDA graph runner, no device memory statistics, no fused optimizer kernels.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "engine/device.h"
#include "engine/fused_optimizer.h"
#include "engine/step_runner.h"

namespace vlmgraph {

void SynchronizeDevice(const at::Device&) {}
void BindThreadToDevice(const at::Device&) {}
int CurrentDeviceIndex() { return -1; }
std::string DeviceFault(const at::Device&) { return ""; }

struct DeviceEvent::Impl {};
DeviceEvent::DeviceEvent(const at::Device&) {}
DeviceEvent::~DeviceEvent() = default;
void DeviceEvent::Record() {}
void DeviceEvent::Synchronize() {}
bool DeviceEvent::WaitFor(double) { return true; }

struct DeviceUploader::Impl {};
DeviceUploader::DeviceUploader(const at::Device&) {}
DeviceUploader::~DeviceUploader() = default;
void DeviceUploader::Upload(const std::vector<at::Tensor>& host,
                            const std::vector<at::Tensor>& device) {
  TORCH_CHECK(host.size() == device.size(), "DeviceUploader::Upload: ", host.size(),
              " host tensors for ", device.size(), " destinations");
  for (size_t i = 0; i < host.size(); ++i) device[i].copy_(host[i]);
}

MemoryStats DeviceMemory(const at::Device&) { return {}; }

std::string DeviceName(const at::Device&) { return "cpu"; }
DeviceCapacity DeviceMemoryCapacity(const at::Device&) { return {}; }
void ResetPeakDeviceMemory(const at::Device&) {}
void ReleaseCachedMemory(const at::Device&) {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}
bool BuiltWithCudaGraphs() { return false; }
std::unique_ptr<StepRunner> MakeCudaGraphStepRunner(int) { return nullptr; }
void NucleusPrefixCuda(const at::Tensor&, const SamplingRows&, const at::Tensor&) {
  TORCH_CHECK(false, "NucleusPrefix on a CUDA tensor needs a CUDA build");
}
void GumbelMaxDrawCuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, const SamplingRows&,
                       const at::Tensor&) {
  TORCH_CHECK(false, "GumbelMaxDraw on a CUDA tensor needs a CUDA build");
}

bool FusedOptimizerAvailable(const at::Device&) { return false; }
void AccumulateGradients(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                         const at::Tensor&) {
  TORCH_CHECK(false, "AccumulateGradients needs a CUDA build");
}
void AddSquaredNorm(const std::vector<at::Tensor>&, const at::Tensor&) {
  TORCH_CHECK(false, "AddSquaredNorm needs a CUDA build");
}
void FusedAdamW(const AdamWTensors&, const at::Tensor&, const AdamWHyperparameters&) {
  TORCH_CHECK(false, "FusedAdamW needs a CUDA build");
}

}  // namespace vlmgraph
