// The scheduler's GPU thread on a real (tiny, CPU) engine: streamed tokens equal Engine::Generate,
// batching groups requests, continuous batching lets short requests pass long ones, a full queue
// refuses, cancellation frees the slot, shutdown fails leftovers, work in pieces (a Train step's
// micro-batches) takes turns with decode steps. And the eager trainer.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "model/checkpoint.h"
#include "server/core/scheduler.h"
#include "server/core/status.h"
#include "server/train/graphed_trainer.h"
#include "server/train/train_slot.h"
#include "server/train/weights_publisher.h"
#include "tests/synthetic_train_batch.h"

namespace vlmgraph::server {
namespace {

using std::chrono::milliseconds;

// Records the engine's batch sizes.
class BatchRecorder : public EngineObserver {
 public:
  void OnBatch(Region region, int64_t n) override {
    std::lock_guard<std::mutex> lock(mu);
    (region == Region::kPrefill ? prefill : decode).push_back(n);
  }
  std::vector<int64_t> Prefill() {
    std::lock_guard<std::mutex> lock(mu);
    return prefill;
  }
  std::mutex mu;
  std::vector<int64_t> prefill, decode;
};

std::unique_ptr<Engine> TinyEngine(std::vector<int64_t> batch_sizes = {1, 2, 4},
                                   EngineObserver* observer = nullptr,
                                   OversizePolicy oversize = OversizePolicy::kEager,
                                   int64_t max_prefill_batch = BucketSpec{}.max_prefill_batch,
                                   int64_t kv_cache_pages = 0) {
  at::manual_seed(0);
  EngineOptions o;
  o.kv_cache_pages = kv_cache_pages;
  o.buckets.oversize = oversize;
  o.buckets.batch_sizes = std::move(batch_sizes);
  o.buckets.max_prefill_batch = max_prefill_batch;
  o.buckets.seq_lens = {16, 32};
  o.buckets.context_lens = {64, 128};
  o.buckets.tile_counts = {1, 2};
  o.buckets.train_batch_sizes = {2, 4};
  o.buckets.train_seq_lens = {16, 32};
  o.log_captures = false;
  auto e = std::make_unique<Engine>(VisionLanguageModel(VlmConfig::Preset("nanovlm-tiny")), o);
  e->SetObserver(observer);
  return e;
}

GenerateRequest Prompt(int64_t first, int64_t len, int64_t max_new) {
  GenerateRequest r;
  for (int64_t i = 0; i < len; ++i) r.input_ids.push_back((first + 7 * i) % 900);
  r.sampling.max_new_tokens = max_new;
  return r;
}

// Reads a stream to its end (bounded): (tokens, error or null).
std::pair<std::vector<int64_t>, std::exception_ptr> Drain(GenerationStream& s) {
  std::vector<int64_t> tokens;
  for (int i = 0; i < 600; ++i) {
    GenerationStream::Update u = s.Wait(milliseconds(100));
    tokens.insert(tokens.end(), u.tokens.begin(), u.tokens.end());
    if (u.done) return {tokens, u.error};
  }
  ADD_FAILURE() << "stream did not finish in 60 s";
  return {tokens, nullptr};
}

grpc::StatusCode CodeOf(std::exception_ptr e) { return StatusFromException(e).error_code(); }

// The status the RPC guard makes of what `f` throws (OK when it throws nothing).
grpc::Status StatusOf(const std::function<void()>& f) {
  try {
    f();
  } catch (...) {
    return StatusFromException(std::current_exception());
  }
  return grpc::Status::OK;
}

TEST(ServerScheduler, StreamsWhatEngineGenerateReturns) {
  std::vector<GenerateRequest> reqs = {Prompt(3, 10, 12), Prompt(50, 20, 5), Prompt(9, 7, 9)};
  const std::vector<std::vector<int64_t>> expected = TinyEngine()->Generate(reqs);
  Scheduler scheduler(nullptr, SchedulerOptions{1000, 16});
  scheduler.Start([] { return TinyEngine(); });
  std::vector<std::shared_ptr<GenerationStream>> streams;
  for (auto& r : reqs)
    streams.push_back(scheduler.SubmitGenerate(scheduler.engine().Validate(r), Clock::now()));
  for (size_t i = 0; i < streams.size(); ++i) {
    auto [tokens, error] = Drain(*streams[i]);
    EXPECT_FALSE(error);
    EXPECT_EQ(tokens, expected[i]) << "request " << i;
  }
  scheduler.Stop();
}

// Note [KV pages per sequence]: with 8 KV pages of 16 tokens (one sequence of the longest context,
// 128 tokens) and 4 slots, requests of 4 pages each run two at a time; the others wait in the
// queue, not refused, and each gets what Engine::Generate gives it. Every page comes back.
TEST(ServerScheduler, RequestsWaitForKvPagesAndGetTheirTokens) {
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 5; ++i) reqs.push_back(Prompt(3 + 11 * i, 20 + i, 40));  // 4 pages
  const std::vector<std::vector<int64_t>> expected = TinyEngine()->Generate(reqs);
  Scheduler scheduler(nullptr, SchedulerOptions{1000, 16});
  scheduler.Start([] { return TinyEngine({1, 2, 4}, nullptr, OversizePolicy::kEager, 4, 8); });
  for (const auto& r : reqs) {
    EXPECT_EQ(scheduler.engine().KvPagesFor(scheduler.engine().Validate(r)), 4);
  }
  std::vector<std::shared_ptr<GenerationStream>> streams;
  for (auto& r : reqs)
    streams.push_back(scheduler.SubmitGenerate(scheduler.engine().Validate(r), Clock::now()));
  for (size_t i = 0; i < streams.size(); ++i) {
    auto [tokens, error] = Drain(*streams[i]);
    EXPECT_FALSE(error) << "request " << i;
    EXPECT_EQ(tokens, expected[i]) << "request " << i;
  }
  int64_t free_pages = -1;
  scheduler.RunOnGpuThread("test", [&](Engine& e) { free_pages = e.FreeKvPages(); });
  EXPECT_EQ(free_pages, 8);
  scheduler.Stop();
}

TEST(ServerScheduler, GroupsWaitingRequestsIntoOnePrefill) {
  BatchRecorder recorder;
  // A long batching delay: four requests for four free slots are admitted together at once.
  Scheduler scheduler(nullptr, SchedulerOptions{5000000, 16});
  scheduler.Start([&] { return TinyEngine({1, 2, 4}, &recorder); });
  std::vector<std::shared_ptr<GenerationStream>> streams;
  for (int i = 0; i < 4; ++i)
    streams.push_back(
        scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(i, 8, 3)), Clock::now()));
  for (auto& s : streams) EXPECT_FALSE(Drain(*s).second);
  EXPECT_EQ(recorder.Prefill(), (std::vector<int64_t>{4}));
  scheduler.Stop();
}

