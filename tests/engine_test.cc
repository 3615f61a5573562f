// Engine tests: bucket rules, padding exactness, generation against upstream's fixture and the
// model's reference loop, continuous batching, validation, seeded sampling; *_CUDA: graph replay.
#include "engine/engine.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#if VLMGRAPH_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "engine/bucket_sizing.h"
#include "engine/device.h"
#include "engine/step_runner.h"
#include "model/checkpoint.h"
#include "model/kv_cache.h"
#include "tests/engine_fixtures.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

using testing::MaxAbsDiff;
using testing::TinyReference;

using testing::SmallBuckets;

std::unique_ptr<Engine> MakeEngine(at::Device device, bool graphs,
                                   BucketSpec buckets = SmallBuckets(),
                                   at::ScalarType dtype = at::kFloat,
                                   std::optional<bool> overlap_decode_steps = std::nullopt,
                                   int64_t kv_cache_pages = 0) {
  EngineOptions o;
  o.kv_cache_pages = kv_cache_pages;
  o.device = device;
  o.dtype = dtype;
  o.buckets = std::move(buckets);
  o.cuda_graphs = graphs;
  o.log_captures = false;
  o.overlap_decode_steps = overlap_decode_steps;
  // Every engine of these tests runs under the graph checks (Notes [Static input check] and
  // [Output lifetime check]): on the CPU, a region output kept past the next run reads poison.
  o.check_graphs = true;
  return std::make_unique<Engine>(LoadModel(testing::TinyCheckpointDir()), o);
}

std::vector<int64_t> Row(const at::Tensor& t, int64_t r) {
  at::Tensor row = t[r].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

// The fixture's two prompts, each with its image tile.
std::vector<GenerateRequest> FixtureRequests(int64_t max_new) {
  const auto& ref = TinyReference().tensors;
  std::vector<GenerateRequest> out;
  for (int64_t r = 0; r < 2; ++r) {
    GenerateRequest q;
    q.input_ids = Row(ref.at("input_ids"), r);
    q.tiles = ref.at("images").narrow(0, r, 1);
    q.sampling.max_new_tokens = max_new;
    out.push_back(q);
  }
  return out;
}

std::vector<int64_t> RandomPrompt(std::mt19937& rng, int64_t len, int64_t vocab) {
  std::uniform_int_distribution<int64_t> d(0, vocab - 1);
  std::vector<int64_t> p(len);
  for (auto& t : p) t = d(rng);
  return p;
}

// Reference: the model's own unbatched, unpadded greedy loop.
std::vector<int64_t> ReferenceGreedy(VisionLanguageModel& m, const GenerateRequest& r) {
  at::Tensor ids = at::tensor(r.input_ids, at::kLong)
                       .view({1, -1})
                       .to(m->decoder->token_embedding->weight.device());
  at::Tensor tiles = r.tiles.defined() ? r.tiles.to(ids.device()) : at::Tensor();
  return Row(m->GenerateGreedy(ids, tiles, r.sampling.max_new_tokens).cpu(), 0);
}

// What one request got: its tokens in order and how it ended.
struct Outcome {
  std::vector<int64_t> tokens;
  FinishReason reason = FinishReason::kNone;
  bool operator==(const Outcome& o) const { return tokens == o.tokens && reason == o.reason; }
};

std::ostream& operator<<(std::ostream& os, const Outcome& o) {
  os << FinishReasonName(o.reason) << " [";
  for (int64_t t : o.tokens) os << t << " ";
  return os << "]";
}

// Continuous batching as the server's scheduler drives it: admit up to two requests whenever a
// slot and their KV pages are free (in order), else step. Request `cancel` (if any) is cancelled
// once it has `cancel_after` tokens, between two calls, as a client that goes away.
std::vector<Outcome> Drive(Engine& engine, const std::vector<GenerateRequest>& reqs,
                           int64_t cancel = -1, size_t cancel_after = 0) {
  std::vector<Outcome> out(reqs.size());
  std::map<SequenceId, size_t> owner;
  std::vector<TokenEvent> events;
  size_t next = 0;
  while (next < reqs.size() || engine.ActiveSequences() > 0) {
    std::vector<ValidatedRequest> waiting;
    for (size_t k = next; k < reqs.size() && k < next + 2; ++k)
      waiting.push_back(engine.Validate(reqs[k]));
    std::vector<const ValidatedRequest*> queue;
    for (const auto& v : waiting) queue.push_back(&v);
    const size_t n = static_cast<size_t>(engine.AdmissibleCount(queue));
    if (n > 0) {
      std::vector<ValidatedRequest> batch(waiting.begin(), waiting.begin() + n);
      const auto ids = engine.Admit(std::move(batch), &events);
      for (size_t k = 0; k < ids.size(); ++k) owner[ids[k]] = next + k;
      next += n;
    } else {
      engine.Step(&events);
    }
    for (const auto& ev : events) {
      Outcome& o = out[owner.at(ev.id)];
      EXPECT_EQ(o.reason, FinishReason::kNone)
          << "a token after the end, request " << owner.at(ev.id);
      o.tokens.push_back(ev.token);
      o.reason = ev.reason;
      if (static_cast<int64_t>(owner.at(ev.id)) == cancel && !ev.finished &&
          o.tokens.size() == cancel_after) {
        engine.Cancel(ev.id);
        o.reason = FinishReason::kCancelled;
      }
    }
    events.clear();
  }
  return out;
}

// More requests than SmallBuckets' 4 slots, greedy and seeded sampling (every third), endings by
// max_new_tokens (request 4 exactly at the longest context, 30 + 34 = 64), and with
// AddStopTokens by stop token (requests 2 and 6); Drive(..., 5, 2) cancels request 5. Overlapped
// decode steps must give each request the same tokens and ending as plain ones.
std::vector<GenerateRequest> MixedRequests() {
  std::mt19937 rng(21);
  std::vector<GenerateRequest> reqs;
  for (int64_t i = 0; i < 9; ++i) {
    GenerateRequest q;
    q.input_ids = RandomPrompt(rng, 2 + (i * 7) % 29, 1000);
    q.sampling.max_new_tokens = 3 + (i * 5) % 11;
    if (i % 3 == 1) {
      q.sampling.greedy = false;
      q.sampling.temperature = 0.8;
      q.sampling.top_k = 50;
      q.sampling.seed = 100 + static_cast<uint64_t>(i);
    }
    reqs.push_back(q);
  }
  reqs[4].input_ids = RandomPrompt(rng, 30, 1000);
  reqs[4].sampling.max_new_tokens = 34;
  return reqs;
}

// Request 2 stops at its 3rd token and request 6 at its 2nd, taken from a run without stops (or
// earlier, where that token came before).
void AddStopTokens(std::vector<GenerateRequest>* reqs, const std::vector<Outcome>& run) {
  for (auto [r, at] : {std::pair<size_t, size_t>{2, 2}, {6, 1}}) {
    ASSERT_GT(run[r].tokens.size(), at + 1);
    (*reqs)[r].sampling.stop_token_ids = {run[r].tokens[at]};
  }
}

TEST(Buckets, PicksSmallestFittingBucketForManyShapes) {
  BucketSpec b;
  b.batch_sizes = {8, 1, 4, 2, 4};
  b.seq_lens = {100, 30, 7};
  b.context_lens = {200, 100};
  b.Validate();
  EXPECT_EQ(b.batch_sizes, (std::vector<int64_t>{1, 2, 4, 8}));  // sorted, de-duplicated
  std::mt19937 rng(1);
  for (int i = 0; i < 2000; ++i) {
    const int64_t batch = std::uniform_int_distribution<int64_t>(1, 10)(rng);
    const int64_t seq = std::uniform_int_distribution<int64_t>(1, 120)(rng);
    auto key = b.PickPrefill(batch, seq);
    if (batch > 8 || seq > 100) {
      EXPECT_FALSE(key.has_value()) << batch << "x" << seq;
      continue;
    }
    ASSERT_TRUE(key.has_value());
    EXPECT_GE(key->batch, batch);
    EXPECT_GE(key->seq, seq);
    for (int64_t bb : b.batch_sizes) EXPECT_FALSE(bb >= batch && bb < key->batch);
    for (int64_t ss : b.seq_lens) EXPECT_FALSE(ss >= seq && ss < key->seq);
  }
  EXPECT_EQ(b.PickDecode(3, 101)->Label(), "b4xc200");
  EXPECT_EQ(b.PickPrefill(3, 8)->Label(), "b4xs30");
  EXPECT_EQ(b.All(Region::kPrefill).size(), 12u);
  EXPECT_EQ(b.All(Region::kPrefill).front().Label(), "b8xs100");  // largest first
}

TEST(Buckets, ValidateNamesTheBadList) {
  BucketSpec b;
  b.seq_lens = {};
  try {
    b.Validate();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("buckets.seq_lens"), std::string::npos);
  }
  BucketSpec c;
  c.seq_lens = {2048};
  c.context_lens = {1024};
  EXPECT_THROW(c.Validate(), std::invalid_argument);
}

