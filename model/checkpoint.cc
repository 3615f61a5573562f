#include "model/checkpoint.h"

#include <ATen/ATen.h>
#include <torch/utils.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "base/atomic_file.h"
#include "base/safetensors.h"
#include "model/hf_checkpoint.h"
#include "model/weight_init.h"

namespace vlmgraph {
namespace {

namespace fs = std::filesystem;

constexpr const char* kEmbedding = "decoder.token_embedding.weight";
constexpr const char* kHead = "decoder.head.weight";

std::string ShapeString(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

// The module's parameters and buffers by module name.
std::map<std::string, at::Tensor> ModuleTensors(VisionLanguageModel& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value();
  for (const auto& b : model->named_buffers()) out[b.key()] = b.value();
  return out;
}

// Module names -> upstream state-dict names: the tied matrix once, under the name safetensors'
// save_model keeps for upstream models.
std::map<std::string, at::Tensor> UpstreamNames(const VlmConfig& cfg,
                                                std::map<std::string, at::Tensor> tensors) {
  if (cfg.lm_tie_weights) {
    auto it = tensors.find(kEmbedding);
    if (it == tensors.end()) throw CheckpointError(std::string("missing tensor ") + kEmbedding);
    tensors[kHead] = it->second;
    tensors.erase(kEmbedding);
  }
  return tensors;
}

// `dir/config.json`, parsed. Throws CheckpointError (with the accepted formats) when there is
// none, ConfigError when it is not JSON.
nlohmann::json ReadCheckpointConfig(const std::string& dir) {
  const fs::path path = fs::path(dir) / "config.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    throw CheckpointError("no config.json in checkpoint directory '" + dir + "'; " +
                          kAcceptedCheckpointFormats);
  }
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot open model config '" + path.string() + "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError("model config '" + path.string() + "' is not valid JSON: " + e.what());
  }
}

// The directory's own name ("smollm2-135m" for "models/smollm2-135m/").
std::string CheckpointName(const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  return p.filename().string();
}

}  // namespace

std::map<std::string, at::Tensor> StateDict(VisionLanguageModel& model) {
  return UpstreamNames(model->cfg, ModuleTensors(model));
}

void LoadWeights(VisionLanguageModel& model, const std::string& safetensors_path) {
  SafetensorsFile file = ReadSafetensors(safetensors_path);
  auto& stored = file.tensors;
  const bool tied = model->cfg.lm_tie_weights;
  // Resolve aliases recorded by safetensors' save_model: {"removed name": "kept name"}.
  for (const auto& [removed, kept] : file.metadata) {
    if (!stored.count(removed) && stored.count(kept)) stored[removed] = stored[kept];
  }
  if (tied) {
    if (!stored.count(kEmbedding) && stored.count(kHead)) stored[kEmbedding] = stored[kHead];
    stored.erase(kHead);
  }

  std::vector<std::string> missing, mismatched;
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  auto assign = [&](const std::string& name, at::Tensor& dst, bool optional) {
    auto it = stored.find(name);
    if (it == stored.end()) {
      if (!optional) missing.push_back(name);
      return;
    }
    used.insert(name);
    if (!it->second.sizes().equals(dst.sizes())) {
      mismatched.push_back(name + " (checkpoint " + ShapeString(it->second.sizes()) +
                           ", config needs " + ShapeString(dst.sizes()) + ")");
      return;
    }
    dst.copy_(it->second);
  };
  for (auto& p : model->named_parameters()) assign(p.key(), p.value(), /*optional=*/false);
  for (auto& b : model->named_buffers()) assign(b.key(), b.value(), /*optional=*/true);

  std::vector<std::string> unexpected;
  for (const auto& [name, t] : stored) {
    if (!used.count(name)) unexpected.push_back(name);
  }
  if (missing.empty() && mismatched.empty() && unexpected.empty()) return;
  throw CheckpointError(TensorMismatchMessage(
      "checkpoint '" + safetensors_path + "' does not match its config:", missing, mismatched,
      unexpected));
}

const char* const kAcceptedCheckpointFormats =
    "vlmgraph loads a nanoVLM checkpoint (config.json with nanoVLM's VLMConfig + "
    "model.safetensors, as nanoVLM's save_pretrained and vlmgraph write them) or a Hugging Face "
    "transformers Llama / SmolLM2 checkpoint (config.json with model_type \"llama\" + "
    "model.safetensors, or model.safetensors.index.json and its shards, as transformers' "
    "save_pretrained writes them)";

std::string TensorMismatchMessage(const std::string& header,
                                  const std::vector<std::string>& missing,
                                  const std::vector<std::string>& mismatched,
                                  const std::vector<std::string>& unexpected) {
  std::ostringstream msg;
  msg << header;
  auto list = [&](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    msg << "\n  " << what << " (" << names.size() << "):";
    for (size_t i = 0; i < names.size() && i < 20; ++i) msg << "\n    " << names[i];
    if (names.size() > 20) msg << "\n    ... and " << names.size() - 20 << " more";
  };
  list("missing tensors", missing);
  list("mis-shaped tensors", mismatched);
  list("unexpected tensors", unexpected);
  return msg.str();
}

VisionLanguageModel LoadModel(const std::string& dir) {
  const nlohmann::json config = ReadCheckpointConfig(dir);
  if (IsTransformersConfig(config)) return LoadTransformersLlama(dir, config);
  const auto weights_path = std::filesystem::path(dir) / "model.safetensors";
  if (!std::filesystem::exists(weights_path)) {
    throw CheckpointError("no model.safetensors in checkpoint directory '" + dir + "'; " +
                          kAcceptedCheckpointFormats);
  }
  const VlmConfig cfg = VlmConfig::FromJson(config);
  VisionLanguageModel model = [&] {
    SkipWeightInit skip;  // LoadWeights overwrites every parameter or throws
    return VisionLanguageModel(cfg);
  }();
  LoadWeights(model, weights_path.string());
  return model;
}

VlmConfig LoadModelConfig(const std::string& dir) {
  const nlohmann::json config = ReadCheckpointConfig(dir);
  if (IsTransformersConfig(config)) {
    return TransformersLlamaConfig(config, CheckpointName(dir));
  }
  return VlmConfig::FromJson(config);
}

void SaveModel(VisionLanguageModel& model, const std::string& dir) {
  SaveModel(model->cfg, ModuleTensors(model), dir);
}

void SaveModel(const VlmConfig& cfg, std::map<std::string, at::Tensor> tensors,
               const std::string& dir) {
  std::filesystem::create_directories(dir);
  // Each file as a fresh temporary renamed into place (base/atomic_file.h).
  WriteFileAtomically((std::filesystem::path(dir) / "config.json").string(), cfg.ToJson().dump(4));
  std::map<std::string, std::string> metadata;
  if (cfg.lm_tie_weights) metadata[kEmbedding] = kHead;
  WriteSafetensors((std::filesystem::path(dir) / "model.safetensors").string(),
                   UpstreamNames(cfg, std::move(tensors)), metadata);
}

}  // namespace vlmgraph
