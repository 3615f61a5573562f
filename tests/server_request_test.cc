// Request conversion and checks (server/grpc/convert.h, server/train/checkpoint_dir.h), the one
// exception -> status mapping (server/core/status.h) and the metrics (server/core/metrics.h): names
// fixed by docs/metrics.md, labels, and the /metrics HTTP endpoint.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <regex>
#include <set>
#include <sstream>

#include "base/atomic_file.h"
#include "base/log.h"
#include "engine/engine.h"
#include "engine/engine_types.h"
#include "image/image_processor.h"
#include "server/config/config.h"
#include "server/core/metrics.h"
#include "server/core/status.h"
#include "server/grpc/convert.h"
#include "server/train/checkpoint_dir.h"
#include "tests/tiny_engine.h"

namespace vlmgraph::server {
namespace {

Limits TestLimits() {
  Limits l = FillDefaults(RawConfig{}).limits;
  l.max_new_tokens = 100;
  l.default_max_new_tokens = 7;
  l.max_images_per_request = 2;
  l.max_logits_positions = 2;
  return l;
}

const VlmConfig& Tiny() {
  static const VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
  return cfg;
}

// The status an expression's exception maps to.
template <typename F>
grpc::Status StatusOf(F&& f) {
  try {
    f();
  } catch (...) {
    return StatusFromException(std::current_exception());
  }
  return grpc::Status::OK;
}

TEST(ServerConvert, SamplingDefaults) {
  v1::GenerateRequest r;
  r.add_input_ids(5);
  GenerateRequest g = ToEngineRequest(r, Tiny(), TestLimits());
  EXPECT_EQ(g.sampling.max_new_tokens, 7);  // unset -> default
  EXPECT_TRUE(g.sampling.greedy);
  EXPECT_FALSE(g.tiles.defined());
  r.mutable_sampling()->set_max_new_tokens(3);
  r.mutable_sampling()->set_sample(true);
  r.mutable_sampling()->set_temperature(0.7);
  r.mutable_sampling()->set_top_p(0.9);
  g = ToEngineRequest(r, Tiny(), TestLimits());
  EXPECT_EQ(g.sampling.max_new_tokens, 3);
  EXPECT_FALSE(g.sampling.greedy);
  EXPECT_DOUBLE_EQ(g.sampling.temperature, 0.7);
  EXPECT_DOUBLE_EQ(g.sampling.top_p, 0.9);
}

// Engine::Validate's limit is the one the conversion's limits name.
const Engine& TinyEngine() {
  const Engine& engine = testing::TinyServingEngine();
  EXPECT_EQ(engine.options().max_new_tokens_limit, TestLimits().max_new_tokens);
  return engine;
}

// One place decides: requests that ToEngineRequest converts without complaint, which
// Engine::Validate alone refuses, with INVALID_ARGUMENT and the gRPC request's field path.
TEST(ServerValidate, EngineValidateDecidesAndErrorsNameTheGrpcFields) {
  struct Case {
    std::function<void(v1::GenerateRequest*)> set;
    std::string message_start;
  };
  const std::vector<Case> cases = {
      {[](v1::GenerateRequest* r) { r->mutable_sampling()->set_max_new_tokens(0); },
       "sampling.max_new_tokens: must be >= 1, got 0"},
      {[](v1::GenerateRequest* r) { r->mutable_sampling()->set_max_new_tokens(-4); },
       "sampling.max_new_tokens: must be >= 1, got -4"},
      {[](v1::GenerateRequest* r) { r->mutable_sampling()->set_max_new_tokens(101); },
       "sampling.max_new_tokens: 101 exceeds this server's limit of 100 (limits.max_new_tokens)"},
      {[](v1::GenerateRequest* r) { r->mutable_sampling()->set_max_new_tokens(31); },
       "sampling.max_new_tokens: prompt (2 tokens) + max_new_tokens (31) exceeds the longest "
       "context bucket (32 tokens)"},
      {[](v1::GenerateRequest* r) {
         for (int i = 0; i < 30; ++i) r->add_input_ids(5);
       },
       "input_ids: prompt of 32 tokens leaves no room for a new token"},
      {[](v1::GenerateRequest* r) {
         r->mutable_sampling()->set_sample(true);
         r->mutable_sampling()->set_temperature(0);
       },
       "sampling.temperature: must be > 0 when sampling"},
      {[](v1::GenerateRequest* r) {
         r->mutable_sampling()->set_sample(true);
         r->mutable_sampling()->set_temperature(std::numeric_limits<double>::infinity());
       },
       "sampling.temperature: must be > 0 when sampling"},
      {[](v1::GenerateRequest* r) {
         r->mutable_sampling()->set_sample(true);
         r->mutable_sampling()->set_top_p(1.5);
       },
       "sampling.top_p: must lie in (0, 1]"},
      {[](v1::GenerateRequest* r) {
         r->mutable_sampling()->set_sample(true);
         r->mutable_sampling()->set_top_k(-1);
       },
       "sampling.top_k: must be >= 0"},
      {[](v1::GenerateRequest* r) { r->mutable_sampling()->add_stop_token_ids(99999); },
       "sampling.stop_token_ids: stop token id 99999 is outside the vocabulary"},
      {[](v1::GenerateRequest* r) { r->set_input_ids(1, 99999); },
       "input_ids[1] = 99999 is outside the vocabulary"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::GenerateRequest r;
    r.add_input_ids(5);
    r.add_input_ids(6);
    cases[i].set(&r);
    GenerateRequest g;
    ASSERT_NO_THROW(g = ToEngineRequest(r, Tiny(), TestLimits())) << "case " << i;
    const grpc::Status s = StatusOf([&] { (void)TinyEngine().Validate(g); });
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "case " << i;
    EXPECT_EQ(s.error_message().rfind(cases[i].message_start, 0), 0u)
        << "case " << i << ": " << s.error_message();
  }
  v1::GenerateRequest ok;
  ok.add_input_ids(5);
  ok.mutable_sampling()->set_max_new_tokens(30);
  const ValidatedRequest v = TinyEngine().Validate(ToEngineRequest(ok, Tiny(), TestLimits()));
  EXPECT_EQ(v->sampling.max_new_tokens, 30);
}

TEST(ServerConvert, TensorImages) {
  v1::GenerateRequest r;
  r.add_input_ids(5);
  // Ready tiles (N, 3, S, S) pass through unchanged.
  v1::FloatTensor* t = r.add_images()->mutable_tensor();
  for (int64_t d : {2, 3, 64, 64}) t->add_shape(d);
  for (int i = 0; i < 2 * 3 * 64 * 64; ++i) t->add_values(static_cast<float>(i % 7) / 7.0f);
  GenerateRequest g = ToEngineRequest(r, Tiny(), TestLimits());
  ASSERT_EQ(g.tiles.sizes(), (std::vector<int64_t>{2, 3, 64, 64}));
  EXPECT_FLOAT_EQ(g.tiles[0][0][0][3].item<float>(), 3.0f / 7.0f);
  // A (3, H, W) image is resized and tiled like a decoded one.
  t->clear_shape();
  t->clear_values();
  for (int64_t d : {3, 30, 45}) t->add_shape(d);
  for (int i = 0; i < 3 * 30 * 45; ++i) t->add_values(0.5f);
  EXPECT_EQ(ToEngineRequest(r, Tiny(), TestLimits()).tiles.size(0), 13);
  // Wrong value count, out-of-range values, bad shapes.
  t->add_values(0.5f);
  grpc::Status s = StatusOf([&] { ToEngineRequest(r, Tiny(), TestLimits()); });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("images[0].tensor.values"), std::string::npos)
      << s.error_message();
  t->mutable_values()->RemoveLast();
  // Each value outside [0, 1] is named with its index, inf as inf and NaN as nan.
  const std::vector<std::pair<float, std::string>> bad = {
      {2.0f, "images[0].tensor.values[7]: 2 is outside [0, 1]"},
      {std::numeric_limits<float>::infinity(), "images[0].tensor.values[7]: not finite: inf"},
      {-std::numeric_limits<float>::infinity(), "images[0].tensor.values[7]: not finite: -inf"},
      {std::numeric_limits<float>::quiet_NaN(), "images[0].tensor.values[7]: not finite: nan"}};
  for (const auto& [value, message] : bad) {
    t->set_values(7, value);
    s = StatusOf([&] { ToEngineRequest(r, Tiny(), TestLimits()); });
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(s.error_message().rfind(message, 0), 0u) << s.error_message();
  }
  t->clear_shape();
  for (int64_t d : {4, 30, 45}) t->add_shape(d);
  s = StatusOf([&] { ToEngineRequest(r, Tiny(), TestLimits()); });
  EXPECT_NE(s.error_message().find("images[0].tensor.shape"), std::string::npos)
      << s.error_message();
}

TEST(ServerConvert, ImageCountAndEmptyImages) {
  v1::GenerateRequest r;
  r.add_input_ids(5);
  r.add_images();
  grpc::Status s = StatusOf([&] { ToEngineRequest(r, Tiny(), TestLimits()); });
  EXPECT_NE(s.error_message().find("images[0]: empty image"), std::string::npos)
      << s.error_message();
  r.mutable_images(0)->set_encoded("not an image");
  s = StatusOf([&] { ToEngineRequest(r, Tiny(), TestLimits()); });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("images[0]: unknown image format"), std::string::npos)
      << s.error_message();
  r.add_images();
  r.add_images();
  s = StatusOf([&] { ToEngineRequest(r, Tiny(), TestLimits()); });
  EXPECT_NE(s.error_message().find("limits.max_images_per_request"), std::string::npos)
      << s.error_message();
}

TEST(ServerConvert, ForwardAndTrainChecks) {
  v1::ForwardRequest f;
  f.add_input_ids(1);
  for (int i = 0; i < 3; ++i) f.add_logits_positions(0);
  EXPECT_EQ(StatusOf([&] { ToEngineRequest(f, Tiny(), TestLimits()); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  v1::TrainBatch b;
  v1::TrainExample* ex = b.add_examples();
  for (int64_t id : {1, 2, 3}) ex->add_input_ids(id);
  for (int64_t id : {2, 3}) ex->add_target_ids(id);
  grpc::Status s = StatusOf([&] { ToTrainBatch(b, Tiny(), TestLimits(), 64); });
  EXPECT_NE(s.error_message().find("batch.examples[0].target_ids"), std::string::npos)
      << s.error_message();
  ex->add_target_ids(5000);
  s = StatusOf([&] { ToTrainBatch(b, Tiny(), TestLimits(), 64); });
  EXPECT_NE(s.error_message().find("target_ids[2]"), std::string::npos) << s.error_message();
  ex->set_target_ids(2, -100);
  EXPECT_EQ(ToTrainBatch(b, Tiny(), TestLimits(), 64).size(), 1u);
  ex->set_input_ids(0, Tiny().image_token_id);  // an image token with no image
  s = StatusOf([&] { ToTrainBatch(b, Tiny(), TestLimits(), 64); });
  EXPECT_NE(s.error_message().find("image tokens"), std::string::npos) << s.error_message();
  ex->set_input_ids(0, 1);
  s = StatusOf([&] { ToTrainBatch(b, Tiny(), TestLimits(), 2); });
  EXPECT_NE(s.error_message().find("longest context"), std::string::npos) << s.error_message();
  for (int i = 0; i < 3; ++i) ex->set_target_ids(i, -100);
  EXPECT_EQ(StatusOf([&] { ToTrainBatch(b, Tiny(), TestLimits(), 64); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// TrainConfig's learning rates (Note [Learning rates]): unset fields take upstream nanoVLM's
// defaults, each set one is checked against [0, 1] (INVALID_ARGUMENT "config.<field>: ..."), and
// trainable_parts freezes (rate 0) every part it does not list.
TEST(ServerConvert, TrainConfigLearningRates) {
  v1::TrainConfig c;
  EXPECT_EQ(ToLearningRates(c), LearningRates());
  c.set_vision_learning_rate(0);
  c.set_language_learning_rate(1e-3);
  EXPECT_EQ(ToLearningRates(c), (LearningRates{/*projector=*/5.12e-3, /*vision=*/0, 1e-3}));
  c.add_trainable_parts(v1::MODEL_PART_PROJECTOR);
  EXPECT_EQ(ToLearningRates(c), (LearningRates{/*projector=*/5.12e-3, 0, /*language=*/0}));
  c.add_trainable_parts(v1::MODEL_PART_LANGUAGE);
  EXPECT_EQ(ToLearningRates(c), (LearningRates{5.12e-3, 0, /*language=*/1e-3}));
  c.add_trainable_parts(v1::MODEL_PART_UNSPECIFIED);
  grpc::Status s = StatusOf([&] { ToLearningRates(c); });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message().rfind("config.trainable_parts[2]: must be MODEL_PART_VISION", 0), 0u)
      << s.error_message();
  c.clear_trainable_parts();
  c.set_projector_learning_rate(1.5);
  s = StatusOf([&] { ToLearningRates(c); });
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(
      s.error_message().rfind("config.projector_learning_rate: must lie in [0, 1], got 1.5", 0), 0u)
      << s.error_message();
}

TEST(ServerConvert, CheckpointDirectoriesStayUnderTheRoot) {
  EXPECT_EQ(CheckpointDirComponents("run1/step_10"), (std::vector<std::string>{"run1", "step_10"}));
  for (const char* bad : {"", "../etc", "a/../../b", "/abs", "a b", "a;b"}) {
    EXPECT_EQ(StatusOf([&] { CheckpointDirComponents(bad); }).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << bad;
  }
}

// A scratch directory tree for checkpoint names, removed with unlink/rmdir (not
// std::filesystem::remove_all: the pip LibTorch exports an incompatible copy of it).
class CheckpointRoot {
 public:
  CheckpointRoot() {
    std::string pattern = ::testing::TempDir() + "vlmgraph_ckpt_XXXXXX";
    base_ = ::mkdtemp(pattern.data()) ? pattern : "";
    EXPECT_FALSE(base_.empty());
  }
  ~CheckpointRoot() {
    for (auto it = made_.rbegin(); it != made_.rend(); ++it) {
      if (::unlink(it->c_str()) != 0) ::rmdir(it->c_str());
    }
    ::rmdir(base_.c_str());
  }
  const std::string& base() const { return base_; }
  std::string Dir(const std::string& rel) { return Made(rel, ::mkdir(Path(rel).c_str(), 0755)); }
  std::string File(const std::string& rel) {
    std::ofstream(Path(rel)) << "x";
    return Made(rel, 0);
  }
  std::string Link(const std::string& rel, const std::string& target) {
    return Made(rel, ::symlink(target.c_str(), Path(rel).c_str()));
  }
  // Removes `rel` (made by the code under test) with the rest.
  void Adopt(const std::string& rel) { made_.push_back(Path(rel)); }

 private:
  std::string Path(const std::string& rel) const { return base_ + "/" + rel; }
  std::string Made(const std::string& rel, int rc) {
    EXPECT_EQ(rc, 0) << rel;
    made_.push_back(Path(rel));
    return made_.back();
  }
  std::string base_;
  std::vector<std::string> made_;
};

TEST(ServerConvert, CheckpointDirectoriesRefuseLinksFilesAndTheRootItself) {
  CheckpointRoot t;
  const std::string root = t.Dir("root"), outside = t.Dir("outside");
  t.Dir("root/real");
  t.File("root/afile");
  t.Link("root/escape", outside);        // a link that leaves the root
  t.Link("root/inner", root + "/real");  // even one that stays inside: links are refused
  t.Link("rootlink", root);              // the root itself may be a link: it is resolved first
  char* canonical = ::realpath(root.c_str(), nullptr);
  ASSERT_NE(canonical, nullptr);
  const std::string canonical_root(canonical);
  std::free(canonical);
  EXPECT_EQ(OpenCheckpointDir(root, "run1/step_10").path, canonical_root + "/run1/step_10");
  t.Adopt("root/run1");
  t.Adopt("root/run1/step_10");
  EXPECT_EQ(OpenCheckpointDir(root, "real/x").path, canonical_root + "/real/x");
  t.Adopt("root/real/x");
  EXPECT_EQ(OpenCheckpointDir(t.base() + "/rootlink", "a.b").path, canonical_root + "/a.b");
  t.Adopt("root/a.b");
  // Without create (resume_from), a missing directory is refused, and nothing is made.
  EXPECT_NE(StatusOf([&] { OpenCheckpointDir(root, "none/x", "config.resume_from", false); })
                .error_message()
                .find("config.resume_from: 'none' does not exist"),
            std::string::npos);
  struct stat st {};
  EXPECT_NE(::lstat((root + "/none").c_str(), &st), 0);
  const std::string long_component(300, 'a');
  std::string long_name;
  while (long_name.size() <= 1024) long_name += "abcdefgh/";
  long_name += "x";
  const std::vector<std::pair<std::string, std::string>> refused = {
      {".", "'.' component"},
      {"./", "'.' component"},
      {"a/./b", "'.' component"},
      {"a//b", "empty"},
      {"a/", "empty"},
      {long_component, "at most 255"},
      {"run/" + long_component + "/x", "at most 255"},
      {long_name, "at most 1024"},
      {"escape", "must stay inside train.checkpoint_dir"},
      {"escape/x", "must stay inside train.checkpoint_dir"},
      {"inner/x", "symbolic link"},
      {"afile", "is a file"},
      {"afile/x", "is a file"},
      {"afile/x/y", "is a file"},
  };
  for (const auto& [name, message] : refused) {
    const grpc::Status s = StatusOf([&] { OpenCheckpointDir(root, name); });
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << name << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(message), std::string::npos)
        << name << ": " << s.error_message();
  }
}

// Note [Checkpoint directories]: a save writes through the directory that was opened and
// checked. Swapping that path for a link to another directory afterwards (a local user racing
// the save) moves nothing outside the root: the files land in the opened directory, wherever it
// now is, and the next open refuses the link.
TEST(ServerConvert, ACheckpointDirectoryStaysTheOneOpenedWhenItsPathIsSwappedForALink) {
  CheckpointRoot t;
  const std::string root = t.Dir("root"), outside = t.Dir("outside");
  t.Dir("root/race");
  const CheckpointDir dir = OpenCheckpointDir(root, "race");
  ASSERT_EQ(::rename((root + "/race").c_str(), (root + "/moved").c_str()), 0);
  t.Adopt("root/moved");
  t.Link("root/race", outside);
  WriteFileAtomically(dir.io_path() + "/config.json", "{}");
  t.Adopt("root/moved/config.json");
  struct stat st {};
  EXPECT_EQ(::lstat((root + "/moved/config.json").c_str(), &st), 0);
  EXPECT_NE(::lstat((outside + "/config.json").c_str(), &st), 0) << "the save left the root";
  const grpc::Status again = StatusOf([&] { OpenCheckpointDir(root, "race"); });
  EXPECT_EQ(again.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(again.error_message().find("symbolic link"), std::string::npos) << again.error_message();
}

TEST(ServerLog, LogSafeEscapesControlBytesAndCutsLongText) {
  EXPECT_EQ(LogSafe("req-1"), "req-1");
  EXPECT_EQ(LogSafe("a\nI forged] line\r\tz"), "a\\nI forged] line\\r\\tz");
  EXPECT_EQ(LogSafe(std::string("x\0y\x1b[31m\x7f\\", 10)), "x\\x00y\\x1b[31m\\x7f\\\\");
  EXPECT_EQ(LogSafe("h\xc3\xa9llo"), "h\xc3\xa9llo");  // UTF-8 kept
  EXPECT_EQ(LogSafe(std::string(1000, 'x'), 4), "xxxx...(1000 bytes)");
  EXPECT_EQ(LogSafe("ab\xc3\xa9", 3), "ab...(4 bytes)");  // not cut inside a character
  const std::string huge(1 << 20, '\n');
  const std::string safe = LogSafe(huge);
  EXPECT_LE(safe.size(), 4 * 128 + 32u);
  EXPECT_EQ(safe.find('\n'), std::string::npos);
  EXPECT_NE(safe.find("(1048576 bytes)"), std::string::npos) << safe;
}

// The prompt alone fills the longest context: the message says to shorten the prompt, and by how
// much, not to lower max_new_tokens to 0.
TEST(ServerValidate, PromptThatFillsTheContextIsTooLong) {
  EngineOptions o;
  o.buckets.batch_sizes = {1};
  o.buckets.seq_lens = {16};
  o.buckets.context_lens = {32, 64};
  o.buckets.tile_counts = {1};
  o.buckets.train_batch_sizes = {1};
  o.buckets.train_seq_lens = {16};
  o.log_captures = false;
  const Engine engine(VisionLanguageModel(VlmConfig::Preset("nanovlm-tiny")), o);
  auto message = [&](int64_t prompt, int64_t max_new) {
    GenerateRequest r;
    r.input_ids.assign(prompt, 5);
    r.sampling.max_new_tokens = max_new;
    try {
      engine.Validate(r);
    } catch (const EngineError& e) {
      EXPECT_EQ(e.code(), EngineError::Code::kInvalidArgument);
      return std::string(e.what());
    }
    return std::string();
  };
  for (const auto& [prompt, over] : {std::pair<int64_t, int64_t>{64, 1}, {70, 7}}) {
    const std::string m = message(prompt, 1);
    EXPECT_EQ(m.find("max_new_tokens to at most"), std::string::npos) << m;
    EXPECT_NE(m.find("prompt of " + std::to_string(prompt) + " tokens"), std::string::npos) << m;
    EXPECT_NE(m.find("shorten it by at least " + std::to_string(over) + " token"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("longest context bucket (64 tokens)"), std::string::npos) << m;
  }
  EXPECT_NE(message(60, 10).find("lower max_new_tokens to at most 4"), std::string::npos);
  EXPECT_EQ(message(63, 1), "");
}

TEST(ServerStatus, OnePlaceMapsEveryErrorKind) {
  using C = grpc::StatusCode;
  EXPECT_EQ(StatusOf([] { throw ServerError(C::RESOURCE_EXHAUSTED, "full"); }).error_code(),
            C::RESOURCE_EXHAUSTED);
  EXPECT_EQ(
      StatusOf([] { throw EngineError(EngineError::Code::kInvalidArgument, "x"); }).error_code(),
      C::INVALID_ARGUMENT);
  EXPECT_EQ(
      StatusOf([] { throw EngineError(EngineError::Code::kResourceExhausted, "x"); }).error_code(),
      C::RESOURCE_EXHAUSTED);
  EXPECT_EQ(
      StatusOf([] { throw EngineError(EngineError::Code::kFailedPrecondition, "x"); }).error_code(),
      C::FAILED_PRECONDITION);
  EXPECT_EQ(StatusOf([] { throw EngineError(EngineError::Code::kUnavailable, "x"); }).error_code(),
            C::UNAVAILABLE);
  EXPECT_EQ(StatusOf([] { throw EngineError(EngineError::Code::kInternal, "x"); }).error_code(),
            C::INTERNAL);
  EXPECT_EQ(StatusOf([] { throw ImageError("bad"); }).error_code(), C::INVALID_ARGUMENT);
  EXPECT_EQ(StatusOf([] { throw std::invalid_argument("bad"); }).error_code(), C::INVALID_ARGUMENT);
  EXPECT_EQ(StatusOf([] { throw std::bad_alloc(); }).error_code(), C::RESOURCE_EXHAUSTED);
  EXPECT_EQ(StatusOf([] { at::ones({2}).view({3}); }).error_code(), C::INTERNAL);
  EXPECT_EQ(StatusOf([] { throw 42; }).error_code(), C::INTERNAL);
  const grpc::Status s =
      StatusOf([] { throw EngineError(EngineError::Code::kInvalidArgument, "say what"); });
  EXPECT_EQ(s.error_message(), "say what");
  EXPECT_STREQ(StatusCodeName(C::INVALID_ARGUMENT), "INVALID_ARGUMENT");
}

// Every metric name of docs/metrics.md's table.
std::set<std::string> DocumentedMetrics() {
  std::ifstream in(std::string(VLMGRAPH_FIXTURES_DIR) + "/../../docs/metrics.md");
  std::set<std::string> names;
  const std::regex row(R"(^\| `((?:vlmgraph|process)_[a-z_]+)` \|)");
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, row)) names.insert(m[1]);
  }
  return names;
}

TEST(ServerMetrics, ExportsExactlyTheDocumentedNames) {
  Metrics metrics;
  // One observation of everything, so every labelled family has a series.
  EngineMetrics& gpu = metrics.ForGpu("0");
  const BucketKey prefill{Region::kPrefill, 2, 64, 0};
  gpu.OnCapture(prefill, 0.5);
  gpu.OnStep(prefill, true, 0.001);
  gpu.OnStep(BucketKey{Region::kDecode, 2, 128, 0}, false, 0.002);
  gpu.OnEagerFallback(Region::kPrefill, "no bucket fits b1xs300");
  gpu.OnTokens(Region::kPrefill, 100, 128);
  gpu.OnBatch(Region::kDecode, 2);
  gpu.ObserveQueueTime("Generate", 0.01);
  metrics.ObserveTimeToFirstToken(0.02);
  metrics.ObserveInterTokenLatency(0.003);
  metrics.ObserveRequest("Generate", grpc::StatusCode::INVALID_ARGUMENT, 0.1);
  metrics.ObserveHttpRequest("/v1/chat/completions", 429, 0.2);
  metrics.AddGeneratedTokens(5);
  gpu.SetQueueDepth(3);
  gpu.SetActiveSequences(2);
  MemoryStats memory{10, 20, 30, 40};
  memory.kv_cache_pages = 8;
  memory.kv_cache_pages_used = 2;
  gpu.SetMemory(memory);
  metrics.ObserveTrainStep(64, 2.5, 1e-3, /*skipped=*/false);
  metrics.ObserveTrainStep(64, NAN, 1e-3, /*skipped=*/true);
  metrics.AddTrainPublish();
  const std::string text = metrics.Render();

  std::set<std::string> exported;
  const std::regex type_line(R"(# TYPE (\S+) (\S+))");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), type_line);
       it != std::sregex_iterator(); ++it) {
    exported.insert((*it)[1]);
  }
  const std::set<std::string> documented = DocumentedMetrics();
  ASSERT_GE(documented.size(), 20u);
  EXPECT_EQ(exported, documented);

  EXPECT_NE(text.find(R"(vlmgraph_graph_replays_total{bucket="b2xs64",gpu="0",region="prefill"} 1)"),
            std::string::npos);
  EXPECT_NE(text.find("vlmgraph_train_skipped_steps_total 1\n"), std::string::npos);
  EXPECT_NE(text.find("vlmgraph_train_steps_total 2\n"), std::string::npos);
  EXPECT_NE(text.find("vlmgraph_train_loss 2.5\n"), std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_eager_runs_total{bucket="b2xc128",gpu="0",region="decode"} 1)"),
            std::string::npos);
  EXPECT_NE(
      text.find(R"(vlmgraph_eager_fallbacks_total{gpu="0",reason="no bucket fits",region="prefill"} 1)"),
      std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_tokens_total{gpu="0",kind="padded",region="prefill"} 128)"),
            std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_requests_total{code="INVALID_ARGUMENT",rpc="Generate"} 1)"),
            std::string::npos);
  EXPECT_NE(
      text.find(
          R"(vlmgraph_step_latency_seconds_count{bucket="b2xs64",gpu="0",mode="graph",region="prefill"} 1)"),
      std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_kv_cache_bytes{gpu="0"} 40)"), std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_kv_cache_usage_ratio{gpu="0"} 0.25)"), std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_engine_healthy{gpu="0"} 1)"), std::string::npos);
  EXPECT_NE(text.find("vlmgraph_train_loss 2.5"), std::string::npos);
  EXPECT_NE(
      text.find(R"(vlmgraph_http_requests_total{endpoint="/v1/chat/completions",status="429"} 1)"),
      std::string::npos);
  EXPECT_NE(
      text.find(
          R"(vlmgraph_http_request_duration_seconds_count{endpoint="/v1/chat/completions"} 1)"),
      std::string::npos);
}

