#include "tools/diagnose/diagnose.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <sstream>

#include "bench/synthetic.h"
#include "engine/device.h"

namespace vlmgraph {
namespace {

using nlohmann::json;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Buckets of a region to time: all of them, or (quick) the smallest and the largest.
std::vector<BucketKey> Pick(const BucketSpec& spec, Region r, bool quick) {
  std::vector<BucketKey> all = spec.All(r);
  std::reverse(all.begin(), all.end());  // smallest first, for reading
  if (!quick || all.size() <= 2) return all;
  return {all.front(), all.back()};
}

json TimeBuckets(Engine& engine, const std::vector<BucketKey>& keys, const DiagnoseOptions& o) {
  json rows = json::object();
  const at::Device device = engine.options().device;
  for (const auto& key : keys) {
    for (int i = 0; i < o.warmup; ++i) engine.TimeRegion(key, 1);
    SynchronizeDevice(device);
    ResetPeakDeviceMemory(device);
    std::vector<double> ms;
    for (int i = 0; i < o.iters; ++i) ms.push_back(engine.TimeRegion(key, 1) * 1e3);
    rows[std::string(RegionName(key.region)) + "/" + key.Label()] = {
        {"median_ms", Median(ms)},
        {"peak_allocated_bytes",
         device.is_cuda() ? json(DeviceMemory(device).peak_allocated_bytes) : json(nullptr)}};
  }
  return rows;
}

json TimeTraining(const TrainerByGraphs& make_trainer, bool graphs, const DiagnoseOptions& o) {
  std::unique_ptr<Trainer> t = make_trainer(graphs);
  const auto& spec = t->options().buckets;
  const int64_t b = spec.train_batch_sizes.front(), s = spec.train_seq_lens.front();
  auto batch = SyntheticTrainBatch(t->model()->cfg, b, s, t->options().max_tiles_per_example);
  const at::Device device = t->options().device;
  SynchronizeDevice(device);
  ResetPeakDeviceMemory(device);
  const auto t0 = std::chrono::steady_clock::now();
  t->Step(batch);
  const double first =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 0; i + 1 < o.warmup; ++i) t->Step(batch);
  std::vector<double> ms;
  for (int i = 0; i < std::max(3, o.iters / 2); ++i) ms.push_back(t->Step(batch).seconds * 1e3);
  return {{"bucket", BucketKey{Region::kTrain, b, s, 0}.Label()},
          {"median_ms", Median(ms)},
          {"first_step_ms", first},
          {"peak_allocated_bytes",
           device.is_cuda() ? json(DeviceMemory(device).peak_allocated_bytes) : json(nullptr)},
          {"captures", t->captures()}};
}

// Generates `prompts` (each of the given length) with `max_new` tokens; returns counter deltas.
json RunShapes(Engine& engine, const std::vector<int64_t>& lengths, int64_t max_new) {
  const VlmConfig& cfg = engine.model_config();
  const EngineCounters before = engine.Counters();
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    GenerateRequest r;
    for (int64_t t = 0; t < lengths[i]; ++t)
      r.input_ids.push_back(1 + (t * 13 + i) % (cfg.lm_base_vocab_size - 1));
    r.sampling.max_new_tokens =
        std::max<int64_t>(1, std::min<int64_t>(max_new, engine.max_context() - lengths[i]));
    reqs.push_back(std::move(r));
  }
  engine.Generate(reqs);
  const EngineCounters after = engine.Counters();
  const int64_t real = after.real_tokens - before.real_tokens,
                padded = after.padded_tokens - before.padded_tokens;
  return {{"captures", after.TotalCaptures() - before.TotalCaptures()},
          {"eager_fallbacks", after.eager_fallbacks - before.eager_fallbacks},
          {"real_tokens", real},
          {"padded_tokens", padded},
          {"padding_waste", real > 0 ? static_cast<double>(padded) / real : 0.0}};
}

