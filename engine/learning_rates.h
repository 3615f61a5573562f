// engine/learning_rates.h: the AdamW learning rate of each part of the model: the one model of
// learning rates that the trainer, the Train RPC, vlmgraph-train and checkpoints share.
//
//   LearningRates r;  // upstream nanoVLM's: projector 5.12e-3, vision 5e-5, language 5e-5
//   r.vision = 0;     // the vision encoder is frozen
//   r.Validate();     // EngineError naming the field when a rate is not in [0, 1]
//   TrainOptions o;  o.learning_rates = r;
//
// Note [Learning rates]
// ~~~~~~~~~~~~~~~~~~~~~
// A job has one rate per parameter group, as upstream nanoVLM's TrainConfig
// (models/config.py: lr_mp = 0.00512, lr_vision_backbone = 5e-5, lr_language_backbone = 5e-5),
// whose values are the defaults here and the only defaults: every layer starts from
// LearningRates{} and sets the rates its user gave. The groups are nanoVLM's modules:
// "projector" (MP, the modality projector), "vision" (vision_encoder), "language" (decoder).
//
// Values: each rate lies in [0, kMaxLearningRate] (NaN is refused) where a user sets it.
// - rate > 0: the group trains; each step uses rate x the schedule's factor
//   (Trainer::SetLearningRateScale; 1 without a schedule).
// - rate 0: the group is frozen: its parameters get no gradients and no optimizer state and never
//   change, as upstream's train.py leaves a group whose rate is not > 0 out of the optimizer and
//   sets requires_grad False. A job with every rate 0 trains nothing and is refused.
// There is no other special value: no "unset", no "inherit another group's rate".
// The bound: an AdamW step moves each weight by about its rate, so a rate above 1 overshoots any
// weight a model has (and keeps the decay factor 1 - rate x weight_decay in [0, 1]).
//
// Names: the APIs call the rates <group>_learning_rate (TrainConfig's language_learning_rate,
// vision_learning_rate, projector_learning_rate in proto/vlmgraph/v1/train.proto; vlmgraph-train's
// train.<group>_learning_rate; the Python client's train_config keywords and
// --<group>-learning-rate flags). Checkpoints (Trainer::SaveCheckpoint, optimizer.safetensors
// metadata) keep each group's rate as learning_rate.<group> and the rate its last step took as
// scheduled_learning_rate.<group>; a resumed job takes both back (Trainer::LoadOptimizerState). A
// checkpoint written before these keys has one "lr", which resumes as every group's rate.
// docs/training.md ("Learning rates") describes this for users.
//
// Thread rules: a value type.
#pragma once

#include <array>
#include <optional>
#include <string>

namespace vlmgraph {

struct LearningRates {
  // Upstream nanoVLM's TrainConfig defaults (models/config.py): lr_mp, lr_vision_backbone,
  // lr_language_backbone.
  double projector = 5.12e-3;
  double vision = 5e-5;
  double language = 5e-5;

  // The largest rate accepted (Note [Learning rates]).
  static constexpr double kMaxLearningRate = 1.0;

  // Each group's name and field, in the trainer's group order.
  struct Group {
    const char* name;  // "vision", "projector", "language"
    double LearningRates::*rate;
  };
  static constexpr std::array<Group, 3> kGroups = {{{"vision", &LearningRates::vision},
                                                    {"projector", &LearningRates::projector},
                                                    {"language", &LearningRates::language}}};

  // Every group at `rate`.
  static LearningRates All(double rate) { return {rate, rate, rate}; }

  // The rate of the group named `name` ("vision", "projector", "language"); nullptr for another
  // name.
  double* Find(const std::string& name);
  const double* Find(const std::string& name) const;

  // The first rate out of range, as {field, problem}: field "language_learning_rate" (the API's
  // name), problem "must lie in [0, 1], got 1e+30; ..." saying what to change. Every layer that
  // takes rates from a user checks them here (the one check) and reports it in its own error
  // type, with its own prefix ("config.", "train."). The APIs accept [0, kMaxLearningRate]; the
  // Trainer accepts any finite rate >= 0 (max_rate infinity), so a library caller can drive a
  // rate no API accepts (what the skipped-step and publish-gate defences are tested with).
  struct Problem {
    std::string field;
    std::string message;
  };
  std::optional<Problem> Check(double max_rate = kMaxLearningRate) const;
  // Check(max_rate) as EngineError(field, "<field>: <problem>") (INVALID_ARGUMENT).
  void Validate(double max_rate = kMaxLearningRate) const;

  bool AnyTrained() const { return projector > 0 || vision > 0 || language > 0; }

  bool operator==(const LearningRates& o) const {
    return projector == o.projector && vision == o.vision && language == o.language;
  }
  bool operator!=(const LearningRates& o) const { return !(*this == o); }
};

}  // namespace vlmgraph
