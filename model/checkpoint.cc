#include "model/checkpoint.h"

#include <ATen/ATen.h>
#include <torch/utils.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "base/atomic_file.h"
#include "base/safetensors.h"
#include "model/weight_init.h"

namespace vlmgraph {
namespace {

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
  std::ostringstream msg;
  msg << "checkpoint '" << safetensors_path << "' does not match its config:";
  auto list = [&](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    msg << "\n  " << what << " (" << names.size() << "):";
    for (size_t i = 0; i < names.size() && i < 20; ++i) msg << "\n    " << names[i];
    if (names.size() > 20) msg << "\n    ... and " << names.size() - 20 << " more";
  };
  list("missing tensors", missing);
  list("mis-shaped tensors", mismatched);
  list("unexpected tensors", unexpected);
  throw CheckpointError(msg.str());
}

VisionLanguageModel LoadModel(const std::string& dir) {
  const auto config_path = std::filesystem::path(dir) / "config.json";
  const auto weights_path = std::filesystem::path(dir) / "model.safetensors";
  if (!std::filesystem::exists(config_path)) {
    throw CheckpointError("no config.json in checkpoint directory '" + dir + "'");
  }
  if (!std::filesystem::exists(weights_path)) {
    throw CheckpointError("no model.safetensors in checkpoint directory '" + dir + "'");
  }
  const VlmConfig cfg = VlmConfig::FromJsonFile(config_path.string());
  VisionLanguageModel model = [&] {
    SkipWeightInit skip;  // LoadWeights overwrites every parameter or throws
    return VisionLanguageModel(cfg);
  }();
  LoadWeights(model, weights_path.string());
  return model;
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