TEST(Buckets, PrefillUsesTheBatchSizesUpToMaxPrefillBatch) {
  BucketSpec b;
  b.batch_sizes = {1, 2, 4, 8, 16};
  b.seq_lens = {8, 16};
  b.context_lens = {32};
  b.max_prefill_batch = 5;  // between entries: prefill batches 1, 2, 4
  b.Validate();
  EXPECT_EQ(b.prefill_batch_sizes(), (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(b.max_prefill(), 4);
  EXPECT_EQ(b.max_batch(), 16);  // decode slots
  EXPECT_EQ(b.PickPrefill(3, 9)->Label(), "b4xs16");
  EXPECT_FALSE(b.PickPrefill(5, 9).has_value());  // only decode goes past 4
  EXPECT_EQ(b.PickDecode(9, 20)->Label(), "b16xc32");
  EXPECT_EQ(b.All(Region::kPrefill).size(), 6u);  // 3 batches x 2 seqs
  EXPECT_EQ(b.All(Region::kPrefill).front().Label(), "b4xs16");
  EXPECT_EQ(b.All(Region::kDecode).size(), 5u);
  b.max_prefill_batch = 0;
  EXPECT_THROW(b.Validate(), std::invalid_argument);
  BucketSpec c;
  c.batch_sizes = {4, 8};
  c.max_prefill_batch = 2;  // below every entry: no prefill bucket at all
  try {
    c.Validate();
    FAIL() << "validated";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("buckets.max_prefill_batch"), std::string::npos);
  }
  BucketSpec derived;
  derived.batch_sizes = {};  // left to the engine: Validate keeps it empty
  EXPECT_NO_THROW(derived.Validate());
  EXPECT_TRUE(derived.batch_sizes.empty());
  derived.gpu_memory_utilization = 1.5;
  EXPECT_THROW(derived.Validate(), std::invalid_argument);
}

// Admit groups prompts into prefill batches of at most max_prefill() rows, while all of them
// decode together in one batch bucket.
TEST(Engine, PrefillGroupsStayWithinMaxPrefillBatchWhileDecodeTakesEverySlot) {
  BucketSpec b = SmallBuckets();
  b.batch_sizes = {1, 2, 4, 8};
  b.max_prefill_batch = 2;
  auto engine = MakeEngine(at::kCPU, false, b);
  std::vector<GenerateRequest> reqs(7);
  std::mt19937 rng(5);
  for (auto& r : reqs) {
    r.input_ids = RandomPrompt(rng, 6, 1000);
    r.sampling.max_new_tokens = 3;
  }
  const auto out = engine->Generate(reqs);
  for (const auto& tokens : out) EXPECT_EQ(tokens.size(), 3u);
  const EngineCounters c = engine->Counters();
  EXPECT_EQ(c.eager_fallbacks, 0);
  int64_t prefill_runs = 0;
  for (const auto& [key, runs] : c.eager_runs) {
    if (key.rfind("prefill/", 0) == 0) {
      EXPECT_TRUE(key == "prefill/b1xs8" || key == "prefill/b2xs8") << key;
      prefill_runs += runs;
    }
  }
  EXPECT_EQ(prefill_runs, 4);                          // 2 + 2 + 2 + 1
  EXPECT_GT(c.eager_runs.count("decode/b8xc32"), 0u);  // 7 sequences in one decode step
}

TEST(Engine, EmptyBatchSizesAreDerivedOnCudaOnly) {
  BucketSpec b = SmallBuckets();
  b.batch_sizes = {};
  try {
    MakeEngine(at::kCPU, false, b);
    FAIL() << "built";
  } catch (const EngineError& e) {
    EXPECT_EQ(e.code(), EngineError::Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("buckets.batch_sizes"), std::string::npos);
  }
}

TEST(Engine, OverlappedDecodeStepsEqualPlainSteps) {
  std::vector<GenerateRequest> reqs = MixedRequests();
  AddStopTokens(&reqs,
                Drive(*MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, false), reqs));
  const std::vector<Outcome> want =
      Drive(*MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, false), reqs, 5, 2);
  // The scenario covers what it claims.
  EXPECT_EQ(want[0].reason, FinishReason::kLength);
  EXPECT_EQ(want[2].reason, FinishReason::kStopToken);
  EXPECT_LE(want[2].tokens.size(), 3u);
  EXPECT_EQ(want[4].reason, FinishReason::kLength);
  EXPECT_EQ(want[4].tokens.size(), 34u);
  EXPECT_EQ(want[5].reason, FinishReason::kCancelled);
  EXPECT_EQ(want[5].tokens.size(), 2u);
  auto engine = MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, true);
  const std::vector<Outcome> got = Drive(*engine, reqs, 5, 2);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], want[i]) << "request " << i;
  EXPECT_EQ(engine->ActiveSequences(), 0);
  EXPECT_EQ(engine->FreeSlots(), 4);
}

