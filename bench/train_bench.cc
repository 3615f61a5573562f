// bench/train_bench.cc: training step time of a preset (default nanovlm-460m, random weights) at
// batch 8 x 256 tokens with one 512px image tile per sample (64 image tokens + 192 text tokens),
// AdamW, bf16 working weights with float32 master weights (engine/trainer.h); eager vs CUDA graphs.
//
//   vlmgraph-train-bench [--preset nanovlm-460m] [--batch 8] [--seq 256] [--steps 20] [--json
//   out.json] [--mode graph|eager|both] [--profile-trace PATH] [--sdpa default|no-cudnn]
//   [--recompute none|vision|all]   (activation recomputation of the vision / all blocks)
//   [--optimizer fused|aten]        (engine/fused_optimizer.h's kernels, or ATen's foreach ops)
//   [--bucket-mb 25]                (data parallel: gradient all-reduce bucket, MiB)
//   [--timeout-seconds 300]         (data parallel: a step longer than this ends the job)
//
// Data parallel: started by torchrun (or anything that sets its RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT; read as vlmgraph-train reads them, tools/train/launch.h), each rank trains its own batch x seq on cuda:LOCAL_RANK with NCCL
// (the per-GPU batch is fixed, as upstream's DDP runs); rank 0 prints and writes the figures,
// with tokens/s per GPU:
//   torchrun --nproc_per_node=2 --no-python vlmgraph-train-bench --mode graph --batch 8 --seq 1024
//
// Figures: first step (including capture for graphs, from Trainer construction; the construction
// alone is reported too), median of the following steps, peak device memory allocated and reserved
// over the run. Capture times go to stderr.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/profile_trace.h"
#include "bench/synthetic.h"
#include "engine/device.h"
#include "engine/trainer.h"
#include "tools/train/launch.h"

namespace {
using Clock = std::chrono::steady_clock;

nlohmann::json Run(const std::string& preset, bool graphs, int64_t batch, int64_t seq, int steps,
                   const std::string& profile_trace, const std::string& recompute,
                   bool fused_optimizer, const vlmgraph::train::RankEnv& env,
                   int64_t bucket_bytes, double timeout_seconds) {
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  at::manual_seed(0);
  vlmgraph::VisionLanguageModel source(vlmgraph::VlmConfig::Preset(preset));
  const auto& cfg = source->cfg;
  // One 512px tile (64 image tokens) + text with next-token targets per example.
  const std::vector<vlmgraph::TrainExample> examples =
      vlmgraph::SyntheticTrainBatch(cfg, batch, seq, 1);
  vlmgraph::TrainOptions o;
  o.device = device;
  if (env.world_size > 1) {
    vlmgraph::DataParallelOptions dp;
    dp.rank = env.rank;
    dp.world_size = env.world_size;
    dp.store_host = env.master_addr;
    dp.store_port = env.store_port;
    dp.launcher_store = env.agent_store;
    dp.backend = "nccl";
    dp.device_index = env.local_rank;
    dp.bucket_bytes = bucket_bytes;
    dp.timeout_seconds = timeout_seconds;
    dp.group_name = std::string("train-bench-") + (graphs ? "graph" : "eager");
    o.data_parallel = vlmgraph::DataParallelGroup::Join(dp);
  }
  o.compute_dtype = at::kBFloat16;
  o.cuda_graphs = graphs;
  o.learning_rates = vlmgraph::LearningRates::All(1e-4);  // docs/benchmarks.md's settings
  o.learning_rates.projector = 1e-3;
  o.max_grad_norm = 1.0;
  o.buckets.train_batch_sizes = {batch};
  o.buckets.train_seq_lens = {seq};
  o.log_captures = true;  // capture times on stderr
  o.recompute_vision = recompute == "vision" || recompute == "all";
  o.recompute_language = recompute == "all";
  o.fused_optimizer = fused_optimizer;
  vlmgraph::SynchronizeDevice(device);
  vlmgraph::ResetPeakDeviceMemory(device);
  const auto t0 = Clock::now();
  vlmgraph::Trainer trainer(source, o);
  vlmgraph::SynchronizeDevice(device);
  const double construct_s = std::chrono::duration<double>(Clock::now() - t0).count();
  // A rank that died ends this one's step with kUnavailable while the device may still run the
  // hung collective: report and end the process at once (engine/trainer.h, Note [A rank that
  // dies] in engine/trainer.cc), as vlmgraph-train does.
  auto step = [&] {
    try {
      return trainer.Step(examples);
    } catch (const vlmgraph::EngineError& e) {
      std::fprintf(stderr, "vlmgraph-train-bench: rank %lld: %s: %s\n",
                   static_cast<long long>(env.rank),
                   e.code() == vlmgraph::EngineError::Code::kUnavailable ? "UNAVAILABLE" : "error",
                   e.what());
      std::fflush(stderr);
      std::_Exit(e.code() == vlmgraph::EngineError::Code::kUnavailable ? 3 : 1);
    }
  };
  auto first = step();
  const double first_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> ms;
  double loss = first.loss;
  for (int i = 0; i < steps; ++i) {
    auto r = step();
    ms.push_back(r.seconds * 1e3);
    loss = r.loss;
  }
  std::sort(ms.begin(), ms.end());
  if (!profile_trace.empty() && env.rank == 0) {  // after the timed steps: no bias
    vlmgraph::bench::ProfileTrace(profile_trace, [&] {
      for (int i = 0; i < 3; ++i) step();
    });
  }
  else if (!profile_trace.empty()) {  // the other ranks take the same steps, untraced
    for (int i = 0; i < 3; ++i) step();
  }
  if (o.data_parallel) {  // every rank done before any leaves (Note [Heartbeats])
    o.data_parallel->Barrier();
    o.data_parallel->Leave();
  }
  const auto mem = vlmgraph::DeviceMemory(device);
  const double median_ms = ms[ms.size() / 2];
  return {{"world_size", env.world_size},
          {"tokens_per_second_per_gpu", static_cast<double>(batch * seq) / (median_ms / 1e3)},
          {"all_reduce_bytes_per_step", first.all_reduce_bytes},
          {"first_step_seconds", first_s},
          {"trainer_construction_seconds", construct_s},
          {"median_step_ms", median_ms},
          {"first_loss", first.loss},
          {"last_loss", loss},
          {"graphs", trainer.captures()},
          {"graph_pool_bytes", trainer.graph_pool_bytes()},
          {"peak_allocated_bytes", mem.peak_allocated_bytes},
          {"peak_reserved_bytes", mem.peak_reserved_bytes}};
}
}  // namespace