json Sweeps(Engine& engine, const DiagnoseOptions& o) {
  const auto& b = engine.options().buckets;
  json out;
  // Vary batch: 1 .. max batch (quick: 1, a between-bucket size, the max), short prompts.
  std::vector<int64_t> batches;
  if (o.quick) {
    batches = {1, std::max<int64_t>(1, b.max_batch() - 1), b.max_batch()};
  } else {
    for (int64_t n = 1; n <= b.max_batch(); ++n) batches.push_back(n);
  }
  json vb = json::array();
  const int64_t short_len = std::max<int64_t>(1, b.seq_lens.front() / 2);
  for (int64_t n : batches) {
    json row = RunShapes(engine, std::vector<int64_t>(n, short_len), 4);
    row["batch"] = n;
    vb.push_back(row);
  }
  out["vary_batch"] = vb;
  // Vary sequence: each seq bucket, one below and one above it (between buckets), and one prompt
  // longer than every bucket (an expected eager fallback, or rejected under oversize: reject).
  std::vector<int64_t> lengths;
  for (int64_t s : b.seq_lens) {
    for (int64_t len : {s - 1, s, s + 1}) {
      if (len >= 1 && len + 2 <= engine.max_context()) lengths.push_back(len);
    }
  }
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  if (o.quick && lengths.size() > 4)
    lengths = {lengths.front(), lengths[lengths.size() / 2], lengths.back()};
  json vs = json::array();
  for (int64_t len : lengths) {
    const bool oversize = len > b.max_seq();
    if (oversize && b.oversize == OversizePolicy::kReject) continue;
    json row = RunShapes(engine, {len}, 2);
    row["seq"] = len;
    row["between_buckets"] =
        !BucketSpec::Smallest(b.seq_lens, len) || *BucketSpec::Smallest(b.seq_lens, len) != len;
    row["oversize"] = oversize;
    vs.push_back(row);
  }
  out["vary_sequence"] = vs;
  int64_t captures = 0, unexpected_fallbacks = 0;
  for (const auto& r : vb)
    captures += r["captures"].get<int64_t>(),
        unexpected_fallbacks += r["eager_fallbacks"].get<int64_t>();
  for (const auto& r : vs) {
    captures += r["captures"].get<int64_t>();
    if (!r["oversize"].get<bool>()) unexpected_fallbacks += r["eager_fallbacks"].get<int64_t>();
  }
  out["captures_after_warmup"] = captures;
  out["unexpected_eager_fallbacks"] = unexpected_fallbacks;
  return out;
}

}  // namespace

double PaddingWaste(const std::vector<int64_t>& lengths, const std::vector<int64_t>& buckets) {
  std::vector<int64_t> sorted = buckets;
  std::sort(sorted.begin(), sorted.end());
  double real = 0, padded = 0;
  for (int64_t len : lengths) {
    auto bucket = BucketSpec::Smallest(sorted, len);
    real += len;
    padded += bucket ? *bucket : len;
  }
  return real > 0 ? padded / real : 1.0;
}

std::vector<int64_t> SuggestBuckets(std::vector<int64_t> lengths, int k) {
  if (lengths.empty() || k < 1) return {};
  std::sort(lengths.begin(), lengths.end());
  std::vector<int64_t> values;  // distinct lengths
  std::vector<int64_t> count;   // how many of each
  for (int64_t len : lengths) {
    if (values.empty() || values.back() != len) {
      values.push_back(len);
      count.push_back(0);
    }
    count.back()++;
  }
  const size_t n = values.size();
  k = std::min<int>(k, static_cast<int>(n));
  std::vector<int64_t> prefix_count(n + 1, 0);
  std::vector<double> prefix_sum(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    prefix_count[i + 1] = prefix_count[i] + count[i];
    prefix_sum[i + 1] = prefix_sum[i] + static_cast<double>(count[i]) * values[i];
  }
  // cost(i, j): lengths values[i..j] padded to values[j] (padding tokens only).
  auto cost = [&](size_t i, size_t j) {
    return static_cast<double>(prefix_count[j + 1] - prefix_count[i]) * values[j] -
           (prefix_sum[j + 1] - prefix_sum[i]);
  };
  const double inf = std::numeric_limits<double>::infinity();
  // best[b][j]: minimal padding of values[0..j] with b buckets, the last ending at j.
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n, inf));
  std::vector<std::vector<size_t>> from(k + 1, std::vector<size_t>(n, 0));
  for (size_t j = 0; j < n; ++j) best[1][j] = cost(0, j);
  for (int b = 2; b <= k; ++b) {
    for (size_t j = 0; j < n; ++j) {
      for (size_t i = 0; i < j; ++i) {  // previous bucket ends at i
        const double c = best[b - 1][i] + cost(i + 1, j);
        if (c < best[b][j]) {
          best[b][j] = c;
          from[b][j] = i;
        }
      }
    }
  }
  std::vector<int64_t> out;
  size_t j = n - 1;
  for (int b = k; b >= 1; --b) {
    out.push_back(values[j]);
    if (b > 1) j = from[b][j];
  }
  std::sort(out.begin(), out.end());
  return out;
}

