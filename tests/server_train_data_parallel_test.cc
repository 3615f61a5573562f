// The Train RPC on a server with several engines (server/train/train_ranks.h,
// Note [In-process ranks]): two CPU engines of the tiny preset behind the real gRPC service, in
// this process, train one job as two gloo ranks (two GPUs and NCCL in the *_CUDA test). The job
// gives the losses and weights of the same job on a one-engine server, its publish is served by
// both engines (and rolled back on both), serving goes on while it trains, and a rank that fails
// ends the job on both ranks with the rank's error while the engines keep serving and the next job
// trains.
#include <ATen/ATen.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/data_parallel.h"
#include "server/config/config.h"
#include "server/core/engine_from_config.h"
#include "server/core/engine_router.h"
#include "server/core/metrics.h"
#include "server/grpc/grpc_server.h"
#include "server/grpc/service.h"
#include "server/train/weights_publisher.h"
#include "tests/server_test_util.h"
#include "tests/test_util.h"
#include "vlmgraph/v1/service.grpc.pb.h"

namespace vlmgraph::server {
namespace {

using std::chrono::milliseconds;

constexpr const char* kInjectedFault = "injected training fault";

// The engine's observer: forwards to the engine's metrics; once `fail_training` is armed, the
// next training micro-batch that runs eagerly (one longer than every train bucket) throws, as a
// failed kernel would, without the device being lost; `step_delay_ms` slows decode steps so that
// requests keep running while a job trains.
class TrainFaultInjector : public ForwardingObserver {
 public:
  explicit TrainFaultInjector(EngineMetrics* metrics) : ForwardingObserver(metrics) {}
  void OnStep(const BucketKey& key, bool graphed, double seconds) override {
    ForwardingObserver::OnStep(key, graphed, seconds);
    if (key.region == Region::kTrain) ++train_steps;
    if (key.region == Region::kDecode && step_delay_ms > 0)
      std::this_thread::sleep_for(milliseconds(step_delay_ms.load()));
  }
  void OnEagerFallback(Region region, const std::string& reason) override {
    ForwardingObserver::OnEagerFallback(region, reason);
    if (region == Region::kTrain && fail_training.exchange(false))
      throw std::runtime_error(kInjectedFault);
  }

  std::atomic<bool> fail_training{false};
  std::atomic<int> step_delay_ms{0};
  std::atomic<int64_t> train_steps{0};

 private:
  EngineMetrics* metrics_;
};

// A server of `engines` CPU engines of the tiny preset (the same seeded weights on each), with a
// publisher over every engine and no publish gate.
class TestServer {
 public:
  // `device` "cuda": engines on cuda:0 .. cuda:engines-1, float32, graphed.
  explicit TestServer(int64_t engines, double timeout_seconds = 60,
                      const std::string& device = "cpu") {
    config_ = FillDefaults(RawConfig{});
    config_.device = device;
    config_.dtype = "float32";
    config_.data_parallel_size = engines;
    config_.server.grpc_address = ListenAddress::Parse("127.0.0.1:0");
    config_.server.http_address = ListenAddress::Parse("127.0.0.1:0");
    config_.server.metrics_address = ListenAddress::Parse("127.0.0.1:0");
    config_.batching.max_queue_delay_us = 0;
    config_.buckets.train_batch_sizes = {1, 2};
    config_.buckets.train_seq_lens = {16, 32};
    config_.buckets.oversize = OversizePolicy::kEager;
    config_.train.data_parallel_timeout_seconds = timeout_seconds;
    ValidateConfig(config_);
    std::vector<EngineSlot> slots;
    const std::vector<std::string> devices = ServingDevices(config_);
    for (size_t i = 0; i < devices.size(); ++i)
      slots.push_back({devices[i], GpuLabel(devices[i], i)});
    SchedulerOptions options{config_.batching.max_queue_delay_us, config_.batching.max_queue_size};
    options.device_fault = [](Engine&) { return std::string(); };  // the devices never fail
    router_ = std::make_unique<EngineRouter>(std::move(slots), &metrics_, options);
    for (size_t i = 0; i < router_->size(); ++i) {
      injectors_.push_back(
          std::make_unique<TrainFaultInjector>(&metrics_.ForGpu(router_->slot(i).gpu)));
      router_->Start(i, [this, i] {
        ServerConfig c = config_;
        c.device = router_->slot(i).device;
        std::unique_ptr<Engine> engine = BuildEngine(c);
        engine->SetObserver(injectors_[i].get());
        engine->Warmup();
        return engine;
      });
    }
    std::vector<Scheduler*> schedulers;
    for (size_t i = 0; i < router_->size(); ++i) schedulers.push_back(&router_->scheduler(i));
    publisher_ = std::make_unique<WeightsPublisher>(std::move(schedulers), nullptr, &metrics_);
    service_ = std::make_unique<VlmGraphService>(router_.get(), &metrics_, config_, nullptr,
                                                 nullptr, publisher_.get());
    grpc_ = std::make_unique<GrpcServer>(config_, service_.get());
    grpc_->SetServing(true);
    stub_ = v1::VlmGraph::NewStub(
        grpc::CreateChannel(grpc_->address(), grpc::InsecureChannelCredentials()));
  }
  ~TestServer() {
    grpc_->Shutdown(0);
    router_->Stop();
  }