TEST(ServerScheduler, AFullPrefillBatchIsAdmittedWithoutWaitingForTheDelay) {
  BatchRecorder recorder;
  // Eight slots, prefill batches of at most four, and a batching delay of an hour: four waiting
  // requests fill one prefill, so they are admitted at once; three wait for a fourth.
  Scheduler scheduler(nullptr, SchedulerOptions{3600LL * 1000 * 1000, 16});
  scheduler.Start([&] { return TinyEngine({1, 2, 4, 8}, &recorder, OversizePolicy::kEager, 4); });
  const Scheduler::LoadView idle = scheduler.View();
  EXPECT_EQ(idle.slots, 8);
  EXPECT_EQ(idle.prefill_batch, 4);
  auto submit = [&](int64_t i) {
    return scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(i, 8, 3)), Clock::now());
  };
  std::vector<std::shared_ptr<GenerationStream>> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(submit(i));
  for (auto& s : streams) EXPECT_FALSE(Drain(*s).second);
  EXPECT_EQ(recorder.Prefill(), (std::vector<int64_t>{4}));
  streams.clear();
  for (int i = 0; i < 3; ++i) streams.push_back(submit(10 + i));
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_EQ(scheduler.View().waiting, 3);
  EXPECT_EQ(recorder.Prefill(), (std::vector<int64_t>{4}));
  streams.push_back(submit(13));
  for (auto& s : streams) EXPECT_FALSE(Drain(*s).second);
  EXPECT_EQ(recorder.Prefill(), (std::vector<int64_t>{4, 4}));
  scheduler.Stop();
}

