// vlmgraph-server: serves a nanoVLM model over gRPC and OpenAI-compatible HTTP, with Prometheus
// metrics.
//
//   vlmgraph-server                                  # built-in nanovlm-tiny on CPU (quick start)
//   vlmgraph-server --config deploy/config.yaml      # a deployment
//   vlmgraph-server --config c.yaml --device cuda:1 --grpc-address 0.0.0.0:50051
//   vlmgraph-server --config c.yaml --device cuda --data-parallel-size 0   # every GPU, one
//   endpoint vlmgraph-server --config c.yaml --print-config-documented  # every key documented,
//   then exit
//
// Only wiring lives here: config -> metrics -> engines (one per device, each on its scheduler's GPU
// thread, behind one router: server/core/engine_router.h) -> gRPC and
// the OpenAI-compatible HTTP API (server/openai/openai_http.h) -> wait for SIGTERM/SIGINT ->
// graceful shutdown (Note [Graceful shutdown], server/grpc/grpc_server.h). Prints one line
// "vlmgraph-server ready: grpc HOST:PORT metrics HOST:PORT[ http HOST:PORT]" on stdout when it
// serves (scripts and tests wait for it; http when server.http_address is set). Exit status: 0
// after a clean shutdown, 2 for a bad config or flags, 1 for other start-up failures.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/descriptors.h"
#include "base/heap_trim.h"
#include "base/log.h"
#include "server/config/flags.h"
#include "server/core/auth.h"
#include "server/core/engine_from_config.h"
#include "server/core/engine_router.h"
#include "server/core/metrics.h"
#include "server/core/scheduler.h"
#include "server/core/text_prompt.h"
#include "server/grpc/grpc_server.h"
#include "server/grpc/service.h"
#include "server/openai/openai_http.h"
#include "server/train/publish_gate.h"
#include "server/train/weights_publisher.h"

