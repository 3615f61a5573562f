// The gRPC service in this process (server/grpc/service.h, Note [Generate on the callback API]):
// one CPU engine of the tiny preset whose decode steps wait at a gate the test opens, and the real
// VlmGraphService on a gRPC server built with at most 4 threads for synchronous calls. Generate
// streams hold no thread while they wait for their tokens, so 32 of them are in flight at once
// and all complete; a cancelled stream ends (counted CANCELLED) while the GPU thread is still
// busy, and its sequence is freed; the shutdown's cancel ends a stream the same way (counted
// UNAVAILABLE, cut by the shutdown deadline).
#include <grpcpp/create_channel.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "server/config/config.h"
#include "server/core/engine_from_config.h"
#include "server/core/engine_router.h"
#include "server/core/metrics.h"
#include "server/grpc/service.h"
#include "tests/server_test_util.h"
#include "vlmgraph/v1/service.grpc.pb.h"

namespace vlmgraph::server {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// Threads the test's gRPC server may create (grpc::ResourceQuota): what synchronous handlers
// could run on at once.
constexpr int kServerThreads = 4;

// The engine's observer: forwards to the engine's metrics; while closed, every decode step waits
// on the GPU thread until the gate opens (at most a minute, so a failing test cannot hang).
class DecodeGate : public ForwardingObserver {
 public:
  explicit DecodeGate(EngineMetrics* metrics) : ForwardingObserver(metrics) {}
  void OnStep(const BucketKey& key, bool graphed, double seconds) override {
    ForwardingObserver::OnStep(key, graphed, seconds);
    if (key.region != Region::kDecode) return;
    std::unique_lock<std::mutex> lock(mu_);
    ++waiting_;
    cv_.notify_all();
    cv_.wait_for(lock, std::chrono::minutes(1), [this] { return open_; });
    --waiting_;
  }

  void Set(bool open) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = open;
    }
    cv_.notify_all();
  }
  // Whether the GPU thread waits at the gate now.
  bool holding() {
    std::lock_guard<std::mutex> lock(mu_);
    return waiting_ > 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
  int waiting_ = 0;
};

bool WaitFor(const std::function<bool()>& done, milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

// The value of the series `name{...}` whose labels include every one of `labels` (0: none, as a
// counter that never counted).
double MetricValue(const std::string& text, const std::string& name,
                   const std::vector<std::string>& labels) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + "{", 0) != 0) continue;
    bool all = true;
    for (const std::string& l : labels) all = all && line.find(l) != std::string::npos;
    if (all) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return 0;
}

struct StreamResult {
  grpc::Status status;
  int64_t tokens = 0;  // token ids streamed in TokenChunks
  int64_t chunks = 0;
  bool summary = false;
  int64_t summary_tokens = -1;  // GenerateSummary.generated_tokens
};

class GrpcServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = FillDefaults(RawConfig{});
    config_.batching.max_queue_delay_us = 0;
    ValidateConfig(config_);
    const std::string device = ServingDevices(config_).at(0);
    SchedulerOptions options{config_.batching.max_queue_delay_us, config_.batching.max_queue_size};
    router_ = std::make_unique<EngineRouter>(std::vector<EngineSlot>{{device, GpuLabel(device, 0)}},
                                             &metrics_, options);
    gate_ = std::make_unique<DecodeGate>(&metrics_.ForGpu(router_->slot(0).gpu));
    router_->Start(0, [this, device] {
      ServerConfig c = config_;
      c.device = device;
      std::unique_ptr<Engine> engine = BuildEngine(c);
      engine->SetObserver(gate_.get());
      engine->Warmup();
      return engine;
    });
    service_ = std::make_unique<VlmGraphService>(router_.get(), &metrics_, config_);
    grpc::ServerBuilder builder;
    grpc::ResourceQuota quota("server_grpc_test");
    quota.SetMaxThreads(kServerThreads);
    builder.SetResourceQuota(quota);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr && port != 0);
    stub_ = v1::VlmGraph::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                      grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    gate_->Set(true);
    if (server_) {
      service_->SetShutdownDeadline(Clock::now());
      server_->Shutdown(std::chrono::system_clock::now());
      server_->Wait();
    }
    router_->Stop();
  }

  static v1::GenerateRequest Request(int64_t first, int64_t max_new) {
    v1::GenerateRequest req;
    for (int64_t i = 0; i < 8; ++i) req.add_input_ids((first + 7 * i) % 200);
    req.mutable_sampling()->set_max_new_tokens(max_new);
    return req;
  }

  // The status of a Generate call the server refuses before its first message.
  grpc::Status Refused(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse m;
    EXPECT_FALSE(reader->Read(&m));
    return reader->Finish();
  }

  // A whole Generate stream of `max_new` tokens (60 s deadline).
  StreamResult Generate(int64_t first, int64_t max_new) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    auto reader = stub_->Generate(&ctx, Request(first, max_new));
    StreamResult r;
    for (v1::GenerateResponse m; reader->Read(&m);) {
      if (m.has_tokens()) {
        r.tokens += m.tokens().token_ids_size();
        ++r.chunks;
      }
      if (m.has_summary()) {
        r.summary = true;
        r.summary_tokens = m.summary().generated_tokens();
      }
    }
    r.status = reader->Finish();
    return r;
  }

  ServerConfig config_;
  Metrics metrics_;
  std::unique_ptr<DecodeGate> gate_;
  std::unique_ptr<EngineRouter> router_;
  std::unique_ptr<VlmGraphService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::VlmGraph::Stub> stub_;
};