int Main(int argc, char** argv) {
  std::string preset = "nanovlm-460m", json, mode = "both", profile_trace, sdpa = "default",
              recompute = "none", optimizer = "fused";
  int64_t batch = 8, seq = 256;
  int steps = 20;
  double bucket_mb = 25, timeout_seconds = 300;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--preset")
      preset = v;
    else if (k == "--batch")
      batch = std::stoll(v);
    else if (k == "--seq")
      seq = std::stoll(v);
    else if (k == "--steps")
      steps = std::stoi(v);
    else if (k == "--json")
      json = v;
    else if (k == "--sdpa")
      sdpa = v;  // default | no-cudnn: PyTorch's own flash attention instead of cuDNN's
    else if (k == "--profile-trace")
      profile_trace = v;  // Chrome trace of 3 steps per mode: PATH.<mode>.json
    else if (k == "--mode")
      mode = v;  // graph | eager | both (separate processes give clean peaks)
    else if (k == "--recompute")
      recompute = v;  // none | vision | all: activation recomputation of those blocks
    else if (k == "--optimizer")
      optimizer = v;  // fused | aten
    else if (k == "--bucket-mb")
      bucket_mb = std::stod(v);
    else if (k == "--timeout-seconds")
      timeout_seconds = std::stod(v);
  }
  const vlmgraph::train::RankEnv env = vlmgraph::train::RankEnvFromEnvironment();
  if (env.world_size > 1) c10::cuda::set_device(static_cast<c10::DeviceIndex>(env.local_rank));
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "needs a CUDA device\n");
    return 1;
  }
  if (sdpa == "no-cudnn") at::globalContext().setSDPUseCuDNN(false);
  nlohmann::json report = {{"preset", preset}, {"batch", batch},         {"seq", seq},
                           {"sdpa", sdpa},     {"recompute", recompute}, {"optimizer", optimizer}};
  for (const char* m : {"graph", "eager"}) {
    if (mode != "both" && mode != m) continue;
    report[m] = Run(preset, std::string(m) == "graph", batch, seq, steps,
                    profile_trace.empty() ? "" : profile_trace + "." + m + ".json", recompute,
                    optimizer != "aten", env, static_cast<int64_t>(bucket_mb * 1048576), timeout_seconds);
    if (env.rank != 0) continue;
    std::printf("%s %s\n", m, report[m].dump(2).c_str());
    std::fflush(stdout);
  }
  if (env.rank != 0) return 0;
  if (!json.empty()) std::ofstream(json) << report.dump(2);
  if (mode != "both") return 0;
  auto gib = [](const nlohmann::json& v) { return v.get<int64_t>() / 1073741824.0; };
  std::printf("\n| figure | eager | CUDA graphs |\n|---|---|---|\n");
  std::printf("| step (median) | %.1f ms | %.1f ms |\n",
              report["eager"]["median_step_ms"].get<double>(),
              report["graph"]["median_step_ms"].get<double>());
  std::printf("| first step (incl. capture) | %.2f s | %.2f s |\n",
              report["eager"]["first_step_seconds"].get<double>(),
              report["graph"]["first_step_seconds"].get<double>());
  std::printf(
      "| peak allocated | %.2f GiB | %.2f GiB |\n| peak reserved | %.2f GiB | %.2f GiB |\n",
      gib(report["eager"]["peak_allocated_bytes"]), gib(report["graph"]["peak_allocated_bytes"]),
      gib(report["eager"]["peak_reserved_bytes"]), gib(report["graph"]["peak_reserved_bytes"]));
  return 0;
}

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const vlmgraph::EngineError& e) {
    // A rank that died or hangs ends the others' steps with kUnavailable (engine/trainer.h).
    std::fprintf(stderr, "vlmgraph-train-bench: %s: %s\n",
                 e.code() == vlmgraph::EngineError::Code::kUnavailable ? "UNAVAILABLE" : "error",
                 e.what());
    return e.code() == vlmgraph::EngineError::Code::kUnavailable ? 3 : 1;
  } catch (const std::exception& e) {  // e.g. a malformed RANK / WORLD_SIZE
    std::fprintf(stderr, "vlmgraph-train-bench: %s\n", e.what());
    return 2;
  }
}