namespace {

constexpr const char* kUsage =
    "usage: vlmgraph-server [--config FILE] [flags]\n"
    "Serves a nanoVLM model over gRPC (vlmgraph.v1.VlmGraph, health, reflection) with Prometheus\n"
    "metrics on a separate port. With no flags: the built-in nanovlm-tiny model on "
    "CPU.\n\nflags:\n";

int Serve(const vlmgraph::server::ServerConfig& config, const sigset_t& signals) {
  using namespace vlmgraph;
  using namespace vlmgraph::server;
  LogInfo("starting: model " + config.model + ", " + config.dtype + " on " + config.device +
          (config.data_parallel_size == 1
               ? std::string()
               : ", data_parallel_size " + std::to_string(config.data_parallel_size)));
  // Every connection is a file descriptor: lift the soft limit to the hard one (as nginx's
  // worker_rlimit_nofile); Note [Descriptor reserve] below bounds the HTTP front within it.
  RaiseDescriptorLimit();
  // Note [gRPC listener]: a gRPC listener that stopped accepting cannot come back: drain and
  // exit with status 1, so the container is restarted.
  GrpcServer::OnListenerFailed([] { kill(getpid(), SIGTERM); });
  // Keys and the exposure rule first: a server that must not start fails before any work.
  const ApiKeys keys = ApiKeys::Load(config);
  CheckExposure(config, keys);
  LogInfo(keys.enabled() ? "auth: " + std::to_string(keys.size()) + " API key(s)"
                         : "auth: none (loopback only, or auth.allow_unauthenticated)");
  // Tokenizer and chat format first: a bad one fails in a second, not after the graph captures.
  const std::unique_ptr<TextModel> text = TextModel::Load(config, BuildModelConfig(config));
  if (text) {
    const Tokenizer& tok = text->tokenizer();
    LogInfo("text: tokenizer " + text->tokenizer_path() + " (" + std::to_string(tok.vocab_size()) +
            " tokens), chat format " + text->chat_format().name() + "; " +
            (tok.max_bytes_per_token() > 0
                 ? "a token stands for at most " + std::to_string(tok.max_bytes_per_token()) +
                       " bytes, so a text of more than " +
                       std::to_string(tok.max_bytes_per_token() * text->options().max_context) +
                       " bytes" + (tok.every_byte_makes_tokens() ? "" : " that have tokens") +
                       " is refused before tokenizing"
                 : "no bound on tokens from bytes (" + tok.no_token_bound_reason() +
                       "): text is tokenized whole before its length is checked"));
  } else {
    LogInfo("text: no tokenizer; requests must send token ids");
  }
  Metrics metrics(config.server.metrics_address);
  SchedulerOptions scheduler_options{config.batching.max_queue_delay_us,
                                     config.batching.max_queue_size};
  // One engine per device (data_parallel_size) behind one front (Note [Data-parallel routing],
  // server/core/engine_router.h).
  std::vector<EngineSlot> slots;
  const std::vector<std::string> devices = ServingDevices(config);
  for (size_t i = 0; i < devices.size(); ++i) slots.push_back({devices[i], GpuLabel(devices[i], i)});
  // Note [Device faults] (server/core/scheduler.h): a GPU that fails stops every engine (the CUDA
  // error is sticky for the process); the server then shuts down with status 1, through the same
  // drain as SIGTERM, so the container's restart policy replaces it.
  EngineRouter router(std::move(slots), &metrics, scheduler_options,
                      [] { kill(getpid(), SIGTERM); });
  for (size_t i = 0; i < router.size(); ++i) {
    ServerConfig engine_config = config;
    engine_config.device = router.slot(i).device;
    EngineMetrics& engine_metrics = metrics.ForGpu(router.slot(i).gpu);
    // One engine after another, so no two CUDA graph captures overlap.
    router.Start(i, [&] {
      std::unique_ptr<vlmgraph::Engine> engine = BuildEngine(engine_config);
      engine->SetObserver(&engine_metrics);
      engine->Warmup();
      return engine;
    });
    const vlmgraph::Engine& ready = router.scheduler(i).engine();
    engine_metrics.InitBuckets(ready.options().buckets);
    engine_metrics.SetMemory(ready.Memory());
    if (router.size() > 1) {
      LogInfo("engine " + std::to_string(i) + " of " + std::to_string(router.size()) +
              " ready on " + router.slot(i).device);
    }
  }
  vlmgraph::Engine& engine = router.engine();
  // What a Train job publishes passes the publish gate; the weights it replaces are kept for
  // rollback (server/train/weights_publisher.h).
  const PublishGate gate = PublishGate::FromConfig(config, engine, text.get());
  LogInfo(gate.options().enabled
              ? "publish gate: " + std::to_string(gate.prompts()) + " held-out prompts"
              : "publish gate: off (train.publish_gate: false)");
  // A publish (and a rollback) changes every engine (Note [Publishing on several engines]).
  std::vector<Scheduler*> schedulers;
  for (size_t i = 0; i < router.size(); ++i) schedulers.push_back(&router.scheduler(i));
  WeightsPublisher publisher(std::move(schedulers), &gate, &metrics);
  VlmGraphService service(&router, &metrics, config, text.get(), &keys, &publisher);
  GrpcServer grpc_server(config, &service, &metrics);
  grpc_server.SetServing(true);
  // Note [Heap trimming] (base/heap_trim.h): memory a burst of large requests left free in
  // malloc's arenas goes back to the system within a second.
  vlmgraph::HeapTrimmer heap_trimmer;
  std::unique_ptr<OpenAiHttpServer> http;  // OpenAI-compatible API; "" = off
  if (!config.server.http_address.empty()) {
    // Note [Descriptor reserve] (base/descriptors.h): the HTTP front leaves room for gRPC.
    ServerConfig http_config = config;
    const DescriptorUse fds = ReadDescriptorUse();
    ServerConfig::Http& h = http_config.http;
    h.max_connections = ConnectionsWithinDescriptors(h.max_connections, fds);
    if (h.max_connections_per_client > h.max_connections) h.max_connections_per_client = h.max_connections;
    if (h.max_connections < config.http.max_connections) {
      LogWarn("http.max_connections " + std::to_string(config.http.max_connections) +
              " lowered to " + std::to_string(h.max_connections) + ": the file descriptor limit is " +
              std::to_string(fds.limit) + " (" + std::to_string(fds.open) +
              " open), and gRPC and files keep a reserve; raise the limit (ulimit -n, "
              "compose's ulimits.nofile) to take more");
    }
    http = std::make_unique<OpenAiHttpServer>(http_config, &router, &metrics, text.get(), &keys,
                                              &publisher);
  }
  if (http) {
    metrics.SetScrapeHook([&http, &metrics] {
      const HttpServerStats s = http->stats();
      metrics.ObserveHttpFront(s);
    });
  }
  const std::string metrics_address =
      config.server.metrics_address.WithPort(metrics.port()).ToString();
  std::string engines;
  for (size_t i = 0; i < router.size(); ++i) engines += (i ? "," : "") + router.slot(i).device;
  LogInfo(std::string("serving on ") + std::to_string(router.size()) + " engine(s) (" + engines +
          "): graphs " + (engine.graphs_enabled() ? "on" : "off") +
          ", max context " + std::to_string(engine.max_context()) + ", gRPC " +
          grpc_server.address() + ", metrics http://" + metrics_address + "/metrics" +
          (http ? ", OpenAI API http://" + http->address() + "/v1" : ""));
  std::printf("vlmgraph-server ready: grpc %s metrics %s%s\n", grpc_server.address().c_str(),
              metrics_address.c_str(), http ? (" http " + http->address()).c_str() : "");
  std::fflush(stdout);

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  char drain[96];
  std::snprintf(drain, sizeof(drain), "received %s: draining for up to %g s",
                signal_number == SIGTERM ? "SIGTERM" : "SIGINT", config.shutdown_timeout_seconds);
  LogInfo(drain);
  // Note [Graceful shutdown]: health turns NOT_SERVING and new calls are refused (UNAVAILABLE /
  // 503) while both listeners stay open, so probes and load balancers see the state; calls in
  // flight (Train streams included) finish. Once none is left, or at the deadline, the listeners
  // close and what still runs is cancelled.
  const auto drain_start = std::chrono::steady_clock::now();
  const auto deadline =
      drain_start +
      std::chrono::milliseconds(static_cast<int64_t>(config.shutdown_timeout_seconds * 1000));
  grpc_server.SetServing(false);
  router.StopAccepting();
  if (http) http->StopAccepting();
  while (std::chrono::steady_clock::now() < deadline &&
         (service.in_flight() > 0 || (http && http->in_flight() > 0))) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double left_seconds = std::max(
      0.0, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
  service.SetShutdownDeadline(deadline);  // what is cancelled from here on was cut by it
  grpc_server.Shutdown(left_seconds);     // every handler has returned after this
  if (http) http->Shutdown(config.shutdown_timeout_seconds);  // counts from its StopAccepting
  metrics.SetScrapeHook(nullptr);  // the front's counters go with it
  for (size_t i = 0; i < router.size(); ++i) {
    if (const std::string fault = router.scheduler(i).device_fault(); !fault.empty()) {
      LogError("exiting with status 1 after a device fault on " + router.slot(i).device + ": " +
               fault);
      std::fflush(nullptr);
      std::_Exit(1);  // destructors would call into the failed CUDA context
    }
  }
  vlmgraph::EngineCounters counters;
  for (size_t i = 0; i < router.size(); ++i) {
    const vlmgraph::EngineCounters c = router.scheduler(i).engine().Counters();
    for (const auto& [key, n] : c.replays) counters.replays[key] += n;
    for (const auto& [key, n] : c.captures) counters.captures[key] += n;
    counters.eager_fallbacks += c.eager_fallbacks;
    counters.real_tokens += c.real_tokens;
    counters.padded_tokens += c.padded_tokens;
  }
  router.Stop();  // fails leftovers, refreshes the gauges one last time, destroys the engines
  LogInfo("stopped: " + std::to_string(counters.TotalReplays()) + " graph replays, " +
          std::to_string(counters.TotalCaptures()) + " captures, " +
          std::to_string(counters.eager_fallbacks) + " eager fallbacks, " +
          std::to_string(counters.real_tokens) + " real / " +
          std::to_string(counters.padded_tokens) + " padded tokens");
  if (GrpcServer::listener_failed()) {
    LogError("exiting with status 1: gRPC's listener had stopped accepting (Note [gRPC listener])");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace vlmgraph;
  using namespace vlmgraph::server;
  // SIGTERM/SIGINT are taken by sigwait() in main only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  ServerConfig config;
  try {
    const CommandLine cl = ParseCommandLine(argc, argv);
    if (cl.help) {
      std::cout << kUsage << FlagsHelp();
      return 0;
    }
    if (!cl.positional.empty())
      throw ServerConfigError(cl.positional[0], "unexpected argument; see --help");
    if (cl.print_config_documented) {
      // The values the file and flags set (not VLMGRAPH_API_KEY), checked like a start would,
      // except for the files of the machine that will serve it (the model, the tokenizer).
      const ConfigSource source = ReadServerConfig(cl);
      ValidateConfig(FillDefaults(source.raw), /*check_files=*/false);
      std::cout << DocumentedConfigYaml(source.raw, source.header);
      return 0;
    }
    // --print-config: a config may be made for another machine (deploy/config.yaml names the
    // image's model), so the model's directory is not checked there.
    config = LoadServerConfig(cl, /*check_files=*/!cl.print_config);
    if (cl.print_config) {
      std::cout << ConfigToYaml(config) << std::endl;
      return 0;
    }
  } catch (const ServerConfigError& e) {
    std::fprintf(stderr, "vlmgraph-server: config error: %s\n", e.what());
    return 2;
  }
  SetLogLevel(config.log_level);
  try {
    return Serve(config, signals);
  } catch (const ServerConfigError& e) {
    LogError(std::string("config error: ") + e.what());
    return 2;
  } catch (const std::exception& e) {
    LogError(std::string("start-up failed: ") + e.what());
    return 1;
  }
}
