#include "server/core/text_prompt.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "server/core/status.h"

namespace vlmgraph::server {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The JSON file at `path`, or null when there is none. Throws ServerConfigError when it exists but
// cannot be parsed.
json ReadJsonIfExists(const fs::path& path) {
  if (!fs::is_regular_file(path)) return nullptr;
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return json::parse(text.str());
  } catch (const json::exception& e) {
    throw ServerConfigError("tokenizer", path.string() + " is not valid JSON: " + e.what());
  }
}

// The text of the file at `path`, or "" when there is none.
std::string ReadTextIfExists(const fs::path& path) {
  if (!fs::is_regular_file(path)) return {};
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A token given as "text" or as an AddedToken object {"content": "text", ...} (transformers
// writes both forms).
std::string TokenText(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string())
    return j["content"].get<std::string>();
  return {};
}

// tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} where
// "default" is the chat template (transformers' multi-template form).
std::string ChatTemplate(const json& tokenizer_config) {
  if (!tokenizer_config.is_object() || !tokenizer_config.contains("chat_template")) return {};
  const json& t = tokenizer_config["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array()) {
    for (const json& entry : t) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string())
        return entry["template"].get<std::string>();
    }
  }
  return {};
}

// The tokenizer.json to load: the configured one, or the checkpoint's, or none.
std::string TokenizerPath(const ServerConfig& config) {
  if (config.tokenizer == "none") return {};
  if (!config.tokenizer.empty()) return config.tokenizer;
  if (IsPresetModel(config.model)) return {};
  const fs::path p = fs::path(config.model) / "tokenizer.json";
  return fs::is_regular_file(p) ? p.string() : std::string();
}

// The image string of each image in order (numbered when there are several), as upstream's
// get_image_string builds them.
std::vector<std::string> ImageStrings(const VlmConfig& model,
                                      const std::vector<ImageTiles>& images) {
  std::vector<std::string> out;
  const bool numbered = images.size() > 1;
  for (size_t i = 0; i < images.size(); ++i) {
    out.push_back(ImageString(model, {images[i].grid_rows, images[i].grid_cols},
                              static_cast<int64_t>(i), numbered));
  }
  return out;
}

