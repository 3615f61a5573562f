// server/core/text_prompt.h: the model's text side (tokenizer, chat format, default stop tokens)
// and prompts built from chat messages or plain text with images, shared by the gRPC service and
// the OpenAI-compatible HTTP endpoint.
//
//   std::unique_ptr<TextModel> text = TextModel::Load(config, engine.model_config());  // or null
//   std::vector<ImageTiles> images = {PreprocessEncodedImage(png, cfg, limits)};
//   Prompt p = text->BuildChat(messages, images, /*add_generation_prompt=*/true);
//   request.input_ids = p.input_ids; request.tiles = p.tiles;
//
// Files: the tokenizer is `config.tokenizer`, or `<checkpoint>/tokenizer.json` when that is unset
// (Hugging Face's format, text/tokenizer.h); a language model's tokenizer that holds none of
// nanoVLM's extra VLM tokens (a transformers SmolLM2 checkpoint's) gets them added at ids
// lm_base_vocab_size.., as upstream's get_tokenizer adds them. The chat template comes from
// `<dir of tokenizer.json>/chat_template.jinja` (transformers 5 saves it so), else from
// `tokenizer_config.json` beside it ("chat_template", as earlier transformers save it), else from
// the model config's `lm_chat_template` (nanoVLM's); it must be ChatML
// (text/chat_format.h), or Load refuses to start. Default stop tokens: the chat format's end of
// turn ("<|im_end|>"), tokenizer_config.json's "eos_token" and generation_config.json's
// "eos_token_id" (an id or a list), those that exist in the vocabulary.
//
// Limits before work: CheckTextLength refuses a text whose byte length shows that it makes more
// tokens than the longest context holds (Tokenizer::MinTokens, Note [Tokens from bytes] in
// text/tokenizer.cc), before anything is tokenized; callers run it before decoding images too,
// and BuildChat / BuildText run it again first.
//
// Special tokens: BuildChat tokenizes the text of the messages with special-token text read as
// plain text, so that "<|im_end|>" typed by a user is not the control token (Note [Special tokens
// as plain text] in text/tokenizer.cc); the template's markers and the image strings are special
// tokens. TextModelOptions::parse_special_in_content (config key parse_special_in_content) makes
// the content's special-token text special tokens too, as transformers' apply_chat_template and
// vLLM do. BuildText tokenizes a plain prompt whole, special tokens recognised: the client writes
// the whole model input there, as it may with token ids.
//
// Errors: Load throws ServerConfigError (key "tokenizer") when a file is unreadable, the template
// is not ChatML, or the tokenizer does not match the model (vocabulary larger than the model's,
// image token text not at cfg.image_token_id). Build* throw ServerError INVALID_ARGUMENT saying
// what to change (empty prompt, images not matching image parts, bad roles), PromptTooLong for a
// text longer than any context.
// Thread rules: immutable after Load; every method is safe from any thread.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "image/image_processor.h"
#include "model/config.h"
#include "server/config/config.h"
#include "server/core/status.h"
#include "text/chat_format.h"
#include "text/tokenizer.h"

namespace vlmgraph::server {

// A text that makes more tokens than the longest context holds, known from its byte length before
// it is tokenized: INVALID_ARGUMENT (the OpenAI API answers 400 context_length_exceeded).
class PromptTooLong : public ServerError {
 public:
  // `field`: "messages", "text" or "prompt".
  PromptTooLong(const std::string& field, size_t text_bytes, int64_t min_tokens,
                int64_t max_context, int64_t max_bytes_per_token);
  const std::string& field() const { return field_; }
  size_t text_bytes() const { return text_bytes_; }
  int64_t min_tokens() const { return min_tokens_; }
  int64_t max_context() const { return max_context_; }
  int64_t max_bytes_per_token() const { return max_bytes_per_token_; }

 private:
  std::string field_;
  size_t text_bytes_;
  int64_t min_tokens_;
  int64_t max_context_;
  int64_t max_bytes_per_token_;
};

// A prompt ready for the engine.
struct Prompt {
  std::vector<int64_t> input_ids;  // image tokens included
  at::Tensor tiles;                // (N, 3, S, S) float32 CPU, or undefined without images
};

// A training example built from chat messages (TextModel::BuildTrainingChat).
struct TrainingPrompt {
  std::vector<int64_t> input_ids;  // image tokens included
  std::vector<int64_t> targets;    // one per id: the next id on assistant turns, else -100
  at::Tensor tiles;                // (N, 3, S, S) float32 CPU, or undefined without images
};

struct TextModelOptions {
  // The longest context, tokens: a text sure to make more tokens is refused before tokenizing.
  // 0 = no limit.
  int64_t max_context = 0;
  // Special-token text in chat message content becomes special tokens (Hugging Face's
  // apply_chat_template) instead of plain text.
  bool parse_special_in_content = false;
};

class TextModel {
 public:
  using Options = TextModelOptions;

  // The configured tokenizer and chat format, or nullptr when the model has none (a preset, or
  // `tokenizer: none`): text requests then fail with FAILED_PRECONDITION.
  // Options from `config`: max_context = max(buckets.context_lens), the engine's longest context
  // (the engine is built from the same buckets); parse_special_in_content.
  static std::unique_ptr<TextModel> Load(const ServerConfig& config, const VlmConfig& model);

  TextModel(Tokenizer tokenizer, ChatFormat chat, const VlmConfig& model,
            std::vector<int64_t> stop_token_ids, std::string tokenizer_path, Options options = {});

  const Tokenizer& tokenizer() const { return tokenizer_; }
  const ChatFormat& chat_format() const { return chat_; }
  const std::vector<int64_t>& default_stop_token_ids() const { return stop_token_ids_; }
  const std::string& tokenizer_path() const { return tokenizer_path_; }
  const Options& options() const { return options_; }

  // Throws PromptTooLong when the text that `texts` form together (one prompt, or the text parts
  // of a chat) makes more than options().max_context tokens whatever it says (Tokenizer::MinTokens:
  // from its byte length, or one pass counting the bytes that make tokens). `field` names it.
  void CheckTextLength(const std::vector<std::string_view>& texts, const std::string& field) const;

  // Chat messages -> prompt. The k-th image part of the conversation takes images[k].
  Prompt BuildChat(const std::vector<ChatMessage>& messages, const std::vector<ImageTiles>& images,
                   bool add_generation_prompt) const;
  // Chat messages -> a training example: the conversation without a reply prompt, the loss on the
  // assistant turns only (text/chat_format.h TokenizeForTraining, upstream nanoVLM's masking).
  // Throws as BuildChat, and INVALID_ARGUMENT for a conversation without an assistant message or
  // with an image in one.
  TrainingPrompt BuildTrainingChat(const std::vector<ChatMessage>& messages,
                                   const std::vector<ImageTiles>& images) const;
  // Plain text -> prompt, tokenized as it is (special tokens in it are recognised); the image
  // strings of `images` come first, as upstream nanoVLM's generate puts them.
  Prompt BuildText(const std::string& text, const std::vector<ImageTiles>& images) const;

 private:
  // The images' tiles, joined in order; undefined without images.
  at::Tensor JoinTiles(const std::vector<ImageTiles>& images) const;

  Tokenizer tokenizer_;
  ChatFormat chat_;
  VlmConfig model_;
  std::vector<int64_t> stop_token_ids_;
  std::string tokenizer_path_;
  Options options_;
};

}  // namespace vlmgraph::server