TEST(ServerScheduler, ShortRequestsPassLongOnes) {
  // Two slots: a long generation holds one; short requests take turns on the other.
  Scheduler scheduler(nullptr, SchedulerOptions{0, 16});
  scheduler.Start([] { return TinyEngine({1, 2}); });
  auto long_stream =
      scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(1, 8, 100)), Clock::now());
  std::vector<std::shared_ptr<GenerationStream>> shorts;
  for (int i = 0; i < 3; ++i)
    shorts.push_back(
        scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(10 + i, 8, 2)), Clock::now()));
  for (auto& s : shorts) {
    auto [tokens, error] = Drain(*s);
    EXPECT_FALSE(error);
    EXPECT_EQ(tokens.size(), 2u);
  }
  // The long one is still running when every short one has finished.
  GenerationStream::Update u = long_stream->Wait(milliseconds(0));
  EXPECT_FALSE(u.done);
  EXPECT_EQ(Drain(*long_stream).first.size() + u.tokens.size(), 100u);
  scheduler.Stop();
}

TEST(ServerScheduler, FullQueueRefusesAndCancelFreesTheSlot) {
  Scheduler scheduler(nullptr, SchedulerOptions{5000000, 2});
  scheduler.Start([] { return TinyEngine({1, 2, 4}); });
  // Held back by the long batching delay (2 waiting < 4 free slots), so the queue stays full.
  auto a = scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(1, 8, 4)), Clock::now());
  auto b = scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(2, 8, 4)), Clock::now());
  try {
    scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(3, 8, 4)), Clock::now());
    FAIL() << "queue limit not enforced";
  } catch (const ServerError& e) {
    EXPECT_EQ(e.code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  EXPECT_EQ(scheduler.QueueDepth(), 2);
  scheduler.Cancel(a);
  scheduler.Cancel(b);
  EXPECT_EQ(CodeOf(Drain(*a).second), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(CodeOf(Drain(*b).second), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(scheduler.QueueDepth(), 0);
  scheduler.Stop();
}

TEST(ServerScheduler, CancellingARunningSequenceFreesItsSlot) {
  Scheduler scheduler(nullptr, SchedulerOptions{0, 16});
  scheduler.Start([] { return TinyEngine({1, 2}); });
  auto s = scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(1, 8, 110)), Clock::now());
  GenerationStream::Update first = s->Wait(milliseconds(10000));
  ASSERT_FALSE(first.tokens.empty());
  scheduler.Cancel(s);
  auto [rest, error] = Drain(*s);
  EXPECT_EQ(CodeOf(error), grpc::StatusCode::CANCELLED);
  EXPECT_LT(first.tokens.size() + rest.size(), 110u);
  int64_t free_slots = -1;
  scheduler.RunOnGpuThread("test", [&](Engine& e) { free_slots = e.FreeSlots(); });
  EXPECT_EQ(free_slots, 2);
  scheduler.Stop();
}

TEST(ServerScheduler, WorkItemsRunOnTheGpuThreadAndRethrow) {
  Scheduler scheduler(nullptr, SchedulerOptions{0, 16});
  scheduler.Start([] { return TinyEngine(); });
  ForwardRequest f;
  f.input_ids = {1, 2, 3, 4};
  f.target_ids = {2, 3, 4, -100};
  ForwardResult result;
  scheduler.RunOnGpuThread("Forward", [&](Engine& e) { result = e.Forward(e.Validate(f)); });
  EXPECT_EQ(result.loss_tokens, 3);
  EXPECT_GT(result.loss, 0);
  EXPECT_THROW(
      scheduler.RunOnGpuThread("Forward", [](Engine&) { throw std::invalid_argument("x"); }),
      std::invalid_argument);
  scheduler.Stop();
  EXPECT_THROW(scheduler.RunOnGpuThread("Forward", [](Engine&) {}), ServerError);
}

TEST(ServerScheduler, StopFailsQueuedAndRunningWork) {
  Scheduler scheduler(nullptr, SchedulerOptions{5000000, 16});
  scheduler.Start([] { return TinyEngine(); });
  auto queued =
      scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(1, 8, 4)), Clock::now());
  ValidatedRequest late = scheduler.engine().Validate(Prompt(1, 8, 4));
  scheduler.Stop();
  EXPECT_EQ(CodeOf(Drain(*queued).second), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THROW(scheduler.SubmitGenerate(std::move(late), Clock::now()), ServerError);
}