// Note [KV pages per sequence]: with fewer KV pages than the slots' full contexts (6 pages of 16
// tokens; a sequence takes its prompt + max_new_tokens, request 4 all 4 pages of the longest
// context), requests wait for pages at the head of the queue, reuse the pages of sequences that
// ended (in another order than the first time: a row's positions are on scattered pages), and an
// overlapped step's one extra write for a sequence that ended on a stop token lands on its freed
// pages or scratch, never in a live sequence's: every request gets the tokens and ending it gets
// with a page per position of every slot, plain and overlapped, and every page comes back.
TEST(Engine, FewerKvPagesThanSlotsGiveTheSameTokens) {
  std::vector<GenerateRequest> reqs = MixedRequests();
  AddStopTokens(&reqs,
                Drive(*MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, false), reqs));
  const std::vector<Outcome> want =
      Drive(*MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, false), reqs, 5, 2);
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlapped" : "plain");
    auto engine = MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, overlap, 6);
    EXPECT_EQ(engine->Memory().kv_cache_pages, 6);
    EXPECT_EQ(engine->FreeKvPages(), 6);
    // Request 4 (30 + 34 tokens) takes all 4 pages of the longest context, request 0 (2 + 3)
    // one: together 5 of the 6, so request 1 (9 + 8 tokens, 2 pages) must wait.
    const ValidatedRequest r4 = engine->Validate(reqs[4]), r0 = engine->Validate(reqs[0]),
                           r1 = engine->Validate(reqs[1]);
    EXPECT_EQ(engine->KvPagesFor(r4), 4);
    EXPECT_EQ(engine->KvPagesFor(r0), 1);
    EXPECT_EQ(engine->KvPagesFor(r1), 2);
    EXPECT_EQ(engine->AdmissibleCount({&r4, &r0, &r1}), 2);
    // First come, first served: after one r4 the second does not fit, and r0 behind it waits.
    EXPECT_EQ(engine->AdmissibleCount({&r4, &r4, &r0}), 1);
    std::vector<TokenEvent> events;
    try {
      engine->Admit({r4, r0, r1}, &events);
      ADD_FAILURE() << "admitted more than its pages hold";
    } catch (const EngineError& e) {
      EXPECT_EQ(e.code(), EngineError::Code::kResourceExhausted);
      EXPECT_NE(std::string(e.what()).find("KV pages"), std::string::npos) << e.what();
    }
    EXPECT_EQ(engine->FreeKvPages(), 6) << "a refused admission holds no page";
    const std::vector<Outcome> got = Drive(*engine, reqs, 5, 2);
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], want[i]) << "request " << i;
    EXPECT_EQ(engine->ActiveSequences(), 0);
    EXPECT_EQ(engine->FreeKvPages(), 6);
    EXPECT_EQ(engine->Memory().kv_cache_pages_used, 0);
  }
  // Fewer pages than one sequence of the longest context (64 tokens = 4 pages) is refused.
  EXPECT_THROW(MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, false, 3), EngineError);
}

// Note [Graph memory pool]: a region's outputs are valid until the runner's next run of any
// bucket (on a GPU, an earlier-captured graph's replay overwrites a later graph's outputs where
// they sit in its intermediates). An overlapped engine queues decode step N + 1 fed with step N's
// tokens on the device, and admits new requests (a prefill run) in between: the tokens carried
// must not be a region output. With the eager runner's output lifetime check, such a carry reads
// poison (the lowest int64) and the embedding fails; on a GPU it read another graph's
// activations as token ids (a device-side assert in the gather).
TEST(Engine, OverlappedStepsCarryTheirTokensAcrossAPrefill) {
  std::vector<GenerateRequest> reqs = MixedRequests();
  auto plain = MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, false);
  const std::vector<Outcome> want = Drive(*plain, reqs);
  auto engine = MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, true);
  // Two greedy sequences decoding (one step queued ahead, carrying its greedy tokens: a sampled
  // step's tokens are a copy), then a third admitted: its prefill runs between the queued step and
  // the next one.
  std::vector<TokenEvent> events;
  std::map<SequenceId, size_t> owner;
  auto admit = [&](size_t k) {
    const auto ids = engine->Admit({engine->Validate(reqs[k])}, &events);
    owner[ids[0]] = k;
  };
  ASSERT_TRUE(reqs[0].sampling.greedy && reqs[2].sampling.greedy && reqs[3].sampling.greedy);
  admit(0);
  admit(2);
  engine->Step(&events);
  engine->Step(&events);
  admit(3);
  while (engine->ActiveSequences() > 0) engine->Step(&events);
  std::vector<Outcome> got(reqs.size());
  for (const TokenEvent& ev : events) {
    got[owner.at(ev.id)].tokens.push_back(ev.token);
    got[owner.at(ev.id)].reason = ev.reason;
  }
  for (size_t k : {0, 2, 3}) EXPECT_EQ(got[k], want[k]) << "request " << k;
}

TEST(StepRunner, EagerRunsPoisonWhatTheyReturnedAtTheNextRun) {
  EagerStepRunner runner;
  runner.set_check_output_lifetime(true);
  const BucketKey a{Region::kDecode, 1, 8, 0}, b{Region::kPrefill, 1, 8, 0};
  const at::Tensor input = at::arange(4, at::kLong);
  std::vector<at::Tensor> first, second;
  runner.Run(a, [&] { return std::vector<at::Tensor>{input, input.to(at::kFloat)}; }, false,
             &first);
  EXPECT_TRUE(at::equal(first[0], input));
  runner.Run(b, [&] { return std::vector<at::Tensor>{input * 2}; }, false, &second);
  EXPECT_TRUE(at::equal(second[0], input * 2));
  // The first run's outputs now read poison; the region's own tensors are untouched.
  EXPECT_TRUE(first[0].eq(std::numeric_limits<int64_t>::min()).all().item<bool>());
  EXPECT_TRUE(first[1].isnan().all().item<bool>());
  EXPECT_TRUE(at::equal(input, at::arange(4, at::kLong)));
  // A capture counts as a run; without checking, outputs are the region's own.
  runner.Capture(a, [] { return std::vector<at::Tensor>{}; });
  EXPECT_TRUE(second[0].eq(std::numeric_limits<int64_t>::min()).all().item<bool>());
  runner.set_check_output_lifetime(false);
  std::vector<at::Tensor> plain;
  runner.Run(a, [&] { return std::vector<at::Tensor>{input}; }, false, &plain);
  EXPECT_EQ(plain[0].data_ptr(), input.data_ptr());
}

TEST(Engine, OverlappedStepsSurviveTimeRegionAndRunEachStepOnce) {
  // A seeded sampled request (the tiny model's greedy output repeats one token, which would hide
  // a token fed to the wrong step): TimeRegion between two steps of an overlapped engine (it
  // replays the queued step's inputs) leaves its tokens those of a plain engine, and each decode
  // token costs one region run: the step that would follow the last one is never queued.
  GenerateRequest q = FixtureRequests(9)[1];
  q.sampling.greedy = false;
  q.sampling.seed = 7;
  auto run = [&](bool overlap, bool time_region, int64_t* decode_runs) {
    auto engine = MakeEngine(at::kCPU, false, SmallBuckets(), at::kFloat, overlap);
    std::vector<TokenEvent> events;
    engine->Admit({engine->Validate(q)}, &events);
    for (int i = 0; engine->ActiveSequences() > 0; ++i) {
      if (i == 3 && time_region)
        engine->TimeRegion(*engine->options().buckets.PickDecode(1, 16), 3);
      engine->Step(&events);
    }
    std::vector<int64_t> tokens;
    for (const auto& ev : events) tokens.push_back(ev.token);
    *decode_runs = 0;
    for (const auto& [k, n] : engine->Counters().eager_runs)
      if (k.rfind("decode/", 0) == 0) *decode_runs += n;
    return tokens;
  };
  int64_t plain_runs = 0, overlap_runs = 0;
  const std::vector<int64_t> want = run(false, false, &plain_runs);
  const std::vector<int64_t> got = run(true, true, &overlap_runs);
  ASSERT_EQ(want.size(), 9u);
  ASSERT_GE(std::set<int64_t>(want.begin(), want.end()).size(), 3u) << "tokens too uniform";
  EXPECT_EQ(got, want);
  EXPECT_EQ(plain_runs, 8);
  EXPECT_EQ(overlap_runs, 8);
}

