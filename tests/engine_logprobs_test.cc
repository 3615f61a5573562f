// Engine logprobs (engine/logprobs.h): each new token's logprob and top alternatives, and a
// prompt's (echo), against log_softmax of the model's own logits from an unbatched scoring pass;
// prompt chunks; requests that ask for none get the tokens they got before; validation.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <vector>

#include "engine/engine.h"
#include "engine/logprobs.h"
#include "model/checkpoint.h"
#include "tests/engine_fixtures.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

constexpr float kTolerance = 1e-4f;  // float32 CPU: the same model, batched against unbatched

std::unique_ptr<Engine> MakeEngine(bool overlap) {
  EngineOptions o;
  o.buckets = testing::SmallBuckets();
  o.log_captures = false;
  o.overlap_decode_steps = overlap;
  o.check_graphs = true;  // a region output read after the runner's next run reads poison
  return std::make_unique<Engine>(LoadModel(testing::TinyCheckpointDir()), o);
}

GenerateRequest Prompt(uint32_t seed, int64_t len, int64_t max_new) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> d(0, 999);
  GenerateRequest q;
  for (int64_t i = 0; i < len; ++i) q.input_ids.push_back(d(rng));
  q.sampling.max_new_tokens = max_new;
  return q;
}

// What one request got, by request index.
struct Got {
  std::vector<int64_t> tokens;
  std::vector<std::optional<TokenLogprob>> logprobs;
  std::shared_ptr<const std::vector<TokenLogprob>> prompt;
};

// Admits every request at once (they fit the slots), then steps until all end.
std::vector<Got> RunAll(Engine& engine, const std::vector<GenerateRequest>& reqs) {
  std::vector<ValidatedRequest> batch;
  for (const auto& r : reqs) batch.push_back(engine.Validate(r));
  std::vector<TokenEvent> events;
  const std::vector<SequenceId> ids = engine.Admit(std::move(batch), &events);
  std::map<SequenceId, size_t> owner;
  for (size_t k = 0; k < ids.size(); ++k) owner[ids[k]] = k;
  std::vector<Got> out(reqs.size());
  auto take = [&] {
    for (TokenEvent& ev : events) {
      Got& g = out[owner.at(ev.id)];
      g.tokens.push_back(ev.token);
      g.logprobs.push_back(ev.logprob);
      if (ev.prompt_logprobs) {
        EXPECT_EQ(g.prompt, nullptr) << "prompt logprobs come once";
        EXPECT_EQ(g.tokens.size(), 1u) << "prompt logprobs come with the first token";
        g.prompt = ev.prompt_logprobs;
      }
    }
    events.clear();
  };
  take();
  while (engine.ActiveSequences() > 0) {
    engine.Step(&events);
    take();
  }
  return out;
}

// log_softmax of the engine's unbatched scoring logits (Engine::Forward) at every position of
// `ids`: (len, V) float32.
at::Tensor ReferenceLogprobs(Engine& engine, const std::vector<int64_t>& ids) {
  ForwardRequest f;
  f.input_ids = ids;
  for (int64_t p = 0; p < static_cast<int64_t>(ids.size()); ++p) f.logits_positions.push_back(p);
  const ForwardResult r = engine.Forward(engine.Validate(f));
  std::vector<at::Tensor> rows;
  for (const auto& row : r.logits) rows.push_back(at::tensor(row));
  return at::log_softmax(at::stack(rows), 1);
}

// `got` equals reference row `row` at `token`, and its top entries are the row's largest, in
// descending order, with the token's own logprob wherever the token is among them.
void ExpectLogprob(const TokenLogprob& got, const at::Tensor& row, int64_t token, int64_t top,
                   const std::string& where) {
  EXPECT_NEAR(got.logprob, row[token].item<float>(), kTolerance) << where;
  ASSERT_EQ(static_cast<int64_t>(got.top.size()), top) << where;
  const auto [values, ids] = row.topk(top);
  for (int64_t j = 0; j < top; ++j) {
    EXPECT_NEAR(got.top[j].second, values[j].item<float>(), kTolerance) << where << " top " << j;
    EXPECT_NEAR(got.top[j].second, row[got.top[j].first].item<float>(), kTolerance) << where;
    if (j > 0) EXPECT_GE(got.top[j - 1].second, got.top[j].second) << where;
    if (got.top[j].first == token) EXPECT_EQ(got.top[j].second, got.logprob) << where;
  }
}

TEST(Logprobs, RowsAreLogSoftmaxAtTheTokenAndItsTopK) {
  const at::Tensor logits = at::randn({3, 50}) * 4;
  const at::Tensor tokens = at::tensor(std::vector<int64_t>{7, 0, 49});
  const LogprobRows rows = LogprobsOfRows(logits.to(at::kBFloat16), tokens, 5).To(at::kCPU);
  const std::vector<TokenLogprob> got = ToTokenLogprobs(rows, {5, 2, 0});
  const at::Tensor want = at::log_softmax(logits.to(at::kBFloat16).to(at::kFloat), 1);
  for (int64_t r = 0; r < 3; ++r) {
    ExpectLogprob(got[r], want[r], tokens[r].item<int64_t>(), std::vector<int64_t>{5, 2, 0}[r],
                  "row " + std::to_string(r));
  }
}

