// tools/train/dataset.h: vlmgraph-train's dataset, a JSONL file of chat conversations.
//
// Format (docs/training.md): one JSON object per line, {"messages": [...]}, the messages in the
// OpenAI chat format: {"role": "system" | "developer" | "user" | "assistant", "content": "text"}
// or "content": [{"type": "text", "text": "..."}, {"type": "image_url", "image_url": {"url":
// U}}], where U is a path to a PNG or JPEG file (relative to the JSONL file's directory), a
// file:// URL, or a data:image/...;base64 URL. Blank lines are skipped. The loss covers the
// assistant turns only (TextModel::BuildTrainingChat).
//
//   ChatDataset data = ChatDataset::Open("data/train.jsonl");         // reads the lines only
//   TrainExample e = data.Example(7, text_model, cfg, limits);         // parses and tokenizes
//
// Errors: DatasetError "<file>:<line>: <field>: <what to change>". Thread rules: immutable after
// Open; Example is safe from any thread.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/trainer.h"
#include "image/image_processor.h"
#include "model/config.h"
#include "server/core/text_prompt.h"
#include "text/chat_format.h"

namespace vlmgraph::train {

class DatasetError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One line's conversation before tokenizing: the messages and their images, encoded.
struct ChatExample {
  std::vector<ChatMessage> messages;
  std::vector<std::string> images;  // encoded bytes, in order of the image parts
};

// Parses one line ({"messages": [...]}); relative image paths are taken from `base_dir`.
// `where` prefixes error messages ("train.jsonl:3"). Without `read_images` an image file is only
// opened (ChatExample::images then holds empty strings).
ChatExample ParseChatExample(const std::string& line, const std::string& base_dir,
                             const std::string& where, bool read_images = true);

// splitmix64 (Steele et al. 2014): the generator of the data order and of the validation split,
// the same on every rank and build. Advances `state`.
uint64_t SplitMix64(uint64_t& state);

// The validation split of a dataset of `n` examples (train.val_fraction): round(fraction x n)
// examples, at least 1, drawn by a Fisher-Yates shuffle seeded by `seed`, held out; the rest
// train. Both lists are ascending indices into the dataset. The same on every rank, build and
// resume. Throws DatasetError when no example would be left to train on.
struct ValidationSplit {
  std::vector<int64_t> train, validation;
};
ValidationSplit SplitForValidation(int64_t n, double fraction, uint64_t seed);

class ChatDataset {
 public:
  // Reads the file's non-blank lines. Throws DatasetError for an unreadable or empty file.
  static ChatDataset Open(const std::string& path);

  int64_t size() const { return static_cast<int64_t>(lines_.size()); }

  // The whole file checked before training starts: every line parses as a conversation and every
  // image file it names can be opened (not decoded; tokenizing and the token limit are checked
  // per example as it is used). Throws DatasetError listing the first `max_errors` bad lines
  // ("<file>:<line>: <field>: <what to change>") and how many there are.
  void Check(int64_t max_errors = 10) const;
  const std::string& path() const { return path_; }

  // Example `index` (0-based among the non-blank lines) ready for the Trainer: images decoded and
  // tiled, the conversation tokenized with the loss on the assistant turns. Throws DatasetError
  // naming the file, line and field; also for more than `max_tokens` tokens (0 = no limit, with
  // `max_tokens_hint` saying which setting to raise) or more than max_tiles tiles.
  TrainExample Example(int64_t index, const server::TextModel& text, const VlmConfig& cfg,
                       int64_t max_tokens, const std::string& max_tokens_hint,
                       int64_t max_tiles) const;

 private:
  std::string path_, base_dir_;
  std::vector<std::string> lines_;
  std::vector<int64_t> line_numbers_;  // 1-based line of each entry
};

}  // namespace vlmgraph::train
