#include "server/core/metrics.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <cctype>
#include <sstream>
#include <stdexcept>

#include "base/descriptors.h"
#include "server/core/status.h"

namespace vlmgraph::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

// Seconds, 100 us .. 60 s: covers a graph replay of a tiny bucket up to a long generation.
const Histogram::BucketBoundaries& LatencyBuckets() {
  static const Histogram::BucketBoundaries b = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                                1,      2.5,     5,      10,    30,     60};
  return b;
}

const Histogram::BucketBoundaries& BatchBuckets() {
  static const Histogram::BucketBoundaries b = {1,  2,  3,  4,  6,  8,   12, 16,
                                                24, 32, 48, 64, 96, 128, 256};
  return b;
}

std::string ModeLabel(bool graphed) { return graphed ? "graph" : "eager"; }

// "no bucket fits b1xs300" -> "no bucket fits": the last word is dropped when it holds a digit.
std::string ReasonLabel(const std::string& reason) {
  const size_t space = reason.find_last_of(' ');
  if (space == std::string::npos) return reason;
  const std::string last = reason.substr(space + 1);
  for (char c : last) {
    if (std::isdigit(static_cast<unsigned char>(c))) return reason.substr(0, space);
  }
  return reason;
}

}  // namespace

Metrics::Metrics(const ListenAddress& metrics_address)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  captures_ =
      &BuildCounter()
           .Name("vlmgraph_graph_captures_total")
           .Help(
               "CUDA graph captures (the analogue of torch.compile recompiles); flat after warm-up")
           .Register(r);
  replays_ =
      &BuildCounter().Name("vlmgraph_graph_replays_total").Help("CUDA graph replays").Register(r);
  eager_runs_ = &BuildCounter()
                     .Name("vlmgraph_eager_runs_total")
                     .Help("Region runs without a graph (CPU, capture off, or oversize)")
                     .Register(r);
  eager_fallbacks_ = &BuildCounter()
                          .Name("vlmgraph_eager_fallbacks_total")
                          .Help("Shapes larger than every bucket that ran eagerly")
                          .Register(r);
  capture_seconds_ = &BuildCounter()
                          .Name("vlmgraph_capture_seconds_total")
                          .Help("Time spent capturing graphs")
                          .Register(r);
  tokens_ = &BuildCounter()
                 .Name("vlmgraph_tokens_total")
                 .Help("Tokens processed; padded counts the whole bucket, so waste = padded / real")
                 .Register(r);
  step_latency_ = &BuildHistogram()
                       .Name("vlmgraph_step_latency_seconds")
                       .Help(
                           "Wall time of one region run (inputs copied, graph replayed or eager "
                           "ops, outputs ready)")
                       .Register(r);
  batch_size_ = &BuildHistogram()
                     .Name("vlmgraph_batch_size")
                     .Help("Real sequences per prefill / decode step")
                     .Register(r);
  queue_time_ = &BuildHistogram()
                     .Name("vlmgraph_queue_time_seconds")
                     .Help("Time from accepting a request to its first engine work")
                     .Register(r);
  time_to_first_token_ = &BuildHistogram()
                              .Name("vlmgraph_time_to_first_token_seconds")
                              .Help("Accepted -> first generated token sent")
                              .Register(r)
                              .Add({}, LatencyBuckets());
  inter_token_latency_ = &BuildHistogram()
                              .Name("vlmgraph_inter_token_latency_seconds")
                              .Help("Gap between consecutive streamed tokens of one request")
                              .Register(r)
                              .Add({}, LatencyBuckets());
  request_duration_ = &BuildHistogram()
                           .Name("vlmgraph_request_duration_seconds")
                           .Help("Accepted -> final message")
                           .Register(r);
  requests_ = &BuildCounter()
                   .Name("vlmgraph_requests_total")
                   .Help("Finished RPCs by gRPC status code")
                   .Register(r);
  http_request_duration_ = &BuildHistogram()
                                .Name("vlmgraph_http_request_duration_seconds")
                                .Help("OpenAI-compatible HTTP API: request read -> last byte sent")
                                .Register(r);
  http_requests_ = &BuildCounter()
                        .Name("vlmgraph_http_requests_total")
                        .Help("Finished requests of the OpenAI-compatible HTTP API by status")
                        .Register(r);
  http_open_connections_ = &BuildGauge()
                                .Name("vlmgraph_http_open_connections")
                                .Help("Open connections of the HTTP front (OpenAI-compatible API)")
                                .Register(r)
                                .Add({});
  http_refused_connections_ = &BuildCounter()
                                   .Name("vlmgraph_http_refused_connections_total")
                                   .Help("HTTP connections refused (503) over http.max_connections "
                                         "or http.max_connections_per_client")
                                   .Register(r)
                                   .Add({});
  http_body_bytes_in_flight_ = &BuildGauge()
                                    .Name("vlmgraph_http_body_bytes_in_flight")
                                    .Help("Request body bytes the HTTP front holds or reads now, "
                                          "of http.max_body_bytes_in_flight")
                                    .Register(r)
                                    .Add({});
  http_refused_bodies_ = &BuildCounter()
                              .Name("vlmgraph_http_refused_bodies_total")
                              .Help("HTTP requests refused (503) because their body would not fit "
                                    "http.max_body_bytes_in_flight")
                              .Register(r)
                              .Add({});
  http_timed_out_requests_ = &BuildCounter()
                                  .Name("vlmgraph_http_timed_out_requests_total")
                                  .Help("HTTP connections cut by a deadline: idle, request head, "
                                        "request body or write (http.*_timeout_seconds)")
                                  .Register(r)
                                  .Add({});
  generated_tokens_ = &BuildCounter()
                           .Name("vlmgraph_generated_tokens_total")
                           .Help("Tokens streamed to clients")
                           .Register(r)
                           .Add({});
  queue_depth_ = &BuildGauge()
                      .Name("vlmgraph_queue_depth")
                      .Help("Requests waiting for a decode slot")
                      .Register(r);
  active_sequences_ = &BuildGauge()
                           .Name("vlmgraph_active_sequences")
                           .Help("Sequences holding a KV-cache slot")
                           .Register(r);
  engine_healthy_ = &BuildGauge()
                         .Name("vlmgraph_engine_healthy")
                         .Help("1 while the engine of this GPU serves, 0 once its device failed")
                         .Register(r);
  auto& heap = BuildGauge()
                   .Name("vlmgraph_process_heap_bytes")
                   .Help(
                       "Host heap of the process (glibc malloc, read at each scrape): in_use = "
                       "bytes allocated and not freed; free = bytes freed but kept by the "
                       "allocator. RSS growing while in_use stays flat is fragmentation or "
                       "memory outside malloc")
                   .Register(r);
  heap_in_use_ = &heap.Add({{"state", "in_use"}});
  heap_free_ = &heap.Add({{"state", "free"}});
  // The names of Prometheus' client libraries (their process collector), read at each scrape.
  open_fds_ = &BuildGauge()
                   .Name("process_open_fds")
                   .Help("Open file descriptors of the process (every connection is one)")
                   .Register(r)
                   .Add({});
  max_fds_ = &BuildGauge()
                  .Name("process_max_fds")
                  .Help("The process's file descriptor limit (RLIMIT_NOFILE, soft)")
                  .Register(r)
                  .Add({});
  gpu_allocated_ = &BuildGauge()
                        .Name("vlmgraph_gpu_memory_allocated_bytes")
                        .Help("Device memory held by live tensors")
                        .Register(r);
  gpu_reserved_ = &BuildGauge()
                       .Name("vlmgraph_gpu_memory_reserved_bytes")
                       .Help("Device memory reserved by the caching allocator")
                       .Register(r);
  graph_pool_ = &BuildGauge()
                     .Name("vlmgraph_graph_pool_bytes")
                     .Help("Device memory of the shared CUDA graph pool")
                     .Register(r);
  kv_cache_ = &BuildGauge()
                   .Name("vlmgraph_kv_cache_bytes")
                   .Help("Static KV cache size")
                   .Register(r);
  kv_cache_usage_ = &BuildGauge()
                         .Name("vlmgraph_kv_cache_usage_ratio")
                         .Help(
                             "Fraction of the KV cache's pages that running sequences hold "
                             "(vLLM's kv_cache_usage_perc), 0 to 1")
                         .Register(r);
  train_steps_ = &BuildCounter()
                      .Name("vlmgraph_train_steps_total")
                      .Help("Optimizer steps taken by Train streams")
                      .Register(r)
                      .Add({});
  train_skipped_steps_ = &BuildCounter()
                              .Name("vlmgraph_train_skipped_steps_total")
                              .Help("Training steps skipped for non-finite gradients")
                              .Register(r)
                              .Add({});
  train_publishes_ = &BuildCounter()
                          .Name("vlmgraph_train_publishes_total")
                          .Help("Times a Train job's weights were published to the serving model")
                          .Register(r)
                          .Add({});
  train_publish_refused_ =
      &BuildCounter()
           .Name("vlmgraph_train_publish_refused_total")
           .Help("Publishes refused by the publish gate or for non-finite weights, by reason")
           .Register(r);
  for (const char* reason :
       {"non_finite_weights", "max_abs_weight", "non_finite", "collapse", "loss_increase"}) {
    train_publish_refused_->Add({{"reason", reason}});
  }
  weights_rollbacks_ = &BuildCounter()
                            .Name("vlmgraph_weights_rollbacks_total")
                            .Help("Times the served weights were rolled back to the previous ones")
                            .Register(r)
                            .Add({});
  train_tokens_ = &BuildCounter()
                       .Name("vlmgraph_train_tokens_total")
                       .Help("Target tokens trained on")
                       .Register(r)
                       .Add({});
  train_loss_ = &BuildGauge()
                     .Name("vlmgraph_train_loss")
                     .Help("Loss of the latest training step")
                     .Register(r)
                     .Add({});
  train_learning_rate_ = &BuildGauge()
                              .Name("vlmgraph_train_learning_rate")
                              .Help("Learning rate of the latest step")
                              .Register(r)
                              .Add({});
  // Every RPC appears at zero from the start, so rate() and dashboards work before traffic.
  for (const char* rpc : {"Generate", "Forward", "Train"}) {
    requests_->Add({{"rpc", rpc}, {"code", "OK"}});
    request_duration_->Add({{"rpc", rpc}}, LatencyBuckets());
  }
  if (!metrics_address.empty()) {
    http_ = std::make_unique<MetricsHttpServer>(metrics_address, [this] { return Render(); });
  }
}

