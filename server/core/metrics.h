// server/core/metrics.h: every Prometheus metric of vlmgraph, owned by one class.
//
// Names, types and labels are fixed by docs/metrics.md (a Grafana dashboard is generated from
// that list). Each engine (one per GPU, server/core/engine_router.h) has its own series, labelled
// gpu="<index>": EngineMetrics implements the engine's EngineObserver (captures, replays, eager
// runs, tokens, batch sizes, step latency per region and bucket) and takes its scheduler's
// observations (queue time, queue depth, active sequences, memory, health). Metrics owns them
// and takes the front's own observations (time to first token, inter-token latency, requests by
// RPC and status code, HTTP requests by endpoint and status, training). `/metrics` is served on
// its own port by MetricsHttpServer (Note [Own metrics endpoint], server/http/metrics_http.h).
//
//   Metrics metrics(config.server.metrics_address);  // Metrics() = no endpoint (tests: Render())
//   EngineMetrics& gpu0 = metrics.ForGpu("0");
//   engine.SetObserver(&gpu0);           // vlmgraph_graph_replays_total{gpu="0",...}
//   metrics.ObserveRequest("Generate", grpc::StatusCode::OK, 0.8);
//
// Thread rules: every method is safe from any thread (prometheus-cpp metrics are thread-safe);
// the EngineObserver methods are cheap, as the engine requires. Errors: the constructor throws
// std::runtime_error naming the address when the port cannot be bound.
#pragma once

#include <grpcpp/support/status.h>
#include <prometheus/labels.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "engine/engine_types.h"
#include "server/http/http_server.h"
#include "server/http/metrics_http.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace vlmgraph::server {

class Metrics;

// The series of one engine, labelled gpu="<gpu()>" (the CUDA device index, or the engine's index
// on CPU). Made by Metrics::ForGpu; lives as long as its Metrics.
class EngineMetrics : public EngineObserver {
 public:
  EngineMetrics(const EngineMetrics&) = delete;
  EngineMetrics& operator=(const EngineMetrics&) = delete;

  const std::string& gpu() const { return gpu_; }

  // Creates the zero-valued series of every configured bucket (captures, replays, eager runs per
  // region and bucket; eager fallbacks per region), so dashboards see each family before its
  // first event (Prometheus' advice: initialise known label sets). Call once, after the engine's
  // warm-up and before it serves (its GPU thread reads the bucket set on every step). From then
  // on a run at a shape that is not a configured bucket (an oversize prompt or train batch run
  // eagerly at its own shape) is labelled bucket="exact", so the number of series stays bounded
  // whatever lengths clients send.
  void InitBuckets(const BucketSpec& buckets);

  // --- EngineObserver (the engine's GPU thread) -------------------------------------------------
  void OnCapture(const BucketKey& key, double seconds) override;
  void OnStep(const BucketKey& key, bool graphed, double seconds) override;
  // `reason`'s trailing shape label ("no bucket fits b1xs300" -> "no bucket fits") is dropped
  // to keep the label's values few.
  void OnEagerFallback(Region region, const std::string& reason) override;
  void OnTokens(Region region, int64_t real, int64_t padded) override;
  void OnBatch(Region region, int64_t real_batch) override;

  // --- its scheduler (server/core/scheduler.h) --------------------------------------------------
  void ObserveQueueTime(const std::string& rpc, double seconds);
  void SetQueueDepth(int64_t requests);
  void SetActiveSequences(int64_t sequences);
  void SetMemory(const MemoryStats& memory);
  // vlmgraph_engine_healthy: 1 while the engine can serve, 0 once its device failed.
  void SetHealthy(bool healthy);

 private:
  friend class Metrics;
  EngineMetrics(Metrics* metrics, std::string gpu);
  prometheus::Labels Labels(prometheus::Labels labels) const;  // `labels` + gpu
  std::string BucketLabel(const BucketKey& key) const;         // key.Label() or "exact"

  Metrics* const metrics_;
  const std::string gpu_;
  // "region/bucket" of every configured bucket (InitBuckets); empty: every label is kept.
  std::set<std::string> known_buckets_;
  prometheus::Counter* capture_seconds_;
  prometheus::Gauge* queue_depth_;
  prometheus::Gauge* active_sequences_;
  prometheus::Gauge* gpu_allocated_;
  prometheus::Gauge* gpu_reserved_;
  prometheus::Gauge* graph_pool_;
  prometheus::Gauge* kv_cache_;
  prometheus::Gauge* kv_cache_usage_;
  prometheus::Gauge* healthy_;
};

class Metrics : public EngineObserver {
 public:
  // Serves /metrics on `metrics_address`; the empty address (the default) serves none.
  explicit Metrics(const ListenAddress& metrics_address = ListenAddress());
  ~Metrics() override;
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The bound HTTP port (useful with port 0), or 0 without an endpoint.
  int port() const;
  // The current exposition (Prometheus text format), as /metrics serves it.
  std::string Render() const;
  // Called at the start of every Render (a scrape), to read values kept elsewhere (the HTTP
  // front's counters: main sets it, and clears it with nullptr before what it reads goes away).
  // Any thread.
  void SetScrapeHook(std::function<void()> hook);
  // The HTTP front's state (server/http/http_server.h HttpServerStats): open connections and
  // body bytes in flight now, and the totals of connections refused over the limits, of bodies
  // refused over the body budget and of requests cut by a deadline.
  void ObserveHttpFront(const HttpServerStats& stats);

