// Config parsing, safetensors I/O and nanoVLM checkpoint load/save.
#include "model/checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <system_error>

#include "model/layers.h"
#include "model/recompute.h"
#include "model/weight_init.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

namespace fs = std::filesystem;

fs::path TempDir(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("vlmgraph_test_" + name + "_" + std::to_string(::getpid()));
  testing::RemoveFlatDirectory(p.string());
  fs::create_directories(p);
  return p;
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(WeightInit, DenseLayersStartAsUpstreamOrSkipTheDraw) {
  // Upstream's _init_weights: weight ~ N(0, 0.02), bias 0, in one draw.
  Dense dense(512, 256, /*bias=*/true);
  EXPECT_NEAR(dense->weight.std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(dense->weight.mean().item<double>(), 0.0, 0.001);
  EXPECT_TRUE(at::equal(dense->bias, at::zeros({256})));
  EXPECT_NEAR(EmbeddingTable(1000, 64)->weight.std().item<double>(), 0.02, 0.001);
  const VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
  EXPECT_NEAR(VisionLanguageModel(cfg)->decoder->token_embedding->weight.std().item<double>(),
              0.02, 0.005);
  // Skipped: the layers draw nothing from the generator; guards nest.
  at::manual_seed(7);
  const double want = at::randn({1}).item<double>();
  at::manual_seed(7);
  {
    SkipWeightInit outer;
    {
      SkipWeightInit inner;
      Dense skipped(512, 256, true);
      EmbeddingTable table(1000, 64);
    }
    EXPECT_TRUE(WeightInitSkipped());
  }
  EXPECT_FALSE(WeightInitSkipped());
  EXPECT_EQ(at::randn({1}).item<double>(), want);
  // LoadModel skips the draw and still takes every tensor from the checkpoint.
  VisionLanguageModel loaded = LoadModel(testing::TinyCheckpointDir());
  const auto file = ReadSafetensors(testing::TinyCheckpointDir() + "/model.safetensors");
  auto params = loaded->named_parameters();
  for (const auto& b : loaded->named_buffers()) params.insert(b.key(), b.value());  // inv_freq
  for (const auto& [name, t] : file.tensors) {
    // The tied head is stored once, under the head's name.
    const std::string key =
        name == "decoder.head.weight" && !params.contains(name) ? "decoder.token_embedding.weight"
                                                                : name;
    ASSERT_TRUE(params.contains(key)) << key;
    EXPECT_TRUE(at::equal(params[key], t.to(params[key].scalar_type()))) << key;
  }
}

TEST(Recompute, RunsTheBlockAgainInBackwardWithTheSameGradients) {
  at::manual_seed(3);
  Dense fc1(16, 32, true), fc2(32, 16, true);
  int calls = 0;
  RecomputeFn block = [&](const at::Tensor& h) {
    ++calls;
    return h + fc2->forward(at::gelu(fc1->forward(h), "tanh"));
  };
  const at::Tensor x0 = at::randn({4, 16});
  auto run = [&](bool recompute) {
    for (auto& p : fc1->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& p : fc2->parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor x = x0.clone().requires_grad_(true);
    at::Tensor y = recompute ? Recompute(block, block(x)) : block(block(x));
    (y * y).sum().backward();
    return std::vector<at::Tensor>{y.detach(), x.grad(), fc1->weight.grad().clone(),
                                   fc2->bias.grad().clone()};
  };
  calls = 0;
  const auto plain = run(false);
  EXPECT_EQ(calls, 2);
  calls = 0;
  const auto recomputed = run(true);
  EXPECT_EQ(calls, 3);  // the recomputed block ran again in the backward pass
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(at::allclose(plain[i], recomputed[i]));
  // Without autograd it is just the block.
  at::NoGradGuard no_grad;
  calls = 0;
  EXPECT_TRUE(at::equal(Recompute(block, x0), block(x0)));
  EXPECT_EQ(calls, 2);
}

TEST(Config, ReadsEveryUpstreamDefaultField) {
  VlmConfig c = VlmConfig::FromJsonFile(testing::FixturesDir() + "/nanovlm-default-config.json");
  EXPECT_EQ(c.lm_hidden_dim, 960);
  EXPECT_EQ(c.lm_n_blocks, 32);
  EXPECT_EQ(c.vit_img_size, 512);
  EXPECT_EQ(c.mp_image_token_length, 64);
  EXPECT_EQ(c.lm_vocab_size, 49218);
  EXPECT_EQ(c.image_token_id, 49152);
  EXPECT_EQ(c.vlm_extra_tokens.size(), 66u);
  EXPECT_EQ(c.vlm_extra_tokens[0].second, "<|image|>");
  // The 460m preset is upstream's default config.
  EXPECT_EQ(VlmConfig::Preset("nanovlm-460m").ToJson(), c.ToJson());
}

TEST(Config, JsonRoundTrip) {
  VlmConfig c = VlmConfig::FromJsonFile(testing::TinyCheckpointDir() + "/config.json");
  EXPECT_EQ(VlmConfig::FromJson(c.ToJson()).ToJson(), c.ToJson());
  EXPECT_EQ(c.image_token_id, 1000);
}

TEST(Config, RejectsInconsistentSizesWithKeyName) {
  nlohmann::json j = VlmConfig::Preset("nanovlm-tiny").ToJson();
  j["lm_n_kv_heads"] = 3;
  EXPECT_NE(ErrorOf([&] { VlmConfig::FromJson(j); }).find("lm_n_kv_heads"), std::string::npos);
  j = VlmConfig::Preset("nanovlm-tiny").ToJson();
  j["lm_hidden_dim"] = "big";
  EXPECT_NE(ErrorOf([&] { VlmConfig::FromJson(j); }).find("'lm_hidden_dim' has the wrong type"),
            std::string::npos);
  EXPECT_NE(ErrorOf([] { VlmConfig::Preset("nope"); }).find("nanovlm-tiny"), std::string::npos);
}

TEST(Safetensors, RoundTripsDtypesShapesAndMetadata) {
  fs::path dir = TempDir("st");
  std::map<std::string, at::Tensor> t = {
      {"f32", at::randn({3, 5})},
      {"bf16", at::randn({7}).to(at::kBFloat16)},
      {"f16", at::randn({2, 2, 2}).to(at::kHalf)},
      {"i64", at::arange(10, at::kLong)},
      {"scalar", at::tensor(3.5f)},
      {"empty", at::empty({0, 4})},
  };
  WriteSafetensors((dir / "x.safetensors").string(), t, {{"k", "v"}});
  SafetensorsFile f = ReadSafetensors((dir / "x.safetensors").string());
  ASSERT_EQ(f.tensors.size(), t.size());
  for (const auto& [name, want] : t) {
    const at::Tensor& got = f.tensors.at(name);
    EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
    EXPECT_TRUE(at::equal(got, want)) << name;
  }
  EXPECT_EQ(f.metadata.at("k"), "v");
}

TEST(Safetensors, RejectsTruncatedAndGarbageFiles) {
  fs::path dir = TempDir("st_bad");
  WriteSafetensors((dir / "ok.safetensors").string(), {{"w", at::randn({64})}});
  const auto size = fs::file_size(dir / "ok.safetensors");
  fs::copy_file(dir / "ok.safetensors", dir / "short.safetensors");
  fs::resize_file(dir / "short.safetensors", size - 16);
  EXPECT_NE(ErrorOf([&] {
              ReadSafetensors((dir / "short.safetensors").string());
            }).find("outside the file"),
            std::string::npos);
  std::ofstream(dir / "junk.safetensors") << "this is not a safetensors file at all";
  EXPECT_THROW(ReadSafetensors((dir / "junk.safetensors").string()), SafetensorsError);
}

TEST(Checkpoint, TiedHeadStoredOnceUnderUpstreamName) {
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  auto sd = StateDict(m);
  EXPECT_EQ(sd.count("decoder.head.weight"), 1u);
  EXPECT_EQ(sd.count("decoder.token_embedding.weight"), 0u);
  // Same set of names as the upstream file.
  SafetensorsFile up = ReadSafetensors(testing::TinyCheckpointDir() + "/model.safetensors");
  ASSERT_EQ(sd.size(), up.tensors.size());
  for (const auto& [name, t] : up.tensors) {
    ASSERT_EQ(sd.count(name), 1u) << name;
    EXPECT_TRUE(at::equal(sd.at(name), t)) << name;
  }
}

TEST(Checkpoint, SaveThenLoadRoundTrips) {
  fs::path dir = TempDir("ckpt");
  VisionLanguageModel m = LoadModel(testing::TinyCheckpointDir());
  SaveModel(m, dir.string());
  VisionLanguageModel again = LoadModel(dir.string());
  auto a = StateDict(m), b = StateDict(again);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << name;
  SafetensorsFile f = ReadSafetensors((dir / "model.safetensors").string());
  EXPECT_EQ(f.metadata.at("decoder.token_embedding.weight"), "decoder.head.weight");
}

TEST(Checkpoint, AcceptsHeadUnderEmbeddingName) {
  fs::path dir = TempDir("ckpt_alias");
  fs::copy_file(testing::TinyCheckpointDir() + "/config.json", dir / "config.json");
  SafetensorsFile f = ReadSafetensors(testing::TinyCheckpointDir() + "/model.safetensors");
  f.tensors["decoder.token_embedding.weight"] = f.tensors.at("decoder.head.weight");
  f.tensors.erase("decoder.head.weight");
  WriteSafetensors((dir / "model.safetensors").string(), f.tensors);
  VisionLanguageModel m = LoadModel(dir.string());
  EXPECT_TRUE(at::equal(m->decoder->HeadWeight(),
                        ReadSafetensors(testing::TinyCheckpointDir() + "/model.safetensors")
                            .tensors.at("decoder.head.weight")));
}

TEST(Checkpoint, NamesMissingUnexpectedAndMisshapedTensors) {
  fs::path dir = TempDir("ckpt_bad");
  fs::copy_file(testing::TinyCheckpointDir() + "/config.json", dir / "config.json");
  SafetensorsFile f = ReadSafetensors(testing::TinyCheckpointDir() + "/model.safetensors");
  f.tensors.erase("decoder.blocks.1.mlp.up_proj.weight");
  f.tensors["decoder.norm.weight"] = at::ones({65});
  f.tensors["vision_encoder.extra.weight"] = at::ones({2});
  WriteSafetensors((dir / "model.safetensors").string(), f.tensors, f.metadata);
  const std::string err = ErrorOf([&] { LoadModel(dir.string()); });
  EXPECT_NE(err.find("missing tensors (1):\n    decoder.blocks.1.mlp.up_proj.weight"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("decoder.norm.weight (checkpoint [65], config needs [64])"), std::string::npos)
      << err;
  EXPECT_NE(err.find("unexpected tensors (1):\n    vision_encoder.extra.weight"), std::string::npos)
      << err;
}

TEST(Checkpoint, LoadsEveryTensorNameOfTheDefaultModel) {
  // The full-size default model's names and shapes, as listed by upstream
  // (nanovlm-default-keys.txt).
  VisionLanguageModel m(VlmConfig::Preset("nanovlm-460m"));
  std::map<std::string, std::vector<int64_t>> ours;
  for (const auto& p : m->named_parameters()) ours[p.key()] = p.value().sizes().vec();
  for (const auto& b : m->named_buffers()) ours[b.key()] = b.value().sizes().vec();
  std::ifstream in(testing::FixturesDir() + "/nanovlm-default-keys.txt");
  ASSERT_TRUE(in) << "missing nanovlm-default-keys.txt";
  std::string line;
  int listed = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::string name = line.substr(0, line.find('\t'));
    std::string shape = line.substr(line.find('\t') + 1);
    shape = shape.substr(0, shape.find('\t'));
    ++listed;
    if (name == "decoder.head.weight") name = "decoder.token_embedding.weight";  // tied
    ASSERT_EQ(ours.count(name), 1u) << name;
    std::ostringstream o;
    o << at::IntArrayRef(ours.at(name));
    std::string got = o.str();
    got.erase(std::remove(got.begin(), got.end(), ' '), got.end());
    shape.erase(std::remove(shape.begin(), shape.end(), ' '), shape.end());
    EXPECT_EQ(got, shape) << name;
  }
  EXPECT_EQ(listed, static_cast<int>(ours.size()) + 1);  // head listed besides the embedding
}

// Reads a whole file (or "" when it cannot be opened).
std::string Contents(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A save into a directory where someone planted symbolic links, under the checkpoint's file names
// and under their temporaries' names, replaces the links with the checkpoint's files and never
// writes the files they point to.
TEST(Checkpoint, SaveReplacesPlantedSymbolicLinksWithoutWritingThroughThem) {
  const fs::path dir = TempDir("ckpt_links"), outside = TempDir("ckpt_links_outside");
  const std::vector<std::string> names = {"config.json", "model.safetensors", "config.json.tmp",
                                          "model.safetensors.tmp"};
  for (const std::string& name : names) {
    std::ofstream(outside / name) << "precious " << name;
    fs::create_symlink(outside / name, dir / name);
  }
  VisionLanguageModel m(VlmConfig::Preset("nanovlm-tiny"));
  SaveModel(m, dir.string());
  for (const std::string& name : names) {
    EXPECT_EQ(Contents(outside / name), "precious " + name) << name << " was written through";
    const bool temporary = name.size() > 4 && name.substr(name.size() - 4) == ".tmp";
    if (temporary) {
      EXPECT_FALSE(fs::exists(fs::symlink_status(dir / name))) << name;
    } else {
      EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(dir / name))) << name;
    }
  }
  VisionLanguageModel loaded = LoadModel(dir.string());
  EXPECT_TRUE(at::equal(loaded->MP->proj->weight, m->MP->proj->weight));
  testing::RemoveFlatDirectory(dir.string());
  testing::RemoveFlatDirectory(outside.string());
}

// Lowers the file size limit for its lifetime; a write past it fails with EFBIG as a full disk
// fails with ENOSPC (SIGXFSZ, which would end the process, is ignored meanwhile).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    saved_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit lower = saved_;
    lower.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &lower), 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, saved_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit saved_{};
  void (*saved_handler_)(int) = nullptr;
};