TEST(Engine, EagerGenerationEqualsUpstreamFixture) {
  auto engine = MakeEngine(at::kCPU, false);
  const auto out = engine->Generate(FixtureRequests(6));
  const at::Tensor want = TinyReference().tensors.at("generated_ids");
  for (int64_t r = 0; r < 2; ++r) EXPECT_EQ(out[r], Row(want, r)) << "row " << r;
}

TEST(Engine, PaddedPrefillLogitsEqualUnpaddedForward) {
  auto engine = MakeEngine(at::kCPU, false);
  VisionLanguageModel ref = LoadModel(testing::TinyCheckpointDir());
  std::mt19937 rng(3);
  for (int64_t len : {1, 5, 8, 13, 32}) {
    ForwardRequest fr;
    fr.input_ids = RandomPrompt(rng, len, 1000);
    for (int64_t p = 0; p < len; ++p) fr.logits_positions.push_back(p);
    ForwardResult got = engine->Forward(engine->Validate(fr));
    EXPECT_GE(got.bucket.seq, len);
    at::NoGradGuard ng;
    at::Tensor want =
        ref->Forward(at::tensor(fr.input_ids, at::kLong).view({1, len}), {}).logits[0];
    at::Tensor got_t = at::empty({len, want.size(1)});
    for (int64_t p = 0; p < len; ++p) got_t[p] = at::tensor(got.logits[p]);
    EXPECT_LT(MaxAbsDiff(got_t, want), 1e-5) << "len " << len << " bucket " << got.bucket.Label();
  }
}

TEST(Engine, ForwardLossMatchesUpstreamLossPerRow) {
  auto engine = MakeEngine(at::kCPU, false);
  VisionLanguageModel ref = LoadModel(testing::TinyCheckpointDir());
  const auto& t = TinyReference().tensors;
  double total = 0;
  int64_t tokens = 0;
  for (int64_t r = 0; r < 2; ++r) {
    ForwardRequest fr;
    fr.input_ids = Row(t.at("input_ids"), r);
    fr.tiles = t.at("images").narrow(0, r, 1);
    fr.target_ids = Row(t.at("targets"), r);
    ForwardResult res = engine->Forward(engine->Validate(fr));
    total += res.loss * res.loss_tokens;
    tokens += res.loss_tokens;
  }
  // Upstream's loss is the mean over both rows' non-ignored targets.
  EXPECT_NEAR(total / tokens, 7.023092269897461, 1e-5);
}

TEST(Engine, BatchedMixedLengthsEqualUnbatchedReference) {
  auto engine = MakeEngine(at::kCPU, false);
  VisionLanguageModel ref = LoadModel(testing::TinyCheckpointDir());
  std::mt19937 rng(5);
  std::vector<GenerateRequest> reqs;
  for (int64_t len : {3, 17, 9, 30, 1, 12, 25}) {  // 7 requests > 4 slots: continuous batching
    GenerateRequest q;
    q.input_ids = RandomPrompt(rng, len, 1000);
    q.sampling.max_new_tokens = 2 + len % 5;
    reqs.push_back(q);
  }
  const auto out = engine->Generate(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_EQ(out[i].size(), static_cast<size_t>(reqs[i].sampling.max_new_tokens));
    EXPECT_EQ(out[i], ReferenceGreedy(ref, reqs[i])) << "request " << i;
  }
  const EngineCounters c = engine->Counters();
  EXPECT_GT(c.padded_tokens, c.real_tokens);
  EXPECT_EQ(c.eager_fallbacks, 0);
  EXPECT_EQ(c.TotalCaptures(), 0);  // CPU: eager only
}

// Fails every prefill batch while armed (an engine call that throws half-way through Admit).
class FailingPrefill : public EngineObserver {
 public:
  void OnBatch(Region region, int64_t) override {
    if (region == Region::kPrefill && armed) throw std::runtime_error("injected prefill failure");
  }
  bool armed = true;
};

TEST(Engine, FailedAdmitHoldsNoSlot) {
  auto engine = MakeEngine(at::kCPU, false);
  FailingPrefill observer;
  engine->SetObserver(&observer);
  auto reqs = FixtureRequests(4);
  std::vector<TokenEvent> events;
  EXPECT_THROW(engine->Admit({engine->Validate(reqs[0]), engine->Validate(reqs[1])}, &events),
               std::runtime_error);
  EXPECT_EQ(engine->FreeSlots(), 4);
  EXPECT_EQ(engine->ActiveSequences(), 0);
  observer.armed = false;
  EXPECT_EQ(engine->Generate({reqs[0], reqs[1]})[1].size(), 4u);  // serves on afterwards
  EXPECT_EQ(engine->DeviceFault(), "");                           // CPU: always usable
}

TEST(Engine, StopTokenEndsSequenceAndFreesSlot) {
  auto engine = MakeEngine(at::kCPU, false);
  auto reqs = FixtureRequests(6);
  reqs[0].sampling.stop_token_ids = {919};  // row 0's first generated token
  std::vector<TokenEvent> events;
  engine->Admit({engine->Validate(reqs[0])}, &events);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(events[0].finished);
  EXPECT_EQ(events[0].reason, FinishReason::kStopToken);
  EXPECT_EQ(engine->ActiveSequences(), 0);
}

TEST(Engine, OversizePromptRunsEagerOrIsRejected) {
  BucketSpec b = SmallBuckets();  // max seq 32, max context 64
  auto engine = MakeEngine(at::kCPU, false, b);
  VisionLanguageModel ref = LoadModel(testing::TinyCheckpointDir());
  std::mt19937 rng(9);
  GenerateRequest q;
  q.input_ids = RandomPrompt(rng, 40, 1000);
  q.sampling.max_new_tokens = 4;
  EXPECT_EQ(engine->Generate({q})[0], ReferenceGreedy(ref, q));
  EXPECT_EQ(engine->Counters().eager_fallbacks, 1);
  // Exact shapes share one counter per region, whatever their length.
  EXPECT_EQ(engine->Counters().eager_runs.at("prefill/exact"), 1);
  EXPECT_EQ(engine->Counters().eager_runs.count("prefill/b1xs40"), 0u);
  b.oversize = OversizePolicy::kReject;
  auto strict = MakeEngine(at::kCPU, false, b);
  try {
    strict->Validate(q);
    FAIL();
  } catch (const EngineError& e) {
    EXPECT_EQ(e.code(), EngineError::Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("largest prefill bucket (32)"), std::string::npos)
        << e.what();
  }
}

// A runner that "captures": records the buckets it ran, returns kCaptureAndReplay the first time.
class RecordingRunner : public StepRunner {
 public:
  double Capture(const BucketKey&, const RegionFn&) override { return 0; }
  RunKind Run(const BucketKey& key, const RegionFn& fn, bool capture_if_missing,
              std::vector<at::Tensor>* outputs) override {
    ran.push_back(key);
    *outputs = fn();
    const bool first = captured.insert(key.Label()).second;
    return first && capture_if_missing ? RunKind::kCaptureAndReplay : RunKind::kReplay;
  }
  bool Has(const BucketKey& key) const override { return captured.count(key.Label()) > 0; }
  bool captures() const override { return true; }
  int64_t graph_count() const override { return static_cast<int64_t>(captured.size()); }
  int64_t pool_bytes() const override { return 0; }
  std::vector<BucketKey> ran;
  std::set<std::string> captured;
};