json RunDiagnostics(const EngineByGraphs& make_engine, const TrainerByGraphs& make_trainer,
                    const DiagnoseOptions& o) {
  json report;
  std::unique_ptr<Engine> graphed = make_engine(true);
  const bool graphs = graphed->graphs_enabled();
  const EngineOptions eo = graphed->options();  // a copy: the engine is released before the end
  const VlmConfig cfg = graphed->model_config();
  int64_t params = 0;
  for (const auto& p : graphed->model()->parameters()) params += p.numel();
  report["environment"] = {
      {"device", eo.device.str()},
      {"dtype", eo.dtype == at::kBFloat16 ? "bfloat16" : "float32"},
      {"graphs_available", graphs},
      {"graphs_note", graphs ? "CUDA graphs captured per bucket"
                             : "CUDA graphs not available (CPU device, CPU-only build, or capture "
                               "disabled): graph rows are null"},
      {"parameters", params},
      {"decoder_blocks", cfg.lm_n_blocks},
      {"buckets",
       {{"batch_sizes", eo.buckets.batch_sizes},
        {"seq_lens", eo.buckets.seq_lens},
        {"context_lens", eo.buckets.context_lens},
        {"tile_counts", eo.buckets.tile_counts}}}};
  graphed->Warmup();
  const EngineCounters warm = graphed->Counters();

  if (o.capture) {
    json per_bucket = json::object();
    for (const auto& [k, seconds] : warm.capture_seconds) {
      per_bucket[k] = {
          {"seconds", seconds},
          {"pool_growth_bytes",
           warm.capture_pool_growth_bytes.count(k) ? warm.capture_pool_growth_bytes.at(k) : 0}};
    }
    report["capture"] = {
        {"available", graphs},
        {"graphs", warm.TotalCaptures()},
        {"total_seconds", warm.capture_seconds_total},
        {"graph_pool_bytes", graphed->Memory().graph_pool_bytes},
        {"kv_cache_bytes", graphed->Memory().kv_cache_bytes},
        {"per_bucket", per_bucket},
        {"per_block_capture", "not supported: this engine captures whole regions only"}};
  }

  json graph_rows, eager_rows, train_graph, train_eager;
  std::vector<BucketKey> keys;
  for (Region r : {Region::kVision, Region::kPrefill, Region::kDecode}) {
    for (const auto& k : Pick(eo.buckets, r, o.quick)) keys.push_back(k);
  }
  if (o.baseline && graphs) graph_rows = TimeBuckets(*graphed, keys, o);
  if (o.sweeps) report["sweeps"] = Sweeps(*graphed, o);
  if (o.dispatch) {
    const EngineCounters c = graphed->Counters();
    report["dispatch"] = {
        {"available", graphs && c.decode_steps > 0},
        {"decode_steps", c.decode_steps},
        {"mean_us_per_step",
         c.decode_steps > 0 ? c.decode_dispatch_seconds_total / c.decode_steps * 1e6 : 0.0},
        {"what",
         "host time from Step() entry until the decode graph replay is launched: bucket choice, "
         "input "
         "fill and copy, launch (torch.compile's guard evaluation costs 175-230 us per step)"}};
  }
  // Advice needs the graphed engine's measured pool; take it before releasing the engine.
  const int64_t measured_pool = graphed->Memory().graph_pool_bytes;
  graphed.reset();
  if (o.baseline) {
    std::unique_ptr<Engine> eager = make_engine(false);
    eager->Warmup();
    eager_rows = TimeBuckets(*eager, keys, o);
    eager.reset();
    json rows = json::array();
    for (const auto& k : keys) {
      const std::string name = std::string(RegionName(k.region)) + "/" + k.Label();
      json row = {{"region", RegionName(k.region)},
                  {"bucket", k.Label()},
                  {"eager_ms", eager_rows[name]["median_ms"]},
                  {"eager_peak_bytes", eager_rows[name]["peak_allocated_bytes"]}};
      if (graphs) {
        row["graph_ms"] = graph_rows[name]["median_ms"];
        row["graph_peak_bytes"] = graph_rows[name]["peak_allocated_bytes"];
        row["speedup"] = eager_rows[name]["median_ms"].get<double>() /
                         std::max(1e-9, graph_rows[name]["median_ms"].get<double>());
      } else {
        row["graph_ms"] = nullptr;
        row["graph_peak_bytes"] = nullptr;
        row["speedup"] = nullptr;
      }
      rows.push_back(row);
    }
    if (o.training && make_trainer) {
      json e = TimeTraining(make_trainer, false, o);
      json row = {{"region", "train"},
                  {"bucket", e["bucket"]},
                  {"eager_ms", e["median_ms"]},
                  {"eager_peak_bytes", e["peak_allocated_bytes"]},
                  {"eager_first_step_ms", e["first_step_ms"]}};
      if (graphs) {
        json g = TimeTraining(make_trainer, true, o);
        row["graph_ms"] = g["median_ms"];
        row["graph_peak_bytes"] = g["peak_allocated_bytes"];
        row["graph_first_step_ms"] = g["first_step_ms"];
        row["speedup"] =
            e["median_ms"].get<double>() / std::max(1e-9, g["median_ms"].get<double>());
      } else {
        row["graph_ms"] = nullptr;
        row["graph_peak_bytes"] = nullptr;
        row["speedup"] = nullptr;
      }
      rows.push_back(row);
    }
    report["baseline"] = {
        {"method", "median of " + std::to_string(o.iters) + " timed runs after " +
                       std::to_string(o.warmup) + " warm-up runs, device synchronised per run"},
        {"rows", rows}};
  }

  if (o.advice) {
    const auto& b = eo.buckets;
    std::vector<int64_t> lengths = o.prompt_lengths;
    std::string source = o.shapes_source;
    if (lengths.empty()) {
      lengths =
          SyntheticPromptLengths(o.quick ? 500 : 5000, b.max_seq() / 4.0, 0.6, b.max_context() - 1);
      source =
          "synthetic lognormal, median " + std::to_string(b.max_seq() / 4) + " tokens, sigma 0.6";
    }
    std::vector<int64_t> fitting;
    int64_t oversize = 0;
    for (int64_t len : lengths) (len <= b.max_seq() ? fitting.push_back(len) : (void)++oversize);
    // Padding-optimal sizes, rounded up to multiples of 8 (tensor-core friendly GEMM shapes).
    std::vector<int64_t> suggested = SuggestBuckets(fitting, static_cast<int>(b.seq_lens.size()));
    for (auto& v : suggested) v = (v + 7) / 8 * 8;
    suggested.erase(std::unique(suggested.begin(), suggested.end()), suggested.end());
    // Graph-pool memory scales with the largest prefill activation (batch x seq); estimate the
    // suggested set's pool from the measured one.
    auto pool_estimate = [&](const std::vector<int64_t>& seqs) -> json {
      if (measured_pool <= 0 || seqs.empty()) return nullptr;
      return static_cast<int64_t>(static_cast<double>(measured_pool) * seqs.back() / b.max_seq());
    };
    report["bucket_advice"] = {
        {"source", source},
        {"requests", lengths.size()},
        {"longer_than_every_bucket", oversize},
        {"current",
         {{"seq_lens", b.seq_lens},
          {"padding_waste", PaddingWaste(fitting, b.seq_lens)},
          {"prefill_graphs", b.seq_lens.size() * b.batch_sizes.size()},
          {"graph_pool_bytes", measured_pool > 0 ? json(measured_pool) : json(nullptr)}}},
        {"suggested",
         {{"seq_lens", suggested},
          {"padding_waste", PaddingWaste(fitting, suggested)},
          {"prefill_graphs", suggested.size() * b.batch_sizes.size()},
          {"graph_pool_bytes_estimate", pool_estimate(suggested)}}},
        {"note",
         "padding_waste = padded tokens / real tokens for prompts that fit a bucket; the suggested "
         "set "
         "has as many seq buckets as the current one, minimises padded tokens for this sample, and "
         "is "
         "rounded up to multiples of 8"}};
  }
  return report;
}