Metrics::~Metrics() { http_.reset(); }  // stop serving before the metrics go away

int Metrics::port() const { return http_ ? http_->port() : 0; }

std::string Metrics::Render() const {
  {
    std::lock_guard<std::mutex> lock(scrape_hook_mu_);  // held while the hook runs: see Set
    if (scrape_hook_) scrape_hook_();
  }
  const DescriptorUse fds = ReadDescriptorUse();
  open_fds_->Set(static_cast<double>(fds.open));
  max_fds_->Set(static_cast<double>(fds.limit));
#if defined(__GLIBC__)
  // Read at scrape time. mallinfo2 (glibc >= 2.33) sums every malloc arena: uordblks = bytes in
  // allocated chunks, hblkhd = bytes in mmap'd chunks, fordblks = free bytes held in the arenas.
  const struct mallinfo2 m = mallinfo2();
  heap_in_use_->Set(static_cast<double>(m.uordblks + m.hblkhd));
  heap_free_->Set(static_cast<double>(m.fordblks));
#endif
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

void Metrics::OnCapture(const BucketKey& key, double seconds) { First().OnCapture(key, seconds); }

void Metrics::OnStep(const BucketKey& key, bool graphed, double seconds) {
  First().OnStep(key, graphed, seconds);
}

void Metrics::OnEagerFallback(Region region, const std::string& reason) {
  First().OnEagerFallback(region, reason);
}

void Metrics::OnTokens(Region region, int64_t real, int64_t padded) {
  First().OnTokens(region, real, padded);
}

void Metrics::OnBatch(Region region, int64_t real_batch) { First().OnBatch(region, real_batch); }

EngineMetrics& Metrics::ForGpu(const std::string& gpu) {
  std::lock_guard<std::mutex> lock(engines_mu_);
  std::unique_ptr<EngineMetrics>& e = engines_[gpu];
  if (!e) e.reset(new EngineMetrics(this, gpu));
  if (first_ == nullptr) first_ = e.get();
  return *e;
}

EngineMetrics& Metrics::First() {
  {
    std::lock_guard<std::mutex> lock(engines_mu_);
    if (first_ != nullptr) return *first_;
  }
  return ForGpu("0");
}

void Metrics::ObserveTimeToFirstToken(double seconds) { time_to_first_token_->Observe(seconds); }

void Metrics::ObserveInterTokenLatency(double seconds) { inter_token_latency_->Observe(seconds); }

void Metrics::ObserveRequest(const std::string& rpc, grpc::StatusCode code, double seconds) {
  requests_->Add({{"rpc", rpc}, {"code", StatusCodeName(code)}}).Increment();
  request_duration_->Add({{"rpc", rpc}}, LatencyBuckets()).Observe(seconds);
}

void Metrics::ObserveHttpRequest(const std::string& endpoint, int status, double seconds) {
  http_requests_->Add({{"endpoint", endpoint}, {"status", std::to_string(status)}}).Increment();
  http_request_duration_->Add({{"endpoint", endpoint}}, LatencyBuckets()).Observe(seconds);
}

void Metrics::SetScrapeHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(scrape_hook_mu_);
  scrape_hook_ = std::move(hook);
}