TEST(RegionDispatcher, RunsTheBucketElseTheExactShapeAndReportsTheFallback) {
  RecordingRunner runner;
  std::vector<std::string> fallbacks;
  RegionDispatcher dispatch(&runner, [&](const BucketKey& exact, const std::string& reason) {
    fallbacks.push_back(exact.Label() + ": " + reason);
  });
  BucketSpec spec = SmallBuckets();
  const BucketKey exact{Region::kPrefill, 3, 20, 0};
  int filled = 0, exact_runs = 0;
  auto bucketed = [&](const BucketKey& key) -> RegionFn {
    ++filled;
    return [key] { return std::vector<at::Tensor>{at::full({key.batch}, 1.0)}; };
  };
  auto run_exact = [&] {
    ++exact_runs;
    return std::vector<at::Tensor>{at::full({3}, 2.0)};
  };
  // A bucket fits (3 x 20 -> 4 x 32): filled, run by the runner, captured on first use.
  DispatchResult r = dispatch.Run(spec.PickPrefill(3, 20), exact, bucketed, run_exact);
  EXPECT_TRUE(r.bucketed);
  EXPECT_EQ(r.key, (BucketKey{Region::kPrefill, 4, 32, 0}));
  EXPECT_EQ(r.kind, RunKind::kCaptureAndReplay);
  EXPECT_EQ(r.outputs[0].size(0), 4);
  EXPECT_EQ(dispatch.Run(spec.PickPrefill(3, 20), exact, bucketed, run_exact).kind,
            RunKind::kReplay);
  EXPECT_EQ(filled, 2);
  EXPECT_EQ(exact_runs, 0);
  EXPECT_TRUE(fallbacks.empty());
  // None fits (seq 40 > 32): the exact shape runs eagerly, counted once as a fallback.
  const BucketKey too_long{Region::kPrefill, 1, 40, 0};
  r = dispatch.Run(spec.PickPrefill(1, 40), too_long, bucketed, run_exact);
  EXPECT_FALSE(r.bucketed);
  EXPECT_EQ(r.key, too_long);
  EXPECT_EQ(r.kind, RunKind::kEager);
  EXPECT_EQ(r.outputs[0].size(0), 3);
  ASSERT_EQ(fallbacks.size(), 1u);
  EXPECT_EQ(fallbacks[0], "b1xs40: no bucket fits b1xs40");
  // Exact shapes asked for: runs eagerly, not a fallback.
  r = dispatch.Run(std::nullopt, exact, bucketed, run_exact, /*exact_requested=*/true);
  EXPECT_FALSE(r.bucketed);
  EXPECT_EQ(fallbacks.size(), 1u);
  EXPECT_EQ(exact_runs, 2);
  EXPECT_EQ(runner.ran.size(), 2u);
}

// A ValidatedRequest / ValidatedForward comes only from Engine::Validate.
static_assert(!std::is_constructible_v<ValidatedRequest, GenerateRequest>);
static_assert(!std::is_constructible_v<ValidatedForward, ForwardRequest>);
static_assert(!std::is_default_constructible_v<ValidatedRequest>);