TEST(ServerScheduler, DeviceFaultFailsEverythingAndStopsServing) {
  // A work item fails and the (injected) device check reports a dead device: the queued request
  // fails with UNAVAILABLE naming the error, new work is refused, the callback runs once.
  std::atomic<bool> dead{false};
  std::atomic<int> callbacks{0};
  std::string reported;
  SchedulerOptions options{5000000, 16};  // requests wait for the delay: still queued
  options.device_fault = [&](Engine&) { return dead ? std::string("cudaErrorAssert: test") : ""; };
  options.on_device_fault = [&](const std::string& error) {
    reported = error;
    callbacks++;
  };
  Scheduler scheduler(nullptr, options);
  scheduler.Start([] { return TinyEngine(); });
  auto queued =
      scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(1, 8, 4)), Clock::now());
  ValidatedRequest later = scheduler.engine().Validate(Prompt(2, 8, 4));
  // A failure with a usable device changes nothing.
  EXPECT_THROW(
      scheduler.RunOnGpuThread("Forward", [](Engine&) { throw std::runtime_error("bad input"); }),
      std::runtime_error);
  EXPECT_EQ(scheduler.device_fault(), "");
  dead = true;
  EXPECT_THROW(scheduler.RunOnGpuThread(
                   "Forward", [](Engine&) { throw std::runtime_error("device-side assert"); }),
               std::runtime_error);
  auto [tokens, error] = Drain(*queued);
  EXPECT_TRUE(tokens.empty());
  EXPECT_EQ(CodeOf(error), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(StatusFromException(error).error_message().find("GPU failed (cudaErrorAssert: test)"),
            std::string::npos);
  EXPECT_EQ(scheduler.device_fault(), "cudaErrorAssert: test");
  EXPECT_EQ(reported, "cudaErrorAssert: test");
  EXPECT_EQ(callbacks.load(), 1);
  try {
    scheduler.SubmitGenerate(std::move(later), Clock::now());
    ADD_FAILURE() << "accepted after a device fault";
  } catch (const ServerError& e) {
    EXPECT_EQ(e.code(), grpc::StatusCode::UNAVAILABLE);
  }
  EXPECT_THROW(scheduler.RunOnGpuThread("Forward", [](Engine&) {}), ServerError);
  scheduler.Stop();
}

TEST(ServerScheduler, EngineStartupErrorsReachStart) {
  Scheduler scheduler(nullptr, SchedulerOptions{});
  EXPECT_THROW(
      scheduler.Start([]() -> std::unique_ptr<Engine> { throw std::runtime_error("no model"); }),
      std::runtime_error);
}

// --- eager trainer -------------------------------------------------------------------------------

