#include "text/chat_format.h"

#include <regex>

namespace vlmgraph {
namespace {

// A Jinja string literal's escapes (\n, \t, \\, \', \") -> the characters they stand for.
std::string UnescapeJinja(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    switch (c) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      default:
        out += c;  // \\ \' \"
    }
  }
  return out;
}

void Require(const std::string& tmpl, const std::string& literal, const std::string& what) {
  if (tmpl.find(literal) == std::string::npos) {
    throw ChatFormatError("chat template is not ChatML (" + what + ": no '" + literal +
                          "' in it); vlmgraph renders ChatML templates only (nanoVLM's and "
                          "SmolLM2's), so use a checkpoint whose chat_template is ChatML");
  }
}

}  // namespace

ChatFormat ChatFormat::FromTemplate(const std::string& tmpl) {
  if (tmpl.empty()) throw ChatFormatError("chat template is empty");
  ChatFormat f;
  Require(tmpl, f.begin_of_turn_, "a turn's start");
  Require(tmpl, f.end_of_turn_, "a turn's end");
  Require(tmpl, "role", "the message role");
  Require(tmpl, "content", "the message content");
  Require(tmpl, "add_generation_prompt", "the reply prompt");
  // The reply prompt "<|im_start|>assistant\n", written with a Jinja escape or a raw newline.
  if (tmpl.find("<|im_start|>assistant\\n") == std::string::npos &&
      tmpl.find("<|im_start|>assistant\n") == std::string::npos) {
    throw ChatFormatError(
        "chat template is not ChatML (no '<|im_start|>assistant\\n' reply prompt); vlmgraph "
        "renders ChatML templates only");
  }
  // A default system message: a literal "<|im_start|>system\n...<|im_end|>" emitted only when the
  // first message is not a system message.
  static const std::regex kDefaultSystem(
      R"(messages\[0\]\[['"]role['"]\]\s*!=\s*['"]system['"][\s\S]*?<\|im_start\|>system(?:\\n|\n)([\s\S]*?)<\|im_end\|>)");
  std::smatch m;
  if (std::regex_search(tmpl, m, kDefaultSystem)) f.default_system_ = UnescapeJinja(m[1].str());
  return f;
}

std::vector<std::string_view> ContentTexts(const std::vector<ChatMessage>& messages) {
  std::vector<std::string_view> texts;
  for (const ChatMessage& m : messages) {
    for (const ChatContentPart& part : m.content) {
      if (!part.text.empty()) texts.push_back(part.text);
    }
  }
  return texts;
}

std::string ChatFormat::Render(const std::vector<ChatMessage>& messages,
                               const std::vector<std::string>& image_strings,
                               bool add_generation_prompt) const {
  return RenderWithRanges(messages, image_strings, add_generation_prompt).text;
}

RenderedChat ChatFormat::RenderWithRanges(const std::vector<ChatMessage>& messages,
                                          const std::vector<std::string>& image_strings,
                                          bool add_generation_prompt) const {
  RenderedChat rendered;
  std::string& out = rendered.text;
  std::vector<TextRange>& ranges = rendered.content_ranges;
  for (const RenderedTurn& turn : RenderTurns(messages, image_strings)) {
    for (const TextRange& r : turn.content_ranges) {
      const TextRange shifted{out.size() + r.begin, out.size() + r.end};
      if (!ranges.empty() && ranges.back().end == shifted.begin) {
        ranges.back().end = shifted.end;
      } else {
        ranges.push_back(shifted);
      }
    }
    out += turn.text;
  }
  if (add_generation_prompt) out += begin_of_turn_ + "assistant\n";
  return rendered;
}

std::vector<RenderedTurn> ChatFormat::RenderTurns(
    const std::vector<ChatMessage>& messages, const std::vector<std::string>& image_strings) const {
  if (messages.empty()) throw ChatFormatError("messages: the conversation is empty");
  std::vector<RenderedTurn> turns;
  if (default_system_ && messages[0].role != "system") {
    RenderedTurn t;
    t.role = "system";
    t.default_system = true;
    t.text = begin_of_turn_ + "system\n";
    t.header_bytes = t.text.size();
    t.text += *default_system_ + end_of_turn_ + "\n";
    turns.push_back(std::move(t));
  }
  size_t image = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& msg = messages[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant") {
      throw ChatFormatError(where + ".role: '" + msg.role +
                            "' is not supported; use system, user or assistant");
    }
    if (msg.role == "system" && i > 0) {
      throw ChatFormatError(where + ": a system message may only come first");
    }
    RenderedTurn turn;
    turn.role = msg.role;
    std::string& out = turn.text;
    std::vector<TextRange>& ranges = turn.content_ranges;
    out = begin_of_turn_ + msg.role + "\n";
    turn.header_bytes = out.size();
    for (const ChatContentPart& part : msg.content) {
      if (part.type == ChatContentPart::Type::kText) {
        if (part.text.empty()) continue;
        if (!ranges.empty() && ranges.back().end == out.size()) {
          ranges.back().end += part.text.size();
        } else {
          ranges.push_back({out.size(), out.size() + part.text.size()});
        }
        out += part.text;
        continue;
      }
      if (image >= image_strings.size()) {
        throw ChatFormatError(where + ": more image parts than images");
      }
      out += image_strings[image++];
    }
    out += end_of_turn_ + "\n";
    turns.push_back(std::move(turn));
  }
  if (image != image_strings.size()) {
    throw ChatFormatError("messages: " + std::to_string(image) + " image parts for " +
                          std::to_string(image_strings.size()) + " images");
  }
  return turns;
}