TEST(Engine, ValidateForwardExplainsBadRequests) {
  auto engine = MakeEngine(at::kCPU, false);  // max context 64
  auto expect_invalid = [&](ForwardRequest r, const std::string& needle) {
    try {
      engine->Validate(r);
      FAIL() << "accepted; expected: " << needle;
    } catch (const EngineError& e) {
      EXPECT_EQ(e.code(), EngineError::Code::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  std::mt19937 rng(5);
  ForwardRequest ok;
  ok.input_ids = RandomPrompt(rng, 6, 1000);
  ok.target_ids = {1, 2, 3, 4, 5, -100};
  ok.logits_positions = {0, 5};
  const ValidatedForward v = engine->Validate(ok);
  EXPECT_EQ(v->input_ids, ok.input_ids);
  ForwardRequest r = ok;
  r.logits_positions = {6};
  expect_invalid(r, "logits position 6 is outside [0, 6)");
  r = ok;
  r.target_ids = {1, 2};
  expect_invalid(r, "target_ids");
  r = ok;
  r.input_ids = RandomPrompt(rng, engine->max_context() + 1, 1000);
  r.target_ids.clear();
  expect_invalid(r, "exceed the longest context bucket");
}

TEST(Engine, ValidateExplainsBadRequests) {
  auto engine = MakeEngine(at::kCPU, false);
  // Each refusal names its field (EngineError::field), and its message starts with that name.
  auto expect_invalid = [&](GenerateRequest r, const std::string& needle,
                            const std::string& field = "") {
    try {
      engine->Validate(r);
      FAIL() << "accepted; expected: " << needle;
    } catch (const EngineError& e) {
      EXPECT_EQ(e.code(), EngineError::Code::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_FALSE(e.field().empty()) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind(e.field(), 0), 0u) << e.field() << " / " << e.what();
      if (!field.empty()) EXPECT_EQ(e.field(), field) << e.what();
      EXPECT_FALSE(e.context_overflow().has_value()) << e.what();
    }
  };
  GenerateRequest ok = FixtureRequests(4)[0];
  engine->Validate(ok);
  GenerateRequest r = ok;
  r.input_ids[7] = 1066;
  expect_invalid(r, "input_ids[7] = 1066 is outside the vocabulary", "input_ids");
  r = ok;
  r.tiles = at::Tensor();
  expect_invalid(r, "has 4 image tokens");
  r = ok;
  r.tiles = at::cat({ok.tiles, ok.tiles});
  expect_invalid(r, "must hold exactly 8 image tokens");
  r = ok;
  r.tiles = at::zeros({1, 3, 32, 32});
  expect_invalid(r, "image tiles must be (N, 3, 64, 64)", "tiles");
  r = ok;
  r.sampling.max_new_tokens = 0;
  expect_invalid(r, "sampling.max_new_tokens: must be >= 1, got 0", "sampling.max_new_tokens");
  r = ok;
  r.input_ids.clear();
  r.tiles = at::Tensor();
  expect_invalid(r, "input_ids is empty");
  r = ok;
  r.sampling.greedy = false;
  r.sampling.top_p = 0;
  expect_invalid(r, "sampling.top_p: must lie in (0, 1]", "sampling.top_p");
  r = ok;
  r.sampling.greedy = false;
  r.sampling.temperature = std::numeric_limits<double>::infinity();
  expect_invalid(r, "must be > 0 when sampling", "sampling.temperature");
  r.sampling.temperature = 1;
  r.sampling.top_k = -1;
  expect_invalid(r, "must be >= 0", "sampling.top_k");
  r = ok;
  r.sampling.stop_token_ids = {3, 1066};
  expect_invalid(r, "stop token id 1066 is outside the vocabulary", "sampling.stop_token_ids");
  // Unsampled, the sampling parameters are not read and not checked.
  r = ok;
  r.sampling.top_p = 0;
  r.sampling.temperature = 0;
  EXPECT_NO_THROW(engine->Validate(r));

  // Too long for the context: context_overflow() carries the numbers a protocol words its error
  // with (prompt tokens, max_new_tokens, longest context; 0 new tokens: the prompt alone).
  auto overflow = [&](const GenerateRequest& q) {
    try {
      engine->Validate(q);
    } catch (const EngineError& e) {
      EXPECT_TRUE(e.context_overflow().has_value()) << e.what();
      return std::make_pair(e, e.context_overflow().value_or(ContextOverflow{}));
    }
    ADD_FAILURE() << "accepted";
    return std::make_pair(EngineError(EngineError::Code::kInternal, ""), ContextOverflow{});
  };
  const int64_t len = static_cast<int64_t>(ok.input_ids.size());
  r = ok;
  r.sampling.max_new_tokens = 100;
  auto [error, o] = overflow(r);
  EXPECT_EQ(error.field(), "sampling.max_new_tokens");
  EXPECT_NE(std::string(error.what()).find("lower max_new_tokens to at most 48"), std::string::npos)
      << error.what();
  EXPECT_EQ(o.prompt_tokens, len);
  EXPECT_EQ(o.max_new_tokens, 100);
  EXPECT_EQ(o.max_context, engine->max_context());
  r = ok;
  r.input_ids.resize(engine->max_context(), 5);  // no room left for a new token
  r.sampling.max_new_tokens = 0;                 // the context is checked first
  std::tie(error, o) = overflow(r);
  EXPECT_EQ(error.field(), "input_ids");
  EXPECT_EQ(o.prompt_tokens, engine->max_context());
  EXPECT_EQ(o.max_new_tokens, 0);
}

// The server's limits.max_new_tokens, as an engine option: refused with the key named; 0 = none.
TEST(Engine, ValidateRefusesMaxNewTokensAboveTheLimit) {
  GenerateRequest r = FixtureRequests(4)[0];
  r.sampling.max_new_tokens = 9;
  auto engine = MakeEngine(at::kCPU, false);
  ASSERT_EQ(engine->options().max_new_tokens_limit, 0);
  EXPECT_NO_THROW(engine->Validate(r));
  EngineOptions o = engine->options();
  o.max_new_tokens_limit = 8;
  const Engine limited(LoadModel(testing::TinyCheckpointDir()), o);
  try {
    limited.Validate(r);
    FAIL() << "accepted";
  } catch (const EngineError& e) {
    EXPECT_EQ(e.field(), "sampling.max_new_tokens");
    EXPECT_EQ(
        std::string(e.what()),
        "sampling.max_new_tokens: 9 exceeds this server's limit of 8 (limits.max_new_tokens)");
  }
  r.sampling.max_new_tokens = 8;
  EXPECT_NO_THROW(limited.Validate(r));
}

// Seeded sampling end to end: a request repeats its tokens, batched with other requests (greedy
// and sampled, before and after it) it still gets them, another seed gets others, and top-1
// sampling is greedy. (The sampler's own tests: tests/sampler_test.cc.)
TEST(Engine, SeededSamplingRepeatsWhateverIsBatchedWithIt) {
  auto engine = MakeEngine(at::kCPU, false);
  GenerateRequest q = FixtureRequests(8)[0];
  q.sampling.greedy = false;
  q.sampling.temperature = 5.0;  // flat enough that different seeds differ
  q.sampling.seed = 42;
  const auto a = engine->Generate({q})[0];
  EXPECT_EQ(engine->Generate({q})[0], a);
  GenerateRequest other = q;
  other.sampling.seed = 9;
  const auto batch = engine->Generate({FixtureRequests(8)[1], q, other});
  EXPECT_EQ(batch[1], a);
  EXPECT_NE(batch[2], a);
  q.sampling.seed = 43;
  EXPECT_NE(engine->Generate({q})[0], a);
  q.sampling.top_k = 1;  // top-1 sampling is greedy
  EXPECT_EQ(engine->Generate({q})[0], engine->Generate({FixtureRequests(8)[0]})[0]);
}

// ---------------------------------------------------------------------------------------------
// GPU: CUDA graph replay against eager.

TEST(EngineGraphs, ReplayEqualsEagerForEveryRegion_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  // Graphs with overlapped decode steps (on by default on CUDA) against eager plain steps.
  auto graphed = MakeEngine(at::kCUDA, true);
  auto eager = MakeEngine(at::kCUDA, false, SmallBuckets(), at::kFloat, false);
  graphed->Warmup();
  ASSERT_TRUE(graphed->graphs_enabled());
  const int64_t captured = graphed->Counters().TotalCaptures();
  EXPECT_EQ(captured, 3 * 3 + 3 * 2 + 2);  // prefill 3x3, decode 3x2, vision 2
  std::mt19937 rng(11);
  // Prefill (several buckets) through Forward, vision through the fixture's image prompts.
  for (int64_t len : {3, 8, 20, 31}) {
    ForwardRequest fr;
    fr.input_ids = RandomPrompt(rng, len, 1000);
    fr.logits_positions = {0, len - 1};
    auto g = graphed->Forward(graphed->Validate(fr)), e = eager->Forward(eager->Validate(fr));
    EXPECT_TRUE(g.graphed);
    for (int k = 0; k < 2; ++k)
      EXPECT_LT(MaxAbsDiff(at::tensor(g.logits[k]), at::tensor(e.logits[k])), 1e-4);
  }
  // Vision + prefill + decode through generation, batches of 1..4 with mixed lengths.
  std::vector<GenerateRequest> reqs = FixtureRequests(6);
  for (int64_t len : {4, 16, 9}) {
    GenerateRequest q;
    q.input_ids = RandomPrompt(rng, len, 1000);
    q.sampling.max_new_tokens = 10;
    reqs.push_back(q);
  }
  EXPECT_EQ(graphed->Generate(reqs), eager->Generate(reqs));
  EXPECT_EQ(graphed->Counters().TotalCaptures(), captured);
  EXPECT_GT(graphed->Counters().TotalReplays(), 0);
}

TEST(EngineGraphs, DecodeGraphReproducesUpstreamGreedyTokens_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  auto engine = MakeEngine(at::kCUDA, true);
  engine->Warmup();
  const auto out = engine->Generate(FixtureRequests(6));
  const at::Tensor want = TinyReference().tensors.at("generated_ids");
  for (int64_t r = 0; r < 2; ++r) EXPECT_EQ(out[r], Row(want, r));
  EXPECT_GT(engine->Counters().replays.count("decode/b2xc32"), 0u);
}

TEST(EngineGraphs, OverlappedDecodeStepsEqualPlainSteps_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  auto plain = MakeEngine(at::kCUDA, true, SmallBuckets(), at::kFloat, false);
  auto overlapped = MakeEngine(at::kCUDA, true, SmallBuckets(), at::kFloat, true);
  plain->Warmup();
  overlapped->Warmup();
  const int64_t captured = overlapped->Counters().TotalCaptures();
  std::vector<GenerateRequest> reqs = MixedRequests();
  AddStopTokens(&reqs, Drive(*plain, reqs));
  const std::vector<Outcome> want = Drive(*plain, reqs, 5, 2);
  EXPECT_EQ(want[2].reason, FinishReason::kStopToken);
  EXPECT_EQ(want[5].reason, FinishReason::kCancelled);
  const std::vector<Outcome> got = Drive(*overlapped, reqs, 5, 2);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], want[i]) << "request " << i;
  EXPECT_EQ(overlapped->Counters().TotalCaptures(), captured);
  EXPECT_EQ(overlapped->Counters().eager_fallbacks, 0);
}

TEST(EngineGraphs, ManyShapesCauseNoNewCapturesAfterWarmup_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  auto engine = MakeEngine(at::kCUDA, true, SmallBuckets(), at::kBFloat16);
  engine->Warmup();
  const int64_t captured = engine->Counters().TotalCaptures();
  std::mt19937 rng(13);
  const auto fixture = FixtureRequests(4);
  for (int round = 0; round < 12; ++round) {
    std::vector<GenerateRequest> reqs;
    const int n = 1 + round % 6;
    for (int i = 0; i < n; ++i) {
      GenerateRequest q = (i % 3 == 0) ? fixture[i % 2] : GenerateRequest{};
      if (i % 3 != 0) q.input_ids = RandomPrompt(rng, 1 + (round * 7 + i * 5) % 32, 1000);
      q.sampling.max_new_tokens = 1 + (round + i) % 20;
      reqs.push_back(q);
    }
    engine->Generate(reqs);
  }
  const EngineCounters c = engine->Counters();
  EXPECT_EQ(c.TotalCaptures(), captured);
  EXPECT_EQ(c.eager_fallbacks, 0);
  EXPECT_GT(c.TotalReplays(), 50);
  const MemoryStats m = engine->Memory();
  EXPECT_GT(m.graph_pool_bytes, 0);
  EXPECT_GE(m.reserved_bytes, m.allocated_bytes);
}

// With batch_sizes left empty the engine sizes the KV cache from the device's free memory after
// loading the weights: its slots are what the cap allows, and the cache, the pool and the weights
// stay within the utilisation.
TEST(EngineGraphs, EmptyBatchSizesAreDerivedFromDeviceMemory_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  BucketSpec b = SmallBuckets();
  b.batch_sizes = {};
  b.max_decode_batch = 24;
  b.max_prefill_batch = 4;
  auto engine = MakeEngine(at::kCUDA, true, b, at::kBFloat16);
  EXPECT_EQ(engine->options().buckets.batch_sizes, (std::vector<int64_t>{1, 2, 4, 8, 16, 24}));
  EXPECT_EQ(engine->FreeSlots(), 24);
  engine->Warmup();
  const EngineCounters c = engine->Counters();
  EXPECT_EQ(c.captures.count("decode/b24xc64"), 1u);
  EXPECT_EQ(c.captures.count("prefill/b8xs32"), 0u);  // above max_prefill_batch
  const MemoryStats m = engine->Memory();
  // Paged: what memory holds after the weights and the pool estimate, far more than the 24 slots'
  // 64 tokens (Note [KV pages per sequence]); the bytes are the pages' (and the scratch page's).
  EXPECT_GE(m.kv_cache_pages * m.kv_cache_page_size, 24 * 64);
  EXPECT_EQ(m.kv_cache_bytes,
            (m.kv_cache_pages + 1) * KvCacheBytes(engine->model_config(), m.kv_cache_page_size, 2));
  EXPECT_EQ(engine->FreeKvPages(), m.kv_cache_pages);
  const DeviceCapacity cap = DeviceMemoryCapacity(at::Device(at::kCUDA, 0));
  EXPECT_GT(cap.total_bytes, 0);
  EXPECT_LE(cap.total_bytes - cap.free_bytes, 0.9 * cap.total_bytes);
  std::vector<GenerateRequest> reqs(30, FixtureRequests(1)[0]);
  for (auto& r : reqs) r.sampling.max_new_tokens = 4;
  for (const auto& tokens : engine->Generate(reqs)) EXPECT_EQ(tokens.size(), 4u);
  EXPECT_EQ(engine->Counters().TotalCaptures(), c.TotalCaptures());
}

// Note [Capture guard]: a region that throws inside its capture (after the two warm-up calls) or
// invalidates it (a synchronising .item()) leaves no capture behind: another thread can still
// allocate device memory (an abandoned capture in global mode forbids cudaMalloc to every thread),
// the runner captures and replays a good region, the abandoned captures' holds on the graph pool
// are released with the runner, and an engine then serves the reference tokens.
TEST(CudaGraphCapture, ARegionThatThrowsEndsItsCaptureAndTheDeviceServesOn_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuBLAS(false);
  const at::Device cuda(at::kCUDA, 0);
  at::Tensor x = at::ones({256, 256}, at::TensorOptions().device(cuda));
  ReleaseCachedMemory(cuda);
  const int64_t reserved_before = DeviceMemory(cuda).reserved_bytes;
  {
    auto runner = MakeCudaGraphStepRunner(0);
    ASSERT_NE(runner, nullptr);
    const BucketKey thrown{Region::kPrefill, 1, 16, 0}, synced{Region::kPrefill, 2, 16, 0};
    int calls = 0;
    EXPECT_THROW(runner->Capture(thrown,
                                 [&] {
                                   at::Tensor y = x * 2 + 1;
                                   if (++calls == 3) throw std::runtime_error("region failed");
                                   return std::vector<at::Tensor>{y};
                                 }),
                 std::runtime_error);
    EXPECT_EQ(calls, 3);
    EXPECT_FALSE(runner->Has(thrown));
    calls = 0;
    EXPECT_ANY_THROW(runner->Capture(synced, [&] {
      at::Tensor y = x.sum();
      if (++calls == 3) (void)y.item<float>();
      return std::vector<at::Tensor>{y};
    }));
    EXPECT_FALSE(runner->Has(synced));
    EXPECT_EQ(runner->graph_count(), 0);
    bool other_thread_ok = false;
    std::thread other([&] {
      at::Tensor fresh = at::ones({64 << 20}, at::TensorOptions().dtype(at::kByte).device(cuda));
      other_thread_ok = fresh.sum().item<int64_t>() == (int64_t{64} << 20);
    });
    other.join();
    EXPECT_TRUE(other_thread_ok);
    std::vector<at::Tensor> out;
    EXPECT_EQ(runner->Run(thrown, [&] { return std::vector<at::Tensor>{x * 3}; }, true, &out),
              RunKind::kCaptureAndReplay);
    EXPECT_EQ(out[0].sum().item<double>(), 3.0 * 256 * 256);
    EXPECT_EQ(runner->graph_count(), 1);
  }
  ReleaseCachedMemory(cuda);
  EXPECT_EQ(DeviceMemory(cuda).reserved_bytes, reserved_before);
  {
    auto engine = MakeEngine(at::kCUDA, true);
    engine->Warmup();
    const auto generated = engine->Generate(FixtureRequests(6));
    const at::Tensor want = TinyReference().tensors.at("generated_ids");
    for (int64_t r = 0; r < 2; ++r) EXPECT_EQ(generated[r], Row(want, r));
  }
}

// Note [Capture mode]: while one thread captures, another thread of the process allocates fresh
// device memory (a cudaMalloc) and synchronises on its own stream, as a second engine's GPU thread
// does; in global capture mode both calls fail.
TEST(CudaGraphCapture, AnotherThreadAllocatesAndSynchronisesWhileAGraphCaptures_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
#if VLMGRAPH_WITH_CUDA
  const at::Device cuda(at::kCUDA, 0);
  at::Tensor x = at::ones({1024}, at::TensorOptions().device(cuda));
  auto runner = MakeCudaGraphStepRunner(0);
  ASSERT_NE(runner, nullptr);
  std::promise<void> capturing, allocated;
  std::shared_future<void> allocated_done = allocated.get_future().share();
  int calls = 0;
  std::string other_error;
  int64_t other_sum = 0;
  std::thread other([&, started = capturing.get_future()]() mutable {
    started.wait();
    try {
      c10::cuda::CUDAStreamGuard stream(c10::cuda::getStreamFromPool(false, 0));
      // An odd size no cached block fits: the allocator calls cudaMalloc.
      at::Tensor fresh =
          at::ones({(int64_t{300} << 20) + 4093}, at::TensorOptions().dtype(at::kByte).device(cuda));
      other_sum = fresh.sum().item<int64_t>();
    } catch (const std::exception& e) {
      other_error = e.what();
    }
    allocated.set_value();
  });
  runner->Capture(BucketKey{Region::kDecode, 1, 32, 0}, [&] {
    at::Tensor y = x * 2;
    if (++calls == 3) {  // inside the capture
      capturing.set_value();
      allocated_done.wait_for(std::chrono::seconds(60));
    }
    return std::vector<at::Tensor>{y};
  });
  other.join();
  EXPECT_EQ(other_error, "");
  EXPECT_EQ(other_sum, (int64_t{300} << 20) + 4093);
  EXPECT_TRUE(runner->Has(BucketKey{Region::kDecode, 1, 32, 0}));
#endif
}

// Note [Graph memory pool]: graphs share one pool, so the output of a graph captured later can sit
// in an intermediate of a graph captured earlier, and every replay of that graph overwrites it.
// Here the first graph's intermediate (x + 7, 4 MiB) is free once its capture ends; the second
// graph's output has its size, so the pool gives it that block. This is why a run's outputs are
// valid only until the runner's next run of any bucket, and the engine carries decode tokens in a
// buffer of its own.
TEST(CudaGraphCapture, AnEarlierGraphsReplayOverwritesALaterGraphsOutput_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
#if VLMGRAPH_WITH_CUDA
  const at::Device cuda(at::kCUDA, 0);
  const at::Tensor x = at::full({int64_t{1} << 20}, 1.0, at::TensorOptions().device(cuda));
  auto runner = MakeCudaGraphStepRunner(0);
  ASSERT_NE(runner, nullptr);
  const BucketKey first{Region::kPrefill, 1, 16, 0}, second{Region::kDecode, 1, 16, 0};
  const RegionFn first_fn = [&] {
    const at::Tensor t = x + 7;
    return std::vector<at::Tensor>{t.sum()};
  };
  const RegionFn second_fn = [&] { return std::vector<at::Tensor>{x * 3}; };
  runner->Capture(first, first_fn);
  // The caching allocator reuses a free block only for the stream it was allocated on, and each
  // capture runs on the next of c10's 32 pool streams (getStreamFromPool, round robin): take 31
  // so that the second capture runs on the first one's stream, as every 32nd capture of
  // Engine::Warmup does.
  for (int i = 0; i < 31; ++i) (void)c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  runner->Capture(second, second_fn);
  std::vector<at::Tensor> second_out, first_out;
  runner->Run(second, second_fn, false, &second_out);
  const at::Tensor kept = second_out[0];
  EXPECT_TRUE(kept.eq(3).all().item<bool>());
  runner->Run(first, first_fn, false, &first_out);
  EXPECT_EQ(first_out[0].item<double>(), 8.0 * (int64_t{1} << 20));
  EXPECT_TRUE(kept.eq(8).all().item<bool>())
      << "the second graph's output was not in the first graph's intermediate: the allocator "
         "placed it elsewhere, so this test does not show the overwrite";
#endif
}

// Note [Static input check]: a static input reallocated after capture (set_ to new storage) makes
// the replay throw, naming the input, instead of reading stale memory; unchecked, it replays.
TEST(CudaGraphCapture, ReplayRefusesAStaticInputThatMoved_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
  const at::Device cuda(at::kCUDA, 0);
  at::Tensor x = at::ones({1024}, at::TensorOptions().device(cuda));
  auto runner = MakeCudaGraphStepRunner(0);
  ASSERT_NE(runner, nullptr);
  runner->WatchStaticInputs([&] { return std::vector<at::Tensor>{x}; });
  runner->set_check_static_inputs(true);
  const BucketKey key{Region::kDecode, 1, 32, 0};
  const RegionFn fn = [&] { return std::vector<at::Tensor>{x * 2}; };
  std::vector<at::Tensor> out;
  runner->Run(key, fn, true, &out);
  runner->Run(key, fn, false, &out);  // unmoved: replays
  EXPECT_EQ(out[0].sum().item<double>(), 2048.0);
  x.set_(at::full({1024}, 5.0, x.options()));
  try {
    runner->Run(key, fn, false, &out);
    ADD_FAILURE() << "replayed a graph whose static input moved";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("static input 0"), std::string::npos) << e.what();
  }
  runner->set_check_static_inputs(false);
  EXPECT_EQ(runner->Run(key, fn, false, &out), RunKind::kReplay);
}

