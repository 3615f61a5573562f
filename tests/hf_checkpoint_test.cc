// Hugging Face transformers Llama checkpoints (model/hf_checkpoint.h) through LoadModel and
// LoadModelConfig: config fields, tensor names and shapes, sharded files, the random parts, and
// the errors for bad directories. Logits against transformers itself:
// tests/parity/test_hf_checkpoint.py.
#include "model/hf_checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "base/safetensors.h"
#include "model/checkpoint.h"
#include "tests/test_util.h"

namespace vlmgraph {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// `text` holds `part`; the message shows the whole text.
#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

constexpr int64_t kHidden = 64, kInter = 128, kLayers = 2, kHeads = 4, kKvHeads = 2, kVocab = 1000;

// A fresh directory under the system's temporary directory, removed with its files at scope end.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_(fs::temp_directory_path() /
              ("vlmgraph_hf_test_" + name + "_" + std::to_string(::getpid()))) {
    testing::RemoveFlatDirectory(path_.string());
    fs::create_directories(path_);
  }
  ~TempDir() { testing::RemoveFlatDirectory(path_.string()); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "(no CheckpointError)";
}

// A random LlamaForCausalLM in transformers' names, as save_pretrained writes it.
struct HfLlama {
  json config;
  std::map<std::string, at::Tensor> tensors;
};

HfLlama MakeHfLlama(bool tied, uint64_t seed = 1) {
  at::manual_seed(seed);
  HfLlama m;
  m.config = {{"architectures", {"LlamaForCausalLM"}},
              {"model_type", "llama"},
              {"hidden_size", kHidden},
              {"intermediate_size", kInter},
              {"num_hidden_layers", kLayers},
              {"num_attention_heads", kHeads},
              {"num_key_value_heads", kKvHeads},
              {"head_dim", kHidden / kHeads},
              {"rms_norm_eps", 1e-5},
              {"rope_parameters", {{"rope_theta", 5000.0}, {"rope_type", "default"}}},
              {"max_position_embeddings", 256},
              {"vocab_size", kVocab},
              {"tie_word_embeddings", tied},
              {"attention_bias", false},
              {"mlp_bias", false},
              {"hidden_act", "silu"},
              {"dtype", "float32"}};
  const int64_t kv = kHidden / kHeads * kKvHeads;
  m.tensors["model.embed_tokens.weight"] = at::randn({kVocab, kHidden});
  if (!tied) m.tensors["lm_head.weight"] = at::randn({kVocab, kHidden});
  m.tensors["model.norm.weight"] = 1 + 0.1 * at::randn({kHidden});
  for (int64_t i = 0; i < kLayers; ++i) {
    const std::string b = "model.layers." + std::to_string(i) + ".";
    m.tensors[b + "self_attn.q_proj.weight"] = at::randn({kHidden, kHidden});
    m.tensors[b + "self_attn.k_proj.weight"] = at::randn({kv, kHidden});
    m.tensors[b + "self_attn.v_proj.weight"] = at::randn({kv, kHidden});
    m.tensors[b + "self_attn.o_proj.weight"] = at::randn({kHidden, kHidden});
    m.tensors[b + "mlp.gate_proj.weight"] = at::randn({kInter, kHidden});
    m.tensors[b + "mlp.up_proj.weight"] = at::randn({kInter, kHidden});
    m.tensors[b + "mlp.down_proj.weight"] = at::randn({kHidden, kInter});
    m.tensors[b + "input_layernorm.weight"] = 1 + 0.1 * at::randn({kHidden});
    m.tensors[b + "post_attention_layernorm.weight"] = 1 + 0.1 * at::randn({kHidden});
  }
  return m;
}

void WriteJson(const fs::path& path, const json& j) { std::ofstream(path) << j.dump(2); }

// config.json and the weights: model.safetensors, or `shards` files with an index.
void WriteHf(const fs::path& dir, const HfLlama& m, int shards = 1) {
  WriteJson(dir / "config.json", m.config);
  if (shards == 1) {
    WriteSafetensors((dir / "model.safetensors").string(), m.tensors, {{"format", "pt"}});
    return;
  }
  std::vector<std::map<std::string, at::Tensor>> parts(shards);
  json weight_map = json::object();
  int k = 0;
  for (const auto& [name, t] : m.tensors) {
    const int shard = k++ % shards;
    char file[64];
    std::snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", shard + 1, shards);
    parts[shard][name] = t;
    weight_map[name] = file;
  }
  for (int s = 0; s < shards; ++s) {
    char file[64];
    std::snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", s + 1, shards);
    WriteSafetensors((dir / file).string(), parts[s], {{"format", "pt"}});
  }
  WriteJson(dir / "model.safetensors.index.json",
            {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}});
}