// Note [Assistant-turn loss]: upstream nanoVLM (data/datasets.py, BaseDataset) tokenizes the whole
// conversation with apply_chat_template, then walks the messages: each message's own rendering
// ("<|im_start|>role\ncontent<|im_end|>\n") is tokenized alone for its length, and for an assistant
// message the positions from prefix_len to the end of its segment get mask 1, where prefix_len is
// the token count of the template's text before the content of an assistant message
// ("<|im_start|>assistant\n"). So an assistant turn's content tokens, its "<|im_end|>" and the "\n"
// after it count; the header does not. Labels are the ids where the mask is 1, else -100, shifted
// left by one (labels[i] = ids[i + 1]), the last -100: position i learns the token after it.
// Here each turn is tokenized alone and the ids joined. This gives the ids of the whole text
// because every turn starts with "<|im_start|>", a special token, which the tokenizer matches
// before pre-tokenization, so no token spans two turns; that is also what upstream's segment
// lengths assume. The template's default system message (SmolLM2's) is a system turn: no loss.
// tests/e2e/test_train_entry.py checks ids and targets against upstream's code run on
// transformers' apply_chat_template.
ChatTrainingTokens TokenizeForTraining(const ChatFormat& chat, const Tokenizer& tokenizer,
                                       const std::vector<ChatMessage>& messages,
                                       const std::vector<std::string>& image_strings,
                                       bool parse_special_in_content) {
  bool has_assistant = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role != "assistant") continue;
    has_assistant = true;
    for (const ChatContentPart& part : messages[i].content) {
      if (part.type == ChatContentPart::Type::kImage) {
        throw ChatFormatError("messages[" + std::to_string(i) +
                              "]: an assistant message has an image part; images belong in "
                              "user messages (the loss covers the assistant's text)");
      }
    }
  }
  const std::vector<RenderedTurn> turns = chat.RenderTurns(messages, image_strings);
  if (!has_assistant) {
    throw ChatFormatError(
        "messages: no assistant message; the loss covers the assistant turns only, so a "
        "training example needs at least one");
  }
  const int64_t prefix_tokens =
      static_cast<int64_t>(tokenizer.Encode(chat.begin_of_turn() + "assistant\n").size());
  ChatTrainingTokens out;
  std::vector<bool> counts;
  for (const RenderedTurn& turn : turns) {
    EncodeOptions options;
    if (!parse_special_in_content) options.plain_ranges = turn.content_ranges;
    const std::vector<int64_t> ids = tokenizer.Encode(turn.text, options);
    const bool assistant = turn.role == "assistant";
    for (size_t k = 0; k < ids.size(); ++k) {
      out.input_ids.push_back(ids[k]);
      counts.push_back(assistant && static_cast<int64_t>(k) >= prefix_tokens);
    }
  }
  out.targets.assign(out.input_ids.size(), -100);
  for (size_t i = 0; i + 1 < out.input_ids.size(); ++i) {
    if (counts[i + 1]) out.targets[i] = out.input_ids[i + 1];
  }
  return out;
}

std::string ImageString(const VlmConfig& cfg, const ImageGrid& grid) {
  return ImageString(cfg, grid, 0, false);
}

std::string ImageString(const VlmConfig& cfg, const ImageGrid& grid, int64_t index, bool numbered) {
  auto token = [&cfg](const std::string& name) -> const std::string& {
    for (const auto& [key, text] : cfg.vlm_extra_tokens) {
      if (key == name) return text;
    }
    throw ChatFormatError("model config: vlm_extra_tokens has no '" + name +
                          "', which the image string needs (upstream get_image_string)");
  };
  std::string image_tokens;
  const std::string& image = token("image_token");
  for (int64_t i = 0; i < cfg.mp_image_token_length; ++i) image_tokens += image;

  std::string out;
  if (numbered) out += "<image: " + std::to_string(index) + ">";
  out += token("global_image_token") + image_tokens;
  if (grid.rows == 1 && grid.cols == 1) return out;  // the one tile is the global image
  for (int64_t r = 1; r <= grid.rows; ++r) {
    for (int64_t c = 1; c <= grid.cols; ++c) {
      out += token("r" + std::to_string(r) + "c" + std::to_string(c)) + image_tokens;
    }
  }
  return out;
}

}  // namespace vlmgraph