TEST(Logprobs, PromptChunksEqualOnePass) {
  auto engine = MakeEngine(false);
  const GenerateRequest q = Prompt(3, 23, 1);
  const at::Tensor want = ReferenceLogprobs(*engine, q.input_ids);
  VisionLanguageModel& m = engine->model();
  at::NoGradGuard no_grad;
  const at::Tensor ids = at::tensor(q.input_ids).view({1, -1});
  const at::Tensor hidden = m->decoder->Forward(m->Embed(ids, at::Tensor())).select(0, 0);
  auto head = [&](const at::Tensor& h) { return m->decoder->Logits(h); };
  // One position per chunk, a chunk that does not divide the prompt, and one chunk for all.
  for (int64_t chunk : {1, 5, 64}) {
    const std::vector<TokenLogprob> got = PromptLogprobs(head, hidden, q.input_ids, 3, chunk);
    ASSERT_EQ(got.size(), q.input_ids.size() - 1);
    for (size_t p = 0; p + 1 < q.input_ids.size(); ++p) {
      ExpectLogprob(got[p], want[static_cast<int64_t>(p)], q.input_ids[p + 1], 3,
                    "chunk " + std::to_string(chunk) + " position " + std::to_string(p));
    }
  }
  EXPECT_EQ(PromptLogprobChunkPositions(49218, kPromptLogprobChunkBytes), 340);
  EXPECT_EQ(PromptLogprobChunkPositions(1 << 30, kPromptLogprobChunkBytes), 1);
}

// Greedy and sampled requests, plain and overlapped decode steps, batched with a request that asks
// for nothing: each new token's logprob is log_softmax of the unbatched logits before it, and the
// prompt's are those of the prompt's own positions.
TEST(Logprobs, NewAndPromptTokensEqualTheModelsLogSoftmax) {
  for (bool overlap : {false, true}) {
    auto engine = MakeEngine(overlap);
    std::vector<GenerateRequest> reqs = {Prompt(1, 7, 6), Prompt(2, 12, 5), Prompt(4, 3, 4)};
    reqs[0].logprobs = {true, 4, true, 2};
    reqs[1].logprobs = {true, 0, false, 0};
    reqs[1].sampling.greedy = false;
    reqs[1].sampling.temperature = 0.7;  // logprobs stay those of the raw logits
    reqs[1].sampling.seed = 5;
    const std::vector<Got> got = RunAll(*engine, reqs);
    for (size_t k = 0; k < 2; ++k) {
      const std::string where =
          "overlap " + std::to_string(overlap) + " request " + std::to_string(k);
      const GenerateRequest& q = reqs[k];
      ASSERT_EQ(got[k].tokens.size(), static_cast<size_t>(q.sampling.max_new_tokens)) << where;
      std::vector<int64_t> all = q.input_ids;
      all.insert(all.end(), got[k].tokens.begin(), got[k].tokens.end());
      const at::Tensor want = ReferenceLogprobs(*engine, all);
      const int64_t len = static_cast<int64_t>(q.input_ids.size());
      for (size_t i = 0; i < got[k].tokens.size(); ++i) {
        ASSERT_TRUE(got[k].logprobs[i].has_value()) << where << " token " << i;
        ExpectLogprob(*got[k].logprobs[i], want[len - 1 + static_cast<int64_t>(i)],
                      got[k].tokens[i], q.logprobs.top, where + " token " + std::to_string(i));
      }
      if (!q.logprobs.prompt) {
        EXPECT_EQ(got[k].prompt, nullptr) << where;
        continue;
      }
      ASSERT_NE(got[k].prompt, nullptr) << where;
      ASSERT_EQ(got[k].prompt->size(), q.input_ids.size() - 1) << where;
      for (size_t p = 0; p + 1 < q.input_ids.size(); ++p) {
        ExpectLogprob((*got[k].prompt)[p], want[static_cast<int64_t>(p)], q.input_ids[p + 1],
                      q.logprobs.prompt_top, where + " prompt " + std::to_string(p));
      }
    }
    for (const auto& lp : got[2].logprobs) EXPECT_FALSE(lp.has_value());
    EXPECT_EQ(got[2].prompt, nullptr);
  }
}

TEST(Logprobs, AskingChangesNoToken) {
  std::vector<GenerateRequest> reqs = {Prompt(5, 9, 7), Prompt(6, 20, 7), Prompt(7, 4, 7)};
  reqs[1].sampling.greedy = false;
  reqs[1].sampling.seed = 11;
  auto plain = MakeEngine(true);
  const std::vector<Got> want = RunAll(*plain, reqs);
  for (auto& q : reqs) q.logprobs = {true, 20, true, 20};
  auto asking = MakeEngine(true);
  const std::vector<Got> got = RunAll(*asking, reqs);
  for (size_t k = 0; k < reqs.size(); ++k) EXPECT_EQ(got[k].tokens, want[k].tokens) << k;
}

TEST(Logprobs, ValidateRefusesMoreThanTwentyAlternatives) {
  auto engine = MakeEngine(false);
  GenerateRequest q = Prompt(1, 4, 2);
  q.logprobs = {true, 21, false, 0};
  try {
    engine->Validate(q);
    FAIL() << "top 21 accepted";
  } catch (const EngineError& e) {
    EXPECT_EQ(e.field(), "logprobs.top");
    EXPECT_NE(std::string(e.what()).find("[0, 20]"), std::string::npos) << e.what();
  }
  q.logprobs = {true, 3, true, -1};
  try {
    engine->Validate(q);
    FAIL() << "prompt_top -1 accepted";
  } catch (const EngineError& e) {
    EXPECT_EQ(e.field(), "logprobs.prompt_top");
  }
  q.logprobs = {true, 20, true, 20};
  EXPECT_NO_THROW(engine->Validate(q));
}

}  // namespace
}  // namespace vlmgraph