// transformers' name -> nanoVLM's module name.
std::string OurName(const std::string& hf) {
  static const std::vector<std::pair<std::string, std::string>> block = {
      {"self_attn.q_proj.weight", "attn.q_proj.weight"},
      {"self_attn.k_proj.weight", "attn.k_proj.weight"},
      {"self_attn.v_proj.weight", "attn.v_proj.weight"},
      {"self_attn.o_proj.weight", "attn.out_proj.weight"},
      {"mlp.gate_proj.weight", "mlp.gate_proj.weight"},
      {"mlp.up_proj.weight", "mlp.up_proj.weight"},
      {"mlp.down_proj.weight", "mlp.down_proj.weight"},
      {"input_layernorm.weight", "norm1.weight"},
      {"post_attention_layernorm.weight", "norm2.weight"}};
  if (hf == "model.embed_tokens.weight") return "decoder.token_embedding.weight";
  if (hf == "lm_head.weight") return "decoder.head.weight";
  if (hf == "model.norm.weight") return "decoder.norm.weight";
  const std::string prefix = "model.layers.";
  const size_t dot = hf.find('.', prefix.size());
  const std::string layer = hf.substr(prefix.size(), dot - prefix.size());
  const std::string rest = hf.substr(dot + 1);
  for (const auto& [from, to] : block) {
    if (rest == from) return "decoder.blocks." + layer + "." + to;
  }
  ADD_FAILURE() << "no nanoVLM name for " << hf;
  return hf;
}

// Every stored tensor sits under its nanoVLM name (vocabulary rows [0, vocab_size)).
void ExpectTensorsLoaded(VisionLanguageModel& model, const HfLlama& hf) {
  auto params = model->named_parameters();
  for (const auto& [name, t] : hf.tensors) {
    const std::string ours = OurName(name);
    ASSERT_TRUE(params.contains(ours)) << ours;
    at::Tensor got = params[ours];
    if (name == "model.embed_tokens.weight" || name == "lm_head.weight") {
      got = got.narrow(0, 0, kVocab);
    }
    EXPECT_TRUE(at::equal(got, t.to(at::kFloat))) << name << " -> " << ours;
  }
}

TEST(HfCheckpoint, LoadsALlamaDirectoryAsNanoVlm) {
  const TempDir dir_scope("tied");
  const fs::path& dir = dir_scope.path();
  const HfLlama hf = MakeHfLlama(/*tied=*/true);
  WriteHf(dir, hf);
  VisionLanguageModel model = LoadModel(dir.string());
  const VlmConfig& c = model->cfg;
  EXPECT_EQ(c.lm_hidden_dim, kHidden);
  EXPECT_EQ(c.lm_inter_dim, kInter);
  EXPECT_EQ(c.lm_n_blocks, kLayers);
  EXPECT_EQ(c.lm_n_heads, kHeads);
  EXPECT_EQ(c.lm_n_kv_heads, kKvHeads);
  EXPECT_DOUBLE_EQ(c.lm_rms_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.lm_re_base, 5000.0);
  EXPECT_EQ(c.lm_max_position_embeddings, 256);
  EXPECT_EQ(c.lm_max_length, 256);
  EXPECT_EQ(c.lm_base_vocab_size, kVocab);
  EXPECT_EQ(c.lm_vocab_size, kVocab + 66);
  EXPECT_EQ(c.image_token_id, kVocab);
  EXPECT_TRUE(c.lm_tie_weights);
  // The vision side is upstream's default nanoVLM, as tools/convert_gguf.py writes it.
  const VlmConfig upstream = VlmConfig::Preset("nanovlm-460m");
  EXPECT_EQ(c.vit_hidden_dim, upstream.vit_hidden_dim);
  EXPECT_EQ(c.vit_img_size, upstream.vit_img_size);
  EXPECT_EQ(c.mp_image_token_length, upstream.mp_image_token_length);
  EXPECT_EQ(c.vlm_extra_tokens, upstream.vlm_extra_tokens);
  // LoadModelConfig reads the same config without the weights.
  EXPECT_EQ(LoadModelConfig(dir.string()).ToJson(), c.ToJson());

  ExpectTensorsLoaded(model, hf);
  EXPECT_FALSE(model->named_parameters().contains("decoder.head.weight"));
  // RoPE from rope_parameters.rope_theta: inv_freq = 1 / theta^(2i/d), d = 16.
  const at::Tensor want_inv_freq = 1.0 / at::pow(5000.0, at::arange(0, 16, 2, at::kFloat) / 16.0);
  EXPECT_TRUE(at::allclose(model->decoder->rotary_embd->inv_freq, want_inv_freq));
  // nanoVLM's VLM token rows: N(0, 0.02).
  const at::Tensor extra = model->decoder->token_embedding->weight.narrow(0, kVocab, 66);
  EXPECT_NEAR(extra.std().item<double>(), 0.02, 0.002);
  // The random vision side is upstream's initialisation, the same on every load.
  const auto& pos = model->vision_encoder->patch_embedding->position_embedding;
  EXPECT_GE(pos.min().item<double>(), 0.0);
  EXPECT_LT(pos.max().item<double>(), 1.0);
  EXPECT_NEAR(model->MP->proj->weight.std().item<double>(), 0.02, 0.002);
  VisionLanguageModel again = LoadModel(dir.string());
  auto a = model->named_parameters(), b = again->named_parameters();
  for (const auto& p : a) EXPECT_TRUE(at::equal(p.value(), b[p.key()])) << p.key();
}

