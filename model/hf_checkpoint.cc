#include "model/hf_checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/utils.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "base/safetensors.h"
#include "model/weight_init.h"

namespace vlmgraph {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Note [A language model as a nanoVLM]
// A transformers Llama checkpoint holds a language model only. vlmgraph serves it as
// tools/convert_gguf.py makes a nanoVLM of a language model, which is how upstream nanoVLM starts
// from SmolLM2 (models/vision_language_model.py from_pretrained of the backbones):
// - the vocabulary grows by nanoVLM's extra VLM tokens (image, global image, the 8 x 8 grid
//   tokens) at ids vocab_size.., rows drawn N(0, 0.02) as upstream's
//   LanguageModel.from_pretrained extends the embedding (and an untied head); text prompts never
//   contain them, so the language model's logits over its own vocabulary are unchanged;
// - the vision encoder and projector have upstream's default shape and upstream's initialisation
//   (dense and patch-convolution weights N(0, 0.02), biases 0, LayerNorm weights 1, position
//   embedding U[0, 1)): random, so answers about images mean nothing until the model is trained.
// Every random tensor is drawn from one CPU generator seeded with kTransformersRandomSeed, in a
// fixed order, not from the global generator: every load gives the same weights, so every
// data-parallel engine and training rank holds the same model.

constexpr const char* kFormat = "transformers Llama";

// Per block: transformers' name after "model.layers.N." -> nanoVLM's after "decoder.blocks.N.".
constexpr std::pair<const char*, const char*> kBlockTensors[] = {
    {"self_attn.q_proj.weight", "attn.q_proj.weight"},
    {"self_attn.k_proj.weight", "attn.k_proj.weight"},
    {"self_attn.v_proj.weight", "attn.v_proj.weight"},
    {"self_attn.o_proj.weight", "attn.out_proj.weight"},
    {"mlp.gate_proj.weight", "mlp.gate_proj.weight"},
    {"mlp.up_proj.weight", "mlp.up_proj.weight"},
    {"mlp.down_proj.weight", "mlp.down_proj.weight"},
    {"input_layernorm.weight", "norm1.weight"},
    {"post_attention_layernorm.weight", "norm2.weight"},
};

constexpr const char* kEmbedTokens = "model.embed_tokens.weight";
constexpr const char* kLmHead = "lm_head.weight";

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string ShapeString(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

// config.json's value at `key` as a T, or `fallback` when absent or null (transformers' LlamaConfig
// default); without a fallback the key is required.
template <typename T>
T Get(const json& config, const char* key, std::optional<T> fallback = std::nullopt) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) {
    if (fallback) return *fallback;
    throw CheckpointError(std::string("transformers config.json has no '") + key +
                          "', which a Llama config needs");
  }
  const bool ok = std::is_same_v<T, bool>      ? it->is_boolean()
                  : std::is_same_v<T, int64_t> ? it->is_number_integer()
                  : std::is_same_v<T, double>  ? it->is_number()
                                               : it->is_string();
  if (!ok) {
    throw CheckpointError(std::string("transformers config.json: '") + key + "' is " + it->dump() +
                          ", not " +
                          (std::is_same_v<T, bool>      ? "a boolean"
                           : std::is_same_v<T, int64_t> ? "an integer"
                           : std::is_same_v<T, double>  ? "a number"
                                                        : "a string"));
  }
  return it->get<T>();
}

std::string ArchitecturesText(const json& config) {
  auto it = config.find("architectures");
  return it == config.end() ? "none" : it->dump();
}

bool HasArchitecture(const json& config, const std::string& name) {
  auto it = config.find("architectures");
  if (it == config.end() || !it->is_array()) return false;
  return std::any_of(it->begin(), it->end(),
                     [&](const json& a) { return a.is_string() && a.get<std::string>() == name; });
}

// Refuses every architecture but LlamaForCausalLM, naming Idefics3 / SmolVLM.
void CheckArchitecture(const json& config) {
  const std::string type = config.value("model_type", std::string());
  const bool idefics = type == "idefics3" || type == "smolvlm" ||
                       HasArchitecture(config, "Idefics3ForConditionalGeneration") ||
                       HasArchitecture(config, "SmolVLMForConditionalGeneration");
  if (idefics) {
    throw CheckpointError(
        "config.json describes a transformers Idefics3 / SmolVLM model (model_type '" + type +
        "', architectures " + ArchitecturesText(config) +
        "), another vision-language architecture than nanoVLM's (its vision tower, connector and "
        "image tokens differ); it does not load. " +
        kAcceptedCheckpointFormats);
  }
  const bool llama =
      type == "llama" || (type.empty() && HasArchitecture(config, "LlamaForCausalLM"));
  if (!llama) {
    throw CheckpointError("config.json describes a transformers model of type '" + type +
                          "' (architectures " + ArchitecturesText(config) +
                          "), which does not load; only model_type 'llama' does. " +
                          kAcceptedCheckpointFormats);
  }
  auto archs = config.find("architectures");
  if (archs != config.end() && archs->is_array() && !archs->empty() &&
      !HasArchitecture(config, "LlamaForCausalLM")) {
    throw CheckpointError("config.json: architectures " + ArchitecturesText(config) +
                          ": only LlamaForCausalLM (a causal language model head) loads");
  }
}

