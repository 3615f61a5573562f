#include "bench/gpu_telemetry.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <string>

namespace vlmgraph::bench {

// The NVML entry points used, as nvml.h declares them (the ABI is stable: _v2 names since CUDA
// 5.5; nvmlDeviceGetCurrentClocksThrottleReasons kept as an alias of the newer
// nvmlDeviceGetCurrentClocksEventReasons).
struct GpuTelemetry::Nvml {
  using Device = void*;
  void* lib = nullptr;
  int (*init)() = nullptr;
  int (*shutdown)() = nullptr;
  int (*by_pci)(const char*, Device*) = nullptr;
  int (*clock)(Device, int, unsigned*) = nullptr;  // NVML_CLOCK_SM = 1
  int (*power)(Device, unsigned*) = nullptr;       // milliwatts
  int (*temperature)(Device, int, unsigned*) = nullptr;  // NVML_TEMPERATURE_GPU = 0
  int (*reasons)(Device, unsigned long long*) = nullptr;
  Device device = nullptr;
};

namespace {
constexpr const char* kReasonNames[] = {
    "gpu_idle",           "applications_clocks_setting", "sw_power_cap",
    "hw_slowdown",        "sync_boost",                  "sw_thermal_slowdown",
    "hw_thermal_slowdown", "hw_power_brake_slowdown",   "display_clock_setting"};

template <typename F>
bool Load(void* lib, const char* name, F* f) {
  *f = reinterpret_cast<F>(dlsym(lib, name));
  return *f != nullptr;
}

nlohmann::json Stats(std::vector<double> v) {
  if (v.empty()) return nullptr;
  std::sort(v.begin(), v.end());
  return {{"min", v.front()}, {"median", v[v.size() / 2]}, {"max", v.back()}};
}
}  // namespace

GpuTelemetry::GpuTelemetry(const std::string& pci_bus_id, double period_seconds)
    : nvml_(std::make_unique<Nvml>()) {
  Nvml& n = *nvml_;
  n.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (n.lib == nullptr) {
    unavailable_ = std::string("unavailable: ") + dlerror();
    return;
  }
  if (!Load(n.lib, "nvmlInit_v2", &n.init) || !Load(n.lib, "nvmlShutdown", &n.shutdown) ||
      !Load(n.lib, "nvmlDeviceGetHandleByPciBusId_v2", &n.by_pci) ||
      !Load(n.lib, "nvmlDeviceGetClockInfo", &n.clock) ||
      !Load(n.lib, "nvmlDeviceGetPowerUsage", &n.power) ||
      !Load(n.lib, "nvmlDeviceGetTemperature", &n.temperature) ||
      !(Load(n.lib, "nvmlDeviceGetCurrentClocksEventReasons", &n.reasons) ||
        Load(n.lib, "nvmlDeviceGetCurrentClocksThrottleReasons", &n.reasons))) {
    unavailable_ = "unavailable: libnvidia-ml.so.1 lacks an entry point";
    return;
  }
  if (n.init() != 0) {
    unavailable_ = "unavailable: nvmlInit failed";
    return;
  }
  if (n.by_pci(pci_bus_id.c_str(), &n.device) != 0) {
    unavailable_ = "unavailable: no NVML device at PCI bus id " + pci_bus_id;
    return;
  }
  Sample s;
  if (Read(&s)) samples_.push_back(s);
  const auto period = std::chrono::duration<double>(period_seconds);
  thread_ = std::thread([this, period] {
    while (!stop_.load()) {
      std::this_thread::sleep_for(period);
      Sample s;
      if (Read(&s)) samples_.push_back(s);
    }
  });
}

GpuTelemetry::~GpuTelemetry() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (nvml_->lib != nullptr && nvml_->shutdown != nullptr && unavailable_.empty())
    nvml_->shutdown();
}

bool GpuTelemetry::Read(Sample* s) const {
  const Nvml& n = *nvml_;
  unsigned power_mw = 0;
  if (n.clock(n.device, /*NVML_CLOCK_SM=*/1, &s->sm_clock_mhz) != 0) return false;
  if (n.power(n.device, &power_mw) != 0) return false;
  if (n.temperature(n.device, /*NVML_TEMPERATURE_GPU=*/0, &s->temperature_c) != 0) return false;
  if (n.reasons(n.device, &s->reasons) != 0) return false;
  s->power_w = power_mw / 1e3;
  return true;
}

nlohmann::json GpuTelemetry::Stop() {
  if (!unavailable_.empty()) return {{"nvml", unavailable_}};
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  Sample last;
  if (Read(&last)) samples_.push_back(last);
  std::vector<double> clock, power, temperature;
  unsigned long long reasons = 0;
  for (const Sample& s : samples_) {
    clock.push_back(s.sm_clock_mhz);
    power.push_back(s.power_w);
    temperature.push_back(s.temperature_c);
    reasons |= s.reasons;
  }
  nlohmann::json names = nlohmann::json::array();
  for (size_t bit = 0; bit < std::size(kReasonNames); ++bit)
    if (reasons & (1ull << bit)) names.push_back(kReasonNames[bit]);
  return {{"sm_clock_mhz", Stats(clock)},
          {"power_w", Stats(power)},
          {"temperature_c", Stats(temperature)},
          {"throttle_reasons", names},
          {"samples", samples_.size()}};
}

double RelativeSpread(std::vector<double> v) {
  if (v.size() < 2) return 0;
  std::sort(v.begin(), v.end());
  const double p10 = v[v.size() / 10], p90 = v[std::min(v.size() - 1, v.size() * 9 / 10)];
  const double median = v[v.size() / 2];
  return median > 0 ? (p90 - p10) / median : 0;
}

}  // namespace vlmgraph::bench