TEST(HfCheckpoint, LoadsShardedUntiedBfloat16Checkpoints) {
  const TempDir dir_scope("sharded");
  const fs::path& dir = dir_scope.path();
  HfLlama hf = MakeHfLlama(/*tied=*/false);
  for (auto& [name, t] : hf.tensors) t = t.to(at::kBFloat16);
  WriteHf(dir, hf, /*shards=*/3);
  VisionLanguageModel model = LoadModel(dir.string());
  EXPECT_FALSE(model->cfg.lm_tie_weights);
  ExpectTensorsLoaded(model, hf);
  const at::Tensor head_extra = model->decoder->head->weight.narrow(0, kVocab, 66);
  EXPECT_NEAR(head_extra.std().item<double>(), 0.02, 0.002);
  EXPECT_EQ(model->decoder->head->weight.scalar_type(), at::kFloat);
}

TEST(HfCheckpoint, ReadsOlderConfigsWithTransformersDefaults) {
  // transformers 4's keys (rope_theta, rope_scaling null) and absent optional keys: LlamaConfig's
  // defaults (num_key_value_heads = heads, tie_word_embeddings false, rms_norm_eps 1e-6,
  // max_position_embeddings 2048, rope_theta 10000); older files also hold rotary_emb.inv_freq.
  HfLlama hf = MakeHfLlama(/*tied=*/false);
  hf.config = {{"architectures", {"LlamaForCausalLM"}},
               {"model_type", "llama"},
               {"_name_or_path", "HuggingFaceTB/SmolLM2-135M"},
               {"hidden_size", kHidden},
               {"intermediate_size", kInter},
               {"num_hidden_layers", kLayers},
               {"num_attention_heads", kHeads},
               {"rope_scaling", nullptr},
               {"vocab_size", kVocab}};
  for (int64_t i = 0; i < kLayers; ++i) {
    const std::string b = "model.layers." + std::to_string(i) + ".";
    hf.tensors[b + "self_attn.k_proj.weight"] = at::randn({kHidden, kHidden});
    hf.tensors[b + "self_attn.v_proj.weight"] = at::randn({kHidden, kHidden});
    hf.tensors[b + "self_attn.rotary_emb.inv_freq"] = at::ones({8});
  }
  const TempDir dir_scope("older");
  const fs::path& dir = dir_scope.path();
  WriteHf(dir, hf);
  const VlmConfig c = LoadModelConfig(dir.string());
  EXPECT_EQ(c.lm_n_kv_heads, kHeads);
  EXPECT_FALSE(c.lm_tie_weights);
  EXPECT_DOUBLE_EQ(c.lm_rms_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.lm_re_base, 10000.0);
  EXPECT_EQ(c.lm_max_position_embeddings, 2048);
  EXPECT_EQ(c.lm_max_length, 2048);
  EXPECT_EQ(c.lm_model_type, "HuggingFaceTB/SmolLM2-135M");
  VisionLanguageModel model = LoadModel(dir.string());
  hf.tensors.erase("model.layers.0.self_attn.rotary_emb.inv_freq");
  hf.tensors.erase("model.layers.1.self_attn.rotary_emb.inv_freq");
  ExpectTensorsLoaded(model, hf);
}