// RoPE's theta, refusing every RoPE variant but the default one (nanoVLM's RotaryEmbedding).
// transformers 5 writes "rope_parameters" {"rope_type", "rope_theta", ...}; earlier versions a
// top-level "rope_theta" and "rope_scaling" ({"rope_type" or "type", "factor", ...} or null).
double RopeTheta(const json& config) {
  double theta = Get<double>(config, "rope_theta", 10000.0);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = config.find(key);
    if (it == config.end() || it->is_null()) continue;
    if (!it->is_object()) {
      throw CheckpointError(std::string("transformers config.json: '") + key + "' is " +
                            it->dump() + ", not an object");
    }
    const json& rope = *it;
    std::string type = "default";
    for (const char* type_key : {"rope_type", "type"}) {
      if (rope.contains(type_key) && rope[type_key].is_string()) {
        type = rope[type_key].get<std::string>();
      }
    }
    if (type != "default") {
      throw CheckpointError(std::string("transformers config.json: ") + key + " " + rope.dump() +
                            ": RoPE scaling '" + type +
                            "' is not implemented by nanoVLM's decoder, which has the default "
                            "RoPE only (inv_freq = 1 / rope_theta^(2i/d) at every position); "
                            "a model that needs it does not load");
    }
    if (Get<double>(rope, "partial_rotary_factor", 1.0) != 1.0) {
      throw CheckpointError(std::string("transformers config.json: ") + key +
                            ".partial_rotary_factor " + rope["partial_rotary_factor"].dump() +
                            ": nanoVLM's RoPE covers the whole head");
    }
    if (rope.contains("rope_theta")) theta = Get<double>(rope, "rope_theta");
  }
  return theta;
}

// Refuses the LlamaConfig options nanoVLM's decoder does not have.
void CheckLlamaFeatures(const json& config, int64_t hidden, int64_t heads) {
  if (Get<bool>(config, "attention_bias", false)) {
    throw CheckpointError(
        "transformers config.json: attention_bias true: nanoVLM's attention "
        "projections have no bias");
  }
  if (Get<bool>(config, "mlp_bias", false)) {
    throw CheckpointError("transformers config.json: mlp_bias true: nanoVLM's MLP has no bias");
  }
  const std::string act = Get<std::string>(config, "hidden_act", std::string("silu"));
  if (act != "silu") {
    throw CheckpointError("transformers config.json: hidden_act '" + act +
                          "': nanoVLM's MLP is SwiGLU (silu)");
  }
  if (heads > 0 && hidden % heads == 0) {
    const int64_t head_dim = Get<int64_t>(config, "head_dim", hidden / heads);
    if (head_dim != hidden / heads) {
      throw CheckpointError(
          "transformers config.json: head_dim " + std::to_string(head_dim) +
          " differs from hidden_size / num_attention_heads = " + std::to_string(hidden / heads) +
          ", the head size of nanoVLM's decoder");
    }
  }
  if (config.contains("quantization_config")) {
    throw CheckpointError(
        "transformers config.json has a quantization_config: quantized "
        "weights do not load; give the checkpoint in float32, float16 or "
        "bfloat16");
  }
}

// The weight files: model.safetensors, or the shards of model.safetensors.index.json, in order,
// with the tensors the index places in each.
struct WeightFiles {
  std::vector<std::string> paths;
  std::map<std::string, std::string> index;  // tensor -> shard file name; empty without an index
};