TEST(ServerMetrics, ConfiguredBucketsStartAtZero) {
  Metrics metrics;
  BucketSpec spec;
  spec.batch_sizes = {1, 2};
  spec.seq_lens = {16};
  spec.context_lens = {32};
  spec.tile_counts = {1, 2};
  spec.Validate();
  EngineMetrics& gpu = metrics.ForGpu("0");
  gpu.InitBuckets(spec);
  const std::string text = metrics.Render();
  EXPECT_NE(text.find(R"(vlmgraph_graph_captures_total{bucket="t2",gpu="0",region="vision"} 0)"),
            std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_graph_replays_total{bucket="b2xc32",gpu="0",region="decode"} 0)"),
            std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_eager_runs_total{bucket="b1xs16",gpu="0",region="prefill"} 0)"),
            std::string::npos);
  EXPECT_NE(
      text.find(R"(vlmgraph_eager_fallbacks_total{gpu="0",reason="no bucket fits",region="train"} 0)"),
      std::string::npos);
  EXPECT_EQ(text.find(R"(bucket="b4xs16")"), std::string::npos);  // only configured buckets
}

TEST(ServerMetrics, ExactShapesShareOneSeries) {
  // Runs at shapes that are not configured buckets (oversize prompts of any length) must not add
  // a series each: a long-running server would grow without bound.
  Metrics metrics;
  BucketSpec spec;
  spec.batch_sizes = {1, 2};
  spec.seq_lens = {16};
  spec.context_lens = {32};
  spec.Validate();
  EngineMetrics& gpu = metrics.ForGpu("0");
  gpu.InitBuckets(spec);
  for (int64_t len = 17; len < 40; ++len) {
    gpu.OnStep(BucketKey{Region::kPrefill, 1, len, 0}, /*graphed=*/false, 0.001);
  }
  gpu.OnStep(BucketKey{Region::kPrefill, 1, 16, 0}, /*graphed=*/false, 0.001);
  metrics.OnCapture(BucketKey{Region::kTrain, 0, 0, 0}, 0.5);  // a trainer's optimizer graph
  const std::string text = metrics.Render();
  EXPECT_NE(text.find(R"(vlmgraph_eager_runs_total{bucket="exact",gpu="0",region="prefill"} 23)"),
            std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_eager_runs_total{bucket="b1xs16",gpu="0",region="prefill"} 1)"),
            std::string::npos);
  EXPECT_NE(text.find(R"(vlmgraph_graph_captures_total{bucket="b0xs0",gpu="0",region="train"} 1)"),
            std::string::npos);
  EXPECT_EQ(text.find(R"(bucket="b1xs17")"), std::string::npos);
  EXPECT_EQ(text.find(R"(bucket="b1xs39")"), std::string::npos);
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return "";
  }
  // Connection: close, so that the server ends the response by closing (not after keep-alive).
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

TEST(ServerMetrics, ServesMetricsOverHttp) {
  Metrics metrics(ListenAddress::Parse("127.0.0.1:0"));
  ASSERT_GT(metrics.port(), 0);
  metrics.AddGeneratedTokens(3);
  const std::string ok = HttpGet(metrics.port(), "/metrics");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200 OK", 0), 0u) << ok.substr(0, 200);
  EXPECT_NE(ok.find("text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(ok.find("vlmgraph_generated_tokens_total 3"), std::string::npos);
  EXPECT_EQ(HttpGet(metrics.port(), "/other").rfind("HTTP/1.1 404", 0), 0u);
  // A second endpoint on the same port fails with the address in the message.
  try {
    Metrics clash(ListenAddress::Parse("127.0.0.1:" + std::to_string(metrics.port())));
    FAIL() << "bound a port twice";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("server.metrics_address"), std::string::npos);
  }
}

}  // namespace
}  // namespace vlmgraph::server
