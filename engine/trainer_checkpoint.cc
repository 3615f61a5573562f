// engine/trainer_checkpoint.cc: the Trainer's checkpoint files: SaveCheckpoint's config.json,
// model.safetensors and optimizer.safetensors (AdamW state, the step, each group's learning
// rates), their size, and LoadOptimizerState. Formats: engine/trainer.h.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/log.h"
#include "base/safetensors.h"
#include "engine/learning_rates.h"
#include "engine/trainer.h"
#include "engine/trainer_internal.h"
#include "model/checkpoint.h"

namespace vlmgraph {
namespace {

// A double as text that reads back to the same double.
std::string ExactText(double v) {
  char text[40];
  std::snprintf(text, sizeof(text), "%.17g", v);
  return text;
}

// The learning rates an optimizer.safetensors keeps (Note [Learning rates]): each group's rate
// and the rate its last step took.
struct SavedLearningRates {
  LearningRates rates, scheduled;
  bool per_group = false;  // false: a file from before per-group rates ("lr" only)
};

// The rates of `meta`: learning_rate.<group> and scheduled_learning_rate.<group>, or the one
// "lr" of older files as every group's rate (and scheduled rate); nullopt when it has neither,
// or an "lr" of 0 (older files wrote "lr" with 6 decimals: a rate below 5e-7 reads as 0), which
// leaves the job's own rates. std::runtime_error naming the key for a value that is not a
// number in range.
std::optional<SavedLearningRates> ReadSavedLearningRates(
    const std::map<std::string, std::string>& meta, const std::string& path) {
  auto number = [&](const std::string& key) {
    const std::string& text = meta.at(key);
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || !(v >= 0 && std::isfinite(v))) {
      throw std::runtime_error("optimizer state '" + path + "': metadata " + key + " is '" + text +
                               "', not a learning rate (a finite number >= 0)");
    }
    return v;
  };
  SavedLearningRates saved;
  int found = 0;
  for (const auto& group : LearningRates::kGroups) {
    const std::string key = std::string("learning_rate.") + group.name;
    const std::string scheduled_key = "scheduled_" + key;
    if (meta.count(key) == 0) continue;
    ++found;
    saved.rates.*group.rate = number(key);
    saved.scheduled.*group.rate =
        meta.count(scheduled_key) ? number(scheduled_key) : saved.rates.*group.rate;
  }
  if (found == static_cast<int>(LearningRates::kGroups.size())) {
    saved.per_group = true;
    return saved;
  }
  if (found > 0) {
    throw std::runtime_error("optimizer state '" + path +
                             "': metadata has learning_rate.<group> for some groups only");
  }
  if (meta.count("lr") == 0) return std::nullopt;
  const double lr = number("lr");
  if (lr == 0) return std::nullopt;
  saved.rates = saved.scheduled = LearningRates::All(lr);
  return saved;
}

}  // namespace

void Trainer::SaveCheckpoint(const std::string& dir) {
  RequireAtRest("SaveCheckpoint");
  if (!optimizer_state_gathered_) {
    throw std::logic_error(
        "Trainer::SaveCheckpoint: the optimizer is sharded over the ranks "
        "(DataParallelOptions::shard_optimizer) and its state was not gathered since the last "
        "step: call GatherOptimizerState on every rank first");
  }
  // The float32 weights: masters of the trained parameters, the frozen ones' float32 copies (or
  // their working values, exact when the source was in the compute dtype), float32 buffers.
  std::map<std::string, at::Tensor> weights = frozen_float32_;
  for (const auto& [name, master] : master_weights_) weights[name] = master;
  for (const auto& p : model_->named_parameters()) {
    if (weights.count(p.key()) == 0) weights.emplace(p.key(), p.value().to(at::kFloat));
  }
  for (const auto& b : model_->named_buffers()) weights.emplace(b.key(), b.value());
  SaveModel(model_->cfg, std::move(weights), dir);
  std::map<std::string, at::Tensor> state;
  for (const auto& g : groups_) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      state["exp_avg." + g.names[i]] = g.exp_avg[i];
      state["exp_avg_sq." + g.names[i]] = g.exp_avg_sq[i];
      state["step." + g.names[i]] = g.steps[i];
    }
  }
  std::map<std::string, std::string> meta = {
      {"optimizer", "adamw"},
      {"betas", std::to_string(options_.beta1) + "," + std::to_string(options_.beta2)},
      {"eps", std::to_string(options_.eps)},
      {"weight_decay", std::to_string(options_.weight_decay)},
      {"steps", std::to_string(steps_)},
  };
  // Note [Learning rates]: each group's rate and the rate its last step took, exactly.
  for (const auto& group : LearningRates::kGroups) {
    const double rate = learning_rates_.*group.rate;
    meta[std::string("learning_rate.") + group.name] = ExactText(rate);
    meta[std::string("scheduled_learning_rate.") + group.name] = ExactText(rate * lr_scale_);
  }
  WriteSafetensors((std::filesystem::path(dir) / "optimizer.safetensors").string(), state, meta);
}