void Metrics::ObserveHttpFront(const HttpServerStats& stats) {
  std::lock_guard<std::mutex> lock(http_front_mu_);
  http_open_connections_->Set(static_cast<double>(stats.open_connections));
  http_body_bytes_in_flight_->Set(static_cast<double>(stats.body_bytes_in_flight));
  // Counters only go up: add what is new since the last scrape.
  auto add_new = [](prometheus::Counter* counter, int64_t total, int64_t* seen) {
    if (total <= *seen) return;
    counter->Increment(static_cast<double>(total - *seen));
    *seen = total;
  };
  add_new(http_refused_connections_, stats.refused_connections, &http_refused_seen_);
  add_new(http_refused_bodies_, stats.refused_bodies, &http_refused_bodies_seen_);
  add_new(http_timed_out_requests_, stats.timed_out_requests, &http_timed_out_seen_);
}

void Metrics::InitHttpEndpoints(const std::vector<std::string>& endpoints) {
  for (const std::string& endpoint : endpoints) {
    http_requests_->Add({{"endpoint", endpoint}, {"status", "200"}});
    http_request_duration_->Add({{"endpoint", endpoint}}, LatencyBuckets());
  }
}

void Metrics::AddGeneratedTokens(int64_t tokens) {
  generated_tokens_->Increment(static_cast<double>(tokens));
}

