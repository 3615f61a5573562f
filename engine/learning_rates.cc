#include "engine/learning_rates.h"

#include <cmath>
#include <cstdio>

#include "engine/engine_types.h"

namespace vlmgraph {
namespace {

std::string Number(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  return text;
}

}  // namespace

double* LearningRates::Find(const std::string& name) {
  for (const Group& g : kGroups) {
    if (name == g.name) return &(this->*g.rate);
  }
  return nullptr;
}

const double* LearningRates::Find(const std::string& name) const {
  return const_cast<LearningRates*>(this)->Find(name);
}

std::optional<LearningRates::Problem> LearningRates::Check(double max_rate) const {
  const LearningRates defaults;
  const bool bounded = std::isfinite(max_rate);
  for (const Group& g : kGroups) {
    const double rate = this->*g.rate;
    if (rate >= 0 && std::isfinite(rate) && rate <= max_rate) continue;  // false for NaN
    const std::string name = g.name;
    const std::string part = name == "language" ? "the language model"
                             : name == "vision" ? "the vision encoder"
                                                : "the modality projector";
    const std::string range =
        bounded ? "must lie in [0, " + Number(max_rate) + "]" : "must be finite and >= 0";
    return Problem{name + "_learning_rate",
                   range + ", got " + Number(rate) + "; set a rate " +
                       (bounded ? "in that range" : ">= 0") + " (0 freezes " + part +
                       "; upstream nanoVLM's default is " + Number(defaults.*g.rate) + ")"};
  }
  return std::nullopt;
}

void LearningRates::Validate(double max_rate) const {
  if (auto p = Check(max_rate)) throw EngineError(p->field, p->field + ": " + p->message);
}

}  // namespace vlmgraph