// A Train job captures graphs of its own and destroys them at its end. What they leave behind
// stays until ReleaseCachedMemory (engine/device.h): c10's CUDA caching allocator keeps each
// destroyed graph's private pool reserved on the device, and the pinned host allocator keeps the
// bookkeeping of each capture's private pool on the host heap. Many short jobs would grow both.
TEST(DeviceMemory, ReleaseCachedMemoryFreesWhatDestroyedGraphsLeft_CUDA) {
  VLMGRAPH_REQUIRE_CUDA();
#if !defined(__GLIBC__)
  GTEST_SKIP() << "needs glibc's mallinfo2 to read the heap";
#else
  const at::Device cuda(at::kCUDA, 0);
  at::Tensor x = at::ones({1024, 1024}, at::TensorOptions().device(cuda));  // 4 MiB input
  auto job = [&] {  // a runner, as a Train job holds: two captures in its pool, then destroyed
    auto runner = MakeCudaGraphStepRunner(0);
    ASSERT_NE(runner, nullptr);
    for (int64_t batch : {1, 2}) {
      runner->Capture(BucketKey{Region::kPrefill, batch, 16, 0},
                      [&] { return std::vector<at::Tensor>{(x * 2 + 1).sum(0)}; });
    }
  };
  auto heap_in_use_bytes = [] {
    const struct mallinfo2 m = mallinfo2();
    return static_cast<int64_t>(m.uordblks + m.hblkhd);
  };
  job();
  ReleaseCachedMemory(cuda);
  const int64_t reserved_before = DeviceMemory(cuda).reserved_bytes;
  const int64_t heap_before = heap_in_use_bytes();
  constexpr int kJobs = 48;
  for (int i = 0; i < kJobs; ++i) job();
  // What is left behind (the test's premise): reserved device pools and heap of each job.
  EXPECT_GT(DeviceMemory(cuda).reserved_bytes, reserved_before);
  EXPECT_GT(heap_in_use_bytes() - heap_before, kJobs * (16 << 10));
  ReleaseCachedMemory(cuda);
  EXPECT_EQ(DeviceMemory(cuda).reserved_bytes, reserved_before);
  EXPECT_LT(heap_in_use_bytes() - heap_before, kJobs * (4 << 10));
#endif
}

}  // namespace
}  // namespace vlmgraph