void Metrics::ObserveTrainStep(int64_t target_tokens, double loss, double learning_rate,
                               bool skipped) {
  train_steps_->Increment();
  if (skipped) {  // the loss of a skipped step is not finite: the gauge keeps the last real one
    train_skipped_steps_->Increment();
    return;
  }
  train_tokens_->Increment(static_cast<double>(target_tokens));
  train_loss_->Set(loss);
  train_learning_rate_->Set(learning_rate);
}

void Metrics::AddTrainPublish() { train_publishes_->Increment(); }

void Metrics::AddTrainPublishRefused(const std::string& reason) {
  train_publish_refused_->Add({{"reason", reason}}).Increment();
}

void Metrics::AddWeightsRollback() { weights_rollbacks_->Increment(); }

// ---------------------------------------------------------------------------------------------
// EngineMetrics

EngineMetrics::EngineMetrics(Metrics* metrics, std::string gpu)
    : metrics_(metrics), gpu_(std::move(gpu)) {
  const prometheus::Labels labels = Labels({});
  capture_seconds_ = &metrics_->capture_seconds_->Add(labels);
  queue_depth_ = &metrics_->queue_depth_->Add(labels);
  active_sequences_ = &metrics_->active_sequences_->Add(labels);
  gpu_allocated_ = &metrics_->gpu_allocated_->Add(labels);
  gpu_reserved_ = &metrics_->gpu_reserved_->Add(labels);
  graph_pool_ = &metrics_->graph_pool_->Add(labels);
  kv_cache_ = &metrics_->kv_cache_->Add(labels);
  kv_cache_usage_ = &metrics_->kv_cache_usage_->Add(labels);
  healthy_ = &metrics_->engine_healthy_->Add(labels);
  healthy_->Set(1);
  for (const char* rpc : {"Generate", "Forward", "Train"}) {
    metrics_->queue_time_->Add(Labels({{"rpc", rpc}}), LatencyBuckets());
  }
}

