// Serving on several engines behind one front (server/core/engine_router.h): two CPU engines of the
// tiny preset, the real gRPC service and OpenAI-compatible HTTP front in this process. Requests
// spread over both engines by load, the metrics carry a gpu label per engine, /health lists both,
// and an (injected) device failure of one engine stops both (a sticky CUDA error is process-wide,
// Note [Device faults]): every request fails (UNAVAILABLE over gRPC, 503 with OpenAI's error body
// over HTTP) and both fronts answer UNAVAILABLE / 503. On 2 GPUs a real device-side assert shows
// the process-wide effect (DataParallelGpus.AFaultOnOneGpuStopsEveryEngine_CUDA).
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include <torch/cuda.h>

#include "engine/device.h"
#include "server/config/config.h"
#include "server/core/engine_from_config.h"
#include "server/core/engine_router.h"
#include "server/core/metrics.h"
#include "server/core/status.h"
#include "server/core/text_prompt.h"
#include "server/grpc/grpc_server.h"
#include "server/grpc/service.h"
#include "server/openai/openai_http.h"
#include "tests/server_test_util.h"
#include "tests/tiny_tokenizer.h"
#include "vlmgraph/v1/service.grpc.pb.h"

namespace vlmgraph::server {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using std::chrono::milliseconds;

constexpr const char* kInjectedFault = "cudaErrorIllegalAddress: injected by the test";

// The engine's observer: forwards to the engine's metrics and, once armed, throws from the next
// region run, as a kernel on a failed GPU does; `step_delay_ms` slows decode steps so requests
// stay running while the test acts.
class FaultInjector : public ForwardingObserver {
 public:
  explicit FaultInjector(EngineMetrics* metrics) : ForwardingObserver(metrics) {}
  void OnStep(const BucketKey& key, bool graphed, double seconds) override {
    ForwardingObserver::OnStep(key, graphed, seconds);
    if (armed) throw std::runtime_error(kInjectedFault);
    if (key.region == Region::kDecode && step_delay_ms > 0)
      std::this_thread::sleep_for(milliseconds(step_delay_ms.load()));
  }

  std::atomic<bool> armed{false};
  std::atomic<int> step_delay_ms{0};

 private:
  EngineMetrics* metrics_;
};

// An HTTP/1.1 exchange on a new connection: (status, body).
std::pair<int, std::string> Http(int port, const std::string& method, const std::string& path,
                                 const std::string& body = "") {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return {0, ""};
  }
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (!body.empty()) {
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\n";
  }
  req += "\r\n" + body;
  send(fd, req.data(), req.size(), 0);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  if (out.size() < 12) return {0, out};
  const size_t split = out.find("\r\n\r\n");
  return {std::stoi(out.substr(9, 3)), split == std::string::npos ? "" : out.substr(split + 4)};
}

class DataParallelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("vlmgraph-dp-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    std::ofstream(dir_ / "tokenizer.json")
        << testing::TinyTokenizerJson(VlmConfig::Preset("nanovlm-tiny")).dump();
    config_ = FillDefaults(RawConfig{});
    config_.data_parallel_size = 2;
    config_.tokenizer = (dir_ / "tokenizer.json").string();
    config_.server.grpc_address = ListenAddress::Parse("127.0.0.1:0");
    config_.server.http_address = ListenAddress::Parse("127.0.0.1:0");
    config_.server.metrics_address =
        ListenAddress::Parse("127.0.0.1:0");  // validated only: metrics_ has no endpoint
    config_.batching.max_queue_delay_us = 0;
    if (max_prefill_batch_ > 0) config_.buckets.max_prefill_batch = max_prefill_batch_;
    ValidateConfig(config_);
    text_ = TextModel::Load(config_, BuildModelConfig(config_));

    std::vector<EngineSlot> slots;
    const std::vector<std::string> devices = ServingDevices(config_);
    ASSERT_EQ(devices, (std::vector<std::string>{"cpu", "cpu"}));
    for (size_t i = 0; i < devices.size(); ++i)
      slots.push_back({devices[i], GpuLabel(devices[i], i)});
    SchedulerOptions options{config_.batching.max_queue_delay_us, config_.batching.max_queue_size};
    // The device check after a failed engine call: the injected engines' devices are gone.
    options.device_fault = [this](Engine& e) {
      for (size_t i = 0; i < 2; ++i) {
        if (&e == engines_[i].load() && injectors_[i]->armed) return std::string(kInjectedFault);
      }
      return std::string();
    };
    router_ = std::make_unique<EngineRouter>(std::move(slots), &metrics_, options,
                                             [this] { every_engine_failed_++; });
    for (size_t i = 0; i < router_->size(); ++i) {
      injectors_[i] = std::make_unique<FaultInjector>(&metrics_.ForGpu(router_->slot(i).gpu));
      router_->Start(i, [this, i] {
        ServerConfig c = config_;
        c.device = router_->slot(i).device;
        std::unique_ptr<Engine> engine = BuildEngine(c);
        engine->SetObserver(injectors_[i].get());
        engine->Warmup();
        engines_[i] = engine.get();
        return engine;
      });
      metrics_.ForGpu(router_->slot(i).gpu).InitBuckets(router_->scheduler(i).engine().options().buckets);
    }
    service_ = std::make_unique<VlmGraphService>(router_.get(), &metrics_, config_, text_.get());
    grpc_ = std::make_unique<GrpcServer>(config_, service_.get(), &metrics_);
    grpc_->SetServing(true);
    http_ = std::make_unique<OpenAiHttpServer>(config_, router_.get(), &metrics_, text_.get());
    stub_ = v1::VlmGraph::NewStub(
        grpc::CreateChannel(grpc_->address(), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (http_) http_->Shutdown(0);
    if (grpc_) grpc_->Shutdown(0);
    if (router_) router_->Stop();
    for (const char* f : {"tokenizer.json"}) ::unlink((dir_ / f).c_str());
    ::rmdir(dir_.c_str());
  }

  // A gRPC Generate of `max_new` tokens from token ids: its status and the tokens streamed.
  std::pair<grpc::Status, int64_t> Generate(int64_t first, int64_t max_new) {
    v1::GenerateRequest req;
    for (int64_t i = 0; i < 8; ++i) req.add_input_ids((first + 7 * i) % 200);
    req.mutable_sampling()->set_max_new_tokens(max_new);
    return StreamGenerate(*stub_, req, std::chrono::seconds(60));
  }

  // A non-streaming /v1/completions of `max_tokens` tokens (no stop tokens).
  std::pair<int, json> Complete(int64_t max_tokens) {
    const json body = {{"model", config_.served_model_name},
                       {"prompt", "abc"},
                       {"max_tokens", max_tokens},
                       {"temperature", 0},
                       {"ignore_eos", true}};
    auto [status, text] = Http(http_->port(), "POST", "/v1/completions", body.dump());
    return {status, json::parse(text, nullptr, /*allow_exceptions=*/false)};
  }

  std::pair<int, json> Health() {
    auto [status, text] = Http(http_->port(), "GET", "/health");
    return {status, json::parse(text, nullptr, /*allow_exceptions=*/false)};
  }

  // Waits until every engine runs at least one sequence.
  bool EveryEngineRuns() {
    for (int i = 0; i < 2000; ++i) {
      bool all = true;
      for (const EngineState& e : router_->States()) all = all && e.running > 0;
      if (all) return true;
      std::this_thread::sleep_for(milliseconds(5));
    }
    return false;
  }

  int64_t max_prefill_batch_ = 0;  // buckets.max_prefill_batch when > 0 (set before SetUp)
  fs::path dir_;
  ServerConfig config_;
  std::unique_ptr<TextModel> text_;
  Metrics metrics_;
  std::unique_ptr<FaultInjector> injectors_[2];
  std::atomic<Engine*> engines_[2] = {nullptr, nullptr};
  std::atomic<int> every_engine_failed_{0};
  std::unique_ptr<EngineRouter> router_;
  std::unique_ptr<VlmGraphService> service_;
  std::unique_ptr<GrpcServer> grpc_;
  std::unique_ptr<OpenAiHttpServer> http_;
  std::unique_ptr<v1::VlmGraph::Stub> stub_;
};

// Prefill batches of at most 4 requests, below the engines' slots.
class DataParallelRoutingTest : public DataParallelTest {
 protected:
  void SetUp() override {
    max_prefill_batch_ = 4;
    DataParallelTest::SetUp();
  }
};

TEST_F(DataParallelRoutingTest, RequestsGoToTheLeastLoadedEngineOrJoinAFillingPrefillGroup) {
  for (auto& injector : injectors_) injector->step_delay_ms = 5;
  // Both GPU threads are held in a work item while requests are routed, so nothing is admitted
  // in between and every choice below is the router's alone (released on every way out).
  std::promise<void> release;
  const std::shared_future<void> released = release.get_future().share();
  std::promise<void> entered[2];
  std::vector<std::future<void>> holds;  // destroyed (joined) after release_once has run
  struct Release {
    std::promise<void>* p;
    bool done = false;
    void operator()() {
      if (!done) p->set_value();
      done = true;
    }
    ~Release() { (*this)(); }
  } release_once{&release};
  for (size_t i = 0; i < 2; ++i) {
    holds.push_back(std::async(std::launch::async, [&, i] {
      router_->scheduler(i).RunOnGpuThread("Forward", [&, i](Engine&) {
        entered[i].set_value();
        released.wait();
      });
    }));
  }
  for (auto& e : entered) e.get_future().wait();
  const Scheduler::LoadView view = router_->scheduler(0).View();
  const int64_t batch = view.prefill_batch;  // the most requests one prefill takes
  ASSERT_GE(batch, 2);
  ASSERT_GT(view.slots, batch + 3);
  std::vector<std::shared_ptr<GenerationStream>> streams;
  std::vector<Scheduler*> chosen;
  GenerateRequest r;
  r.input_ids = {1, 2, 3, 4};
  r.sampling.max_new_tokens = 100;
  auto submit = [&] {
    Scheduler* s = nullptr;
    streams.push_back(router_->SubmitGenerate(router_->engine().Validate(r), Clock::now(), &s));
    chosen.push_back(s);
    return s;
  };
  // A light load spreads: each request goes to the engine with less running + waiting.
  for (int64_t i = 0; i < 2 * batch; ++i) submit();
  EXPECT_EQ(router_->scheduler(0).Load(), batch);
  EXPECT_EQ(router_->scheduler(1).Load(), batch);
  // Both engines hold a prefill batch's worth: a request that starts a new prefill group on one
  // engine is followed there by the next ones, until that group is full.
  Scheduler* filling = submit();
  EXPECT_EQ(submit(), filling);
  // Forward (Pick) goes by load alone.
  Scheduler* other = &router_->scheduler(&router_->scheduler(0) == filling ? 1 : 0);
  EXPECT_EQ(&router_->Pick(), other);
  EXPECT_EQ(submit(), filling);
  EXPECT_EQ(filling->View().waiting, batch + 3);
  EXPECT_EQ(other->View().waiting, batch);
  release_once();
  for (auto& h : holds) h.get();
  // Each request runs where it was routed.
  const int64_t on_filling = std::count(chosen.begin(), chosen.end(), filling);
  const int64_t on_other = std::count(chosen.begin(), chosen.end(), other);
  for (int i = 0; i < 2000 && (filling->Running() != on_filling || other->Running() != on_other); ++i)
    std::this_thread::sleep_for(milliseconds(2));
  EXPECT_EQ(filling->Running(), batch + 3);
  EXPECT_EQ(other->Running(), batch);
  // Both decode (each engine's series carry its label, checked below).
  auto decode_steps = [this](const char* gpu) {
    const std::string text = metrics_.Render();
    const std::string series =
        std::string("vlmgraph_batch_size_count{gpu=\"") + gpu + "\",region=\"decode\"} ";
    const size_t at = text.find(series);
    return at == std::string::npos ? 0.0 : std::stod(text.substr(at + series.size()));
  };
  for (int i = 0; i < 2000 && (decode_steps("0") == 0 || decode_steps("1") == 0); ++i)
    std::this_thread::sleep_for(milliseconds(2));
  for (size_t i = 0; i < streams.size(); ++i) chosen[i]->Cancel(streams[i]);

  // Over gRPC and HTTP at once; each engine's series carry its label.
  for (auto& injector : injectors_) injector->step_delay_ms = 2;
  std::vector<std::future<grpc::Status>> grpc_calls;
  std::vector<std::future<int>> http_calls;
  for (int i = 0; i < 3; ++i) {
    grpc_calls.push_back(std::async(std::launch::async, [this, i] { return Generate(i, 24).first; }));
    http_calls.push_back(std::async(std::launch::async, [this] { return Complete(24).first; }));
  }
  for (auto& c : grpc_calls) EXPECT_TRUE(c.get().ok());
  for (auto& c : http_calls) EXPECT_EQ(c.get(), 200);
  const std::string text = metrics_.Render();
  for (const char* gpu : {"0", "1"}) {
    const std::string decode =
        std::string("vlmgraph_batch_size_count{gpu=\"") + gpu + "\",region=\"decode\"} ";
    const size_t at = text.find(decode);
    ASSERT_NE(at, std::string::npos) << decode;
    EXPECT_GT(std::stod(text.substr(at + decode.size())), 0) << decode;
    EXPECT_NE(text.find(std::string("vlmgraph_engine_healthy{gpu=\"") + gpu + "\"} 1"),
              std::string::npos);
    EXPECT_NE(text.find(std::string("vlmgraph_kv_cache_bytes{gpu=\"") + gpu + "\"}"),
              std::string::npos);
  }
}

// Note [Malformed requests] (server/grpc/grpc_server.h): bytes protobuf cannot parse, sent as a
// unary Forward and as a streaming Generate, get INVALID_ARGUMENT naming the request type (gRPC
// itself answers INTERNAL / UNIMPLEMENTED with no message), and are counted.
TEST_F(DataParallelTest, AMalformedRequestIsInvalidArgumentNamingItsType) {
  auto channel = grpc::CreateChannel(grpc_->address(), grpc::InsecureChannelCredentials());
  // Field 1, length-delimited, with a length varint that never ends.
  const std::string garbage = "\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01";
  grpc::Slice slice(garbage);
  const grpc::ByteBuffer request(&slice, 1);
  {
    grpc::ClientContext ctx;
    grpc::ByteBuffer response;
    const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel.get(),
        grpc::internal::RpcMethod("/vlmgraph.v1.VlmGraph/Forward",
                                  grpc::internal::RpcMethod::NORMAL_RPC),
        &ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("not a valid serialized vlmgraph.v1.ForwardRequest"),
              std::string::npos)
        << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
            channel.get(),
            grpc::internal::RpcMethod("/vlmgraph.v1.VlmGraph/Generate",
                                      grpc::internal::RpcMethod::SERVER_STREAMING),
            &ctx, request));
    grpc::ByteBuffer chunk;
    while (reader->Read(&chunk)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find("not a valid serialized vlmgraph.v1.GenerateRequest"),
              std::string::npos)
        << s.error_message();
  }
  const std::string text = metrics_.Render();
  for (const char* rpc : {"Forward", "Generate"}) {
    const std::string series = std::string("vlmgraph_requests_total{code=\"INVALID_ARGUMENT\",rpc=\"") +
                               rpc + "\"} 1";
    EXPECT_NE(text.find(series), std::string::npos) << series;
  }
  // The server serves on.
  EXPECT_TRUE(Generate(1, 4).first.ok());
}

