// bench/train_bench.cc: training step time of a preset (default nanovlm-460m, random weights) at
// batch 8 x 256 tokens with one 512px image tile per sample (64 image tokens + 192 text tokens),
// AdamW, bf16 working weights with float32 master weights (engine/trainer.h); eager vs CUDA graphs.
//
//   vlmgraph-train-bench [--preset nanovlm-460m] [--batch 8] [--seq 256] [--steps 20] [--json
//   out.json] [--mode graph|eager|both] [--profile-trace PATH] [--sdpa default|no-cudnn]
//   [--recompute none|vision|all]   (activation recomputation of the vision / all blocks)
//   [--optimizer fused|aten]        (engine/fused_optimizer.h's kernels, or ATen's foreach ops)
//   [--bucket-mb 25]                (data parallel: gradient all-reduce bucket, MiB)
//   [--reduce-dtype default|float32|bfloat16]  (data parallel: DataParallelOptions::reduce_dtype)
//   [--timeout-seconds 300]         (data parallel: a step longer than this ends the job)
//   [--shard-optimizer on|off]      (data parallel: ZeRO stage 1, DataParallelOptions::
//                                    shard_optimizer; default: that option's default)
//   [--peak-tflops X]               (the device's dense bf16 peak for MFU; default: from its name,
//                                    vlmgraph::PeakBf16Tflops of model/flops.h;
//                                    none known: no MFU)
//   [--broadcast-in-forward on|off] (sharded: the later blocks' weights broadcast in the next
//                                    step's forward, DataParallelOptions::broadcast_in_forward)
//   [--stage-tiles on|off]          (on: tiles staged in bf16 pinned memory ahead, as
//                                    vlmgraph-train's prefetch does; off: float32 tiles converted
//                                    on the step's path; Note [Staged tiles], engine/trainer.h)
//   [--submit on|off]               (on: step i + 1 submitted before step i is waited for,
//                                    Trainer::Submit / Wait, as vlmgraph-train runs them; off:
//                                    Step() after Step(); the step time is then the host's too)
//   [--global-batch on|off]         (data parallel, on: the ranks split one synthetic batch of
//                                    world_size x batch examples, so a 1-GPU run at that batch
//                                    takes the same steps; off: each rank its own copy)
//
// Data parallel: started by torchrun (or anything that sets its RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT; read as vlmgraph-train reads them, launch/launch.h), each rank trains its own batch x seq on cuda:LOCAL_RANK with NCCL
// (the per-GPU batch is fixed, as upstream's DDP runs); rank 0 prints and writes the figures,
// with tokens/s per GPU:
//   torchrun --nproc_per_node=2 --no-python vlmgraph-train-bench --mode graph --batch 8 --seq 1024
//
// Figures: first step (including capture for graphs, from Trainer construction; the construction
// alone is reported too), median of the following steps and their spread ((p90 - p10) / median;
// "unstable" above 5%), every step's loss, peak device memory allocated and reserved over the
// run, and the GPU's SM clock, power, temperature and throttle reasons over the timed steps
// (NVML, bench/gpu_telemetry.h). Capture times go to stderr.
//
// MFU (model FLOPs utilisation): model FLOPs per step by PaLM's formula (model/flops.h: 6 x matmul
// parameters x tokens for both towers, the projector and the LM head, plus 12 x layers x d x T
// per token for attention), per rank, over the median step, against the device's dense bf16 peak.
// --mode eager --profile-trace PATH writes the trace bench/train_regions.py splits by region
// (vision encoder, projector, decoder blocks, LM head + loss, optimizer; forward and backward).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/gpu_telemetry.h"
#include "bench/profile_trace.h"
#include "bench/synthetic.h"
#include "engine/device.h"
#include "engine/trainer.h"
#include "model/flops.h"
#include "launch/launch.h"

