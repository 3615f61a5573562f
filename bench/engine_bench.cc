// bench/engine_bench.cc: start-up capture cost, time to first token and decode step latency of the
// engine, CUDA graphs vs eager, on a built-in preset (default: nanovlm-460m, random weights; timing
// does not depend on weight values).
//
//   vlmgraph-bench [--model nanovlm-460m|CHECKPOINT_DIR] [--dtype bfloat16] [--device cuda]
//                  [--json out.json]         (--preset is --model's older name)
//                  [--profile-trace PATH]   (Chrome traces of 10 decode steps per mode and batch)
//                  [--decode-only 1]        (graphs only, decode only)
//                  [--overlap 0|1]          (overlapped decode steps off / on; default: engine's)
//                  [--sampling 1]           (decode requests sample: temperature 0.8, top-k 50,
//                                            top-p 0.9, a seed each; default greedy)
//                  [--decode-batches 1,8,32] (decode rows; "derived" buckets below allow up to
//                                            the largest derived bucket)
//                  [--batch-buckets default|derived] (derived: decode batch buckets from the
//                                            device's memory up to --max-decode-batch, as the
//                                            server derives them, engine/bucket_sizing.h)
//                  [--max-decode-batch 256]
//
// Method: each figure is the median over `--iters` timed runs after `--warmup` untimed runs.
// TTFT = Validate() + Admit() of N requests, each one 512x512 image tile + 64 text tokens (vision,
// prefill and the first token copied to the host), divided by nothing: it is the time until every
// request of the batch has its first token. Decode = one Step() over N active sequences (embedding,
// all blocks over the KV cache, head, sampling, token copied to the host). With overlapped decode
// steps (the default on CUDA) a Step() queues the next step before waiting for its own tokens, so
// in a steady run its time is the step's device time or the host's work per step, whichever is
// longer.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/profile_trace.h"
#include "engine/engine.h"
#include "model/checkpoint.h"