TEST(TrainSlot, OneJobAtATimeAndAnEndingJobMakesNewOnesWait) {
  TrainSlot slot;
  slot.Acquire(nullptr);
  try {
    slot.Acquire(nullptr);
    ADD_FAILURE() << "two jobs at once";
  } catch (const ServerError& e) {
    EXPECT_EQ(e.code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // The job is ending (its client was told): a new job waits for it instead of being refused.
  slot.MarkEnding();
  std::atomic<bool> acquired{false};
  std::thread next([&] {
    slot.Acquire([] { return false; });
    acquired = true;
  });
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_FALSE(acquired.load());  // still waiting: the ending job holds the slot
  slot.Release();
  next.join();
  EXPECT_TRUE(acquired.load());
  // A waiting call that is cancelled gives up with CANCELLED.
  slot.MarkEnding();
  try {
    slot.Acquire([] { return true; });
    ADD_FAILURE() << "a cancelled call took the slot";
  } catch (const ServerError& e) {
    EXPECT_EQ(e.code(), grpc::StatusCode::CANCELLED);
  }
  slot.Release();
  slot.Acquire(nullptr);  // free again
  slot.Release();
}

std::vector<TrainExample> Batch(int64_t rows, int64_t len) {
  return vlmgraph::testing::SyntheticTrainBatch(rows, len);
}

TEST(ServerTrainer, LossGoesDownAndGradientsAreReleased) {
  auto engine = TinyEngine();
  TrainJobOptions o;
  o.trainer.learning_rates = {/*projector=*/0, /*vision=*/0, /*language=*/3e-3};
  std::vector<double> losses;
  {
    auto job = MakeTrainBackend(*engine, o, nullptr);
    for (int i = 0; i < 8; ++i) losses.push_back(job->Step(Batch(3, 12)).loss);
    EXPECT_EQ(job->steps(), 8);
  }
  EXPECT_LT(losses.back(), losses.front() - 0.5);
  for (auto& p : engine->model()->parameters()) EXPECT_FALSE(p.requires_grad());
  // Generation still works after training, with the trained weights.
  EXPECT_EQ(engine->Generate({Prompt(1, 8, 3)})[0].size(), 3u);
}

TEST(ServerTrainer, PaddingToABucketDoesNotChangeTheLoss) {
  TrainJobOptions padded, exact;
  exact.trainer.exact_shapes = true;
  auto e1 = TinyEngine();
  auto e2 = TinyEngine();
  TrainStepResult a = MakeTrainBackend(*e1, padded, nullptr)->Step(Batch(3, 12));
  TrainStepResult b = MakeTrainBackend(*e2, exact, nullptr)->Step(Batch(3, 12));
  EXPECT_EQ(a.buckets.front().Label(), "b4xs16");
  EXPECT_EQ(b.buckets.front().Label(), "b3xs12");
  EXPECT_EQ(a.target_tokens, b.target_tokens);
  EXPECT_NEAR(a.loss, b.loss, 1e-4);
  EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-3);
}

TEST(ServerTrainer, SavesALoadableCheckpointAndRefusesNothingToTrain) {
  auto engine = TinyEngine();
  TrainJobOptions o;
  auto job = MakeTrainBackend(*engine, o, nullptr);
  job->Step(Batch(2, 10));
  WeightsPublisher(nullptr, nullptr, nullptr).Publish(*engine, job->weights());  // served from here
  const auto dir = std::filesystem::temp_directory_path() / "vlmgraph_trainer_test_ckpt";
  job->Save(dir.string());
  VisionLanguageModel loaded = LoadModel(dir.string());
  EXPECT_TRUE(at::allclose(loaded->decoder->token_embedding->weight,
                           engine->model()->decoder->token_embedding->weight));
  // Not std::filesystem::remove_all: the pip LibTorch exports an incompatible copy of it.
  for (const char* f : {"config.json", "model.safetensors"}) ::unlink((dir / f).c_str());
  ::rmdir(dir.c_str());
  job.reset();
  TrainJobOptions none;
  none.trainer.learning_rates = LearningRates::All(0);
  EXPECT_THROW(MakeTrainBackend(*engine, none, nullptr), ServerError);
}

TEST(ServerTrainer, ServingModelChangesOnlyWhenTheJobPublishes) {
  auto engine = TinyEngine();
  ForwardRequest probe;
  probe.input_ids = Batch(1, 12)[0].input_ids;
  probe.target_ids = Batch(1, 12)[0].targets;
  const double before = engine->Forward(engine->Validate(probe)).loss;
  TrainJobOptions o;
  o.trainer.learning_rates = {/*projector=*/0, /*vision=*/0, /*language=*/3e-3};
  std::vector<double> losses;
  auto job = MakeTrainBackend(*engine, o, nullptr);
  for (int i = 0; i < 8; ++i) {
    TrainStepResult s = job->Step(Batch(3, 12));
    EXPECT_EQ(s.buckets.front().Label(), "b4xs16");
    EXPECT_EQ(s.step, i + 1);
    EXPECT_FALSE(s.skipped);
    losses.push_back(s.loss);
  }
  EXPECT_LT(losses.back(), losses.front() - 0.5);
  // The job trained its own copy: the engine still serves the weights it started with.
  EXPECT_DOUBLE_EQ(engine->Forward(engine->Validate(probe)).loss, before);
  WeightsPublisher(nullptr, nullptr, nullptr).Publish(*engine, job->weights());
  // Now it serves the trained weights (the probe is the batch's first example).
  EXPECT_LT(engine->Forward(engine->Validate(probe)).loss, before - 0.5);
}

TEST(ServerTrainer, NonFiniteStepsAreSkippedAndNonFiniteWeightsNeverPublished) {
  auto engine = TinyEngine();
  ForwardRequest probe;
  probe.input_ids = Batch(1, 12)[0].input_ids;
  probe.target_ids = Batch(1, 12)[0].targets;
  const double before = engine->Forward(engine->Validate(probe)).loss;
  // A learning rate of 1e30 (a reported attack): the first update is finite but enormous, later
  // steps see non-finite gradients and are skipped; serving never sees any of it.
  TrainJobOptions o;
  o.trainer.learning_rates = {/*projector=*/0, /*vision=*/0, /*language=*/1e30};
  {
    auto job = MakeTrainBackend(*engine, o, nullptr);
    int skipped = 0;
    for (int i = 0; i < 4; ++i) skipped += job->Step(Batch(3, 12)).skipped;
    EXPECT_GE(skipped, 2);
    EXPECT_DOUBLE_EQ(engine->Forward(engine->Validate(probe)).loss, before);
  }
  // With weight decay 1e30 too, the decay term overflows and the weights become NaN / inf: they
  // are neither published nor saved.
  o.trainer.weight_decay = 1e30;
  auto job = MakeTrainBackend(*engine, o, nullptr);
  for (int i = 0; i < 2; ++i) job->Step(Batch(3, 12));
  try {
    WeightsPublisher(nullptr, nullptr, nullptr).Publish(*engine, job->weights());
    ADD_FAILURE() << "published non-finite weights";
  } catch (const ServerError& e) {
    EXPECT_EQ(e.code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(std::string(e.what()).find("NaN or infinite"), std::string::npos) << e.what();
  }
  const auto dir = std::filesystem::temp_directory_path() / "vlmgraph_trainer_test_nan_ckpt";
  for (const char* f : {"config.json", "model.safetensors", "optimizer.safetensors"})
    ::unlink((dir / f).c_str());
  EXPECT_THROW(job->Save(dir.string()), ServerError);
  EXPECT_FALSE(std::filesystem::exists(dir / "model.safetensors"));
  // Serving is untouched.
  const double after = engine->Forward(engine->Validate(probe)).loss;
  EXPECT_TRUE(std::isfinite(after));
  EXPECT_DOUBLE_EQ(after, before);
}

// Note [Interleaving bound]: a Train step of 32 examples (train batch buckets up to 4) runs as 8
// micro-batches, one per pass of the GPU thread, and a running Generate takes a decode step
// between every two of them instead of waiting for the whole step.
TEST(ServerScheduler, GenerateDecodesBetweenTheMicroBatchesOfATrainStep) {
  // What the GPU thread did, in order: 'd' a decode step, 'm' a train micro-batch.
  struct Events : EngineObserver {
    void OnBatch(Region region, int64_t) override {
      if (region == Region::kDecode) Add('d');
    }
    void Add(char c) {
      std::lock_guard<std::mutex> lock(mu);
      log.push_back(c);
    }
    std::string Log() {
      std::lock_guard<std::mutex> lock(mu);
      return log;
    }
    std::mutex mu;
    std::string log;
  } events;
  Scheduler scheduler(nullptr, SchedulerOptions{0, 16});
  scheduler.Start([&] { return TinyEngine({1, 2, 4}, &events); });
  TrainJobOptions o;
  o.trainer.learning_rates.vision = o.trainer.learning_rates.projector = 0;
  std::unique_ptr<TrainBackend> job;
  scheduler.RunOnGpuThread("Train", [&](Engine& e) { job = MakeTrainBackend(e, o, nullptr); });
  // A gate holds the GPU thread while the Generate request and the Train step are queued, so
  // both start in the same pass of its loop, whatever the test threads' timing.
  std::atomic<bool> gate_running{false}, open_gate{false};
  std::thread gate([&] {
    scheduler.RunOnGpuThread("test", [&](Engine&) {
      gate_running = true;
      while (!open_gate) std::this_thread::sleep_for(milliseconds(1));
    });
  });
  while (!gate_running) std::this_thread::sleep_for(milliseconds(1));
  auto generation =
      scheduler.SubmitGenerate(scheduler.engine().Validate(Prompt(1, 8, 100)), Clock::now());
  std::vector<TrainExample> batch = Batch(32, 12);
  bool begun = false;
  TrainStepResult stats;
  std::thread train([&] {
    scheduler.RunPiecesOnGpuThread("Train", [&](Engine&) {
      if (!begun) {
        begun = true;
        job->BeginStep(std::move(batch));
      }
      events.Add('m');
      if (!job->RunNextMicroBatch()) return false;
      stats = job->StepResult();
      return true;
    });
  });
  while (scheduler.QueueDepth() < 2) std::this_thread::sleep_for(milliseconds(1));
  open_gate = true;
  gate.join();
  train.join();
  ASSERT_EQ(stats.buckets.size(), 8u);
  EXPECT_EQ(stats.buckets.front().Label(), "b4xs16");
  const std::string log = events.Log();
  const size_t first = log.find('m'), last = log.rfind('m');
  ASSERT_NE(first, std::string::npos);
  const std::string during = log.substr(first, last - first + 1);
  EXPECT_EQ(std::count(during.begin(), during.end(), 'm'), 8) << log;
  EXPECT_EQ(during.find("mm"), std::string::npos) << "micro-batches without a decode step "
                                                     "between them: "
                                                  << log;
  EXPECT_GE(std::count(during.begin(), during.end(), 'd'), 7) << log;
  // The generation went on meanwhile: it decoded while the step ran and still finishes.
  auto [tokens, error] = Drain(*generation);
  EXPECT_FALSE(error);
  EXPECT_EQ(tokens.size(), 100u);
  scheduler.RunOnGpuThread("Train", [&](Engine&) { job.reset(); });
  scheduler.Stop();
}

// Pieces of two items take turns, one piece each per pass of the GPU thread's loop; a piece that
// throws ends its item (the error reaches the caller, no more pieces run).
TEST(ServerScheduler, WorkInPiecesTakesTurnsAndStopsAtAnError) {
  Scheduler scheduler(nullptr, SchedulerOptions{0, 16});
  scheduler.Start([] { return TinyEngine(); });
  std::string order;  // written on the GPU thread, read after both items are done
  int a_done = 0, b_done = 0;
  std::atomic<bool> a_running{false};
  std::thread a([&] {
    scheduler.RunPiecesOnGpuThread("test", [&](Engine&) {
      // The first piece holds the GPU thread until the second item is queued.
      a_running = true;
      while (a_done == 0 && scheduler.QueueDepth() < 1)
        std::this_thread::sleep_for(milliseconds(1));
      order.push_back('a');
      return ++a_done == 3;
    });
  });
  while (!a_running) std::this_thread::sleep_for(milliseconds(1));
  std::thread b([&] {
    scheduler.RunPiecesOnGpuThread("test", [&](Engine&) {
      order.push_back('b');
      return ++b_done == 3;
    });
  });
  a.join();
  b.join();
  EXPECT_EQ(order, "ababab");
  int calls = 0;
  EXPECT_THROW(scheduler.RunPiecesOnGpuThread("test",
                                              [&](Engine&) -> bool {
                                                if (++calls == 2) throw std::runtime_error("x");
                                                return false;
                                              }),
               std::runtime_error);
  EXPECT_EQ(calls, 2);
  scheduler.Stop();
}

// A batch wider than every train bucket is split into micro-batches that fit, also with oversize
// reject; only an example longer than every bucket is refused.
TEST(ServerTrainer, WideBatchesAreSplitAndOnlyTooLongExamplesRefused) {
  auto engine = TinyEngine({1, 2, 4}, nullptr, OversizePolicy::kReject);
  TrainJobOptions o;
  o.trainer.learning_rates.vision = o.trainer.learning_rates.projector = 0;
  auto job = MakeTrainBackend(*engine, o, nullptr);
  const TrainStepResult r = job->Step(Batch(9, 12));  // 3 micro-batches of 3
  ASSERT_EQ(r.buckets.size(), 3u);
  EXPECT_EQ(r.buckets.front().Label(), "b4xs16");
  const grpc::Status s = StatusOf([&] { job->Step(Batch(2, 40)); });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("buckets.train_seq_lens"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(job->steps(), 1);
}

// A valid job config that trains no language weight (language learning rate 0; trainable_parts
// without LANGUAGE becomes that rate, ToLearningRates) refuses a text-only batch with
// INVALID_ARGUMENT that says what to change, and the job goes on (before: INTERNAL, "element 0 of
// tensors does not require grad").
TEST(ServerTrainer, JobWithoutLanguageTrainingRefusesTextOnlyBatches) {
  auto engine = TinyEngine();
  TrainJobOptions o;
  o.trainer.learning_rates.language = 0;
  auto job = MakeTrainBackend(*engine, o, nullptr);
  const grpc::Status s = StatusOf([&] { job->Step(Batch(3, 12)); });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("no example has an image"), std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("train the language model"), std::string::npos);
  EXPECT_EQ(job->steps(), 0);
}

}  // namespace
}  // namespace vlmgraph::server