// A save that fails part-way (a full disk, simulated by the file size limit) throws an error
// that names the file and the cause, and leaves neither a partial file nor its temporary; an
// existing checkpoint file stays as it was.
TEST(Checkpoint, FailedSaveLeavesNoPartialOrTemporaryFile) {
  const fs::path dir = TempDir("ckpt_full");
  VisionLanguageModel m(VlmConfig::Preset("nanovlm-tiny"));
  std::ofstream(dir / "model.safetensors") << "the previous checkpoint";
  const std::map<std::string, at::Tensor> big = {{"w", at::ones({1 << 16})}};  // 256 KiB
  std::string error;
  {
    FileSizeLimit limit(64 << 10);
    error = ErrorOf([&] { WriteSafetensors((dir / "big.safetensors").string(), big); });
    EXPECT_THROW(SaveModel(m, dir.string()), std::system_error);
  }
  EXPECT_NE(error.find("big.safetensors.tmp"), std::string::npos) << error;
  EXPECT_NE(error.find(std::strerror(EFBIG)), std::string::npos) << error;
  for (const char* name : {"big.safetensors", "big.safetensors.tmp", "model.safetensors.tmp"})
    EXPECT_FALSE(fs::exists(fs::symlink_status(dir / name))) << name;
  EXPECT_EQ(Contents(dir / "model.safetensors"), "the previous checkpoint");
  // Without the limit the same saves succeed.
  WriteSafetensors((dir / "big.safetensors").string(), big);
  EXPECT_TRUE(
      at::equal(ReadSafetensors((dir / "big.safetensors").string()).tensors.at("w"), big.at("w")));
  testing::RemoveFlatDirectory(dir.string());
}

}  // namespace
}  // namespace vlmgraph
