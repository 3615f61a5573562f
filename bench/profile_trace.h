// bench/profile_trace.h: records a Chrome trace (Kineto: host ops and device kernels) of a piece
// of a benchmark, for `bench/trace_summary.py`. Used by the benchmarks' `--profile-trace PATH`.
//
//   vlmgraph::bench::ProfileTrace("train.json", [&] { trainer.Step(examples); });
//
// Kernels replayed from a CUDA graph are recorded too (CUPTI reports them one by one). The trace
// is written when `body` returns; errors of the profiler are thrown as c10::Error.
#pragma once

#include <torch/csrc/autograd/profiler_kineto.h>

#include <functional>
#include <set>
#include <string>

namespace vlmgraph::bench {

inline void ProfileTrace(const std::string& path, const std::function<void()>& body) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  body();
  prof::disableProfiler()->save(path);
}

}  // namespace vlmgraph::bench