std::string FormatDiagnostics(const json& r) {
  std::ostringstream o;
  char line[512];
  auto num = [](const json& v, const char* fmt) -> std::string {
    if (v.is_null()) return "n/a";
    char b[64];
    std::snprintf(b, sizeof b, fmt, v.get<double>());
    return b;
  };
  const auto& env = r["environment"];
  std::snprintf(line, sizeof line, "%.1fM parameters", env["parameters"].get<int64_t>() / 1e6);
  o << "vlmgraph-diagnose: " << env["device"].get<std::string>() << ", "
    << env["dtype"].get<std::string>() << ", " << line << "; "
    << env["graphs_note"].get<std::string>() << "\n";
  if (r.contains("baseline")) {
    o << "\n== baseline (" << r["baseline"]["method"].get<std::string>() << ")\n";
    o << "| region | bucket | eager ms | graph ms | speedup | eager peak MiB | graph peak MiB "
         "|\n|---|---|---|---|---|---|---|\n";
    for (const auto& row : r["baseline"]["rows"]) {
      auto mib = [&](const json& v) {
        return v.is_null() ? std::string("n/a") : std::to_string(v.get<int64_t>() >> 20);
      };
      std::snprintf(line, sizeof line, "| %s | %s | %s | %s | %s | %s | %s |\n",
                    row["region"].get<std::string>().c_str(),
                    row["bucket"].get<std::string>().c_str(), num(row["eager_ms"], "%.3f").c_str(),
                    num(row["graph_ms"], "%.3f").c_str(), num(row["speedup"], "%.2fx").c_str(),
                    mib(row["eager_peak_bytes"]).c_str(), mib(row["graph_peak_bytes"]).c_str());
      o << line;
    }
  }
  if (r.contains("sweeps")) {
    const auto& s = r["sweeps"];
    o << "\n== sweeps: captures after warm-up " << s["captures_after_warmup"].get<int64_t>()
      << ", unexpected eager fallbacks " << s["unexpected_eager_fallbacks"].get<int64_t>() << "\n";
    o << "| sweep | shape | captures | eager fallbacks | padding waste |\n|---|---|---|---|---|\n";
    for (const auto& row : s["vary_batch"]) {
      std::snprintf(
          line, sizeof line, "| batch | %lld | %lld | %lld | %.2fx |\n",
          (long long)row["batch"].get<int64_t>(), (long long)row["captures"].get<int64_t>(),
          (long long)row["eager_fallbacks"].get<int64_t>(), row["padding_waste"].get<double>());
      o << line;
    }
    for (const auto& row : s["vary_sequence"]) {
      std::snprintf(
          line, sizeof line, "| seq | %lld%s | %lld | %lld | %.2fx |\n",
          (long long)row["seq"].get<int64_t>(), row["oversize"].get<bool>() ? " (oversize)" : "",
          (long long)row["captures"].get<int64_t>(),
          (long long)row["eager_fallbacks"].get<int64_t>(), row["padding_waste"].get<double>());
      o << line;
    }
  }
  if (r.contains("capture")) {
    const auto& c = r["capture"];
    o << "\n== capture: " << c["graphs"].get<int64_t>() << " graphs in "
      << num(c["total_seconds"], "%.2f") << " s, pool "
      << (c["graph_pool_bytes"].get<int64_t>() >> 20) << " MiB, KV cache "
      << (c["kv_cache_bytes"].get<int64_t>() >> 20)
      << " MiB; per-block capture: " << c["per_block_capture"].get<std::string>() << "\n";
    if (!c["per_bucket"].empty()) {
      o << "| bucket | capture ms | pool growth MiB |\n|---|---|---|\n";
      for (const auto& [k, v] : c["per_bucket"].items()) {
        std::snprintf(line, sizeof line, "| %s | %.1f | %.1f |\n", k.c_str(),
                      v["seconds"].get<double>() * 1e3,
                      v["pool_growth_bytes"].get<int64_t>() / 1048576.0);
        o << line;
      }
    }
  }
  if (r.contains("dispatch")) {
    const auto& d = r["dispatch"];
    o << "\n== dispatch: "
      << (d["available"].get<bool>()
              ? num(d["mean_us_per_step"], "%.1f") + " us host time per decode step over " +
                    std::to_string(d["decode_steps"].get<int64_t>()) + " steps"
              : std::string("n/a (no graph replays)"))
      << "\n";
  }
  if (r.contains("bucket_advice")) {
    const auto& a = r["bucket_advice"];
    o << "\n== bucket advice (" << a["source"].get<std::string>() << ", "
      << a["requests"].get<size_t>() << " requests, "
      << a["longer_than_every_bucket"].get<int64_t>() << " longer than every bucket)\n";
    o << "| set | seq_lens | padding waste | prefill graphs | graph pool MiB "
         "|\n|---|---|---|---|---|\n";
    for (const char* which : {"current", "suggested"}) {
      const auto& s = a[which];
      const json& pool =
          s.contains("graph_pool_bytes") ? s["graph_pool_bytes"] : s["graph_pool_bytes_estimate"];
      o << "| " << which << " | " << s["seq_lens"].dump() << " | "
        << num(s["padding_waste"], "%.3fx") << " | " << s["prefill_graphs"].get<int64_t>() << " | "
        << (pool.is_null() ? std::string("n/a")
                           : std::to_string(pool.get<int64_t>() >> 20) +
                                 (std::string(which) == "suggested" ? " (est.)" : ""))
        << " |\n";
    }
  }
  return o.str();
}

}  // namespace vlmgraph