  EngineRouter& router() { return *router_; }
  TrainFaultInjector& injector(size_t i) { return *injectors_[i]; }
  v1::VlmGraph::Stub& stub() { return *stub_; }

  // Engine i's served parameters (copies), read on its GPU thread.
  std::map<std::string, at::Tensor> Served(size_t i) {
    std::map<std::string, at::Tensor> out;
    router_->scheduler(i).RunOnGpuThread("test", [&](Engine& e) {
      // On the CPU: the engines' GPUs differ, and so may the engine compared with.
      for (const auto& p : e.model()->named_parameters()) out[p.key()] = p.value().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    });
    return out;
  }

  // Engine i's logits at the last position of a fixed prompt (a Forward on that engine).
  std::vector<float> Logits(size_t i) {
    ForwardRequest f;
    f.input_ids = {5, 17, 33, 41, 60, 72, 88, 90};
    f.logits_positions = {7};
    const ValidatedForward req = router_->engine().Validate(f);
    ForwardResult r;
    router_->scheduler(i).RunOnGpuThread("test", [&](Engine& e) { r = e.Forward(req); });
    return r.logits.at(0);
  }

  // A greedy generation of `max_new` tokens on engine i, straight through its scheduler.
  std::vector<int64_t> GenerateOn(size_t i, int64_t max_new) {
    GenerateRequest r;
    r.input_ids = {1, 2, 3, 4, 5, 6};
    r.sampling.max_new_tokens = max_new;
    auto stream = router_->scheduler(i).SubmitGenerate(router_->engine().Validate(r), Clock::now());
    std::vector<int64_t> tokens;
    for (;;) {
      GenerationStream::Update u = stream->Wait(milliseconds(1000));
      tokens.insert(tokens.end(), u.tokens.begin(), u.tokens.end());
      if (u.error) std::rethrow_exception(u.error);
      if (u.done) return tokens;
    }
  }

  // A gRPC Generate of `max_new` tokens: its status and the tokens streamed.
  std::pair<grpc::Status, int64_t> Generate(int64_t max_new) {
    v1::GenerateRequest req;
    for (int64_t i = 0; i < 8; ++i) req.add_input_ids(3 + 11 * i);
    req.mutable_sampling()->set_max_new_tokens(max_new);
    return StreamGenerate(*stub_, req, std::chrono::seconds(120));
  }