void Trainer::LoadOptimizerState(const std::string& path) {
  RequireAtRest("LoadOptimizerState");
  Warmup();  // its captures reset the optimizer state: before loading it, not after
  SafetensorsFile f = ReadSafetensors(path);
  const std::optional<SavedLearningRates> saved = ReadSavedLearningRates(f.metadata, path);
  if (saved && saved->per_group) {
    // A group the checkpoint froze has no AdamW state to resume.
    for (const auto& g : groups_) {
      if (*saved->rates.Find(g.name) == 0) {
        throw std::runtime_error("the checkpoint '" + path + "' froze the " + g.name +
                                 " part (learning_rate." + g.name + " 0) and has no optimizer " +
                                 "state for it; set " + g.name +
                                 "_learning_rate to 0 to resume it");
      }
    }
  }
  at::NoGradGuard no_grad;
  for (auto& g : groups_) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      for (auto [prefix, dst] : {std::pair<const char*, at::Tensor*>{"exp_avg.", &g.exp_avg[i]},
                                 {"exp_avg_sq.", &g.exp_avg_sq[i]},
                                 {"step.", &g.steps[i]}}) {
        auto it = f.tensors.find(prefix + g.names[i]);
        if (it == f.tensors.end() || !it->second.sizes().equals(dst->sizes())) {
          throw std::runtime_error("optimizer state '" + path + "' lacks or mis-shapes " + prefix +
                                   g.names[i]);
        }
        dst->copy_(it->second);
      }
    }
  }
  if (auto it = f.metadata.find("steps"); it != f.metadata.end()) steps_ = std::stoll(it->second);
  // Every rank loads the whole state: nothing is stale (Note [Sharded optimizer]).
  optimizer_state_gathered_ = true;
  if (!saved) return;
  // Note [Learning rates]: the trained groups take the checkpoint's rates back, and every group
  // the schedule's factor of its last step (one factor, as SetLearningRateScale keeps it).
  const LearningRates job = learning_rates_;
  double scale = 1;
  bool have_scale = false;
  for (const auto& g : groups_) {
    const double rate = *saved->rates.Find(g.name);
    *learning_rates_.Find(g.name) = rate;
    if (!have_scale && rate > 0) {
      scale = *saved->scheduled.Find(g.name) / rate;
      have_scale = true;
    }
  }
  SetLearningRateScale(scale);
  if (learning_rates_ != job || scale != 1) {
    LogInfo(
        LogFormat("resumed the learning rates of %s: projector %g, vision %g, language %g, "
                  "schedule factor %g (the job set projector %g, vision %g, language %g)",
                  path.c_str(), learning_rates_.projector, learning_rates_.vision,
                  learning_rates_.language, scale, job.projector, job.vision, job.language));
  }
}

int64_t Trainer::checkpoint_bytes() const {
  int64_t bytes = 64 << 10, tensors = 0;
  for (const auto& p : model_->parameters()) {
    bytes += 4 * p.numel();
    ++tensors;
  }
  for (const auto& b : model_->buffers()) {
    bytes += 4 * b.numel();
    ++tensors;
  }
  for (const auto& g : groups_) {
    for (const auto& p : g.params) bytes += 8 * p.numel() + 4;
    tensors += 3 * static_cast<int64_t>(g.params.size());
  }
  return bytes + 512 * tensors;
}

}  // namespace vlmgraph