namespace {
using Clock = std::chrono::steady_clock;

nlohmann::json Run(const std::string& preset, bool graphs, int64_t batch, int64_t seq, int steps,
                   const std::string& profile_trace, const std::string& recompute,
                   bool fused_optimizer, const vlmgraph::launch::RankEnv& env,
                   int64_t bucket_bytes, double timeout_seconds, const std::string& reduce_dtype,
                   bool stage_tiles, bool global_batch, const std::string& shard_optimizer,
                   const std::string& broadcast_in_forward, double peak_tflops, bool submit) {
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  at::manual_seed(0);
  vlmgraph::VisionLanguageModel source(vlmgraph::VlmConfig::Preset(preset));
  const auto& cfg = source->cfg;
  // One 512px tile (64 image tokens) + text with next-token targets per example.
  std::vector<vlmgraph::TrainExample> examples =
      global_batch && env.world_size > 1
          ? vlmgraph::ShardForRank(
                vlmgraph::SyntheticTrainBatch(cfg, batch * env.world_size, seq, 1), env.rank,
                env.world_size)
          : vlmgraph::SyntheticTrainBatch(cfg, batch, seq, 1);
  if (stage_tiles) {
    for (auto& e : examples) vlmgraph::StageTrainExample(e, device, at::kBFloat16);
  }
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
    if (reduce_dtype == "float32") dp.reduce_dtype = at::kFloat;
    if (reduce_dtype == "bfloat16") dp.reduce_dtype = at::kBFloat16;
    if (shard_optimizer != "default") dp.shard_optimizer = shard_optimizer == "on";
    if (broadcast_in_forward != "default") dp.broadcast_in_forward = broadcast_in_forward == "on";
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
  // dies] in engine/trainer_step.cc), as vlmgraph-train does.
  auto guarded = [&](auto&& call) {
    try {
      return call();
    } catch (const vlmgraph::EngineError& e) {
      std::fprintf(stderr, "vlmgraph-train-bench: rank %lld: %s: %s\n",
                   static_cast<long long>(env.rank),
                   e.code() == vlmgraph::EngineError::Code::kUnavailable ? "UNAVAILABLE" : "error",
                   e.what());
      std::fflush(stderr);
      std::_Exit(e.code() == vlmgraph::EngineError::Code::kUnavailable ? 3 : 1);
    }
  };
  auto step = [&] { return guarded([&] { return trainer.Step(examples); }); };
  // n steps, each result to on_result: Step() each, or (--submit on) step i + 1 submitted before
  // step i is waited for (Trainer::Submit / Wait), as vlmgraph-train runs them.
  auto run_steps = [&](int n, const std::function<void(const vlmgraph::TrainStepResult&)>& on_result) {
    if (!submit) {
      for (int i = 0; i < n; ++i) on_result(step());
      return;
    }
    guarded([&] { trainer.Submit(examples); });
    for (int i = 0; i < n; ++i) {
      if (i + 1 < n) guarded([&] { trainer.Submit(examples); });
      on_result(guarded([&] { return trainer.Wait(); }));
    }
  };
  auto first = step();
  const double first_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> ms, losses = {first.loss};
  double loss = first.loss;
  char pci_bus_id[32] = {};
  {
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(device.index());
    std::snprintf(pci_bus_id, sizeof(pci_bus_id), "%08x:%02x:%02x.0", p->pciDomainID, p->pciBusID,
                  p->pciDeviceID);
  }
  vlmgraph::bench::GpuTelemetry telemetry(pci_bus_id);
  run_steps(steps, [&](const vlmgraph::TrainStepResult& r) {
    ms.push_back(r.seconds * 1e3);
    losses.push_back(r.loss);
    loss = r.loss;
  });
  const nlohmann::json gpu = telemetry.Stop();
  const double spread = vlmgraph::bench::RelativeSpread(ms);
  std::sort(ms.begin(), ms.end());
  if (!profile_trace.empty() && env.rank == 0) {  // after the timed steps: no bias
    vlmgraph::bench::ProfileTrace(profile_trace,
                                  [&] { run_steps(3, [](const vlmgraph::TrainStepResult&) {}); });
  } else if (!profile_trace.empty()) {  // the other ranks take the same steps, untraced
    run_steps(3, [](const vlmgraph::TrainStepResult&) {});
  }
  if (o.data_parallel) {  // every rank done before any leaves (Note [Heartbeats])
    o.data_parallel->Barrier();
    o.data_parallel->Leave();
  }
  const auto mem = vlmgraph::DeviceMemory(device);
  const double median_ms = ms[ms.size() / 2];
  int64_t tiles = 0;
  for (const auto& e : examples) tiles += e.tiles.defined() ? e.tiles.size(0) : 0;
  const vlmgraph::TrainStepFlops flops = vlmgraph::TrainFlopsPerStep(cfg, batch, seq, tiles);
  const std::string device_name = at::cuda::getDeviceProperties(device.index())->name;
  const double peak = peak_tflops > 0 ? peak_tflops : vlmgraph::PeakBf16Tflops(device_name);
  const double achieved_tflops = flops.total() / (median_ms / 1e3) / 1e12;
  return {{"world_size", env.world_size},
          {"device_name", device_name},
          {"model_tflop_per_step", flops.total() / 1e12},
          {"model_tflop_per_step_by_part",
           {{"vision_encoder", flops.vision_encoder / 1e12},
            {"projector", flops.projector / 1e12},
            {"decoder", flops.decoder / 1e12},
            {"lm_head", flops.lm_head / 1e12},
            {"attention", flops.attention / 1e12}}},
          {"model_tflops_per_second", achieved_tflops},
          {"peak_bf16_tflops", peak > 0 ? nlohmann::json(peak) : nlohmann::json()},
          {"mfu", peak > 0 ? nlohmann::json(achieved_tflops / peak) : nlohmann::json()},
          {"tokens_per_second_per_gpu", static_cast<double>(batch * seq) / (median_ms / 1e3)},
          {"all_reduce_bytes_per_step", first.all_reduce_bytes},
          {"first_step_seconds", first_s},
          {"trainer_construction_seconds", construct_s},
          {"median_step_ms", median_ms},
          {"step_ms_spread", spread},
          {"unstable", spread > 0.05},
          {"gpu", gpu},
          {"losses", losses},
          {"reduce_dtype", reduce_dtype},
          {"optimizer_sharded", trainer.optimizer_sharded()},
          {"broadcast_in_forward_wait_block", trainer.forward_broadcast_wait_block()},
          {"submitted_steps", submit},
          {"staged_tiles", stage_tiles},
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
  double bucket_mb = 25, timeout_seconds = 300, peak_tflops = 0;
  std::string reduce_dtype = "default", stage_tiles = "on", global_batch = "off",
              shard_optimizer = "default", broadcast_in_forward = "default", submit = "on";
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
    else if (k == "--reduce-dtype")
      reduce_dtype = v;  // default | float32 | bfloat16
    else if (k == "--stage-tiles")
      stage_tiles = v;  // on | off
    else if (k == "--global-batch")
      global_batch = v;  // on | off
    else if (k == "--shard-optimizer")
      shard_optimizer = v;  // default | on | off
    else if (k == "--broadcast-in-forward")
      broadcast_in_forward = v;  // default | on | off
    else if (k == "--peak-tflops")
      peak_tflops = std::stod(v);
    else if (k == "--submit")
      submit = v;  // on | off
  }
  for (const auto& [flag, value] : {std::pair<const char*, const std::string&>{
                                        "--shard-optimizer", shard_optimizer},
                                    {"--broadcast-in-forward", broadcast_in_forward},
                                    {"--submit", submit}}) {
    if (value != "default" && value != "on" && value != "off") {
      std::fprintf(stderr, "%s: on or off, not %s\n", flag, value.c_str());
      return 2;
    }
  }
  if (reduce_dtype != "default" && reduce_dtype != "float32" && reduce_dtype != "bfloat16") {
    std::fprintf(stderr, "--reduce-dtype: default, float32 or bfloat16, not %s\n",
                 reduce_dtype.c_str());
    return 2;
  }
  const vlmgraph::launch::RankEnv env = vlmgraph::launch::RankEnvFromEnvironment();
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
                    optimizer != "aten", env, static_cast<int64_t>(bucket_mb * 1048576),
                    timeout_seconds, reduce_dtype, stage_tiles == "on", global_batch == "on",
                    shard_optimizer, broadcast_in_forward, peak_tflops, submit != "off");
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
