// Publishing into the served model on a real (tiny, CPU) engine: the `publish` scope, the
// publish gate's rules and held-out prompts, a 1e30 job's weights refused with the served weights
// unchanged, and rollback to the weights served before the last publish.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "server/core/auth.h"
#include "server/core/scheduler.h"
#include "server/core/status.h"
#include "server/train/graphed_trainer.h"
#include "server/train/publish_gate.h"
#include "server/train/weights_publisher.h"
#include "tests/synthetic_train_batch.h"

namespace vlmgraph::server {
namespace {

const std::string kTrainKey = "train-only-key-0123456789";
const std::string kPublishKey = "train-and-publish-key-0123456789";
const std::string kAllKey = "all-scopes-key-0123456789";

grpc::StatusCode CodeOf(const std::function<void()>& fn, std::string* message = nullptr) {
  try {
    fn();
  } catch (const ServerError& e) {
    if (message) *message = e.what();
    return e.code();
  }
  return grpc::StatusCode::OK;
}

TEST(ServerAuth, TrainScopeCannotPublish) {
  const ApiKeys keys = ApiKeys::Parse(
      "train " + kTrainKey + "\ntrain,publish " + kPublishKey + "\nall " + kAllKey + "\n", "keys");
  auto authorize = [&](const std::string& key, Scope scope) {
    return CodeOf([&] { keys.Authorize("Bearer " + key, scope, "Train publish"); });
  };
  EXPECT_EQ(authorize(kTrainKey, Scope::kTrain), grpc::StatusCode::OK);
  std::string message;
  EXPECT_EQ(CodeOf([&] { keys.Authorize("Bearer " + kTrainKey, Scope::kPublish, "Train publish"); },
                   &message),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(message.find("'publish' scope"), std::string::npos) << message;
  EXPECT_NE(message.find("Train publish"), std::string::npos) << message;
  EXPECT_EQ(authorize(kPublishKey, Scope::kPublish), grpc::StatusCode::OK);
  EXPECT_EQ(authorize(kPublishKey, Scope::kInference), grpc::StatusCode::PERMISSION_DENIED);
  for (Scope s : {Scope::kInference, Scope::kTrain, Scope::kPublish})
    EXPECT_EQ(authorize(kAllKey, s), grpc::StatusCode::OK) << ScopeName(s);
  EXPECT_STREQ(ScopeName(Scope::kPublish), "publish");
}

TEST(ServerAuth, ServerApiKeyHasEveryScopeAndUnknownScopesNamePublish) {
  ServerConfig config;
  config.server.api_key = kAllKey;
  const ApiKeys keys = ApiKeys::Load(config);
  for (Scope s : {Scope::kInference, Scope::kTrain, Scope::kPublish})
    EXPECT_NO_THROW(keys.Authorize("Bearer " + kAllKey, s, "x")) << ScopeName(s);
  try {
    ApiKeys::Parse("deploy " + kAllKey + "\n", "keys");
    ADD_FAILURE() << "an unknown scope was accepted";
  } catch (const ServerConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("inference, train, publish, all"), std::string::npos)
        << e.what();
  }
}

// --- the gate and the publisher on a tiny engine
// --------------------------------------------------

std::unique_ptr<Engine> TinyEngine() {
  at::manual_seed(0);
  EngineOptions o;
  o.buckets.batch_sizes = {1, 2};
  o.buckets.seq_lens = {16, 32};
  o.buckets.context_lens = {64, 128};
  o.buckets.tile_counts = {1, 2};
  o.buckets.train_batch_sizes = {2, 4};
  o.buckets.train_seq_lens = {16, 32};
  o.log_captures = false;
  return std::make_unique<Engine>(VisionLanguageModel(VlmConfig::Preset("nanovlm-tiny")), o);
}

ServerConfig GateConfig() {
  ServerConfig c;
  c.train.publish_gate = true;
  c.train.publish_gate_max_loss_increase = 1.0;
  c.train.publish_gate_max_abs_weight = 1000;
  return c;
}

std::vector<TrainExample> Batch(int64_t rows, int64_t len) {
  return vlmgraph::testing::SyntheticTrainBatch(rows, len);
}

// Loss and greedy tokens of the weights the engine serves now.
struct Served {
  double loss;
  std::vector<int64_t> tokens;
  bool operator==(const Served& o) const { return loss == o.loss && tokens == o.tokens; }
};
Served Probe(Engine& engine) {
  ForwardRequest f;
  f.input_ids = Batch(1, 12)[0].input_ids;
  f.target_ids = Batch(1, 12)[0].targets;
  GenerateRequest g;
  g.input_ids = f.input_ids;
  g.sampling.max_new_tokens = 6;
  return {engine.Forward(engine.Validate(f)).loss, engine.Generate({g})[0]};
}

TrainJobOptions LanguageJob(double lr) {
  TrainJobOptions o;
  o.trainer.learning_rates = {/*projector=*/0, /*vision=*/0, /*language=*/lr};
  return o;
}

TEST(PublishGate, BuiltInTokenPromptsScoreTheServedModel) {
  auto engine = TinyEngine();
  const PublishGate gate = PublishGate::FromConfig(GateConfig(), *engine, nullptr);
  EXPECT_EQ(gate.prompts(), 4);
  const HeldOutScore s = gate.Score(*engine);
  EXPECT_EQ(s.prompts, 4);
  EXPECT_EQ(s.loss_tokens, 4 * 15);
  EXPECT_TRUE(std::isfinite(s.loss));
  EXPECT_GT(s.loss, 0);
  EXPECT_TRUE(s.finite_logits);
  EXPECT_EQ(s.prompts_ending_at_once, 0);  // no stop tokens configured
  // Scoring changes nothing: the same weights score the same.
  EXPECT_DOUBLE_EQ(gate.Score(*engine).loss, s.loss);
}

TEST(PublishGate, JudgesEachRuleInOrder) {
  auto engine = TinyEngine();
  const PublishGate gate(*engine, {{1, 2, 3, 4, 5}, {6, 7, 8, 9}}, /*stop_token_ids=*/{3},
                         PublishGateOptions{});
  HeldOutScore served;
  served.loss = 6.0;
  served.loss_tokens = 60;
  served.prompts = 4;
  HeldOutScore ok = served;
  ok.loss = 6.9;  // +0.9 <= 1.0
  EXPECT_TRUE(gate.Judge(served, ok, 12.0).accepted());
  HeldOutScore worse = served;
  worse.loss = 7.2;
  GateVerdict v = gate.Judge(served, worse, 12.0);
  EXPECT_EQ(v.reason, "loss_increase");
  EXPECT_NE(v.message.find("6 nats/token served, 7.2 with the job's weights"), std::string::npos)
      << v.message;
  EXPECT_EQ(gate.Judge(served, ok, 5.6e26).reason, "max_abs_weight");
  HeldOutScore nan = served;
  nan.loss = std::nan("");
  EXPECT_EQ(gate.Judge(served, nan, 12.0).reason, "non_finite");
  HeldOutScore inf_logits = ok;
  inf_logits.finite_logits = false;
  EXPECT_EQ(gate.Judge(served, inf_logits, 12.0).reason, "non_finite");
  HeldOutScore silent = ok;
  silent.prompts_ending_at_once = 4;  // every answer would be empty
  EXPECT_EQ(gate.Judge(served, silent, 12.0).reason, "collapse");
  HeldOutScore served_silent = served;
  served_silent.prompts_ending_at_once = 4;  // the served model already ends at once: no collapse
  EXPECT_TRUE(gate.Judge(served_silent, silent, 12.0).accepted());
  // A served loss that is not finite bounds nothing.
  HeldOutScore served_nan = served;
  served_nan.loss = std::nan("");
  EXPECT_TRUE(gate.Judge(served_nan, worse, 12.0).accepted());
}

TEST(PublishGate, BuiltInTokenSequencesDoNotBoundTheLoss) {
  auto engine = TinyEngine();
  const PublishGate built_in = PublishGate::FromConfig(GateConfig(), *engine, nullptr);
  EXPECT_FALSE(built_in.bounds_loss());
  HeldOutScore served, candidate;
  served.loss = 7.0;
  candidate.loss = 13.3;  // the digits example's 300 steps on nanovlm-tiny
  served.prompts = candidate.prompts = 4;
  EXPECT_TRUE(built_in.Judge(served, candidate, 1.4).accepted());
  const PublishGate chosen(*engine, {{1, 2, 3, 4}}, {}, PublishGateOptions{});
  EXPECT_TRUE(chosen.bounds_loss());
  EXPECT_EQ(chosen.Judge(served, candidate, 1.4).reason, "loss_increase");
}

TEST(PublishGate, PromptsFileIsReadAndCheckedAtStartUp) {
  auto engine = TinyEngine();
  const std::string path =
      (std::filesystem::temp_directory_path() / "vlmgraph_gate_prompts.txt").string();
  ServerConfig c = GateConfig();
  c.train.publish_gate_prompts_file = path;
  {
    std::ofstream out(path);
    out << "# held-out token ids\n1 2 3 4 5 6\n\n7, 8, 9, 10\n";
  }
  EXPECT_EQ(PublishGate::FromConfig(c, *engine, nullptr).prompts(), 2);
  {
    std::ofstream out(path);
    out << "1 2 3\nhello world\n";
  }
  try {
    PublishGate::FromConfig(c, *engine, nullptr);
    ADD_FAILURE() << "a line of words was taken as token ids";
  } catch (const ServerConfigError& e) {
    EXPECT_EQ(e.key_path(), "train.publish_gate_prompts_file line 2");
  }
  {
    std::ofstream out(path);
    out << "1 2 99999\n";  // outside the vocabulary
  }
  EXPECT_THROW(PublishGate::FromConfig(c, *engine, nullptr), ServerConfigError);
  ::unlink(path.c_str());
  c.train.publish_gate_prompts_file = path;  // now missing
  EXPECT_THROW(PublishGate::FromConfig(c, *engine, nullptr), ServerConfigError);
}

// The reported attack: a language learning rate of 1e30 leaves every weight finite after the
// first step, which the finiteness check alone published. The gate refuses it for its largest
// |weight| (on this random model its held-out loss is no worse than the served one's) and
// serving is bit for bit what it was.
TEST(WeightsPublisher, TheWeightsOfA1e30JobAreRefusedAndServingIsUnchanged) {
  auto engine = TinyEngine();
  const Served before = Probe(*engine);
  auto job = MakeTrainBackend(*engine, LanguageJob(1e30), nullptr);
  const TrainStepResult step = job->Step(Batch(3, 12));
  ASSERT_FALSE(step.skipped);
  ASSERT_TRUE(std::isfinite(step.grad_norm));
  double max_abs = 0;
  for (const auto& [name, w] : job->weights()) {
    ASSERT_TRUE(at::isfinite(w).all().item<bool>()) << name;
    max_abs = std::max(max_abs, w.abs().max().item<double>());
  }
  EXPECT_GT(max_abs, 1e20);  // finite, but no model

  const PublishGate gate = PublishGate::FromConfig(GateConfig(), *engine, nullptr);
  WeightsPublisher publisher(nullptr, &gate, nullptr);
  std::string message;
  EXPECT_EQ(CodeOf([&] { publisher.Publish(*engine, job->weights()); }, &message),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(message.find("publish refused by the publish gate"), std::string::npos) << message;
  EXPECT_NE(message.find("above train.publish_gate_max_abs_weight 1000"), std::string::npos)
      << message;
  EXPECT_NE(message.find("nats/token served"), std::string::npos) << message;  // the losses
  EXPECT_TRUE(Probe(*engine) == before);
  EXPECT_FALSE(publisher.can_rollback());
}

TEST(WeightsPublisher, AHealthyPublishIsServedAndRollbackRestoresThePreviousWeights) {
  auto engine = TinyEngine();
  const PublishGate gate = PublishGate::FromConfig(GateConfig(), *engine, nullptr);
  WeightsPublisher publisher(nullptr, &gate, nullptr);
  const Served before = Probe(*engine);
  std::string message;
  EXPECT_EQ(CodeOf([&] { publisher.RollbackOnGpuThread(*engine); }, &message),
            grpc::StatusCode::FAILED_PRECONDITION);  // nothing published yet
  EXPECT_NE(message.find("nothing to roll back"), std::string::npos) << message;

  auto job = MakeTrainBackend(*engine, LanguageJob(3e-3), nullptr);
  for (int i = 0; i < 8; ++i) job->Step(Batch(3, 12));
  const PublishReport r = publisher.Publish(*engine, job->weights());
  EXPECT_TRUE(r.gated);
  EXPECT_EQ(r.candidate.prompts, 4);
  EXPECT_LE(r.candidate.loss, r.served.loss + 1.0);
  EXPECT_GT(r.tensors, 0);
  const Served trained = Probe(*engine);
  EXPECT_LT(trained.loss, before.loss - 0.5);  // the probe is the batch's first example
  EXPECT_TRUE(publisher.can_rollback());

  // A later publish the gate refuses keeps the rollback copy of the accepted one.
  auto bad = MakeTrainBackend(*engine, LanguageJob(1e30), nullptr);
  bad->Step(Batch(3, 12));
  EXPECT_EQ(CodeOf([&] { publisher.Publish(*engine, bad->weights()); }),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(Probe(*engine) == trained);

  const RollbackReport back = publisher.RollbackOnGpuThread(*engine);
  EXPECT_EQ(back.tensors, r.tensors);
  EXPECT_GT(back.bytes, 0);
  EXPECT_TRUE(Probe(*engine) == before);  // bit for bit
  EXPECT_FALSE(publisher.can_rollback());
  EXPECT_EQ(CodeOf([&] { publisher.RollbackOnGpuThread(*engine); }),
            grpc::StatusCode::FAILED_PRECONDITION);  // one level
}

TEST(WeightsPublisher, NonFiniteWeightsAreRefusedWithTheGateOff) {
  auto engine = TinyEngine();
  ServerConfig c = GateConfig();
  c.train.publish_gate = false;
  const PublishGate gate = PublishGate::FromConfig(c, *engine, nullptr);
  EXPECT_EQ(gate.prompts(), 0);
  WeightsPublisher publisher(nullptr, &gate, nullptr);
  const Served before = Probe(*engine);
  auto job = MakeTrainBackend(*engine, LanguageJob(1e-3), nullptr);
  job->Step(Batch(2, 10));
  NamedWeights poisoned;
  for (const auto& [name, w] : job->weights()) poisoned.emplace_back(name, w.clone());
  poisoned.front().second.view(-1)[0] = std::nanf("");
  std::string message;
  EXPECT_EQ(CodeOf([&] { publisher.Publish(*engine, poisoned); }, &message),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(message.find("NaN or infinite"), std::string::npos) << message;
  EXPECT_TRUE(Probe(*engine) == before);
  // With the gate off, finite weights are published unscored.
  const PublishReport r = publisher.Publish(*engine, job->weights());
  EXPECT_FALSE(r.gated);
  EXPECT_FALSE(Probe(*engine) == before);
}

// Rollback() is the thread-safe entry point (RollbackWeights RPC, HTTP admin endpoint): it runs on
// the scheduler's GPU thread, serialised with generation.
TEST(WeightsPublisher, RollbackFromAnotherThreadRunsOnTheGpuThread) {
  Scheduler scheduler(nullptr, SchedulerOptions{1000, 16});
  scheduler.Start([] { return TinyEngine(); });
  std::unique_ptr<PublishGate> gate;
  Served before{}, trained{};
  scheduler.RunOnGpuThread("test", [&](Engine& e) {
    gate = std::make_unique<PublishGate>(PublishGate::FromConfig(GateConfig(), e, nullptr));
  });
  WeightsPublisher publisher(&scheduler, gate.get(), nullptr);
  EXPECT_EQ(CodeOf([&] { publisher.Rollback(); }), grpc::StatusCode::FAILED_PRECONDITION);
  scheduler.RunOnGpuThread("test", [&](Engine& e) {
    before = Probe(e);
    auto job = MakeTrainBackend(e, LanguageJob(3e-3), nullptr);
    for (int i = 0; i < 4; ++i) job->Step(Batch(3, 12));
    publisher.Publish(e, job->weights());
    trained = Probe(e);
  });
  EXPECT_FALSE(trained == before);
  const RollbackReport r = publisher.Rollback();
  EXPECT_GT(r.tensors, 0);
  EXPECT_GE(r.seconds, 0);
  Served after{};
  scheduler.RunOnGpuThread("test", [&](Engine& e) { after = Probe(e); });
  EXPECT_TRUE(after == before);
  scheduler.Stop();
  EXPECT_EQ(CodeOf([&] { publisher.Rollback(); }), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace vlmgraph::server