  // The series of the engine labelled gpu="`gpu`", made on the first call (its healthy gauge
  // at 1); the reference stays valid as long as this Metrics.
  EngineMetrics& ForGpu(const std::string& gpu);

  // --- EngineObserver: the first engine's series (ForGpu's first call; gpu="0" before any), which
  // is the engine the Train RPC's jobs run on (server/grpc/train_rpc.cc)
  // -------------------------------
  void OnCapture(const BucketKey& key, double seconds) override;
  void OnStep(const BucketKey& key, bool graphed, double seconds) override;
  void OnEagerFallback(Region region, const std::string& reason) override;
  void OnTokens(Region region, int64_t real, int64_t padded) override;
  void OnBatch(Region region, int64_t real_batch) override;

  // --- server observations ----------------------------------------------------------------------
  void ObserveTimeToFirstToken(double seconds);
  void ObserveInterTokenLatency(double seconds);
  // A finished RPC: vlmgraph_requests_total{rpc, code} and vlmgraph_request_duration_seconds{rpc}.
  void ObserveRequest(const std::string& rpc, grpc::StatusCode code, double seconds);
  // A finished request of the OpenAI-compatible HTTP API (server/openai/openai_http.h):
  // vlmgraph_http_requests_total{endpoint, status} and
  // vlmgraph_http_request_duration_seconds{endpoint}. `endpoint` is a route ("/v1/completions")
  // or "other", never a raw path; `status` the HTTP status (499: the client went away).
  void ObserveHttpRequest(const std::string& endpoint, int status, double seconds);
  // Zero-valued series (status 200) of each endpoint, so dashboards see them before traffic.
  void InitHttpEndpoints(const std::vector<std::string>& endpoints);
  void AddGeneratedTokens(int64_t tokens);
  // One optimizer step of a Train stream (its latency goes to OnStep with region train).
  // Skipped steps (non-finite gradients) count in vlmgraph_train_skipped_steps_total too and leave
  // the loss and learning-rate gauges as they were.
  void ObserveTrainStep(int64_t target_tokens, double loss, double learning_rate, bool skipped);
  void AddTrainPublish();  // a Train job's weights became the serving weights
  // A publish refused (server/train/weights_publisher.h): `reason` non_finite_weights or a publish
  // gate verdict (max_abs_weight, non_finite, collapse, loss_increase).
  void AddTrainPublishRefused(const std::string& reason);
  void AddWeightsRollback();  // the served weights went back to those before the last publish

 private:
  friend class EngineMetrics;
  EngineMetrics& First();  // ForGpu's first engine, or gpu "0"

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> http_;
  std::mutex engines_mu_;
  std::map<std::string, std::unique_ptr<EngineMetrics>> engines_;  // engines_mu_
  EngineMetrics* first_ = nullptr;                                 // engines_mu_

  prometheus::Family<prometheus::Counter>* captures_;
  prometheus::Family<prometheus::Counter>* replays_;
  prometheus::Family<prometheus::Counter>* eager_runs_;
  prometheus::Family<prometheus::Counter>* eager_fallbacks_;
  prometheus::Family<prometheus::Counter>* capture_seconds_;
  prometheus::Family<prometheus::Counter>* tokens_;
  prometheus::Family<prometheus::Histogram>* step_latency_;
  prometheus::Family<prometheus::Histogram>* batch_size_;
  prometheus::Family<prometheus::Histogram>* queue_time_;
  prometheus::Histogram* time_to_first_token_;
  prometheus::Histogram* inter_token_latency_;
  prometheus::Family<prometheus::Histogram>* request_duration_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* http_request_duration_;
  prometheus::Family<prometheus::Counter>* http_requests_;
  prometheus::Counter* generated_tokens_;
  prometheus::Family<prometheus::Gauge>* queue_depth_;
  prometheus::Family<prometheus::Gauge>* active_sequences_;
  mutable std::mutex scrape_hook_mu_;
  std::function<void()> scrape_hook_;  // scrape_hook_mu_
  prometheus::Gauge* http_open_connections_;
  prometheus::Counter* http_refused_connections_;
  prometheus::Gauge* http_body_bytes_in_flight_;
  prometheus::Counter* http_refused_bodies_;
  prometheus::Counter* http_timed_out_requests_;
  std::mutex http_front_mu_;
  int64_t http_refused_seen_ = 0, http_timed_out_seen_ = 0;  // http_front_mu_
  int64_t http_refused_bodies_seen_ = 0;                     // http_front_mu_
  prometheus::Gauge* open_fds_;      // set in Render (a scrape)
  prometheus::Gauge* max_fds_;
  prometheus::Gauge* heap_in_use_;  // set in Render (a scrape)
  prometheus::Gauge* heap_free_;
  prometheus::Family<prometheus::Gauge>* gpu_allocated_;
  prometheus::Family<prometheus::Gauge>* gpu_reserved_;
  prometheus::Family<prometheus::Gauge>* graph_pool_;
  prometheus::Family<prometheus::Gauge>* kv_cache_;
  prometheus::Family<prometheus::Gauge>* kv_cache_usage_;
  prometheus::Family<prometheus::Gauge>* engine_healthy_;
  prometheus::Counter* train_steps_;
  prometheus::Counter* train_tokens_;
  prometheus::Counter* train_skipped_steps_;
  prometheus::Counter* train_publishes_;
  prometheus::Family<prometheus::Counter>* train_publish_refused_;
  prometheus::Counter* weights_rollbacks_;
  prometheus::Gauge* train_loss_;
  prometheus::Gauge* train_learning_rate_;
};

}  // namespace vlmgraph::server
