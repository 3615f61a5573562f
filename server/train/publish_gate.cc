#include "server/train/publish_gate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "base/log.h"
#include "server/core/status.h"

namespace vlmgraph::server {
namespace {

constexpr const char* kPromptsKey = "train.publish_gate_prompts_file";

// Four short chat questions: general knowledge, counting, a translation, a sentence to write.
const std::vector<std::string>& BuiltInQuestions() {
  static const std::vector<std::string> questions = {
      "What is the capital of France?",
      "How many legs does a spider have?",
      "Translate 'good morning' into Spanish.",
      "Write one sentence about the sea.",
  };
  return questions;
}

// Four fixed 16-token sequences inside the base vocabulary (never the image token).
std::vector<std::vector<int64_t>> BuiltInTokenPrompts(const VlmConfig& model) {
  const int64_t vocab = std::max<int64_t>(
      2, std::min(model.lm_base_vocab_size > 0 ? model.lm_base_vocab_size : model.lm_vocab_size,
                  model.lm_vocab_size));
  std::vector<std::vector<int64_t>> out;
  for (int64_t p = 0; p < 4; ++p) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < 16; ++i) {
      int64_t id = (1 + 37 * p + 7 * i) % vocab;
      if (id == model.image_token_id) id = (id + 1) % vocab;
      ids.push_back(id);
    }
    out.push_back(std::move(ids));
  }
  return out;
}

// "1 2 3" or "1, 2, 3" -> ids; ServerConfigError naming `where` otherwise.
std::vector<int64_t> ParseIds(const std::string& line, const std::string& where) {
  std::string text = line;
  std::replace(text.begin(), text.end(), ',', ' ');
  std::istringstream in(text);
  std::vector<int64_t> ids;
  for (std::string word; in >> word;) {
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size() || id < 0) {
      throw ServerConfigError(where, "'" + LogSafe(word, 40) +
                                         "' is not a token id (a model without a tokenizer takes "
                                         "token ids separated by spaces or commas)");
    }
    ids.push_back(id);
  }
  return ids;
}

// The non-blank lines of `path` that do not start with '#', with their line numbers.
std::vector<std::pair<int, std::string>> ReadPromptLines(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ServerConfigError(kPromptsKey, "cannot read '" + path + "'");
  std::vector<std::pair<int, std::string>> lines;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    lines.emplace_back(number, line);
  }
  if (lines.empty()) throw ServerConfigError(kPromptsKey, "'" + path + "' holds no prompt");
  return lines;
}

std::string Number(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4g", v);
  return text;
}

ForwardRequest HeldOutRequest(const std::vector<int64_t>& ids) {
  ForwardRequest r;
  r.input_ids = ids;
  r.target_ids.assign(ids.begin() + 1, ids.end());
  r.target_ids.push_back(-100);
  r.logits_positions = {static_cast<int64_t>(ids.size()) - 1};
  return r;
}

}  // namespace

PublishGate PublishGate::FromConfig(const ServerConfig& config, const Engine& engine,
                                    const TextModel* text) {
  const ServerConfig::Train& t = config.train;
  PublishGateOptions options;
  options.enabled = t.publish_gate;
  options.max_loss_increase = t.publish_gate_max_loss_increase;
  options.max_abs_weight = t.publish_gate_max_abs_weight;
  std::vector<int64_t> stop = config.model_stop_token_ids;
  if (stop.empty() && text != nullptr) stop = text->default_stop_token_ids();
  if (!options.enabled) return PublishGate(engine, {}, stop, options);

  auto render = [&](const std::string& question, const std::string& where) {
    if (text == nullptr) return ParseIds(question, where);
    ChatMessage m;
    m.role = "user";
    m.content.push_back(ChatContentPart::Text(question));
    try {
      return text->BuildChat({m}, {}, /*add_generation_prompt=*/true).input_ids;
    } catch (const std::exception& e) {
      throw ServerConfigError(where, e.what());
    }
  };
  std::vector<std::vector<int64_t>> prompts;
  const std::string& path = t.publish_gate_prompts_file;
  if (!path.empty()) {
    for (const auto& [number, line] : ReadPromptLines(path)) {
      const std::string where = std::string(kPromptsKey) + " line " + std::to_string(number);
      std::vector<int64_t> ids = render(line, where);
      if (ids.size() < 2) throw ServerConfigError(where, "a prompt needs at least 2 tokens");
      try {
        (void)engine.Validate(HeldOutRequest(ids));
      } catch (const std::exception& e) {
        throw ServerConfigError(where, e.what());
      }
      prompts.push_back(std::move(ids));
    }
  } else {
    std::vector<std::vector<int64_t>> built_in;
    if (text != nullptr) {
      for (const std::string& q : BuiltInQuestions()) built_in.push_back(render(q, kPromptsKey));
    } else {
      built_in = BuiltInTokenPrompts(engine.model_config());
    }
    for (std::vector<int64_t>& ids : built_in) {
      try {
        (void)engine.Validate(HeldOutRequest(ids));
        prompts.push_back(std::move(ids));
      } catch (const std::exception& e) {
        LogWarn(std::string("publish gate: a built-in held-out prompt is left out: ") + e.what());
      }
    }
    if (prompts.empty()) {
      LogWarn(
          "publish gate: no held-out prompt fits this engine; only the weight bound is checked "
          "(set train.publish_gate_prompts_file)");
    }
  }
  // Built-in token sequences belong to no task: their loss bounds nothing (Note [Publish gate]).
  const bool bound_loss = text != nullptr || !path.empty();
  return PublishGate(engine, prompts, stop, options, bound_loss);
}

