// Fuzz target: chat prompt building (text/chat_format.h: ChatFormat::FromTemplate, Render,
// ImageString; server/core/text_prompt.h: TextModel::BuildChat and BuildText with a tiny
// tokenizer). Input: FuzzedDataProvider bytes: a chat template (tokenizer_config.json's
// chat_template, from the checkpoint), then messages (role, text and image parts), image grids and
// a text prompt. Expected errors: ChatFormatError (std::invalid_argument) and ServerError
// (INVALID_ARGUMENT).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "server/core/status.h"
#include "server/core/text_prompt.h"
#include "tests/fuzz/fuzz_util.h"
#include "text/chat_format.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace vlmgraph;
  FuzzedDataProvider in(data, size);
  const VlmConfig& cfg = fuzz::TinyConfig();
  const std::string tmpl = in.ConsumeRandomLengthString(8192);
  ChatFormat chat = fuzz::TinyTextModel().chat_format();
  fuzz::ExpectOnly<ChatFormatError>("chat_prompt", [&] { chat = ChatFormat::FromTemplate(tmpl); });
  const server::TextModel text(fuzz::TinyTokenizer(), chat, cfg, {257}, "fuzz tokenizer");

  static const char* kRoles[] = {"system", "user", "assistant", "tool", ""};
  std::vector<ChatMessage> messages(in.ConsumeIntegralInRange<size_t>(0, 6));
  size_t image_parts = 0;
  for (ChatMessage& m : messages) {
    m.role = in.ConsumeBool() ? kRoles[in.ConsumeIntegralInRange<size_t>(0, 4)]
                              : in.ConsumeRandomLengthString(16);
    for (size_t parts = in.ConsumeIntegralInRange<size_t>(0, 4); parts > 0; --parts) {
      if (in.ConsumeBool()) {
        m.content.push_back(ChatContentPart::Image());
        ++image_parts;
      } else {
        m.content.push_back(ChatContentPart::Text(in.ConsumeRandomLengthString(256)));
      }
    }
  }
  // Usually as many images as image parts, sometimes not; grids up to 9 x 9 (the model config has
  // row/column tokens up to 8 x 8).
  const size_t images_count =
      in.ConsumeBool() ? image_parts : in.ConsumeIntegralInRange<size_t>(0, 5);
  std::vector<ImageTiles> images(images_count);
  for (ImageTiles& t : images) {
    t.grid_rows = in.ConsumeIntegralInRange<int64_t>(1, 9);
    t.grid_cols = in.ConsumeIntegralInRange<int64_t>(1, 9);
    t.has_global = t.grid_rows * t.grid_cols > 1;
    t.tiles = at::zeros({t.grid_rows * t.grid_cols + (t.has_global ? 1 : 0), 3, 1, 1});
  }
  const bool add_generation_prompt = in.ConsumeBool();
  const std::string prompt = in.ConsumeRemainingBytesAsString();

  fuzz::ExpectOnly<ChatFormatError, server::ServerError>("chat_prompt", [&] {
    chat.Render(messages, std::vector<std::string>(images.size(), "<img>"), add_generation_prompt);
  });
  fuzz::ExpectOnly<ChatFormatError, server::ServerError>("chat_prompt", [&] {
    text.BuildChat(messages, images, add_generation_prompt);
  });
  fuzz::ExpectOnly<ChatFormatError, server::ServerError>("chat_prompt",
                                                         [&] { text.BuildText(prompt, images); });
  return 0;
}