TEST_F(GrpcServiceTest, GenerateStreamsInFlightAtOnceNeedNoThreadEach) {
  constexpr int kStreams = 32;
  constexpr int64_t kNewTokens = 6;
  gate_->Set(false);
  std::vector<std::future<StreamResult>> calls;
  for (int i = 0; i < kStreams; ++i) {
    calls.push_back(std::async(std::launch::async, [this, i] { return Generate(i, kNewTokens); }));
  }
  // Every stream is accepted and waits for its tokens while the GPU thread is held, although the
  // server has 4 threads: a stream that held one would leave the others waiting for it.
  const bool all_in_flight =
      WaitFor([&] { return service_->in_flight() == kStreams; }, seconds(10));
  const int64_t in_flight = service_->in_flight();
  gate_->Set(true);
  EXPECT_TRUE(all_in_flight) << "streams in flight at once: " << in_flight << " of " << kStreams;
  for (auto& call : calls) {
    const StreamResult r = call.get();
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, kNewTokens);
    EXPECT_TRUE(r.summary);
    EXPECT_EQ(r.summary_tokens, kNewTokens);
    EXPECT_GE(r.chunks, 1);
  }
  EXPECT_EQ(service_->in_flight(), 0);
  EXPECT_EQ(MetricValue(metrics_.Render(), "vlmgraph_requests_total",
                        {"rpc=\"Generate\"", "code=\"OK\""}),
            kStreams);
}

TEST_F(GrpcServiceTest, ACancelledStreamEndsWhileTheGpuThreadIsBusy) {
  gate_->Set(false);
  grpc::ClientContext ctx;
  auto reader = stub_->Generate(&ctx, Request(1, 8));
  // Admitted: its first decode step waits at the gate.
  ASSERT_TRUE(WaitFor([&] { return gate_->holding(); }, seconds(30)));
  ctx.TryCancel();
  for (v1::GenerateResponse m; reader->Read(&m);) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The call ended without waiting for the engine, which still holds the GPU thread.
  EXPECT_TRUE(WaitFor([&] { return service_->in_flight() == 0; }, seconds(10)));
  EXPECT_TRUE(WaitFor(
      [&] {
        return MetricValue(metrics_.Render(), "vlmgraph_requests_total",
                           {"rpc=\"Generate\"", "code=\"CANCELLED\""}) == 1;
      },
      seconds(10)));
  EXPECT_TRUE(gate_->holding());
  gate_->Set(true);
  // Its sequence was cancelled in the engine: nothing runs or waits once the GPU thread goes on.
  EXPECT_TRUE(WaitFor(
      [&] {
        const EngineState s = router_->States().at(0);
        return s.running == 0 && s.waiting == 0;
      },
      seconds(30)));
  // The engine serves the next stream.
  const StreamResult next = Generate(2, 4);
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.tokens, 4);
}

TEST_F(GrpcServiceTest, ShutdownCutsAStreamWhoseEngineIsBusy) {
  gate_->Set(false);
  auto call = std::async(std::launch::async, [this] { return Generate(1, 8); });
  ASSERT_TRUE(WaitFor([&] { return gate_->holding(); }, seconds(30)));
  // Note [Graceful shutdown]: the drain is over; gRPC cancels what still runs. The stream ends at
  // once, although its engine still holds the GPU thread, so Shutdown returns.
  service_->SetShutdownDeadline(Clock::now());
  const auto start = std::chrono::steady_clock::now();
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  server_.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(10));
  EXPECT_TRUE(gate_->holding());
  EXPECT_FALSE(call.get().status.ok());
  EXPECT_EQ(service_->in_flight(), 0);
  // Recorded as cut by the shutdown deadline, not as cancelled by its client.
  const std::string metrics = metrics_.Render();
  EXPECT_EQ(
      MetricValue(metrics, "vlmgraph_requests_total", {"rpc=\"Generate\"", "code=\"UNAVAILABLE\""}),
      1);
  EXPECT_EQ(
      MetricValue(metrics, "vlmgraph_requests_total", {"rpc=\"Generate\"", "code=\"CANCELLED\""}),
      0);
}

