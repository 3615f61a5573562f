// bench/gpu_telemetry.h: the GPU's clocks, power and throttle reasons beside a benchmark's
// figures, read through NVML (the driver's libnvidia-ml.so.1, opened with dlopen: the benches
// need no NVML headers or link-time library, and report `"nvml": "unavailable: ..."` without
// one).
//
//   GpuTelemetry t(PciBusId(device_index));  // sampling every 100 ms on its own thread
//   ... timed steps ...
//   nlohmann::json j = t.Stop();    // {"sm_clock_mhz": {"min", "median", "max"}, "power_w":
//                                   //  {...}, "temperature_c": {...}, "throttle_reasons": [...],
//                                   //  "samples": N}
//
// Throttle reasons are the names of NVML's nvmlClocksEventReasons bits seen in any sample
// (nvml.h: "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown",
// "sync_boost", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
// "display_clock_setting"); a figure measured while "sw_power_cap" or a thermal or hardware
// slowdown held was measured on a slowed GPU.
//
// Thread rules: construct and Stop on one thread. Errors: none thrown; NVML failures give
// "unavailable".
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace vlmgraph::bench {

class GpuTelemetry {
 public:
  // pci_bus_id: "domain:bus:device.function" as cudaDeviceGetPCIBusId writes it (the same GPU
  // whatever CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say).
  explicit GpuTelemetry(const std::string& pci_bus_id, double period_seconds = 0.1);
  ~GpuTelemetry();
  GpuTelemetry(const GpuTelemetry&) = delete;
  GpuTelemetry& operator=(const GpuTelemetry&) = delete;
  // Ends sampling (one last sample) and summarises; call once.
  nlohmann::json Stop();

 private:
  struct Sample {
    unsigned sm_clock_mhz = 0, temperature_c = 0;
    double power_w = 0;
    unsigned long long reasons = 0;
  };
  bool Read(Sample* s) const;

  struct Nvml;
  std::unique_ptr<Nvml> nvml_;
  std::string unavailable_;
  std::vector<Sample> samples_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The spread of repeated measurements: (p90 - p10) / median of `values` (> 0.05: flag the
// figure as unstable). 0 for fewer than 2 values.
double RelativeSpread(std::vector<double> values);

}  // namespace vlmgraph::bench