WeightFiles FindWeightFiles(const std::string& dir) {
  const fs::path root(dir);
  std::error_code ec;
  WeightFiles files;
  const fs::path single = root / "model.safetensors";
  const fs::path index_path = root / "model.safetensors.index.json";
  if (fs::is_regular_file(single, ec)) {
    files.paths.push_back(single.string());
    return files;
  }
  if (!fs::is_regular_file(index_path, ec)) {
    std::string found;
    for (const char* other :
         {"pytorch_model.bin", "pytorch_model.bin.index.json", "model.safetensors.index.json",
          "tf_model.h5", "flax_model.msgpack"}) {
      if (fs::exists(root / other, ec)) found = other;
    }
    throw CheckpointError(
        "transformers checkpoint '" + dir + "' has neither model.safetensors nor " +
        "model.safetensors.index.json" +
        (found.empty() ? std::string()
                       : " (it has " + found +
                             ": save the model with transformers' save_pretrained, whose default "
                             "is safetensors)") +
        "; " + kAcceptedCheckpointFormats);
  }
  json index;
  try {
    std::ifstream in(index_path);
    index = json::parse(in);
  } catch (const json::exception& e) {
    throw CheckpointError(index_path.string() + " is not valid JSON: " + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw CheckpointError(index_path.string() + " has no \"weight_map\" object");
  }
  std::set<std::string> seen;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!file.is_string()) {
      throw CheckpointError(index_path.string() + ": weight_map[\"" + tensor +
                            "\"] is not a file name");
    }
    const std::string name = file.get<std::string>();
    // Plain file names only: the index cannot send the loader out of the directory.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
        name.find('\\') != std::string::npos) {
      throw CheckpointError(index_path.string() + ": shard '" + name + "' of tensor " + tensor +
                            " is not a plain file name in the checkpoint directory");
    }
    files.index[tensor] = name;
    if (seen.insert(name).second) {
      if (!fs::is_regular_file(root / name, ec)) {
        throw CheckpointError(index_path.string() + " names shard " + name + " (tensor " + tensor +
                              "), which is not in '" + dir + "'");
      }
      files.paths.push_back((root / name).string());
    }
  }
  std::sort(files.paths.begin(), files.paths.end());
  return files;
}

// Draws upstream's initialisation of the vision encoder and projector (Note [A language model as
// a nanoVLM]) from `gen`.
void InitVisionRandomly(VisionLanguageModel& model, at::Generator& gen) {
  for (torch::nn::Module* part : {static_cast<torch::nn::Module*>(model->vision_encoder.get()),
                                  static_cast<torch::nn::Module*>(model->MP.get())}) {
    for (auto& p : part->named_parameters()) {
      at::Tensor& t = p.value();
      if (EndsWith(p.key(), "position_embedding")) {
        t.uniform_(0.0, 1.0, gen);
      } else if (EndsWith(p.key(), ".bias")) {
        t.zero_();
      } else if (t.dim() == 1) {  // LayerNorm weights: every other weight is a matrix or a kernel
        t.fill_(1.0);
      } else {
        t.normal_(0.0, 0.02, gen);
      }
    }
  }
}

}  // namespace

bool IsTransformersConfig(const json& config) {
  return config.is_object() && (config.contains("model_type") || config.contains("architectures"));
}

VlmConfig TransformersLlamaConfig(const json& config, const std::string& name) {
  if (!config.is_object()) throw CheckpointError("config.json must hold a JSON object");
  CheckArchitecture(config);
  const int64_t hidden = Get<int64_t>(config, "hidden_size");
  const int64_t heads = Get<int64_t>(config, "num_attention_heads");
  CheckLlamaFeatures(config, hidden, heads);

  VlmConfig c = VlmConfig::Preset("nanovlm-460m");  // upstream's defaults, as convert_gguf.py
  c.lm_hidden_dim = hidden;
  c.lm_inter_dim = Get<int64_t>(config, "intermediate_size");
  c.lm_n_blocks = Get<int64_t>(config, "num_hidden_layers");
  c.lm_n_heads = heads;
  c.lm_n_kv_heads = Get<int64_t>(config, "num_key_value_heads", heads);
  c.lm_rms_eps = Get<double>(config, "rms_norm_eps", 1e-6);
  c.lm_re_base = RopeTheta(config);
  c.lm_max_position_embeddings = Get<int64_t>(config, "max_position_embeddings", int64_t{2048});
  c.lm_max_length = std::min<int64_t>(c.lm_max_length, c.lm_max_position_embeddings);
  const int64_t vocab = Get<int64_t>(config, "vocab_size");
  if (vocab < 1) throw CheckpointError("transformers config.json: vocab_size must be positive");
  c.lm_base_vocab_size = vocab;
  c.lm_vocab_size = vocab + c.extra_token_amount;
  c.image_token_id = vocab;  // the first extra token, as upstream's tokenizer numbers them
  c.lm_tie_weights = Get<bool>(config, "tie_word_embeddings", false);
  const std::string source = Get<std::string>(config, "_name_or_path", std::string());
  c.lm_model_type = c.lm_tokenizer = source.empty() ? name : source;
  try {
    c.Validate();
  } catch (const ConfigError& e) {
    throw CheckpointError(std::string("transformers config.json does not describe a model "
                                      "nanoVLM's decoder can run: ") +
                          e.what());
  }
  return c;
}

