// text/chat_format.h: chat messages -> prompt text (the chat template), and nanoVLM's image
// string.
//
//   ChatFormat chat = ChatFormat::FromTemplate(tokenizer_config["chat_template"]);  // ChatML only
//   std::vector<ChatMessage> messages = {{"user", {ChatContentPart::Image(), {"What is this?"}}}};
//   std::string image = ImageString(cfg, {{2, 2}});        // one image cut into a 2 x 2 grid
//   std::string text = chat.Render(messages, {image}, /*add_generation_prompt=*/true);
//   // "<|im_start|>system\n...<|im_end|>\n<|im_start|>user\n<|global_image|><|image|>...
//   //  <row_1_col_1><|image|>...What is this?<|im_end|>\n<|im_start|>assistant\n"
//
// Chat format: ChatML, the format both upstream nanoVLM's `lm_chat_template` (models/config.py)
// and SmolLM2's own template render: per message "<|im_start|>" + role + "\n" + content +
// "<|im_end|>\n", then "<|im_start|>assistant\n" when a reply is asked for. The server does not run
// Jinja: FromTemplate recognises a ChatML template by its literals and refuses any other template,
// so a checkpoint whose template it cannot reproduce is refused at start instead of being prompted
// wrongly. A template that inserts a default system message when the conversation has none (as
// SmolLM2's does: `{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n
// You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}`)
// keeps doing so.
//
// Image string: upstream's get_image_string (data/processors.py): for each image, "<image: i>"
// when the prompt has several images, then the global image token followed by
// mp_image_token_length image tokens, then, when the image was cut into more than one tile, for
// each grid cell (row-major) its "<row_r_col_c>" token followed by mp_image_token_length image
// tokens. The tile order matches ImageTiles (image/image_processor.h): global tile first.
//
// Content ranges: RenderWithRanges also returns where each text part of the messages lies in the
// prompt text, so that the tokenizer can read special-token text there as plain text (Note
// [Special tokens as plain text] in text/tokenizer.cc); the template's own text and the image
// strings lie outside them.
//
// Training (TokenizeForTraining): the conversation's token ids and per-position targets, the loss
// on the assistant turns only, as upstream nanoVLM's datasets mask it (Note [Assistant-turn loss]
// in chat_format.cc): each assistant turn's content, its "<|im_end|>" and the "\n" after it count;
// the template's "<|im_start|>assistant\n", system and user turns (and the default system message)
// do not.
//
// Errors: ChatFormatError (std::invalid_argument) saying what is wrong or what to change.
// Thread rules: ChatFormat is an immutable value; every function is safe from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "text/tokenizer.h"

namespace vlmgraph {

class ChatFormatError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// One part of a message's content: text, or the place of the next image of the request.
struct ChatContentPart {
  enum class Type { kText, kImage };
  Type type = Type::kText;
  std::string text;  // kText only

  static ChatContentPart Text(std::string text) { return {Type::kText, std::move(text)}; }
  static ChatContentPart Image() { return {Type::kImage, {}}; }
};

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::vector<ChatContentPart> content;
};

// A rendered prompt and the byte ranges of its message text parts (sorted, not overlapping;
// adjacent parts are one range).
struct RenderedChat {
  std::string text;
  std::vector<TextRange> content_ranges;
};

// One turn of a rendered conversation: "<|im_start|>" + role + "\n" + content + "<|im_end|>\n".
struct RenderedTurn {
  std::string role;             // "system", "user" or "assistant"
  bool default_system = false;  // the template's own system message (not one of the messages)
  std::string text;
  size_t header_bytes = 0;                // "<|im_start|>" + role + "\n"
  std::vector<TextRange> content_ranges;  // the message's text parts, in `text`
};

// The messages' text parts, in order (views into `messages`).
std::vector<std::string_view> ContentTexts(const std::vector<ChatMessage>& messages);

class ChatFormat {
 public:
  // Recognises a ChatML Jinja template (the `chat_template` of tokenizer_config.json or
  // nanoVLM's `lm_chat_template`). Throws ChatFormatError naming the missing literal when the
  // template is not ChatML.
  static ChatFormat FromTemplate(const std::string& jinja_template);

  const std::string& name() const { return name_; }  // "chatml"
  // The system message the template inserts when the conversation does not start with one.
  const std::optional<std::string>& default_system_prompt() const { return default_system_; }
  // The token text that ends a turn ("<|im_end|>"): the default stop token of chat requests.
  const std::string& end_of_turn() const { return end_of_turn_; }

  // The prompt text of `messages`. The k-th image part (counting over all messages) is replaced
  // by image_strings[k]. Throws ChatFormatError for an empty conversation, a role other than
  // system / user / assistant, a system message after the first, or a count of image parts that
  // differs from image_strings.size().
  std::string Render(const std::vector<ChatMessage>& messages,
                     const std::vector<std::string>& image_strings,
                     bool add_generation_prompt) const;
  // The same, with the byte ranges of the message text parts.
  RenderedChat RenderWithRanges(const std::vector<ChatMessage>& messages,
                                const std::vector<std::string>& image_strings,
                                bool add_generation_prompt) const;
  // The conversation turn by turn (the default system message first, when the template inserts
  // one); their texts joined are Render(..., add_generation_prompt = false). Same errors.
  std::vector<RenderedTurn> RenderTurns(const std::vector<ChatMessage>& messages,
                                        const std::vector<std::string>& image_strings) const;
  const std::string& begin_of_turn() const { return begin_of_turn_; }

 private:
  std::string name_ = "chatml";
  std::string begin_of_turn_ = "<|im_start|>";
  std::string end_of_turn_ = "<|im_end|>";
  std::optional<std::string> default_system_;
};

// A conversation ready for training: input_ids with one target per position (the id that should
// follow it, or -100 = no loss), as upstream nanoVLM's VQADataset builds its labels.
struct ChatTrainingTokens {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> targets;
};

// `messages` rendered with `chat` (image parts replaced by image_strings, as Render) and tokenized
// with `tokenizer`, the targets on the assistant turns only (Note [Assistant-turn loss]). The
// message text is plain text unless `parse_special_in_content` (TextModelOptions). Throws
// ChatFormatError for what Render refuses, a conversation without an assistant message (nothing to
// learn) and an image part in an assistant message; TokenizerError for text that is not UTF-8.
ChatTrainingTokens TokenizeForTraining(const ChatFormat& chat, const Tokenizer& tokenizer,
                                       const std::vector<ChatMessage>& messages,
                                       const std::vector<std::string>& image_strings,
                                       bool parse_special_in_content);

// How one image was cut (ImageTiles::grid_rows / grid_cols).
struct ImageGrid {
  int64_t rows = 1;
  int64_t cols = 1;
};

// Upstream's get_image_string for the images of one prompt, with the token texts of
// cfg.vlm_extra_tokens ("image_token", "global_image_token", "r{row}c{col}"). `numbered`: prefix
// each image with "<image: i>"; upstream does so when the prompt has more than one image (pass
// grids.size() > 1). Throws ChatFormatError when the config lacks a token the grid needs.
std::string ImageString(const VlmConfig& cfg, const ImageGrid& grid);
std::string ImageString(const VlmConfig& cfg, const ImageGrid& grid, int64_t index, bool numbered);

}  // namespace vlmgraph
