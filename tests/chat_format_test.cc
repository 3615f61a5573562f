// Chat format (ChatML recognition and rendering) and nanoVLM's image string (text/chat_format.h).
// The expected strings are what Jinja renders for the templates below (transformers'
// apply_chat_template); upstream's get_image_string gives the image strings.
#include "text/chat_format.h"

#include <gtest/gtest.h>

namespace vlmgraph {
namespace {

// SmolLM2-135M-Instruct's chat template, as its GGUF and tokenizer_config.json carry it.
const char* kSmolLm2Template =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\n' }}{% endif %}";

// Llama 3's template (not ChatML).
const char* kLlama3Template =
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

std::vector<ChatMessage> UserSays(const std::string& text) {
  return {{"user", {ChatContentPart::Text(text)}}};
}

TEST(ChatFormat, NanoVlmTemplateRendersChatMlWithoutSystem) {
  const ChatFormat f = ChatFormat::FromTemplate(VlmConfig().lm_chat_template);
  EXPECT_EQ(f.name(), "chatml");
  EXPECT_FALSE(f.default_system_prompt().has_value());
  EXPECT_EQ(f.Render(UserSays("Hi"), {}, true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(f.Render(UserSays("Hi"), {}, false), "<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatFormat, SmolLm2TemplateAddsItsDefaultSystemMessage) {
  const ChatFormat f = ChatFormat::FromTemplate(kSmolLm2Template);
  ASSERT_TRUE(f.default_system_prompt().has_value());
  EXPECT_EQ(*f.default_system_prompt(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_EQ(f.Render(UserSays("What is 2+2?"), {}, true),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
  // A conversation that brings its own system message gets no default one.
  std::vector<ChatMessage> m = {{"system", {ChatContentPart::Text("Be brief.")}},
                                {"user", {ChatContentPart::Text("Hi")}},
                                {"assistant", {ChatContentPart::Text("Hello!")}},
                                {"user", {ChatContentPart::Text("Bye")}}};
  EXPECT_EQ(f.Render(m, {}, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatFormat, EscapedNewlinesInTheSystemLiteralAreUnescaped) {
  std::string t = kSmolLm2Template;
  // The same template with Jinja escapes instead of raw newlines inside its string literals.
  for (size_t at; (at = t.find('\n')) != std::string::npos;) t.replace(at, 1, "\\n");
  const ChatFormat f = ChatFormat::FromTemplate(t);
  ASSERT_TRUE(f.default_system_prompt().has_value());
  EXPECT_EQ(*f.default_system_prompt(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
}

TEST(ChatFormat, RefusesTemplatesThatAreNotChatMl) {
  try {
    ChatFormat::FromTemplate(kLlama3Template);
    FAIL() << "a Llama 3 template was taken for ChatML";
  } catch (const ChatFormatError& e) {
    EXPECT_NE(std::string(e.what()).find("not ChatML"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ChatFormat::FromTemplate(""), ChatFormatError);
}

TEST(ChatFormat, ImagePartsTakeTheirImageStringsInOrder) {
  const ChatFormat f = ChatFormat::FromTemplate(VlmConfig().lm_chat_template);
  std::vector<ChatMessage> m = {
      {"user", {ChatContentPart::Image(), ChatContentPart::Text("and"), ChatContentPart::Image()}}};
  EXPECT_EQ(f.Render(m, {"<A>", "<B>"}, false), "<|im_start|>user\n<A>and<B><|im_end|>\n");
  EXPECT_THROW(f.Render(m, {"<A>"}, false), ChatFormatError);
  EXPECT_THROW(f.Render(m, {"<A>", "<B>", "<C>"}, false), ChatFormatError);
}

TEST(ChatFormat, RefusesBadConversations) {
  const ChatFormat f = ChatFormat::FromTemplate(VlmConfig().lm_chat_template);
  EXPECT_THROW(f.Render({}, {}, true), ChatFormatError);
  EXPECT_THROW(f.Render({{"tool", {ChatContentPart::Text("x")}}}, {}, true), ChatFormatError);
  EXPECT_THROW(
      f.Render({{"user", {ChatContentPart::Text("x")}}, {"system", {ChatContentPart::Text("y")}}},
               {}, true),
      ChatFormatError);
}

std::string Repeat(const std::string& s, int64_t n) {
  std::string out;
  for (int64_t i = 0; i < n; ++i) out += s;
  return out;
}

TEST(ImageString, MatchesUpstreamGetImageString) {
  const VlmConfig cfg = VlmConfig::Preset("nanovlm-460m");  // upstream's default config
  const std::string tile = Repeat("<|image|>", cfg.mp_image_token_length);
  // One tile: the global image token only.
  EXPECT_EQ(ImageString(cfg, {1, 1}), "<|global_image|>" + tile);
  // A 2 x 3 grid: the global tile, then each cell row-major with its position token.
  EXPECT_EQ(ImageString(cfg, {2, 3}), "<|global_image|>" + tile + "<row_1_col_1>" + tile +
                                          "<row_1_col_2>" + tile + "<row_1_col_3>" + tile +
                                          "<row_2_col_1>" + tile + "<row_2_col_2>" + tile +
                                          "<row_2_col_3>" + tile);
  // Several images are numbered.
  EXPECT_EQ(ImageString(cfg, {1, 1}, 1, true), "<image: 1><|global_image|>" + tile);
}

TEST(ImageString, NamesTheMissingGridToken) {
  const VlmConfig cfg = VlmConfig::Preset("nanovlm-460m");
  try {
    ImageString(cfg, {9, 1});
    FAIL() << "a 9-row grid has no <row_9_col_1> token";
  } catch (const ChatFormatError& e) {
    EXPECT_NE(std::string(e.what()).find("r9c1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace vlmgraph