TEST_F(DataParallelTest, HealthListsEveryEngine) {
  const auto [status, body] = Health();
  EXPECT_EQ(status, 200);
  EXPECT_EQ(body["status"], "serving");
  ASSERT_EQ(body["engines"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const json& e = body["engines"][i];
    EXPECT_EQ(e["device"], "cpu");
    EXPECT_EQ(e["gpu"], std::to_string(i));
    EXPECT_EQ(e["healthy"], true);
    EXPECT_EQ(e["running"], 0);
    EXPECT_EQ(e["waiting"], 0);
  }
}

TEST_F(DataParallelTest, AFaultOnOneEngineStopsEveryEngine) {
  // One long gRPC generation and one long HTTP completion per engine... then engine 1's GPU fails
  // (Note [Device faults]: the CUDA error is sticky for the whole process): every request ends
  // with UNAVAILABLE / 503 naming the error, both engines stop, and the server is told to restart.
  for (auto& injector : injectors_) injector->step_delay_ms = 5;
  auto g0 = std::async(std::launch::async, [this] { return Generate(1, 100); });
  auto g1 = std::async(std::launch::async, [this] { return Generate(2, 100); });
  ASSERT_TRUE(EveryEngineRuns());
  auto h0 = std::async(std::launch::async, [this] { return Complete(100); });
  auto h1 = std::async(std::launch::async, [this] { return Complete(100); });
  for (int i = 0; i < 2000; ++i) {
    const std::vector<EngineState> s = router_->States();
    if (s[0].running == 2 && s[1].running == 2) break;
    std::this_thread::sleep_for(milliseconds(5));
  }
  injectors_[1]->armed = true;
  for (const grpc::Status& s : {g0.get().first, g1.get().first}) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    EXPECT_NE(s.error_message().find("GPU failed"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find(kInjectedFault), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("the server restarts"), std::string::npos) << s.error_message();
  }
  for (const auto& [status, body] : {h0.get(), h1.get()}) {
    EXPECT_EQ(status, 503) << body.dump();
    EXPECT_EQ(body["error"]["type"], "server_error") << body.dump();
    EXPECT_NE(body["error"]["message"].get<std::string>().find(kInjectedFault), std::string::npos)
        << body.dump();
  }
  EXPECT_EQ(router_->serving_engines(), 0);
  EXPECT_EQ(every_engine_failed_.load(), 1);
  const auto [status, health] = Health();
  EXPECT_EQ(status, 503);
  EXPECT_EQ(health["engines"][0]["healthy"], false);
  EXPECT_EQ(health["engines"][1]["healthy"], false);
  EXPECT_EQ(health["engines"][1]["error"], kInjectedFault);
  EXPECT_NE(health["engines"][0]["error"].get<std::string>().find(kInjectedFault),
            std::string::npos)
      << health.dump();
  EXPECT_NE(health["engines"][0]["error"].get<std::string>().find("raised on cpu"),
            std::string::npos)
      << health.dump();
  const grpc::Status after = Generate(3, 4).first;
  EXPECT_EQ(after.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(after.error_message().find("no GPU of this server can serve"), std::string::npos);
  const std::string text = metrics_.Render();
  EXPECT_NE(text.find("vlmgraph_engine_healthy{gpu=\"0\"} 0"), std::string::npos);
  EXPECT_NE(text.find("vlmgraph_engine_healthy{gpu=\"1\"} 0"), std::string::npos);
}

TEST_F(DataParallelTest, WithEveryEngineDownBothFrontsAnswerUnavailable) {
  for (auto& injector : injectors_) injector->armed = true;
  // Each engine fails at its next request (its prefill): the request gets UNAVAILABLE / 503 and
  // the engine stops. Requests alternate between idle engines, so two of them take both down.
  const auto first = Generate(1, 4).first;
  const auto second = Complete(4);
  EXPECT_EQ(first.error_code(), grpc::StatusCode::UNAVAILABLE) << first.error_message();
  EXPECT_EQ(second.first, 503) << second.second.dump();
  ASSERT_EQ(router_->serving_engines(), 0);
  EXPECT_EQ(every_engine_failed_.load(), 1);

  const auto [code, message] = [this] {
    const grpc::Status s = Generate(3, 4).first;
    return std::make_pair(s.error_code(), s.error_message());
  }();
  EXPECT_EQ(code, grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(message.find("no GPU of this server can serve"), std::string::npos) << message;
  const auto [status, body] = Complete(4);
  EXPECT_EQ(status, 503);
  EXPECT_NE(body["error"]["message"].get<std::string>().find("no GPU of this server can serve"),
            std::string::npos);
  const auto [health_status, health] = Health();
  EXPECT_EQ(health_status, 503);
  EXPECT_EQ(health["engines"].size(), 2u);
  EXPECT_EQ(health["engines"][0]["healthy"], false);
}

// What a stream of the router brought: its tokens and its error (nullptr when it finished).
struct Streamed {
  std::vector<int64_t> tokens;
  std::exception_ptr error;
};

Streamed Collect(const std::shared_ptr<GenerationStream>& stream) {
  Streamed out;
  for (int i = 0; i < 6000; ++i) {
    GenerationStream::Update u = stream->Wait(milliseconds(10));
    out.tokens.insert(out.tokens.end(), u.tokens.begin(), u.tokens.end());
    if (u.done || u.error) {
      out.error = u.error;
      return out;
    }
  }
  out.error = std::make_exception_ptr(std::runtime_error("no end within 60 s"));
  return out;
}

// The scenario of AFaultOnOneGpuStopsEveryEngine_CUDA, in its own process (a device-side assert
// leaves CUDA unusable for the rest of the process). Prints each failed check; returns their
// count.
int OneGpuFaultsAndEveryEngineStops() {
  int failed = 0;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) {
      ++failed;
      std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    }
  };
  ServerConfig config = FillDefaults(RawConfig{});
  config.model = "nanovlm-tiny";
  config.device = "cuda";
  config.data_parallel_size = 2;
  config.buckets.batch_sizes = {1, 2, 4};
  config.buckets.seq_lens = {16, 32};
  config.buckets.context_lens = {64};
  config.buckets.tile_counts = {1};
  ValidateConfig(config, /*check_files=*/false);
  const std::vector<std::string> devices = ServingDevices(config);
  std::vector<EngineSlot> slots;
  for (size_t i = 0; i < devices.size(); ++i) slots.push_back({devices[i], GpuLabel(devices[i], i)});
  std::atomic<int> every_engine_failed{0};
  // Leaked: engines on a failed device must not be destroyed (as the server exits).
  auto* router = new EngineRouter(std::move(slots), nullptr, SchedulerOptions{0, 64},
                                  [&every_engine_failed] { ++every_engine_failed; });
  for (size_t i = 0; i < router->size(); ++i) {
    router->Start(i, [&config, router, i] {
      ServerConfig c = config;
      c.device = router->slot(i).device;
      std::unique_ptr<Engine> engine = BuildEngine(c);
      engine->Warmup();
      return engine;
    });
  }
  // Each GPU thread is bound to its engine's device.
  for (size_t i = 0; i < 2; ++i) {
    int current = -2;
    router->scheduler(i).RunOnGpuThread(
        "check", [&](Engine&) { current = CurrentDeviceIndex(); }, Clock::now());
    check(current == static_cast<int>(i), "GPU thread " + std::to_string(i) +
                                              " runs on device " + std::to_string(current));
  }
  GenerateRequest r;
  r.input_ids = {5, 17, 42, 7, 99, 3, 64, 12};
  r.sampling.max_new_tokens = 48;
  auto run = [&](Scheduler& s) {
    return Collect(s.SubmitGenerate(router->engine().Validate(r), Clock::now()));
  };
  const Streamed want = run(router->scheduler(0));
  check(!want.error && want.tokens.size() == 48u, "engine 0 generates before the fault");
  check(run(router->scheduler(1)).tokens == want.tokens, "engine 1 generates what engine 0 does");

  // A request runs on engine 1 when its GPU hits a device-side assert (an index out of bounds in
  // a gather, as a bad token id in the embedding).
  std::shared_ptr<GenerationStream> running =
      router->scheduler(1).SubmitGenerate(router->engine().Validate(r), Clock::now());
  GenerationStream::Update first = running->Wait(std::chrono::seconds(30));
  check(!first.tokens.empty() && !first.done, "the request on engine 1 runs");
  try {
    router->scheduler(1).RunOnGpuThread(
        "InjectFault",
        [](Engine& engine) {
          const at::Device device = engine.options().device;
          const at::Tensor table = at::ones({4}, at::TensorOptions().device(device));
          const at::Tensor index =
              at::full({1}, 1000, at::TensorOptions().dtype(at::kLong).device(device));
          (void)table.index_select(0, index);
          SynchronizeDevice(device);
        },
        Clock::now());
    check(false, "the injected fault threw");
  } catch (const ServerError& e) {
    check(e.code() == grpc::StatusCode::UNAVAILABLE,
          std::string("the faulting work ends UNAVAILABLE: ") + e.what());
  }
  const Streamed ended = Collect(running);
  check(ended.error != nullptr, "the request on engine 1 ended with an error");
  if (ended.error) {
    const grpc::Status status = StatusFromException(ended.error);
    check(status.error_code() == grpc::StatusCode::UNAVAILABLE,
          "the request on engine 1 ended UNAVAILABLE: " + status.error_message());
  }
  std::fprintf(stderr, "engine 1's device fault: %s\n",
               router->scheduler(1).device_fault().c_str());
  // The premise of Note [Device faults]: the error is sticky for the process, cuda:0 included.
  std::string cuda0;
  try {
    at::Tensor t = at::ones({4}, at::TensorOptions().device(at::Device(at::kCUDA, 0)));
    cuda0 = std::to_string((t * 2).sum().item<double>());
  } catch (const std::exception& e) {
    cuda0 = std::string("error: ") + e.what();
  }
  std::fprintf(stderr, "cuda:0 after the fault on cuda:1: %.120s\n", cuda0.c_str());
  check(cuda0.rfind("error: ", 0) == 0, "cuda:0 fails too after the assert on cuda:1");
  // Every engine stops at once, with the error; the server is told to restart.
  for (int i = 0; i < 1000 && router->serving_engines() > 0; ++i)
    std::this_thread::sleep_for(milliseconds(2));
  check(router->serving_engines() == 0, "no engine serves");
  check(router->scheduler(0).device_fault().find("raised on cuda:1") != std::string::npos,
        "engine 0 stopped with engine 1's error: " + router->scheduler(0).device_fault());
  check(every_engine_failed.load() == 1, "on_every_engine_failed ran once");
  try {
    Scheduler* chosen = nullptr;
    (void)router->SubmitGenerate(router->engine().Validate(r), Clock::now(), &chosen);
    check(false, "a request after the fault is refused");
  } catch (const ServerError& e) {
    check(e.code() == grpc::StatusCode::UNAVAILABLE, std::string("refused UNAVAILABLE: ") + e.what());
  }
  if (failed == 0) std::fprintf(stderr, "every engine stopped after engine 1's device fault\n");
  std::fflush(stderr);
  return failed;
}

// Note [Device faults] (server/core/scheduler.h) on real GPUs: a device-side assert on cuda:1 ends
// engine 1's running request (UNAVAILABLE), makes CUDA fail on cuda:0 too (the error is sticky
// for the process), and the router stops both engines at once and reports that none is left (the
// server restarts); and each engine's GPU thread is bound to its device. In a child process of
// its own (gtest's threadsafe death-test style re-executes this binary).
TEST(DataParallelGpus, AFaultOnOneGpuStopsEveryEngine_CUDA) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  EXPECT_EXIT(std::_Exit(OneGpuFaultsAndEveryEngineStops() == 0 ? 0 : 1),
              ::testing::ExitedWithCode(0), "every engine stopped after engine 1's device fault");
}

TEST(DataParallelConfig, DevicesFromTheConfig) {
  ServerConfig c = FillDefaults(RawConfig{});
  EXPECT_EQ(ServingDevices(c), (std::vector<std::string>{"cpu"}));
  c.data_parallel_size = 3;
  EXPECT_EQ(ServingDevices(c), (std::vector<std::string>{"cpu", "cpu", "cpu"}));
  EXPECT_EQ(GpuLabel("cuda:3", 0), "3");
  EXPECT_EQ(GpuLabel("cpu", 2), "2");
  if (!at::hasCUDA()) {
    c.device = "cuda";
    c.data_parallel_size = 2;
    try {
      ServingDevices(c);
      ADD_FAILURE() << "two CUDA engines without CUDA";
    } catch (const ServerConfigError& e) {
      EXPECT_EQ(e.key_path(), "data_parallel_size");
    }
  }
}

}  // namespace
}  // namespace vlmgraph::server