VisionLanguageModel LoadTransformersLlama(const std::string& dir, const json& config) {
  fs::path p = fs::path(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  const VlmConfig cfg = TransformersLlamaConfig(config, p.filename().string());
  const WeightFiles files = FindWeightFiles(dir);
  VisionLanguageModel model = [&] {
    SkipWeightInit skip;  // every parameter is loaded or drawn below
    return VisionLanguageModel(cfg);
  }();
  torch::NoGradGuard no_grad;

  // transformers' name -> the parameter it fills; vocab: only rows [0, vocab_size).
  struct Target {
    at::Tensor dst;
    bool vocab_rows;
  };
  std::map<std::string, Target> targets;
  auto params = model->named_parameters();
  targets[kEmbedTokens] = {params["decoder.token_embedding.weight"], true};
  if (!cfg.lm_tie_weights) targets[kLmHead] = {params["decoder.head.weight"], true};
  targets["model.norm.weight"] = {params["decoder.norm.weight"], false};
  for (int64_t i = 0; i < cfg.lm_n_blocks; ++i) {
    const std::string hf = "model.layers." + std::to_string(i) + ".";
    const std::string ours = "decoder.blocks." + std::to_string(i) + ".";
    for (const auto& [hf_suffix, our_suffix] : kBlockTensors) {
      targets[hf + hf_suffix] = {params[ours + our_suffix], false};
    }
  }

  const int64_t base = cfg.lm_base_vocab_size;
  std::vector<std::string> mismatched, unexpected;
  std::map<std::string, std::string> found_in;  // tensor -> weight file it came from
  at::Tensor tied_head;                         // a tied model's stored lm_head.weight, if any
  for (const std::string& path : files.paths) {
    SafetensorsFile file = ReadSafetensors(path);
    const std::string file_name = fs::path(path).filename().string();
    for (auto& [name, t] : file.tensors) {
      if (!found_in.emplace(name, file_name).second) {
        throw CheckpointError("transformers checkpoint '" + dir + "': tensor " + name +
                              " is stored twice (" + found_in[name] + " and " + file_name + ")");
      }
      if (EndsWith(name, "rotary_emb.inv_freq")) continue;  // recomputed from the config
      if (cfg.lm_tie_weights && name == kLmHead) {
        tied_head = t.to(at::kFloat);
        continue;
      }
      auto it = targets.find(name);
      if (it == targets.end()) {
        unexpected.push_back(name);
        continue;
      }
      at::Tensor dst = it->second.vocab_rows ? it->second.dst.narrow(0, 0, base) : it->second.dst;
      if (!at::isFloatingType(t.scalar_type())) {
        mismatched.push_back(name + " (dtype " + std::string(c10::toString(t.scalar_type())) +
                             ", needs a floating-point tensor)");
      } else if (!t.sizes().equals(dst.sizes())) {
        mismatched.push_back(name + " (checkpoint " + ShapeString(t.sizes()) +
                             ", config.json needs " + ShapeString(dst.sizes()) + ")");
      } else {
        dst.copy_(t);
      }
    }
  }
  for (const auto& [tensor, shard] : files.index) {
    auto it = found_in.find(tensor);
    if (it == found_in.end() || it->second != shard) {
      throw CheckpointError("transformers checkpoint '" + dir +
                            "': model.safetensors.index.json places tensor " + tensor + " in " +
                            shard + ", which does not hold it");
    }
  }
  std::vector<std::string> missing;
  for (const auto& [name, target] : targets) {
    if (!found_in.count(name)) missing.push_back(name);
  }
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    throw CheckpointError(TensorMismatchMessage(
        "transformers checkpoint '" + dir + "' (" + kFormat + ") does not match its config.json:",
        missing, mismatched, unexpected));
  }
  if (tied_head.defined()) {
    const at::Tensor embedding = params["decoder.token_embedding.weight"].narrow(0, 0, base);
    if (!tied_head.sizes().equals(embedding.sizes()) || !at::equal(tied_head, embedding)) {
      throw CheckpointError("transformers checkpoint '" + dir +
                            "': config.json has tie_word_embeddings true, but lm_head.weight "
                            "differs from model.embed_tokens.weight; set tie_word_embeddings to "
                            "false to load it as a separate head");
    }
  }

  // The random parts, in a fixed order (Note [A language model as a nanoVLM]).
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(kTransformersRandomSeed);
  InitVisionRandomly(model, gen);
  const int64_t extra = cfg.lm_vocab_size - base;
  params["decoder.token_embedding.weight"].narrow(0, base, extra).normal_(0.0, 0.02, gen);
  if (!cfg.lm_tie_weights) {
    params["decoder.head.weight"].narrow(0, base, extra).normal_(0.0, 0.02, gen);
  }
  return model;
}

}  // namespace vlmgraph