 private:
  ServerConfig config_;
  Metrics metrics_;
  std::vector<std::unique_ptr<TrainFaultInjector>> injectors_;
  std::unique_ptr<EngineRouter> router_;
  std::unique_ptr<WeightsPublisher> publisher_;
  std::unique_ptr<VlmGraphService> service_;
  std::unique_ptr<GrpcServer> grpc_;
  std::unique_ptr<v1::VlmGraph::Stub> stub_;
};

// Step s's batch: 4 examples of different lengths (so that the two halves' mean losses differ),
// the last one `long_last` tokens long when set (longer than every train bucket: it runs eagerly).
v1::TrainRequest Batch(int s, int64_t long_last = 0) {
  v1::TrainRequest m;
  v1::TrainBatch* b = m.mutable_batch();
  for (int r = 0; r < 4; ++r) {
    const int64_t len = (r == 3 && long_last > 0) ? long_last : 5 + 3 * r;
    v1::TrainExample* e = b->add_examples();
    for (int64_t i = 0; i < len; ++i) e->add_input_ids((s * 13 + r * 31 + i * 7) % 200);
    for (int64_t i = 1; i < len; ++i) e->add_target_ids(e->input_ids(i));
    e->add_target_ids(-100);
  }
  return m;
}

struct JobRun {
  grpc::Status status;
  std::vector<v1::TrainStepResult> steps;
  int published = 0;
  double seconds = 0;
  std::vector<double> step_seconds;  // each batch's write-to-result wall time at the client
};

// A Train job of `steps` batches (Batch(s), or `batch(s)` when given), then a publish request
// when `publish`.
JobRun RunJob(v1::VlmGraph::Stub& stub, int steps, bool publish,
              const std::function<v1::TrainRequest(int)>& batch = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  auto stream = stub.Train(&ctx);
  v1::TrainRequest config;
  v1::TrainConfig* c = config.mutable_config();
  c->set_language_learning_rate(1e-2);
  c->add_trainable_parts(v1::MODEL_PART_LANGUAGE);
  c->set_max_grad_norm(0.5);  // clipping takes the global gradient norm
  JobRun run;
  bool ok = stream->Write(config);
  for (int s = 0; ok && s < steps; ++s) {
    const auto sent = std::chrono::steady_clock::now();
    ok = stream->Write(batch ? batch(s) : Batch(s));
    v1::TrainResponse r;
    ok = ok && stream->Read(&r);
    if (ok && r.has_step()) run.steps.push_back(r.step());
    run.step_seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count());
  }
  if (ok && publish) {
    v1::TrainRequest p;
    p.mutable_publish();
    v1::TrainResponse r;
    ok = stream->Write(p) && stream->Read(&r);
    if (ok && r.has_published()) ++run.published;
  }
  stream->WritesDone();
  v1::TrainResponse rest;
  while (stream->Read(&rest)) {
  }
  run.status = stream->Finish();
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

double MaxAbsDiff(const std::map<std::string, at::Tensor>& a,
                  const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  for (const auto& [name, t] : a) {
    worst = std::max(worst, (t - b.at(name)).abs().max().item<double>());
  }
  return worst;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max<double>(worst, std::abs(a[i] - b[i]));
  return worst;
}

#define SKIP_WITHOUT_GLOO()                                                      \
  do {                                                                           \
    if (!DataParallelGroup::BackendAvailable("gloo")) GTEST_SKIP() << "no gloo"; \
  } while (0)

// Six float32 steps on 2 engines against the same job on 1 engine: each engine trains on half of
// every batch of 4 (2 examples, one micro-batch of bucket 2), the one engine on all 4 in two
// micro-batches of 2, accumulating: the same losses, gradient norms (clipped globally), loss
// tokens and, once published, weights on both engines within 1e-5. On `device` ("cpu": gloo;
// "cuda": two GPUs, NCCL, graphed steps).
void ExpectTwoEnginesTrainTheJobOfOneEngine(const std::string& device) {
  constexpr int kSteps = 6;
  JobRun one, two;
  std::map<std::string, at::Tensor> want;
  {
    TestServer server(1, 60, device);
    one = RunJob(server.stub(), kSteps, /*publish=*/true);
    ASSERT_TRUE(one.status.ok()) << one.status.error_message();
    want = server.Served(0);
  }
  TestServer server(2, 60, device);
  const std::map<std::string, at::Tensor> before = server.Served(1);
  two = RunJob(server.stub(), kSteps, /*publish=*/true);
  ASSERT_TRUE(two.status.ok()) << two.status.error_message();
  // Informational: each job's steps per second over the whole job (its start, the ranks' group
  // and the captures included), and in the steady state (the median of steps 3 .. kSteps, each
  // from the batch's write to its result at the client).
  auto steady = [](std::vector<double> v) {
    v.erase(v.begin(), v.begin() + std::min<size_t>(2, v.size()));
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : 1.0 / v[v.size() / 2];
  };
  std::printf(
      "[train rpc %s] %d steps: whole job 1 engine %.1f steps/s, 2 engines %.1f steps/s; steady "
      "state 1 engine %.1f steps/s, 2 engines %.1f steps/s\n",
      device.c_str(), kSteps, kSteps / one.seconds, kSteps / two.seconds, steady(one.step_seconds),
      steady(two.step_seconds));
  ASSERT_EQ(two.steps.size(), one.steps.size());
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(two.steps[s].loss(), one.steps[s].loss(), 1e-5) << "step " << s;
    EXPECT_NEAR(two.steps[s].grad_norm(), one.steps[s].grad_norm(),
                1e-5 * std::max(1.0, one.steps[s].grad_norm()))
        << "step " << s;
    EXPECT_EQ(two.steps[s].loss_tokens(), one.steps[s].loss_tokens()) << "step " << s;
    EXPECT_EQ(two.steps[s].step(), s + 1);
  }
  EXPECT_EQ(two.published, 1);
  // Both engines trained (one step each per batch) and both serve the job's weights.
  EXPECT_EQ(server.injector(0).train_steps.load(), kSteps);
  EXPECT_EQ(server.injector(1).train_steps.load(), kSteps);
  const auto served0 = server.Served(0), served1 = server.Served(1);
  EXPECT_GT(MaxAbsDiff(served1, before), 1e-3);  // the publish changed engine 1 too
  EXPECT_LE(MaxAbsDiff(served0, want), 1e-5);
  EXPECT_LE(MaxAbsDiff(served1, want), 1e-5);
}

// TrainConfig.publish_on_end: after the client's half-close the job publishes and says so, one
// TrainResponse{published} with the job's step count, before the stream closes OK; both engines
// then serve the job's weights.
TEST(ServerTrainDataParallel, PublishOnEndIsAnsweredBeforeTheStreamCloses) {
  SKIP_WITHOUT_GLOO();
  TestServer server(2, 60, "cpu");
  const std::map<std::string, at::Tensor> before = server.Served(0);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto stream = server.stub().Train(&ctx);
  v1::TrainRequest config;
  config.mutable_config()->set_language_learning_rate(1e-2);
  config.mutable_config()->add_trainable_parts(v1::MODEL_PART_LANGUAGE);
  config.mutable_config()->set_publish_on_end(true);
  ASSERT_TRUE(stream->Write(config));
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(stream->Write(Batch(s)));
  stream->WritesDone();
  std::vector<v1::TrainResponse> responses;
  for (v1::TrainResponse r; stream->Read(&r);) responses.push_back(r);
  const grpc::Status status = stream->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(responses.size(), 3u);
  EXPECT_TRUE(responses[0].has_step());
  EXPECT_TRUE(responses[1].has_step());
  ASSERT_TRUE(responses[2].has_published());
  EXPECT_EQ(responses[2].published().step(), 2);
  EXPECT_GT(MaxAbsDiff(server.Served(0), before), 1e-4);
  EXPECT_LE(MaxAbsDiff(server.Served(0), server.Served(1)), 1e-5);
}

TEST(ServerTrainDataParallel, TwoEnginesTrainTheJobOfOneEngineAndBothServeItsWeights) {
  SKIP_WITHOUT_GLOO();
  ExpectTwoEnginesTrainTheJobOfOneEngine("cpu");
}

// The same on two GPUs: NCCL ranks in one process, each capturing its graphs on its own GPU
// thread at the same time (Note [Capture mode] in engine/step_runner.h).
TEST(ServerTrainDataParallel, TwoGpuEnginesTrainTheJobOfOneGpuEngine_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  if (at::getNumGPUs() < 2) GTEST_SKIP() << "needs 2 GPUs";
  if (!DataParallelGroup::BackendAvailable("nccl")) GTEST_SKIP() << "no NCCL in this build";
  at::globalContext().setAllowTF32CuBLAS(false);
  ExpectTwoEnginesTrainTheJobOfOneEngine("cuda");
}

// A publish changes both engines (equal logits on each, unlike before it), a rollback restores
// both, and Generate keeps being served on both engines while the job trains.
TEST(ServerTrainDataParallel, PublishAndRollbackChangeEveryEngineAndServingGoesOn) {
  SKIP_WITHOUT_GLOO();
  TestServer server(2);
  const std::vector<float> before0 = server.Logits(0), before1 = server.Logits(1);
  ASSERT_EQ(MaxAbsDiff(before0, before1), 0);

  // Long generations on both engines, decoding between the pieces of the job's steps.
  for (size_t i = 0; i < 2; ++i) server.injector(i).step_delay_ms = 3;
  std::vector<std::future<std::pair<grpc::Status, int64_t>>> generations;
  for (int i = 0; i < 4; ++i) {
    generations.push_back(
        std::async(std::launch::async, [&server] { return server.Generate(48); }));
  }
  const JobRun job = RunJob(server.stub(), 4, /*publish=*/true);
  ASSERT_TRUE(job.status.ok()) << job.status.error_message();
  for (auto& g : generations) {
    const auto [status, tokens] = g.get();
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(tokens, 48);
  }
  for (size_t i = 0; i < 2; ++i) server.injector(i).step_delay_ms = 0;

  const std::vector<float> after0 = server.Logits(0), after1 = server.Logits(1);
  EXPECT_GT(MaxAbsDiff(after0, before0), 1e-3);
  EXPECT_LE(MaxAbsDiff(after0, after1), 1e-6);
  EXPECT_EQ(server.GenerateOn(0, 8), server.GenerateOn(1, 8));

  grpc::ClientContext ctx;
  v1::RollbackWeightsRequest req;
  v1::RollbackWeightsResponse resp;
  const grpc::Status rolled = server.stub().RollbackWeights(&ctx, req, &resp);
  ASSERT_TRUE(rolled.ok()) << rolled.error_message();
  EXPECT_EQ(MaxAbsDiff(server.Logits(0), before0), 0);
  EXPECT_EQ(MaxAbsDiff(server.Logits(1), before1), 0);
}

// Rank 1 fails in its second step, before the step's all-reduce, while rank 0 waits in it: the
// job ends on both ranks with rank 1's error (INTERNAL, naming the rank) well within the
// timeout, both engines keep serving, and the next job trains on both.
TEST(ServerTrainDataParallel, AFailingRankEndsTheJobOnEveryRankAndTheNextJobTrains) {
  SKIP_WITHOUT_GLOO();
  constexpr double kTimeout = 20;
  TestServer server(2, kTimeout);
  const JobRun failed = RunJob(server.stub(), 3, /*publish=*/false, [&server](int s) {
    if (s == 1) server.injector(1).fail_training = true;
    // Step 1's last example (rank 1's shard) is longer than every train bucket: rank 1 runs it
    // eagerly, and the injected fault fires there.
    return Batch(s, s == 1 ? 40 : 0);
  });
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL)
      << failed.status.error_message();
  EXPECT_NE(failed.status.error_message().find("training rank 1 of 2"), std::string::npos)
      << failed.status.error_message();
  EXPECT_NE(failed.status.error_message().find(kInjectedFault), std::string::npos)
      << failed.status.error_message();
  EXPECT_EQ(failed.steps.size(), 1u);
  EXPECT_LT(failed.seconds, kTimeout);