prometheus::Labels EngineMetrics::Labels(prometheus::Labels labels) const {
  labels.emplace("gpu", gpu_);
  return labels;
}

std::string EngineMetrics::BucketLabel(const BucketKey& key) const {
  if (known_buckets_.empty()) return key.Label();
  const std::string label = key.Label();
  return known_buckets_.count(std::string(RegionName(key.region)) + "/" + label) ? label : "exact";
}

void EngineMetrics::InitBuckets(const BucketSpec& buckets) {
  // A trainer's optimizer step is reported as region train, batch 0 (engine/trainer.h).
  const BucketKey optimizer{Region::kTrain, 0, 0, 0};
  known_buckets_.insert(std::string(RegionName(optimizer.region)) + "/" + optimizer.Label());
  for (int r = 0; r < kNumRegions; ++r) {
    const Region region = static_cast<Region>(r);
    for (const BucketKey& key : buckets.All(region)) {
      known_buckets_.insert(std::string(RegionName(region)) + "/" + key.Label());
      const prometheus::Labels labels = Labels({{"region", RegionName(region)}, {"bucket", key.Label()}});
      metrics_->captures_->Add(labels);
      metrics_->replays_->Add(labels);
      metrics_->eager_runs_->Add(labels);
    }
    metrics_->eager_fallbacks_->Add(
        Labels({{"region", RegionName(region)}, {"reason", "no bucket fits"}}));
  }
}

void EngineMetrics::OnCapture(const BucketKey& key, double seconds) {
  metrics_->captures_->Add(Labels({{"region", RegionName(key.region)}, {"bucket", BucketLabel(key)}}))
      .Increment();
  capture_seconds_->Increment(seconds);
}

void EngineMetrics::OnStep(const BucketKey& key, bool graphed, double seconds) {
  prometheus::Labels labels =
      Labels({{"region", RegionName(key.region)}, {"bucket", BucketLabel(key)}});
  (graphed ? metrics_->replays_ : metrics_->eager_runs_)->Add(labels).Increment();
  labels["mode"] = ModeLabel(graphed);
  metrics_->step_latency_->Add(labels, LatencyBuckets()).Observe(seconds);
}

void EngineMetrics::OnEagerFallback(Region region, const std::string& reason) {
  metrics_->eager_fallbacks_
      ->Add(Labels({{"region", RegionName(region)}, {"reason", ReasonLabel(reason)}}))
      .Increment();
}

void EngineMetrics::OnTokens(Region region, int64_t real, int64_t padded) {
  metrics_->tokens_->Add(Labels({{"region", RegionName(region)}, {"kind", "real"}}))
      .Increment(static_cast<double>(real));
  metrics_->tokens_->Add(Labels({{"region", RegionName(region)}, {"kind", "padded"}}))
      .Increment(static_cast<double>(padded));
}

void EngineMetrics::OnBatch(Region region, int64_t real_batch) {
  metrics_->batch_size_->Add(Labels({{"region", RegionName(region)}}), BatchBuckets())
      .Observe(static_cast<double>(real_batch));
}

void EngineMetrics::ObserveQueueTime(const std::string& rpc, double seconds) {
  metrics_->queue_time_->Add(Labels({{"rpc", rpc}}), LatencyBuckets()).Observe(seconds);
}

void EngineMetrics::SetQueueDepth(int64_t requests) {
  queue_depth_->Set(static_cast<double>(requests));
}

void EngineMetrics::SetActiveSequences(int64_t sequences) {
  active_sequences_->Set(static_cast<double>(sequences));
}

void EngineMetrics::SetMemory(const MemoryStats& m) {
  gpu_allocated_->Set(static_cast<double>(m.allocated_bytes));
  gpu_reserved_->Set(static_cast<double>(m.reserved_bytes));
  graph_pool_->Set(static_cast<double>(m.graph_pool_bytes));
  kv_cache_->Set(static_cast<double>(m.kv_cache_bytes));
  kv_cache_usage_->Set(m.kv_cache_pages > 0 ? static_cast<double>(m.kv_cache_pages_used) /
                                                  static_cast<double>(m.kv_cache_pages)
                                            : 0.0);
}

void EngineMetrics::SetHealthy(bool healthy) { healthy_->Set(healthy ? 1 : 0); }

}  // namespace vlmgraph::server
