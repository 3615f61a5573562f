// server/text_prompt.h: the model's text side (tokenizer, chat format, default stop tokens) and
// prompts built from chat messages or plain text with images, shared by the gRPC service and the
// OpenAI-compatible HTTP endpoint.
//
//   std::unique_ptr<TextModel> text = TextModel::Load(config, engine.model_config());  // or null
//   std::vector<ImageTiles> images = {PreprocessEncodedImage(png, cfg, limits)};
//   Prompt p = text->BuildChat(messages, images, /*add_generation_prompt=*/true);
//   request.input_ids = p.input_ids; request.tiles = p.tiles;
//
// Files: the tokenizer is `config.tokenizer`, or `<checkpoint>/tokenizer.json` when that is unset
// (Hugging Face's format, model/tokenizer.h). The chat template comes from
// `<dir of tokenizer.json>/tokenizer_config.json` ("chat_template", as transformers saves it),
// else from the model config's `lm_chat_template` (nanoVLM's); it must be ChatML
// (model/chat_format.h), or Load refuses to start. Default stop tokens: the chat format's end of
// turn ("<|im_end|>"), tokenizer_config.json's "eos_token" and generation_config.json's
// "eos_token_id" (an id or a list), those that exist in the vocabulary.
//
// Errors: Load throws ServerConfigError (key "tokenizer") when a file is unreadable, the template
// is not ChatML, or the tokenizer does not match the model (vocabulary larger than the model's,
// image token text not at cfg.image_token_id). Build* throw ServerError INVALID_ARGUMENT saying
// what to change (empty prompt, images not matching image parts, bad roles).
// Thread rules: immutable after Load; every method is safe from any thread.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "model/chat_format.h"
#include "model/config.h"
#include "model/image_processor.h"
#include "model/tokenizer.h"
#include "server/config.h"

namespace vlmgraph::server {

// A prompt ready for the engine.
struct Prompt {
  std::vector<int64_t> input_ids;  // image tokens included
  at::Tensor tiles;                // (N, 3, S, S) float32 CPU, or undefined without images
};

class TextModel {
 public:
  // The configured tokenizer and chat format, or nullptr when the model has none (a preset, or
  // `tokenizer: none`): text requests then fail with FAILED_PRECONDITION.
  static std::unique_ptr<TextModel> Load(const ServerConfig& config, const VlmConfig& model);

  TextModel(Tokenizer tokenizer, ChatFormat chat, const VlmConfig& model,
            std::vector<int64_t> stop_token_ids, std::string tokenizer_path);

  const Tokenizer& tokenizer() const { return tokenizer_; }
  const ChatFormat& chat_format() const { return chat_; }
  const std::vector<int64_t>& default_stop_token_ids() const { return stop_token_ids_; }
  const std::string& tokenizer_path() const { return tokenizer_path_; }

  // Chat messages -> prompt. The k-th image part of the conversation takes images[k].
  Prompt BuildChat(const std::vector<ChatMessage>& messages, const std::vector<ImageTiles>& images,
                   bool add_generation_prompt) const;
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
};

}  // namespace vlmgraph::server