namespace {

using vlmgraph::Engine;
using vlmgraph::EngineOptions;
using vlmgraph::GenerateRequest;
using vlmgraph::TokenEvent;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Args {
  std::string preset = "nanovlm-460m", dtype = "bfloat16", device = "cuda", json, profile_trace;
  int warmup = 3, iters = 20;
  bool decode_only = false;  // skip TTFT and the eager engine (for profilers)
  int overlap = -1;          // overlapped decode steps: 0 off, 1 on, -1 the engine's default
  bool sampling = false;     // decode requests sample instead of taking the argmax
  std::vector<int64_t> decode_batches = {1, 8, 32};
  bool derived_buckets = false;  // batch buckets from the device's memory
  int64_t max_decode_batch = 256;
};

std::vector<int64_t> ParseList(const std::string& v) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= v.size()) {
    const size_t comma = v.find(',', start);
    out.push_back(std::stoll(v.substr(start, comma - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

GenerateRequest ImagePrompt(const vlmgraph::VlmConfig& cfg, int64_t text_tokens, int64_t max_new) {
  GenerateRequest r;
  for (int64_t i = 0; i < cfg.mp_image_token_length; ++i) r.input_ids.push_back(cfg.image_token_id);
  for (int64_t i = 0; i < text_tokens; ++i) r.input_ids.push_back(100 + i);
  r.tiles = at::rand({1, 3, cfg.vit_img_size, cfg.vit_img_size});
  r.sampling.max_new_tokens = max_new;
  return r;
}

nlohmann::json RunOne(vlmgraph::VisionLanguageModel model, const Args& a, bool graphs) {
  EngineOptions o;
  o.device = at::Device(a.device);
  o.dtype = a.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  o.cuda_graphs = graphs;
  o.log_captures = false;
  if (a.overlap >= 0) o.overlap_decode_steps = a.overlap == 1;
  if (a.derived_buckets) {
    o.buckets.batch_sizes.clear();  // derived from the device's memory at construction
    o.buckets.max_decode_batch = a.max_decode_batch;
  }
  Engine engine(std::move(model), o);
  const auto& cfg = engine.model_config();
  nlohmann::json out;
  auto t0 = Clock::now();
  engine.Warmup();
  out["capture_seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
  out["graphs"] = engine.Counters().TotalCaptures();
  const auto mem = engine.Memory();
  out["graph_pool_bytes"] = mem.graph_pool_bytes;
  out["kv_cache_bytes"] = mem.kv_cache_bytes;
  out["kv_cache_tokens"] = mem.kv_cache_pages * mem.kv_cache_page_size;
  out["reserved_bytes_after_warmup"] = mem.reserved_bytes;
  std::vector<TokenEvent> events;
  for (int64_t batch : {1, 8}) {
    if (a.decode_only) break;
    std::vector<double> ms;
    for (int i = 0; i < a.warmup + a.iters; ++i) {
      std::vector<GenerateRequest> reqs(batch,
                                        ImagePrompt(cfg, 64, 1));  // finish at once: slots free
      auto s = Clock::now();
      std::vector<vlmgraph::ValidatedRequest> validated;
      for (const auto& r : reqs) validated.push_back(engine.Validate(r));
      engine.Admit(std::move(validated), &events);
      const double dt = std::chrono::duration<double, std::milli>(Clock::now() - s).count();
      if (i >= a.warmup) ms.push_back(dt);
      events.clear();
    }
    out["ttft_ms"]["batch_" + std::to_string(batch)] = Median(ms);
  }
  out["batch_sizes"] = engine.options().buckets.batch_sizes;
  for (int64_t batch : a.decode_batches) {
    if (batch > engine.options().buckets.max_batch()) {
      out["skipped_decode_batches"].push_back(batch);  // more than the engine's slots
      continue;
    }
    std::vector<GenerateRequest> reqs(batch, ImagePrompt(cfg, 64, 1000));
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto& sp = reqs[i].sampling;
      sp.max_new_tokens = a.warmup + a.iters + 24;  // + 10 profiled steps
      if (a.sampling) {                             // typical chat settings
        sp.greedy = false;
        sp.temperature = 0.8;
        sp.top_k = 50;
        sp.top_p = 0.9;
        sp.seed = 1000 + i;
      }
    }
    std::vector<vlmgraph::ValidatedRequest> validated;
    for (const auto& r : reqs) validated.push_back(engine.Validate(r));
    const auto ids = engine.Admit(std::move(validated), &events);
    std::vector<double> ms;
    for (int i = 0; i < a.warmup + a.iters; ++i) {
      auto s = Clock::now();
      engine.Step(&events);
      const double dt = std::chrono::duration<double, std::milli>(Clock::now() - s).count();
      if (i >= a.warmup) ms.push_back(dt);
    }
    events.clear();
    const auto key = *engine.options().buckets.PickDecode(
        batch, 64 + cfg.mp_image_token_length + a.iters + a.warmup + 1);
    out["decode_region_only_ms"]["batch_" + std::to_string(batch)] =
        engine.TimeRegion(key, 50) * 1e3;
    if (!a.profile_trace.empty()) {  // 10 decode steps: PATH.<graph|eager>.b<N>.json
      vlmgraph::bench::ProfileTrace(
          a.profile_trace + (graphs ? ".graph" : ".eager") + ".b" + std::to_string(batch) + ".json",
          [&] {
            for (int i = 0; i < 10; ++i) engine.Step(&events);
          });
      events.clear();
    }
    for (auto id : ids) engine.Cancel(id);  // free the slots for the next batch size
    out["decode_ms_per_step"]["batch_" + std::to_string(batch)] = Median(ms);
  }
  out["captures_after_warmup"] = engine.Counters().TotalCaptures() - out["graphs"].get<int64_t>();
  out["peak_reserved_bytes"] = engine.Memory().reserved_bytes;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--preset" || k == "--model")
      a.preset = v;
    else if (k == "--dtype")
      a.dtype = v;
    else if (k == "--device")
      a.device = v;
    else if (k == "--json")
      a.json = v;
    else if (k == "--iters")
      a.iters = std::stoi(v);
    else if (k == "--warmup")
      a.warmup = std::stoi(v);
    else if (k == "--profile-trace")
      a.profile_trace = v;
    else if (k == "--decode-only")
      a.decode_only = v == "1";
    else if (k == "--overlap")
      a.overlap = std::stoi(v);
    else if (k == "--sampling")
      a.sampling = v == "1";
    else if (k == "--decode-batches")
      a.decode_batches = ParseList(v);
    else if (k == "--batch-buckets")
      a.derived_buckets = v == "derived";
    else if (k == "--max-decode-batch")
      a.max_decode_batch = std::stoll(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (a.device.rfind("cuda", 0) == 0 && !torch::cuda::is_available()) {
    std::fprintf(stderr, "no CUDA device; run with --device cpu --preset nanovlm-tiny\n");
    return 1;
  }
  at::manual_seed(0);
  nlohmann::json report;
  report["preset"] = a.preset;
  report["dtype"] = a.dtype;
  report["device"] = a.device;
  report["overlap_decode_steps"] = a.overlap < 0 ? "default" : a.overlap == 1 ? "on" : "off";
  report["decode_sampling"] =
      a.sampling ? "temperature 0.8, top_k 50, top_p 0.9, seeded" : "greedy";
  report["buckets"] = {{"batch_sizes", vlmgraph::BucketSpec().batch_sizes},
                       {"seq_lens", vlmgraph::BucketSpec().seq_lens},
                       {"context_lens", vlmgraph::BucketSpec().context_lens},
                       {"tile_counts", vlmgraph::BucketSpec().tile_counts}};
  for (bool graphs : {true, false}) {
    if (a.decode_only && !graphs) break;
    // A preset (random weights) or a checkpoint directory (tools/convert_gguf.py writes one).
    const auto presets = vlmgraph::VlmConfig::PresetNames();
    vlmgraph::VisionLanguageModel model =
        std::find(presets.begin(), presets.end(), a.preset) != presets.end()
            ? vlmgraph::VisionLanguageModel(vlmgraph::VlmConfig::Preset(a.preset))
            : vlmgraph::LoadModel(a.preset);
    report[graphs ? "graph" : "eager"] = RunOne(std::move(model), a, graphs);
    std::printf("%s\n", report[graphs ? "graph" : "eager"].dump(2).c_str());
    std::fflush(stdout);
  }
  if (a.decode_only) {
    if (!a.json.empty()) std::ofstream(a.json) << report.dump(2);
    return 0;
  }
  std::printf("\n| figure | eager | CUDA graphs | speedup |\n|---|---|---|---|\n");
  auto row = [&](const char* name, const nlohmann::json& e, const nlohmann::json& g) {
    std::printf("| %s | %.3f ms | %.3f ms | %.1fx |\n", name, e.get<double>(), g.get<double>(),
                e.get<double>() / g.get<double>());
  };
  for (const char* b : {"batch_1", "batch_8"}) {
    row((std::string("time to first token, ") + b).c_str(), report["eager"]["ttft_ms"][b],
        report["graph"]["ttft_ms"][b]);
  }
  for (int64_t batch : a.decode_batches) {
    const std::string b = "batch_" + std::to_string(batch);
    if (!report["eager"]["decode_ms_per_step"].contains(b) ||
        !report["graph"]["decode_ms_per_step"].contains(b)) {
      continue;  // more than the engine's slots
    }
    row(("decode per step, " + b).c_str(), report["eager"]["decode_ms_per_step"][b],
        report["graph"]["decode_ms_per_step"][b]);
  }
  std::printf("| start-up capture | | %.2f s (%lld graphs, pool %.1f MiB) | |\n",
              report["graph"]["capture_seconds"].get<double>(),
              (long long)report["graph"]["graphs"].get<int64_t>(),
              report["graph"]["graph_pool_bytes"].get<int64_t>() / 1048576.0);
  if (!a.json.empty()) std::ofstream(a.json) << report.dump(2);
  return 0;
}