TEST(HfCheckpoint, NamesEveryWrongTensor) {
  HfLlama hf = MakeHfLlama(/*tied=*/true);
  hf.tensors.erase("model.layers.1.mlp.up_proj.weight");
  hf.tensors["model.layers.0.self_attn.k_proj.weight"] = at::randn({kHidden, kHidden});
  hf.tensors["model.layers.2.mlp.up_proj.weight"] = at::randn({kInter, kHidden});
  hf.tensors["model.norm.weight"] = at::ones({kHidden}, at::kLong);
  const TempDir dir_scope("wrong");
  const fs::path& dir = dir_scope.path();
  WriteHf(dir, hf);
  const std::string e = ErrorOf([&] { LoadModel(dir.string()); });
  EXPECT_HAS(e, "missing tensors (1):\n    model.layers.1.mlp.up_proj.weight");
  EXPECT_HAS(e,
             "model.layers.0.self_attn.k_proj.weight (checkpoint [64, 64], "
             "config.json needs [32, 64])");
  EXPECT_HAS(e, "model.norm.weight (dtype Long");
  EXPECT_HAS(e, "unexpected tensors (1):\n    model.layers.2.mlp.up_proj.weight");

  // A vocabulary that disagrees with vocab_size, and a tied model whose stored head differs.
  HfLlama vocab = MakeHfLlama(/*tied=*/true);
  vocab.tensors["model.embed_tokens.weight"] = at::randn({kVocab + 1, kHidden});
  WriteHf(dir, vocab);
  EXPECT_HAS(ErrorOf([&] { LoadModel(dir.string()); }),
             "model.embed_tokens.weight (checkpoint [1001, 64], config.json needs "
             "[1000, 64])");
  HfLlama head = MakeHfLlama(/*tied=*/true);
  head.tensors["lm_head.weight"] = at::randn({kVocab, kHidden});
  WriteHf(dir, head);
  EXPECT_HAS(ErrorOf([&] { LoadModel(dir.string()); }),
             "tie_word_embeddings true, but lm_head.weight differs");
  head.tensors["lm_head.weight"] = head.tensors["model.embed_tokens.weight"];
  WriteHf(dir, head);
  EXPECT_NO_THROW(LoadModel(dir.string()));  // the same matrix stored twice loads
}

