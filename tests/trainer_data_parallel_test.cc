// Data parallelism (engine/data_parallel.h) over gloo on the CPU, and over NCCL (*_CUDA): 2 gloo
// ranks (threads, loopback TCPStore) equal 1 rank accumulating the same global batch, with and
// without the sharded optimizer and gradient accumulation; checkpoints move between rank counts;
// a lost rank ends the step with kUnavailable; ranks as processes (launched as torchrun does)
// equal one rank; submitted steps change no result.
#include "engine/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "model/checkpoint.h"
#include "base/safetensors.h"
#include "tests/test_util.h"
#include "tests/trainer_fixtures.h"

namespace vlmgraph {
namespace {

using testing::TinyReference;
using namespace trainer_fixtures;

DataParallelOptions GlooOptions(int64_t rank, int64_t world, int64_t port, double timeout_seconds) {
  DataParallelOptions o;
  o.rank = rank;
  o.world_size = world;
  o.store_port = port;
  o.timeout_seconds = timeout_seconds;
  o.backend = "gloo";
  return o;
}

// Runs body(rank) on `world` threads at once; rethrows the first exception a rank threw.
void RunRanks(int64_t world, const std::function<void(int64_t)>& body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int64_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// A global batch of 4 different examples (two fixture rows and their remapped variants), images
// included.
std::vector<TrainExample> GlobalBatch(const VlmConfig& cfg) {
  std::vector<TrainExample> b = FixtureBatch();
  b.push_back(Variant(cfg, 0));
  b.push_back(Variant(cfg, 1));
  return b;
}

#define SKIP_WITHOUT_GLOO()                         \
  if (!DataParallelGroup::BackendAvailable("gloo")) \
  GTEST_SKIP() << "built without gloo (Debian libgloo-dev; scripts/install-deps.sh installs it)"

TEST(DataParallel, ShardForRankSplitsAsGradientAccumulationDoes) {
  const std::vector<int> batch = {0, 1, 2, 3, 4, 5, 6};
  EXPECT_EQ(ShardForRank(batch, 0, 2), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(ShardForRank(batch, 1, 2), (std::vector<int>{4, 5, 6}));
  EXPECT_EQ(ShardForRank(batch, 0, 1), batch);
  EXPECT_THROW(ShardForRank(std::vector<int>{0}, 0, 2), EngineError);
  EXPECT_THROW(ShardForRank(std::vector<int>{0, 1, 2, 3, 4}, 3, 4), EngineError);  // 2,2,1,0
  EXPECT_THROW(ShardForRank(batch, 2, 2), EngineError);
}

TEST(DataParallel, JoinRefusesBadOptions) {
  EXPECT_THROW(DataParallelGroup::Join(GlooOptions(2, 2, 29500, 1)), EngineError);
  EXPECT_THROW(DataParallelGroup::Join(GlooOptions(0, 0, 29500, 1)), EngineError);
  EXPECT_THROW(DataParallelGroup::Join(GlooOptions(1, 2, 0, 1)), EngineError);  // port 0: rank 0
  DataParallelOptions o = GlooOptions(0, 1, 0, 1);
  o.backend = "mpi";
  try {
    DataParallelGroup::Join(o);
    FAIL() << "backend mpi accepted";
  } catch (const EngineError& e) {
    EXPECT_EQ(e.code(), EngineError::Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("gloo"), std::string::npos) << e.what();
  }
}

// What one rank of a two-rank job took: its steps and its final master weights.
struct RankRun {
  std::vector<TrainStepResult> steps;
  std::map<std::string, at::Tensor> masters;
};

// Two gloo ranks (threads, loopback store), each `steps` steps on its shard of `batch`; `setup`
// adjusts a rank's model, trainer options and group options before it joins.
std::vector<RankRun> RunTwoGlooRanks(
    const std::vector<TrainExample>& batch, int steps,
    const std::function<void(int64_t, VisionLanguageModel&, TrainOptions&, DataParallelOptions&)>&
        setup) {
  StoreRendezvous store;
  std::vector<RankRun> runs(2);
  RunRanks(2, [&](int64_t rank) {
    VisionLanguageModel source = LoadModel(testing::TinyCheckpointDir());
    TrainOptions o = FixtureOptions(at::kCPU, false);
    DataParallelOptions dp = store.For(rank, GlooOptions(rank, 2, 0, 60));
    setup(rank, source, o, dp);
    o.data_parallel = DataParallelGroup::Join(dp);
    Trainer t(source, o);
    const std::vector<TrainExample> shard = ShardForRank(batch, rank, 2);
    for (int s = 0; s < steps; ++s) runs[rank].steps.push_back(t.Step(shard));
    t.GatherOptimizerState();  // every rank (a no-op unless the optimizer is sharded)
    runs[rank].masters = Masters(t);
  });
  return runs;
}

// Rank 0's master weights within `tolerance` of `single`'s, and every rank's equal to rank 0's.
void ExpectMastersMatchOneRank(const std::vector<RankRun>& runs, Trainer& single,
                               double tolerance) {
  double worst = 0;
  for (const auto& [name, w] : Masters(single)) {
    worst = std::max(worst, testing::MaxAbsDiff(runs[0].masters.at(name), w));
    for (size_t r = 1; r < runs.size(); ++r)
      EXPECT_TRUE(at::equal(runs[0].masters.at(name), runs[r].masters.at(name))) << name;
  }
  EXPECT_LE(worst, tolerance);
}

// Ten float32 steps of two ranks, each on half of a global batch of 4, against one rank
// accumulating the same 4 examples in two micro-batches: the same losses, gradient norms and
// weights. Rank 1 starts from other weights: the trainer must broadcast rank 0's. `shard`:
// DataParallelOptions::shard_optimizer; bucket_bytes 0: the default buckets.
void ExpectTwoRanksMatchOneRankAccumulatingTheGlobalBatch(bool shard, int64_t bucket_bytes) {
  constexpr int kSteps = 10;
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  const std::vector<TrainExample> batch = GlobalBatch(m->cfg);
  TrainOptions single_options = FixtureOptions(at::kCPU, false);
  single_options.grad_accum_steps = 2;
  single_options.max_grad_norm = 0.5;  // clipping must use the global norm
  Trainer single(m, single_options);
  std::vector<TrainStepResult> want;
  for (int s = 0; s < kSteps; ++s) want.push_back(single.Step(batch));

  const std::vector<RankRun> got = RunTwoGlooRanks(
      batch, kSteps,
      [&](int64_t rank, VisionLanguageModel& source, TrainOptions& o, DataParallelOptions& dp) {
        if (rank == 1) {
          at::NoGradGuard ng;
          for (auto& p : source->parameters()) p.add_(0.25);
        }
        o.max_grad_norm = 0.5;
        dp.shard_optimizer = shard;
        if (bucket_bytes > 0) dp.bucket_bytes = bucket_bytes;
      });
  for (int s = 0; s < kSteps; ++s) {
    for (int64_t rank = 0; rank < 2; ++rank) {
      EXPECT_NEAR(got[rank].steps[s].loss, want[s].loss, 1e-6) << "rank " << rank << " step " << s;
      EXPECT_NEAR(got[rank].steps[s].grad_norm, want[s].grad_norm, 1e-6 * want[s].grad_norm)
          << "rank " << rank << " step " << s;
      EXPECT_GT(got[rank].steps[s].all_reduce_bytes, 0);
    }
  }
  ExpectMastersMatchOneRank(got, single, 1e-6);
}

// Gradient accumulation: two ranks with two micro-batches each (the first only accumulates, the
// second reduces bucket by bucket during its backward) against one rank accumulating the same 4
// examples in four micro-batches.
void ExpectAccumulatingRanksMatchOneRank(bool shard, int64_t bucket_bytes) {
  constexpr int kSteps = 4;
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  const std::vector<TrainExample> batch = GlobalBatch(m->cfg);
  TrainOptions single_options = FixtureOptions(at::kCPU, false);
  single_options.grad_accum_steps = 4;
  Trainer single(m, single_options);
  std::vector<TrainStepResult> want;
  for (int s = 0; s < kSteps; ++s) want.push_back(single.Step(batch));

  const std::vector<RankRun> got = RunTwoGlooRanks(
      batch, kSteps, [&](int64_t, VisionLanguageModel&, TrainOptions& o, DataParallelOptions& dp) {
        o.grad_accum_steps = 2;
        dp.shard_optimizer = shard;
        if (bucket_bytes > 0) dp.bucket_bytes = bucket_bytes;
      });
  for (int s = 0; s < kSteps; ++s) {
    for (int64_t rank = 0; rank < 2; ++rank) {
      EXPECT_NEAR(got[rank].steps[s].loss, want[s].loss, 1e-6) << "rank " << rank << " step " << s;
      EXPECT_EQ(got[rank].steps[s].buckets.size(), 2u);
    }
  }
  ExpectMastersMatchOneRank(got, single, 1e-6);
}

// Every rank runs the whole optimizer (DDP's way).
TEST(DataParallel, TwoGlooRanksMatchOneRankAccumulatingTheGlobalBatch) {
  SKIP_WITHOUT_GLOO();
  ExpectTwoRanksMatchOneRankAccumulatingTheGlobalBatch(/*shard=*/false, /*bucket_bytes=*/0);
}

// Many buckets: 4 KiB each.
TEST(DataParallel, AccumulatingRanksWithSmallBucketsMatchOneRank) {
  SKIP_WITHOUT_GLOO();
  ExpectAccumulatingRanksMatchOneRank(/*shard=*/false, /*bucket_bytes=*/4096);
}

// ZeRO stage 1 (DataParallelOptions::shard_optimizer, Note [Sharded optimizer]): each rank runs
// AdamW on the parameters it owns and broadcasts them; the same steps as one rank (after
// GatherOptimizerState every master weight too), in 4 KiB buckets, each with parameters of both
// owners.
TEST(DataParallel, ShardedOptimizerRanksMatchOneRank) {
  SKIP_WITHOUT_GLOO();
  ExpectTwoRanksMatchOneRankAccumulatingTheGlobalBatch(/*shard=*/true, /*bucket_bytes=*/4096);
}

// The same with two micro-batches per rank: the accumulating micro-step, then the reduce to the
// owners, the norm's all-reduce and the broadcast around the optimizer part.
TEST(DataParallel, ShardedOptimizerWithAccumulationMatchesOneRank) {
  SKIP_WITHOUT_GLOO();
  ExpectAccumulatingRanksMatchOneRank(/*shard=*/true, /*bucket_bytes=*/0);
}

// Owners: largest parameters first, each to the rank owning the fewest elements; every rank
// computes the same owners; Owned picks a rank's entries.
TEST(DataParallel, OptimizerShardsBalanceWholeParameters) {
  const std::vector<int64_t> numels = {100, 10, 60, 50, 10, 5};
  OptimizerShards r0(numels, 2, 0), r1(numels, 2, 1);
  EXPECT_EQ(r0.owners(), r1.owners());
  // 100 -> 0; 60 -> 1; 50 -> 1 (60 < 100); the first 10 -> 0 (100 < 110); the second 10 -> 0
  // (110 = 110: ties go to the lowest rank); 5 -> 1 (110 < 120).
  EXPECT_EQ(r0.owners(), (std::vector<int64_t>{0, 0, 1, 1, 0, 1}));
  EXPECT_EQ(r0.numel_of(0), 120);
  EXPECT_EQ(r0.numel_of(1), 115);
  EXPECT_EQ(r0.owned(), (std::vector<size_t>{0, 1, 4}));
  EXPECT_EQ(r1.owned(), (std::vector<size_t>{2, 3, 5}));
  std::vector<at::Tensor> all;
  for (int64_t n : numels) all.push_back(at::zeros({n}));
  const std::vector<at::Tensor> mine = r1.Owned(all);
  ASSERT_EQ(mine.size(), 3u);
  EXPECT_TRUE(mine[0].is_same(all[2]));
  OptimizerShards alone(numels, 1, 0);
  EXPECT_EQ(alone.owned().size(), numels.size());
  EXPECT_THROW(OptimizerShards(numels, 2, 2), std::invalid_argument);
}

// A checkpoint rank 0 saves after 3 two-rank steps resumes on one rank (accumulating the same
// global batch) with the losses the two ranks took next (the second depends on the AdamW moments
// the checkpoint kept). Sharded: the ranks gather the optimizer's state first, and a save
// before that is refused.
void ExpectCheckpointAtTwoRanksResumesAtOne(bool shard) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("vlmgraph_dp_ckpt_" + std::to_string(shard) +
                                                    "_" + std::to_string(::getpid()));
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  const std::vector<TrainExample> batch = GlobalBatch(m->cfg);
  StoreRendezvous store;
  double next_loss[2][2] = {{0, 0}, {0, 0}};
  RunRanks(2, [&](int64_t rank) {
    VisionLanguageModel source = LoadModel(testing::TinyCheckpointDir());
    TrainOptions o = FixtureOptions(at::kCPU, false);
    DataParallelOptions dp = store.For(rank, GlooOptions(rank, 2, 0, 60));
    dp.shard_optimizer = shard;
    o.data_parallel = DataParallelGroup::Join(dp);
    Trainer t(source, o);
    EXPECT_EQ(t.optimizer_sharded(), shard);
    const std::vector<TrainExample> shard_of_batch = ShardForRank(batch, rank, 2);
    for (int s = 0; s < 3; ++s) t.Step(shard_of_batch);
    if (shard && rank == 0) EXPECT_THROW(t.SaveCheckpoint(dir.string()), std::logic_error);
    t.GatherOptimizerState();
    if (rank == 0) t.SaveCheckpoint(dir.string());
    o.data_parallel->Barrier();
    for (int s = 0; s < 2; ++s) next_loss[rank][s] = t.Step(shard_of_batch).loss;
  });
  VisionLanguageModel saved = LoadModel(dir.string());
  TrainOptions o = FixtureOptions(at::kCPU, false);
  o.grad_accum_steps = 2;
  Trainer resumed(saved, o);
  resumed.LoadOptimizerState((dir / "optimizer.safetensors").string());
  EXPECT_EQ(resumed.steps(), 3);
  for (int s = 0; s < 2; ++s) {
    EXPECT_NEAR(resumed.Step(batch).loss, next_loss[0][s], 1e-6) << "step " << 4 + s;
    EXPECT_EQ(next_loss[0][s], next_loss[1][s]);
  }
}

TEST(DataParallel, CheckpointSavedAtTwoRanksResumesAtOne) {
  SKIP_WITHOUT_GLOO();
  ExpectCheckpointAtTwoRanksResumesAtOne(/*shard=*/false);
}

TEST(DataParallel, CheckpointSavedAtTwoShardedRanksResumesAtOne) {
  SKIP_WITHOUT_GLOO();
  ExpectCheckpointAtTwoRanksResumesAtOne(/*shard=*/true);
}

// A rank that leaves mid-job: the other rank's next step ends with kUnavailable (not a hang), and
// a rank whose peer never joins gives up after the timeout.
TEST(DataParallel, LostRankEndsTheStepWithUnavailable) {
  SKIP_WITHOUT_GLOO();
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  const std::vector<TrainExample> batch = GlobalBatch(m->cfg);
  StoreRendezvous store;
  const double timeout_seconds = 5;
  EngineError::Code code = EngineError::Code::kInternal;
  std::string message;
  double seconds = -1;
  RunRanks(2, [&](int64_t rank) {
    VisionLanguageModel source = LoadModel(testing::TinyCheckpointDir());
    TrainOptions o = FixtureOptions(at::kCPU, false);
    o.data_parallel =
        DataParallelGroup::Join(store.For(rank, GlooOptions(rank, 2, 0, timeout_seconds)));
    Trainer t(source, o);
    const std::vector<TrainExample> shard = ShardForRank(batch, rank, 2);
    t.Step(shard);
    if (rank == 1) return;  // leaves: its trainer and group are destroyed
    const auto t0 = std::chrono::steady_clock::now();
    try {
      t.Step(shard);
    } catch (const EngineError& e) {
      code = e.code();
      message = e.what();
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  EXPECT_EQ(code, EngineError::Code::kUnavailable) << message;
  EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
  EXPECT_LT(seconds, timeout_seconds + 10);

  const auto t0 = std::chrono::steady_clock::now();
  try {
    DataParallelGroup::Join(GlooOptions(0, 2, /*port=*/0, 1.0));
    FAIL() << "joined a group of 2 alone";
  } catch (const EngineError& e) {
    EXPECT_EQ(e.code(), EngineError::Code::kUnavailable) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 15);
}

// Heartbeats (Note [Heartbeats] in engine/data_parallel.cc): live ranks that do no collective for
// longer than the timeout are not lost; a rank whose group is gone is, within the timeout plus a
// heartbeat or two.
TEST(DataParallel, HeartbeatsFindALostPeer) {
  SKIP_WITHOUT_GLOO();
  StoreRendezvous store;
  std::string lost_while_alive = "unset", lost_after = "";
  double seconds_to_notice = -1;
  std::atomic<bool> rank1_gone{false};
  RunRanks(2, [&](int64_t rank) {
    DataParallelOptions o = store.For(rank, GlooOptions(rank, 2, 0, 1.5));
    o.heartbeat_seconds = 0.1;
    auto group = DataParallelGroup::Join(o);
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // idle, both alive
    if (rank == 0) lost_while_alive = group->LostPeer();
    group->Barrier();
    if (rank == 1) {
      group.reset();  // rank 1 is gone: no more heartbeats
      rank1_gone = true;
      return;
    }
    while (!rank1_gone) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto t0 = std::chrono::steady_clock::now();
    while (group->LostPeer().empty() &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    seconds_to_notice =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    lost_after = group->LostPeer();
  });
  EXPECT_EQ(lost_while_alive, "");
  EXPECT_NE(lost_after.find("rank 1"), std::string::npos) << lost_after;
  EXPECT_GE(seconds_to_notice, 1.0);
  EXPECT_LT(seconds_to_notice, 4.0);
}

// Note [NCCL ranks in tests]: NCCL with captured collectives wants one GPU per process, so the
// GPU data-parallel test runs its ranks as child processes: this binary again, filtered to
// DataParallel.ProcessRank, with VLMGRAPH_TEST_DP_RANK / _WORLD / _PORT / _BACKEND / _OUT in the
// environment. A rank writes its losses and master weights to _OUT (safetensors). World 1 is the
// reference: one rank on one GPU accumulating the whole global batch in two micro-batches (a child
// too, so the parent only compares files).
constexpr int kNcclSteps = 20;

std::vector<double> ToVector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

TEST(DataParallel, ProcessRank) {
  const char* rank_env = std::getenv("VLMGRAPH_TEST_DP_RANK");
  if (rank_env == nullptr)
    GTEST_SKIP() << "a rank of ExpectProcessRanksMatchOneRank (Note [NCCL ranks in tests])";
  const int64_t rank = std::stoll(rank_env);
  const int64_t world = std::stoll(std::getenv("VLMGRAPH_TEST_DP_WORLD"));
  const std::string backend = std::getenv("VLMGRAPH_TEST_DP_BACKEND");
  if (!DataParallelGroup::BackendAvailable(backend)) GTEST_SKIP() << "built without " << backend;
  // bfloat16: bf16 training, gradients reduced in bf16 (the default for bf16); per-rank gradient
  // accumulation steps (the one-rank reference takes world x as many).
  const bool bf16 = std::string(std::getenv("VLMGRAPH_TEST_DP_DTYPE")) == "bfloat16";
  const int64_t accum = std::stoll(std::getenv("VLMGRAPH_TEST_DP_ACCUM"));
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  const std::vector<TrainExample> batch = GlobalBatch(m->cfg);
  TrainOptions o = backend == "nccl" ? FixtureOptions(at::Device(at::kCUDA, rank), /*graphs=*/true)
                                     : FixtureOptions(at::kCPU, /*graphs=*/false);
  o.max_grad_norm = 0.5;  // clipping must use the global norm
  if (bf16) o.compute_dtype = at::kBFloat16;
  o.grad_accum_steps = accum;
  if (world > 1) {
    DataParallelOptions dp;
    dp.rank = rank;
    dp.world_size = world;
    dp.store_port = std::stoll(std::getenv("VLMGRAPH_TEST_DP_PORT"));
    dp.launcher_store = true;  // RunNcclRanks serves it
    dp.backend = backend;
    dp.device_index = rank;
    dp.timeout_seconds = 120;
    dp.bucket_bytes = 64 * 1024;  // several buckets even for the tiny model
    dp.shard_optimizer = std::string(std::getenv("VLMGRAPH_TEST_DP_SHARD")) == "1";
    dp.broadcast_in_forward = std::string(std::getenv("VLMGRAPH_TEST_DP_FORWARD")) == "1";
    o.data_parallel = DataParallelGroup::Join(dp);
  } else {
    o.grad_accum_steps = 2 * accum;
  }
  Trainer t(m, o);
  const std::vector<TrainExample> shard = ShardForRank(batch, rank, world);
  std::vector<double> losses;
  // Step() each, or each step submitted before the one before it is waited for (Note
  // [Submitted steps]).
  const bool submit = std::string(std::getenv("VLMGRAPH_TEST_DP_SUBMIT")) == "1";
  if (submit) t.Submit(shard);
  for (int s = 0; s < kNcclSteps; ++s) {
    if (submit && s + 1 < kNcclSteps) t.Submit(shard);
    const TrainStepResult r = submit ? t.Wait() : t.Step(shard);
    if (backend == "nccl") ASSERT_NE(r.kind, RunKind::kEager) << "step " << s;
    losses.push_back(r.loss);
  }
  if (world > 1 && backend == "nccl") {
    // Every graph at warm-up: per train bucket the all-reducing one (float32 reduction, or bf16
    // with one micro-batch per step: AdamW inside it) and with accumulation the accumulating
    // one; the optimizer's own graph unless AdamW runs inside the micro-step. bf16 reduction with
    // accumulation reduces after the last micro-batch: no all-reducing graph.
    const int64_t buckets = static_cast<int64_t>(t.options().buckets.All(Region::kTrain).size());
    const int64_t want = !bf16       ? buckets * (accum > 1 ? 2 : 1) + 1
                         : accum > 1 ? buckets + 1
                                     : buckets;
    EXPECT_EQ(t.captures(), want);
  }
  t.GatherOptimizerState();  // every rank (sharded optimizer)
  std::map<std::string, at::Tensor> out = Masters(t);
  out["__losses__"] = at::tensor(losses, at::kDouble);
  out["__forward_broadcast_wait_block__"] = at::tensor({t.forward_broadcast_wait_block()});
  for (const auto& p :
       t.model()->named_parameters())  // the working weights each rank computes with
    out["__working__." + p.key()] = p.value().detach().to(at::kCPU).clone();
  WriteSafetensors(std::getenv("VLMGRAPH_TEST_DP_OUT"), out);
  if (o.data_parallel) {  // every rank done before any leaves (Note [Heartbeats])
    o.data_parallel->Barrier();
    o.data_parallel->Leave();
  }
}

// Runs DataParallel.ProcessRank as `world` child processes (ranks 0 .. world - 1) writing
// `dir`/<name>R.safetensors; true when every one exited with status 0.
// How the ranks of ExpectProcessRanksMatchOneRank train.
struct RankSetup {
  std::string dtype = "float32";     // or "bfloat16" (bf16 training and gradient reduction)
  int64_t accum = 1;                 // gradient accumulation steps per rank
  bool shard = false;                // DataParallelOptions::shard_optimizer
  bool broadcast_in_forward = true;  // DataParallelOptions::broadcast_in_forward
  bool submit = false;               // Trainer::Submit one ahead + Wait instead of Step
  double max_loss_diff = 1e-5, max_weight_diff = 1e-5;  // against the one-rank reference
};

bool RunNcclRanks(int64_t world, const std::filesystem::path& dir, const std::string& name,
                  const std::string& backend, const RankSetup& setup) {
  // The parent serves the ranks' TCPStore on a port the system picks, as torchrun's agent does
  // (the ranks join with DataParallelOptions::launcher_store); it lives until they have exited.
  c10::intrusive_ptr<c10d::TCPStore> store;
  int64_t port = 0;
  if (world > 1) {
    c10d::TCPStoreOptions so;
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    so.timeout = std::chrono::milliseconds(120'000);
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    port = store->getPort();
  }
  std::vector<pid_t> pids;
  for (int64_t rank = 0; rank < world; ++rank) {
    std::vector<std::string> env_strings = {
        "VLMGRAPH_TEST_DP_RANK=" + std::to_string(rank),
        "VLMGRAPH_TEST_DP_WORLD=" + std::to_string(world),
        "VLMGRAPH_TEST_DP_PORT=" + std::to_string(port),
        "VLMGRAPH_TEST_DP_BACKEND=" + backend,
        "VLMGRAPH_TEST_DP_DTYPE=" + setup.dtype,
        "VLMGRAPH_TEST_DP_ACCUM=" + std::to_string(setup.accum),
        std::string("VLMGRAPH_TEST_DP_SHARD=") + (setup.shard ? "1" : "0"),
        std::string("VLMGRAPH_TEST_DP_FORWARD=") + (setup.broadcast_in_forward ? "1" : "0"),
        std::string("VLMGRAPH_TEST_DP_SUBMIT=") + (setup.submit ? "1" : "0"),
        "VLMGRAPH_TEST_DP_OUT=" + (dir / (name + std::to_string(rank) + ".safetensors")).string()};
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
    std::string filter = "--gtest_filter=DataParallel.ProcessRank";
    char* argv[] = {exe.data(), filter.data(), nullptr};
    pid_t pid = 0;
    if (posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()) != 0) return false;
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    ok = ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0 && ok;
  }
  return ok;
}

// Ranks as processes (Note [NCCL ranks in tests]) against the one-rank reference: losses and
// weights within the setup's bounds after kNcclSteps steps.
void ExpectProcessRanksMatchOneRank(const std::string& backend, const RankSetup& setup = {}) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("vlmgraph_" + backend + "_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  ASSERT_TRUE(RunNcclRanks(2, dir, "rank", backend, setup))
      << "a rank failed (its output is above)";
  ASSERT_TRUE(RunNcclRanks(1, dir, "reference", backend, setup)) << "the one-rank reference failed";
  const SafetensorsFile want = ReadSafetensors((dir / "reference0.safetensors").string());
  const std::vector<double> want_losses = ToVector(want.tensors.at("__losses__"));
  for (int64_t rank = 0; rank < 2; ++rank) {
    const SafetensorsFile got =
        ReadSafetensors((dir / ("rank" + std::to_string(rank) + ".safetensors")).string());
    const std::vector<double> losses = ToVector(got.tensors.at("__losses__"));
    ASSERT_EQ(losses.size(), want_losses.size());
    double worst_loss = 0, worst = 0;
    for (size_t s = 0; s < losses.size(); ++s)
      worst_loss = std::max(worst_loss, std::abs(losses[s] - want_losses[s]));
    for (const auto& [name, w] : want.tensors) {
      if (name.rfind("__", 0) == 0) continue;  // losses, working weights, the wait block
      auto it = got.tensors.find(name);
      ASSERT_NE(it, got.tensors.end()) << name;
      worst = std::max(worst, testing::MaxAbsDiff(it->second, w));
    }
    EXPECT_LE(worst_loss, setup.max_loss_diff) << "rank " << rank;
    EXPECT_LE(worst, setup.max_weight_diff) << "rank " << rank;
    std::printf(
        "%s %s accum %lld%s rank %lld: %zu steps, final loss %.8f (one rank %.8f), max |loss - "
        "one rank| %.3g, max |w - w_one_rank| %.3g\n",
        backend.c_str(), setup.dtype.c_str(), static_cast<long long>(setup.accum),
        setup.shard ? " sharded" : "", static_cast<long long>(rank), losses.size(), losses.back(),
        want_losses.back(), worst_loss, worst);
  }
  // unlink/rmdir, not std::filesystem::remove_all: the process may bind that symbol to the copy
  // inside libtorch.so, whose use here crashes (seen with torch 2.11's wheel).
  for (const char* f : {"rank0.safetensors", "rank1.safetensors", "reference0.safetensors"})
    ::unlink((dir / f).c_str());
  ::rmdir(dir.c_str());
}

// Two NCCL ranks (two GPUs, two processes), each on half of a global batch of 4, 20 float32
// graphed steps with clipping, against one rank on one GPU accumulating the same 4 examples in two
// micro-batches: losses and weights within 1e-5.
TEST(DataParallel, TwoNcclRanksMatchOneRank_CUDA) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  if (!DataParallelGroup::BackendAvailable("nccl")) GTEST_SKIP() << "built without NCCL";
  ExpectProcessRanksMatchOneRank("nccl");
}

// bf16 training, gradients reduced in bf16, AdamW inside each rank's graph: two NCCL ranks
// track one rank that accumulates the same global batch in float32, within bf16 rounding of the
// averaged gradients. Measured on 2 x H100 (20 steps): max |loss diff| 1.1e-3, max |w diff|
// 8.5e-4; with two micro-batches per rank 1.3e-3 and 2.8e-3. The bounds leave 2-9x of that.
TEST(DataParallel, TwoNcclRanksReducingInBFloat16TrackOneRank_CUDA) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  if (!DataParallelGroup::BackendAvailable("nccl")) GTEST_SKIP() << "built without NCCL";
  RankSetup bf16;
  bf16.dtype = "bfloat16";
  bf16.max_loss_diff = 1e-2;
  bf16.max_weight_diff = 5e-3;
  ExpectProcessRanksMatchOneRank("nccl", bf16);
}

// The same with two micro-batches per rank: float32 accumulation, the bf16 all-reduce after the
// last backward (GradientReducer::ReduceAccumulated), AdamW in the optimizer's graph.
TEST(DataParallel, TwoAccumulatingNcclRanksReducingInBFloat16TrackOneRank_CUDA) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  if (!DataParallelGroup::BackendAvailable("nccl")) GTEST_SKIP() << "built without NCCL";
  RankSetup bf16;
  bf16.dtype = "bfloat16";
  bf16.accum = 2;
  bf16.max_loss_diff = 1e-2;
  bf16.max_weight_diff = 5e-3;
  ExpectProcessRanksMatchOneRank("nccl", bf16);
}

// The sharded optimizer (ZeRO stage 1) on NCCL ranks: float32 within 1e-5 as above; bf16 (the
// reduce, the norm's all-reduce and the broadcast inside the micro-step's graph) and bf16 with two
// micro-batches (eager around the optimizer's graph) within the bounds of the unsharded runs.
TEST(DataParallel, TwoShardedNcclRanksMatchOneRank_CUDA) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  if (!DataParallelGroup::BackendAvailable("nccl")) GTEST_SKIP() << "built without NCCL";
  RankSetup f32;
  f32.shard = true;
  ExpectProcessRanksMatchOneRank("nccl", f32);
  for (int64_t accum : {1, 2}) {
    RankSetup bf16;
    bf16.dtype = "bfloat16";
    bf16.accum = accum;
    bf16.shard = true;
    bf16.max_loss_diff = 1e-2;
    bf16.max_weight_diff = 5e-3;
    ExpectProcessRanksMatchOneRank("nccl", bf16);
  }
}

// Note [Weights broadcast in the forward]: two sharded bf16 NCCL ranks whose later blocks'
// weights go out in the next step's forward compute what the same ranks compute with every weight
// broadcast in its own step: the same losses, masters and working weights, and each rank's
// working weights equal the other's after GatherOptimizerState. A forward that read a weight
// before its broadcast landed, or a gather that left one out, shows as a difference.
TEST(DataParallel, WeightsBroadcastInTheForwardChangeNoResult_CUDA) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  if (!DataParallelGroup::BackendAvailable("nccl")) GTEST_SKIP() << "built without NCCL";
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("vlmgraph_forward_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  RankSetup setup;
  setup.dtype = "bfloat16";
  setup.shard = true;
  setup.broadcast_in_forward = true;
  ASSERT_TRUE(RunNcclRanks(2, dir, "forward", "nccl", setup)) << "a rank failed (output above)";
  setup.broadcast_in_forward = false;
  ASSERT_TRUE(RunNcclRanks(2, dir, "own_step", "nccl", setup)) << "a rank failed (output above)";
  std::map<std::string, at::Tensor> working0;
  for (int64_t rank = 0; rank < 2; ++rank) {
    const std::string r = std::to_string(rank);
    const SafetensorsFile got = ReadSafetensors((dir / ("forward" + r + ".safetensors")).string());
    const SafetensorsFile want =
        ReadSafetensors((dir / ("own_step" + r + ".safetensors")).string());
    EXPECT_GE(got.tensors.at("__forward_broadcast_wait_block__").item<int64_t>(), 0)
        << "nothing was broadcast in the forward: the test compares nothing";
    EXPECT_EQ(want.tensors.at("__forward_broadcast_wait_block__").item<int64_t>(), -1);
    double worst = 0;
    for (const auto& [name, w] : want.tensors) {
      if (name == "__forward_broadcast_wait_block__") continue;
      auto it = got.tensors.find(name);
      ASSERT_NE(it, got.tensors.end()) << name;
      const double diff = testing::MaxAbsDiff(it->second, w);
      EXPECT_EQ(diff, 0) << name << " rank " << rank;
      worst = std::max(worst, diff);
      if (name.rfind("__working__.", 0) != 0) continue;
      if (rank == 0) {
        working0[name] = it->second;
      } else {
        EXPECT_EQ(testing::MaxAbsDiff(it->second, working0.at(name)), 0)
            << name << ": rank 1's working weight is not rank 0's";
      }
    }
    std::printf(
        "broadcast in the forward (wait before block %lld) rank %lld: max |diff| %.3g\n",
        static_cast<long long>(got.tensors.at("__forward_broadcast_wait_block__").item<int64_t>()),
        static_cast<long long>(rank), worst);
  }
  for (const char* f : {"forward0", "forward1", "own_step0", "own_step1"})
    ::unlink((dir / (std::string(f) + ".safetensors")).c_str());
  ::rmdir(dir.c_str());
}

// Note [Submitted steps]: two ranks that submit each step before waiting for the one before
// compute what the same ranks compute with Step(): the same losses, masters and working weights,
// bit for bit. On NCCL (graphed, their uploads beside the step before) float32, and sharded bf16
// with the weights broadcast in the next step's forward; on gloo float32 eager steps.
void ExpectSubmittedRanksEqualSteppedRanks(const std::string& backend, RankSetup setup) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("vlmgraph_submit_" + backend + std::to_string(::getpid()));
  fs::create_directories(dir);
  setup.submit = true;
  ASSERT_TRUE(RunNcclRanks(2, dir, "submitted", backend, setup)) << "a rank failed (output above)";
  setup.submit = false;
  ASSERT_TRUE(RunNcclRanks(2, dir, "stepped", backend, setup)) << "a rank failed (output above)";
  for (int64_t rank = 0; rank < 2; ++rank) {
    const std::string r = std::to_string(rank);
    const SafetensorsFile got =
        ReadSafetensors((dir / ("submitted" + r + ".safetensors")).string());
    const SafetensorsFile want = ReadSafetensors((dir / ("stepped" + r + ".safetensors")).string());
    ASSERT_EQ(got.tensors.size(), want.tensors.size());
    for (const auto& [name, w] : want.tensors) {
      auto it = got.tensors.find(name);
      ASSERT_NE(it, got.tensors.end()) << name;
      EXPECT_EQ(testing::MaxAbsDiff(it->second, w), 0) << name << " rank " << rank;
    }
  }
  for (const char* f : {"submitted0", "submitted1", "stepped0", "stepped1"})
    ::unlink((dir / (std::string(f) + ".safetensors")).c_str());
  ::rmdir(dir.c_str());
}

TEST(DataParallel, SubmittedStepsChangeNoResult_CUDA) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  if (!DataParallelGroup::BackendAvailable("nccl")) GTEST_SKIP() << "built without NCCL";
  ExpectSubmittedRanksEqualSteppedRanks("nccl", RankSetup{});
  RankSetup sharded;
  sharded.dtype = "bfloat16";
  sharded.shard = true;
  ExpectSubmittedRanksEqualSteppedRanks("nccl", sharded);
}

TEST(DataParallel, SubmittedGlooStepsChangeNoResult) {
  SKIP_WITHOUT_GLOO();
  ExpectSubmittedRanksEqualSteppedRanks("gloo", RankSetup{});
}

// Note [Unreached groups] across ranks: with no image on any rank, the vision encoder and the
// projector stay exactly as loaded on every rank (unsharded and sharded optimizer) while the
// language model learns; with images on rank 1 only, rank 0's zero local gradient does not stop
// them: both ranks equal one rank accumulating the same two micro-batches.
TEST(DataParallel, GroupsNoRankReachesStayAsTheyWere) {
  SKIP_WITHOUT_GLOO();
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  auto text_only = [&](int64_t r) { return TextOnly(m->cfg, r); };
  std::map<std::string, at::Tensor> loaded;
  for (const auto& p : m->named_parameters()) loaded[p.key()] = p.value().detach().clone();
  for (const bool shard : {false, true}) {
    const std::vector<RankRun> got =
        RunTwoGlooRanks({text_only(0), text_only(1), text_only(1), text_only(0)}, 2,
                        [&](int64_t, VisionLanguageModel&, TrainOptions&, DataParallelOptions& dp) {
                          dp.shard_optimizer = shard;
                        });
    int moved = 0;
    for (int64_t rank = 0; rank < 2; ++rank) {
      for (const auto& [name, w] : got[rank].masters) {
        if (name.rfind("vision_encoder.", 0) == 0 || name.rfind("MP.", 0) == 0) {
          EXPECT_TRUE(at::equal(w, loaded.at(name)))
              << "shard " << shard << " rank " << rank << ": " << name;
        } else if (!at::equal(w, loaded.at(name))) {
          ++moved;
        }
      }
    }
    EXPECT_GT(moved, 0) << "shard " << shard;
  }
  // Images on rank 1 only, against one rank taking both halves as two micro-batches.
  const std::vector<TrainExample> mixed = {text_only(0), text_only(1), FixtureBatch()[0],
                                           FixtureBatch()[1]};
  TrainOptions single_options = FixtureOptions(at::kCPU, false);
  single_options.grad_accum_steps = 2;
  Trainer single(m, single_options);
  for (int s = 0; s < 2; ++s) single.Step(mixed);
  for (const bool shard : {false, true}) {
    const std::vector<RankRun> got = RunTwoGlooRanks(
        mixed, 2, [&](int64_t, VisionLanguageModel&, TrainOptions&, DataParallelOptions& dp) {
          dp.shard_optimizer = shard;
        });
    ExpectMastersMatchOneRank(got, single, 1e-6);
    EXPECT_FALSE(at::equal(got[0].masters.at("MP.proj.weight"), loaded.at("MP.proj.weight")));
  }
}

// The same with gloo ranks as separate CPU processes (eager steps).
TEST(DataParallel, TwoGlooProcessesMatchOneRank) {
  SKIP_WITHOUT_GLOO();
  ExpectProcessRanksMatchOneRank("gloo");
}

}  // namespace
}  // namespace vlmgraph