// The tokenizer at `path`. One that holds none of the model's extra VLM tokens and no id at or
// above lm_base_vocab_size (the base tokenizer of a language model, such as a transformers
// SmolLM2 checkpoint's) gets them appended as special added tokens at ids lm_base_vocab_size..,
// in the config's order, as upstream nanoVLM's get_tokenizer and tools/convert_gguf.py add them.
Tokenizer LoadTokenizer(const std::string& path, const VlmConfig& model) {
  Tokenizer tokenizer = [&] {
    try {
      return Tokenizer::FromFile(path);
    } catch (const std::exception& e) {
      throw ServerConfigError("tokenizer", e.what());
    }
  }();
  if (model.vlm_extra_tokens.empty() || tokenizer.vocab_size() > model.lm_base_vocab_size ||
      model.image_token_id != model.lm_base_vocab_size) {
    return tokenizer;
  }
  for (const auto& [name, text] : model.vlm_extra_tokens) {
    if (tokenizer.TokenToId(text)) return tokenizer;
  }
  json j = ReadJsonIfExists(path);
  if (!j.contains("added_tokens") || !j["added_tokens"].is_array()) {
    j["added_tokens"] = json::array();
  }
  int64_t id = model.lm_base_vocab_size;
  for (const auto& [name, text] : model.vlm_extra_tokens) {
    j["added_tokens"].push_back({{"id", id++},
                                 {"content", text},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  }
  try {
    return Tokenizer::FromJson(j.dump());
  } catch (const std::exception& e) {
    throw ServerConfigError("tokenizer", path + " with nanoVLM's extra tokens: " + e.what());
  }
}

}  // namespace

PromptTooLong::PromptTooLong(const std::string& field, size_t text_bytes, int64_t min_tokens,
                             int64_t max_context, int64_t max_bytes_per_token)
    : ServerError(grpc::StatusCode::INVALID_ARGUMENT,
                  field + ": " + std::to_string(text_bytes) + " bytes of text make at least " +
                      std::to_string(min_tokens) + " tokens (no token of this tokenizer stands " +
                      "for more than " + std::to_string(max_bytes_per_token) +
                      " bytes), more than the longest context holds (" +
                      std::to_string(max_context) +
                      " tokens); shorten the text or raise buckets.context_lens"),
      field_(field),
      text_bytes_(text_bytes),
      min_tokens_(min_tokens),
      max_context_(max_context),
      max_bytes_per_token_(max_bytes_per_token) {}

std::unique_ptr<TextModel> TextModel::Load(const ServerConfig& config, const VlmConfig& model) {
  const std::string path = TokenizerPath(config);
  if (path.empty()) return nullptr;
  Tokenizer tokenizer = LoadTokenizer(path, model);
  const fs::path dir = fs::path(path).parent_path();
  const json tokenizer_config = ReadJsonIfExists(dir / "tokenizer_config.json");
  // transformers 5 saves the template as chat_template.jinja, which wins over tokenizer_config's
  // when both exist, as transformers loads them.
  std::string template_source = (dir / "chat_template.jinja").string();
  std::string chat_template = ReadTextIfExists(dir / "chat_template.jinja");
  if (chat_template.empty()) {
    chat_template = ChatTemplate(tokenizer_config);
    template_source = (dir / "tokenizer_config.json").string() + "'s chat_template";
  }
  if (chat_template.empty()) {
    chat_template = model.lm_chat_template;
    template_source = "the model config's lm_chat_template";
  }
  ChatFormat chat = [&] {
    try {
      return ChatFormat::FromTemplate(chat_template);
    } catch (const ChatFormatError& e) {
      throw ServerConfigError("tokenizer", template_source + ": " + e.what());
    }
  }();

  if (tokenizer.vocab_size() > model.lm_vocab_size) {
    throw ServerConfigError("tokenizer", path + " has " + std::to_string(tokenizer.vocab_size()) +
                                             " tokens, more than the model's lm_vocab_size (" +
                                             std::to_string(model.lm_vocab_size) +
                                             "): it belongs to another model");
  }
  for (const auto& [name, text] : model.vlm_extra_tokens) {
    if (name != "image_token") continue;
    const std::optional<int64_t> id = tokenizer.TokenToId(text);
    if (!id || *id != model.image_token_id) {
      throw ServerConfigError(
          "tokenizer", path + ": the image token '" + text + "' must have id " +
                           std::to_string(model.image_token_id) + " (the model's image_token_id)" +
                           (id ? ", it has " + std::to_string(*id) : ", it is missing") +
                           "; give the language model's own tokenizer.json (nanoVLM's extra "
                           "tokens are then added at ids lm_base_vocab_size..) or one with them "
                           "at those ids, as upstream's get_tokenizer makes it");
    }
  }

  // Default stop tokens: end of turn, the tokenizer's EOS, generation_config's eos_token_id.
  std::vector<int64_t> stop;
  auto add = [&stop](std::optional<int64_t> id) {
    if (id && std::find(stop.begin(), stop.end(), *id) == stop.end()) stop.push_back(*id);
  };
  add(tokenizer.TokenToId(chat.end_of_turn()));
  if (tokenizer_config.is_object() && tokenizer_config.contains("eos_token")) {
    const std::string eos = TokenText(tokenizer_config["eos_token"]);
    if (!eos.empty()) add(tokenizer.TokenToId(eos));
  }
  const json generation_config = ReadJsonIfExists(dir / "generation_config.json");
  if (generation_config.is_object() && generation_config.contains("eos_token_id")) {
    const json& e = generation_config["eos_token_id"];
    for (const json& id : e.is_array() ? e : json::array({e})) {
      if (id.is_number_integer() && id.get<int64_t>() >= 0 &&
          id.get<int64_t>() < tokenizer.vocab_size())
        add(id.get<int64_t>());
    }
  }
  Options options;
  if (!config.buckets.context_lens.empty()) options.max_context = config.buckets.max_context();
  options.parse_special_in_content = config.parse_special_in_content;
  return std::make_unique<TextModel>(std::move(tokenizer), std::move(chat), model, std::move(stop),
                                     path, options);
}

TextModel::TextModel(Tokenizer tokenizer, ChatFormat chat, const VlmConfig& model,
                     std::vector<int64_t> stop_token_ids, std::string tokenizer_path,
                     Options options)
    : tokenizer_(std::move(tokenizer)),
      chat_(std::move(chat)),
      model_(model),
      stop_token_ids_(std::move(stop_token_ids)),
      tokenizer_path_(std::move(tokenizer_path)),
      options_(options) {}

void TextModel::CheckTextLength(const std::vector<std::string_view>& texts,
                                const std::string& field) const {
  if (options_.max_context <= 0) return;
  const int64_t min_tokens = tokenizer_.MinTokens(texts);
  if (min_tokens > options_.max_context) {
    size_t text_bytes = 0;
    for (std::string_view t : texts) text_bytes += t.size();
    throw PromptTooLong(field, text_bytes, min_tokens, options_.max_context,
                        tokenizer_.max_bytes_per_token());
  }
}

Prompt TextModel::BuildChat(const std::vector<ChatMessage>& messages,
                            const std::vector<ImageTiles>& images,
                            bool add_generation_prompt) const {
  CheckTextLength(ContentTexts(messages), "messages");
  const std::vector<std::string> image_strings = ImageStrings(model_, images);
  RenderedChat chat;
  try {
    chat = chat_.RenderWithRanges(messages, image_strings, add_generation_prompt);
  } catch (const ChatFormatError& e) {
    throw InvalidArgument(e.what());
  }
  Prompt p;
  try {
    // The template already holds the special tokens (transformers' apply_chat_template tokenizes
    // with add_special_tokens=False); the content's special-token text is plain text unless
    // configured otherwise (Note [Special tokens as plain text] in text/tokenizer.cc).
    EncodeOptions options;
    if (!options_.parse_special_in_content) options.plain_ranges = std::move(chat.content_ranges);
    p.input_ids = tokenizer_.Encode(chat.text, options);
  } catch (const TokenizerError& e) {
    throw InvalidArgument(std::string("messages: ") + e.what());
  }
  p.tiles = JoinTiles(images);
  return p;
}

TrainingPrompt TextModel::BuildTrainingChat(const std::vector<ChatMessage>& messages,
                                            const std::vector<ImageTiles>& images) const {
  CheckTextLength(ContentTexts(messages), "messages");
  const std::vector<std::string> image_strings = ImageStrings(model_, images);
  TrainingPrompt p;
  try {
    ChatTrainingTokens t = TokenizeForTraining(chat_, tokenizer_, messages, image_strings,
                                               options_.parse_special_in_content);
    p.input_ids = std::move(t.input_ids);
    p.targets = std::move(t.targets);
  } catch (const ChatFormatError& e) {
    throw InvalidArgument(e.what());
  } catch (const TokenizerError& e) {
    throw InvalidArgument(std::string("messages: ") + e.what());
  }
  p.tiles = JoinTiles(images);
  return p;
}

Prompt TextModel::BuildText(const std::string& text, const std::vector<ImageTiles>& images) const {
  CheckTextLength({text}, "prompt");
  std::string full;
  for (const std::string& image : ImageStrings(model_, images)) full += image;
  full += text;
  Prompt p;
  try {
    // As vLLM's completions: the tokenizer's own special tokens (a BOS, where it adds one).
    p.input_ids = tokenizer_.Encode(full, /*add_special_tokens=*/true);
  } catch (const TokenizerError& e) {
    throw InvalidArgument(std::string("prompt: ") + e.what());
  }
  p.tiles = JoinTiles(images);
  return p;
}

at::Tensor TextModel::JoinTiles(const std::vector<ImageTiles>& images) const {
  if (images.empty()) return {};
  std::vector<at::Tensor> tiles;
  for (const ImageTiles& t : images) tiles.push_back(t.tiles);
  return tiles.size() == 1 ? tiles[0] : at::cat(tiles, 0);
}

}  // namespace vlmgraph::server