  // Both engines serve, through the router and each on its own.
  EXPECT_EQ(server.router().serving_engines(), 2);
  for (int i = 0; i < 2; ++i) {
    const auto [status, tokens] = server.Generate(6);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(tokens, 6);
  }
  EXPECT_EQ(server.GenerateOn(0, 6).size(), 6u);
  EXPECT_EQ(server.GenerateOn(1, 6).size(), 6u);

  // The next job creates its ranks afresh and trains on both engines.
  const int64_t before0 = server.injector(0).train_steps, before1 = server.injector(1).train_steps;
  const JobRun next = RunJob(server.stub(), 2, /*publish=*/true);
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.steps.size(), 2u);
  EXPECT_EQ(next.published, 1);
  EXPECT_EQ(server.injector(0).train_steps - before0, 2);
  EXPECT_EQ(server.injector(1).train_steps - before1, 2);
  EXPECT_LE(MaxAbsDiff(server.Logits(0), server.Logits(1)), 1e-6);
}

// A batch that leaves an engine no example is refused with INVALID_ARGUMENT; the job goes on
// being refused no further: the stream ends, and the next job trains.
TEST(ServerTrainDataParallel, ABatchSmallerThanTheEnginesIsRefused) {
  SKIP_WITHOUT_GLOO();
  TestServer server(2);
  const JobRun one_example = RunJob(server.stub(), 1, /*publish=*/false, [](int s) {
    v1::TrainRequest m = Batch(s);
    m.mutable_batch()->mutable_examples()->DeleteSubrange(1, 3);
    return m;
  });
  EXPECT_EQ(one_example.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << one_example.status.error_message();
  EXPECT_NE(one_example.status.error_message().find("trains on 2 engines"), std::string::npos)
      << one_example.status.error_message();
  EXPECT_TRUE(RunJob(server.stub(), 1, /*publish=*/false).status.ok());
}

}  // namespace
}  // namespace vlmgraph::server