TEST_F(GrpcServiceTest, InvalidGenerateRequestIsRefusedFromThePrepareThread) {
  v1::GenerateRequest req = Request(1, 4);
  req.mutable_sampling()->set_max_new_tokens(0);
  const grpc::Status status = Refused(req);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("sampling.max_new_tokens"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(service_->in_flight(), 0);
  EXPECT_EQ(MetricValue(metrics_.Render(), "vlmgraph_requests_total",
                        {"rpc=\"Generate\"", "code=\"INVALID_ARGUMENT\""}),
            1);
}

// Log-probabilities over gRPC (v1::LogprobsParams): one per generated token, the prompt's from its
// second token on in the first chunk, each equal to log_softmax of the Forward RPC's logits at the
// position that predicted it; the top lists sorted, the greedy token first; the token's own
// logprob in its top list. A top without its switch is refused.
TEST_F(GrpcServiceTest, GenerateReturnsLogprobsOfTheForwardLogits) {
  gate_->Set(true);
  constexpr int64_t kNew = 5, kTop = 3, kPromptTop = 2;
  v1::GenerateRequest req = Request(3, kNew);
  req.mutable_logprobs()->set_tokens(true);
  req.mutable_logprobs()->set_top(kTop);
  req.mutable_logprobs()->set_prompt(true);
  req.mutable_logprobs()->set_prompt_top(kPromptTop);
  std::vector<int64_t> ids(req.input_ids().begin(), req.input_ids().end());
  const size_t prompt_len = ids.size();
  std::vector<v1::TokenLogprob> token_logprobs, prompt_logprobs;
  int prompt_chunks = 0;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    auto reader = stub_->Generate(&ctx, req);
    for (v1::GenerateResponse m; reader->Read(&m);) {
      if (!m.has_tokens()) continue;
      ASSERT_EQ(m.tokens().logprobs_size(), m.tokens().token_ids_size());
      ids.insert(ids.end(), m.tokens().token_ids().begin(), m.tokens().token_ids().end());
      token_logprobs.insert(token_logprobs.end(), m.tokens().logprobs().begin(),
                            m.tokens().logprobs().end());
      if (m.tokens().prompt_logprobs_size() > 0) {
        ++prompt_chunks;
        prompt_logprobs.assign(m.tokens().prompt_logprobs().begin(),
                               m.tokens().prompt_logprobs().end());
      }
    }
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_EQ(token_logprobs.size(), static_cast<size_t>(kNew));
  EXPECT_EQ(prompt_chunks, 1);
  ASSERT_EQ(prompt_logprobs.size(), prompt_len - 1);

  // The reference: the logits of the whole sequence but its last token, from the Forward RPC.
  v1::ForwardRequest fwd;
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    fwd.add_input_ids(ids[i]);
    fwd.add_logits_positions(static_cast<int64_t>(i));
  }
  v1::ForwardResponse logits;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(60));
    const grpc::Status status = stub_->Forward(&ctx, fwd, &logits);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_EQ(logits.logits_size(), static_cast<int>(ids.size() - 1));
  auto check = [&](const v1::TokenLogprob& got, size_t position, int64_t top,
                   const char* what) -> bool {
    const auto& row = logits.logits(static_cast<int>(position)).logits();
    double max_logit = -1e30;
    for (float v : row) max_logit = std::max<double>(max_logit, v);
    double sum = 0;
    for (float v : row) sum += std::exp(v - max_logit);
    auto log_softmax = [&](int64_t id) {
      return row[static_cast<int>(id)] - max_logit - std::log(sum);
    };
    const int64_t token = ids[position + 1];
    EXPECT_NEAR(got.logprob(), log_softmax(token), 1e-4) << what << " at position " << position;
    EXPECT_EQ(got.top_size(), top) << what;
    bool has_token = false;
    for (int k = 0; k < got.top_size(); ++k) {
      EXPECT_NEAR(got.top(k).logprob(), log_softmax(got.top(k).token_id()), 1e-4) << what;
      if (k > 0) EXPECT_GE(got.top(k - 1).logprob(), got.top(k).logprob()) << what;
      has_token = has_token || got.top(k).token_id() == token;
    }
    return has_token;
  };
  for (size_t i = 0; i < prompt_logprobs.size(); ++i)
    check(prompt_logprobs[i], i, kPromptTop, "prompt");
  for (size_t i = 0; i < token_logprobs.size(); ++i) {
    // Greedy: the generated token is the most likely one, first in its top list.
    EXPECT_TRUE(check(token_logprobs[i], prompt_len - 1 + i, kTop, "token"));
    EXPECT_EQ(token_logprobs[i].top(0).token_id(), ids[prompt_len + i]);
  }

  // A top without its switch.
  for (const bool prompt : {false, true}) {
    v1::GenerateRequest bad = Request(3, 2);
    if (prompt) {
      bad.mutable_logprobs()->set_prompt_top(2);
    } else {
      bad.mutable_logprobs()->set_top(2);
    }
    const grpc::Status status = Refused(bad);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find(prompt ? "logprobs.prompt_top" : "logprobs.top"),
              std::string::npos)
        << status.error_message();
  }
  // Out of range: the engine's check, with the field's name.
  v1::GenerateRequest big = Request(3, 2);
  big.mutable_logprobs()->set_tokens(true);
  big.mutable_logprobs()->set_top(kMaxTopLogprobs + 1);
  const grpc::Status status = Refused(big);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("logprobs.top"), std::string::npos)
      << status.error_message();
}

}  // namespace
}  // namespace vlmgraph::server
