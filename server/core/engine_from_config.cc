#include "server/core/engine_from_config.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>

#include "model/checkpoint.h"

namespace vlmgraph::server {

EngineOptions ToEngineOptions(const ServerConfig& config) {
  EngineOptions o;
  if (config.device == "cpu") {
    o.device = at::Device(at::kCPU);
  } else {
    if (!torch::cuda::is_available()) {
      throw ServerConfigError("device", "'" + config.device +
                                            "' requested but no CUDA device is available "
                                            "(use device: cpu, or --device cpu)");
    }
    o.device = at::Device(config.device);
    if (o.device.has_index() && o.device.index() >= static_cast<int>(torch::cuda::device_count())) {
      throw ServerConfigError("device",
                              "'" + config.device + "' does not exist; this machine has " +
                                  std::to_string(torch::cuda::device_count()) + " CUDA device(s)");
    }
  }
  o.dtype = config.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  o.buckets = config.buckets;
  o.cuda_graphs = config.capture.enabled;
  o.lazy_capture = config.capture.lazy;
  o.programmatic_dependent_launch = config.capture.programmatic_dependent_launch;
  o.max_new_tokens_limit = config.limits.max_new_tokens;
  return o;
}

std::vector<std::string> ServingDevices(const ServerConfig& config) {
  if (config.device == "cpu") {
    return std::vector<std::string>(static_cast<size_t>(std::max<int64_t>(1, config.data_parallel_size)),
                                    "cpu");
  }
  if (config.data_parallel_size == 1) return {config.device};  // ToEngineOptions checks it
  const int64_t count = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
  const int64_t base = config.device == "cuda" ? 0 : at::Device(config.device).index();
  const int64_t n = config.data_parallel_size == 0 ? count - base : config.data_parallel_size;
  if (n < 1 || base + n > count) {
    throw ServerConfigError("data_parallel_size",
                            std::to_string(config.data_parallel_size) + " engine(s) from " +
                                config.device + " need CUDA devices " + std::to_string(base) +
                                ".." + std::to_string(base + std::max<int64_t>(n, 1) - 1) +
                                ", but this machine has " + std::to_string(count) +
                                " CUDA device(s)");
  }
  std::vector<std::string> devices;
  for (int64_t i = 0; i < n; ++i) devices.push_back("cuda:" + std::to_string(base + i));
  return devices;
}

VlmConfig BuildModelConfig(const ServerConfig& config) {
  if (IsPresetModel(config.model)) return VlmConfig::Preset(config.model);
  try {
    return LoadModelConfig(config.model);
  } catch (const std::exception& e) {
    throw ServerConfigError("model", std::string("cannot load checkpoint: ") + e.what());
  }
}

VisionLanguageModel BuildModel(const ServerConfig& config) {
  if (IsPresetModel(config.model)) {
    // Random weights, but the same ones every run: the demo and the e2e tests compare outputs.
    at::manual_seed(config.seed);
    return VisionLanguageModel(VlmConfig::Preset(config.model));
  }
  try {
    return LoadModel(config.model);
  } catch (const std::exception& e) {
    throw ServerConfigError("model", std::string("cannot load checkpoint: ") + e.what());
  }
}

std::unique_ptr<Engine> BuildEngine(const ServerConfig& config) {
  EngineOptions options = ToEngineOptions(config);
  return std::make_unique<Engine>(BuildModel(config), std::move(options));
}

}  // namespace vlmgraph::server