PublishGate::PublishGate(const Engine& engine, const std::vector<std::vector<int64_t>>& prompts,
                         std::vector<int64_t> stop_token_ids, PublishGateOptions options,
                         bool bound_loss)
    : stop_token_ids_(std::move(stop_token_ids)), options_(options), bound_loss_(bound_loss) {
  for (const std::vector<int64_t>& ids : prompts) {
    prompts_.push_back(engine.Validate(HeldOutRequest(ids)));
  }
}

HeldOutScore PublishGate::Score(Engine& engine) const {
  HeldOutScore s;
  double loss_sum = 0;
  for (const ValidatedForward& prompt : prompts_) {
    const ForwardResult r = engine.Forward(prompt);
    loss_sum += r.loss * static_cast<double>(r.loss_tokens);
    s.loss_tokens += r.loss_tokens;
    ++s.prompts;
    const std::vector<float>& logits = r.logits.at(0);
    bool finite = true;
    for (float v : logits) finite = finite && std::isfinite(v);
    s.finite_logits = s.finite_logits && finite;
    const int64_t next = std::max_element(logits.begin(), logits.end()) - logits.begin();
    if (std::find(stop_token_ids_.begin(), stop_token_ids_.end(), next) != stop_token_ids_.end())
      ++s.prompts_ending_at_once;
  }
  s.loss = s.loss_tokens > 0 ? loss_sum / static_cast<double>(s.loss_tokens) : 0.0;
  return s;
}

GateVerdict PublishGate::Judge(const HeldOutScore& served, const HeldOutScore& candidate,
                               double candidate_max_abs_weight) const {
  const std::string losses = "held-out loss " + Number(served.loss) + " nats/token served, " +
                             Number(candidate.loss) + " with the job's weights (" +
                             std::to_string(candidate.prompts) + " prompts, " +
                             std::to_string(candidate.loss_tokens) + " tokens)";
  if (options_.max_abs_weight > 0 && !(candidate_max_abs_weight <= options_.max_abs_weight)) {
    return {"max_abs_weight", "the largest |weight| is " + Number(candidate_max_abs_weight) +
                                  ", above train.publish_gate_max_abs_weight " +
                                  Number(options_.max_abs_weight) + "; " + losses};
  }
  if (candidate.prompts == 0) return {};
  if (!std::isfinite(candidate.loss) || !candidate.finite_logits) {
    return {"non_finite", "the job's weights give NaN or infinite " +
                              std::string(candidate.finite_logits ? "loss" : "logits") + "; " +
                              losses};
  }
  if (!stop_token_ids_.empty() && candidate.prompts_ending_at_once == candidate.prompts &&
      served.prompts_ending_at_once < served.prompts) {
    return {"collapse",
            "with the job's weights every held-out answer ends at once (its first "
            "token is a stop token on " +
                std::to_string(candidate.prompts) + " of " + std::to_string(candidate.prompts) +
                " prompts, served: " + std::to_string(served.prompts_ending_at_once) + "); " +
                losses};
  }
  if (bound_loss_ && std::isfinite(served.loss) &&
      candidate.loss > served.loss + options_.max_loss_increase) {
    return {"loss_increase", losses + ": +" + Number(candidate.loss - served.loss) +
                                 " nats/token, above train.publish_gate_max_loss_increase " +
                                 Number(options_.max_loss_increase)};
  }
  return {};
}

}  // namespace vlmgraph::server