TEST(HfCheckpoint, RefusesWhatNanoVlmsDecoderLacks) {
  const TempDir dir_scope("features");
  const fs::path& dir = dir_scope.path();
  auto error_with = [&](const std::function<void(json&)>& edit) {
    HfLlama hf = MakeHfLlama(/*tied=*/true);
    edit(hf.config);
    WriteHf(dir, hf);
    const std::string load = ErrorOf([&] { LoadModel(dir.string()); });
    EXPECT_EQ(ErrorOf([&] { LoadModelConfig(dir.string()); }), load);
    return load;
  };
  EXPECT_HAS(error_with([](json& c) {
               c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
             }),
             "RoPE scaling 'llama3' is not implemented");
  EXPECT_HAS(error_with([](json& c) {
               c["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e4}};
             }),
             "RoPE scaling 'yarn' is not implemented");
  EXPECT_HAS(error_with([](json& c) {
               c["rope_scaling"] = {{"type", "linear"}};
             }),
             "RoPE scaling 'linear'");
  EXPECT_HAS(error_with([](json& c) { c["attention_bias"] = true; }), "attention_bias true");
  EXPECT_HAS(error_with([](json& c) { c["mlp_bias"] = true; }), "mlp_bias true");
  EXPECT_HAS(error_with([](json& c) { c["hidden_act"] = "gelu"; }), "hidden_act 'gelu'");
  EXPECT_HAS(error_with([](json& c) { c["head_dim"] = 32; }),
             "head_dim 32 differs from hidden_size / num_attention_heads = 16");
  EXPECT_HAS(error_with([](json& c) {
               c["quantization_config"] = {{"quant_method", "gptq"}};
             }),
             "quantized weights do not load");
  EXPECT_HAS(error_with([](json& c) { c.erase("hidden_size"); }), "no 'hidden_size'");
  EXPECT_HAS(error_with([](json& c) { c["num_hidden_layers"] = "2"; }),
             "'num_hidden_layers' is \"2\", not an integer");
  EXPECT_HAS(error_with([](json& c) { c["num_key_value_heads"] = 3; }),
             "lm_n_heads must be a multiple of lm_n_kv_heads");
}

TEST(HfCheckpoint, RefusesOtherArchitecturesSayingWhatLoads) {
  const TempDir dir_scope("archs");
  const fs::path& dir = dir_scope.path();
  auto error_for = [&](const json& config) {
    WriteJson(dir / "config.json", config);
    return ErrorOf([&] { LoadModel(dir.string()); });
  };
  const std::string idefics = error_for(
      {{"model_type", "idefics3"}, {"architectures", {"Idefics3ForConditionalGeneration"}}});
  EXPECT_HAS(idefics, "Idefics3 / SmolVLM");
  EXPECT_HAS(idefics, "transformers Llama / SmolLM2 checkpoint");
  EXPECT_HAS(error_for({{"model_type", "smolvlm"}}), "Idefics3 / SmolVLM");
  const std::string gpt2 =
      error_for({{"model_type", "gpt2"}, {"architectures", {"GPT2LMHeadModel"}}});
  EXPECT_HAS(gpt2, "type 'gpt2'");
  EXPECT_HAS(gpt2, "only model_type 'llama'");
  EXPECT_HAS(gpt2, "nanoVLM checkpoint (config.json with nanoVLM's VLMConfig");
  EXPECT_HAS(
      error_for({{"model_type", "llama"}, {"architectures", {"LlamaForSequenceClassification"}}}),
      "only LlamaForCausalLM");
}

TEST(HfCheckpoint, MissingFilesSayWhichFormatsLoad) {
  const TempDir dir_scope("files");
  const fs::path& dir = dir_scope.path();
  EXPECT_HAS(ErrorOf([&] { LoadModel(dir.string()); }), "no config.json in checkpoint directory");
  EXPECT_HAS(ErrorOf([&] { LoadModelConfig(dir.string()); }),
             "transformers Llama / SmolLM2 checkpoint (config.json with model_type");
  // A nanoVLM config without its weights.
  WriteJson(dir / "config.json",
            json::parse(std::ifstream(testing::TinyCheckpointDir() + "/config.json")));
  EXPECT_HAS(ErrorOf([&] { LoadModel(dir.string()); }),
             "no model.safetensors in checkpoint directory");
  // A transformers config without safetensors weights.
  const HfLlama hf = MakeHfLlama(/*tied=*/true);
  WriteJson(dir / "config.json", hf.config);
  std::ofstream(dir / "pytorch_model.bin") << "not read";
  const std::string bin = ErrorOf([&] { LoadModel(dir.string()); });
  EXPECT_HAS(bin, "has neither model.safetensors nor model.safetensors.index.json");
  EXPECT_HAS(bin, "it has pytorch_model.bin");

  // Indexes that point outside the directory, at a missing shard, or at the wrong shard.
  const TempDir sharded_scope("index");
  const fs::path& sharded = sharded_scope.path();
  WriteHf(sharded, hf, /*shards=*/2);
  json index = json::parse(std::ifstream(sharded / "model.safetensors.index.json"));
  json bad = index;
  bad["weight_map"]["model.norm.weight"] = "../model-00001-of-00002.safetensors";
  WriteJson(sharded / "model.safetensors.index.json", bad);
  EXPECT_HAS(ErrorOf([&] { LoadModel(sharded.string()); }),
             "is not a plain file name in the checkpoint directory");
  bad = index;
  bad["weight_map"]["model.norm.weight"] = "model-00003-of-00002.safetensors";
  WriteJson(sharded / "model.safetensors.index.json", bad);
  EXPECT_HAS(ErrorOf([&] { LoadModel(sharded.string()); }),
             "names shard model-00003-of-00002.safetensors (tensor model.norm.weight)");
  bad = index;
  const std::string shard = bad["weight_map"]["model.norm.weight"];
  bad["weight_map"]["model.norm.weight"] = shard == "model-00001-of-00002.safetensors"
                                               ? "model-00002-of-00002.safetensors"
                                               : "model-00001-of-00002.safetensors";
  WriteJson(sharded / "model.safetensors.index.json", bad);
  EXPECT_HAS(ErrorOf([&] { LoadModel(sharded.string()); }), "places tensor model.norm.weight in");
  WriteJson(sharded / "model.safetensors.index.json", index);
  EXPECT_NO_THROW(LoadModel(sharded.string()));
}

}  // namespace
}  // namespace vlmgraph
