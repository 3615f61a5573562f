// The OpenAI-compatible API's protocol side (server/openai/requests.h), without sockets: request
// parsing and its errors, the exception -> HTTP error mapping, prompts and sampling built from
// requests (with a small byte-level tokenizer over the nanovlm-tiny config), and response bodies.
// The HTTP server itself is tested end to end with the official `openai` SDK
// (tests/e2e/test_openai.py).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_types.h"
#include "image/image_processor.h"
#include "server/config/config.h"
#include "server/core/status.h"
#include "server/core/text_prompt.h"
#include "server/openai/choices.h"
#include "server/openai/logprobs_json.h"
#include "server/openai/openai_http.h"
#include "server/openai/requests.h"
#include "server/openai/responses.h"
#include "tests/image_fixtures.h"
#include "tests/tiny_engine.h"
#include "text/chat_format.h"
#include "text/tokenizer.h"

namespace vlmgraph::server::openai {
namespace {

// A 2 x 2 RGB PNG (red, green, blue, white), base64.
constexpr const char* kPngBase64 =
    "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP4z8DA8J+BkYHh////"
    "DAAe9gT9Ce00PgAAAABJRU5ErkJggg==";

std::string PngDataUrl() { return std::string("data:image/png;base64,") + kPngBase64; }

Limits TestLimits() {
  Limits l = FillDefaults(RawConfig{}).limits;
  l.max_new_tokens = 100;
  l.default_max_new_tokens = 7;
  l.max_images_per_request = 2;
  return l;
}

RequestContext Ctx() { return {"tiny-chat", TestLimits()}; }

const VlmConfig& Tiny() {
  static const VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
  return cfg;
}

// The error an expression throws, as the HTTP layer maps it.
template <typename F>
ErrorInfo ErrorOf(F&& f) {
  try {
    f();
  } catch (...) {
    return ErrorFromException(std::current_exception());
  }
  return ErrorInfo{200, "", "no error", "", ""};
}

// GPT-2's bytes_to_unicode (openai/gpt-2 src/encoder.py): the byte-level token text of one byte.
std::string ByteLevelText(int byte) {
  auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  int code = byte;
  if (!printable(byte)) {
    int n = 0;
    for (int b = 0; b < byte; ++b) n += printable(b) ? 0 : 1;
    code = 256 + n;
  }
  std::string utf8;
  if (code < 0x80) {
    utf8 += static_cast<char>(code);
  } else {
    utf8 += static_cast<char>(0xC0 | (code >> 6));
    utf8 += static_cast<char>(0x80 | (code & 0x3F));
  }
  return utf8;
}

// A byte-level BPE tokenizer without merges (one token per byte, ids 0..255), ChatML's two
// special tokens (256, 257) and the tiny config's image tokens at image_token_id onwards.
const Tokenizer& TinyTokenizer() {
  static const Tokenizer tokenizer = [] {
    nlohmann::json vocab = nlohmann::json::object();
    for (int b = 0; b < 256; ++b) vocab[ByteLevelText(b)] = b;
    nlohmann::json added = nlohmann::json::array();
    auto add = [&](int64_t id, const std::string& text) {
      added.push_back({{"id", id},
                       {"content", text},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", true}});
    };
    add(256, "<|im_start|>");
    add(257, "<|im_end|>");
    int64_t id = Tiny().image_token_id;
    for (const auto& [name, text] : Tiny().vlm_extra_tokens) add(id++, text);
    const nlohmann::json byte_level = {{"type", "ByteLevel"},
                                       {"add_prefix_space", false},
                                       {"trim_offsets", true},
                                       {"use_regex", true}};
    const nlohmann::json j = {{"version", "1.0"},
                              {"truncation", nullptr},
                              {"padding", nullptr},
                              {"added_tokens", added},
                              {"normalizer", nullptr},
                              {"pre_tokenizer", byte_level},
                              {"post_processor", nullptr},
                              {"decoder", byte_level},
                              {"model",
                               {{"type", "BPE"},
                                {"dropout", nullptr},
                                {"unk_token", nullptr},
                                {"continuing_subword_prefix", nullptr},
                                {"end_of_word_suffix", nullptr},
                                {"fuse_unk", false},
                                {"byte_fallback", false},
                                {"ignore_merges", false},
                                {"vocab", vocab},
                                {"merges", nlohmann::json::array()}}}};
    return Tokenizer::FromJson(j.dump());
  }();
  return tokenizer;
}

const TextModel& Text() {
  static const TextModel text(TinyTokenizer(), ChatFormat::FromTemplate(Tiny().lm_chat_template),
                              Tiny(), /*stop_token_ids=*/{257}, "test tokenizer");
  return text;
}

// --- parsing
// ---------------------------------------------------------------------------------------

TEST(OpenAiProtocol, ChatDefaults) {
  const ChatCompletionRequest r = ParseChatCompletionRequest(
      R"({"model": "tiny-chat", "messages": [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Hi"}]})",
      Ctx());
  ASSERT_EQ(r.chat.messages.size(), 2u);
  EXPECT_EQ(r.chat.messages[0].role, "system");
  ASSERT_EQ(r.chat.messages[1].content.size(), 1u);
  EXPECT_EQ(r.chat.messages[1].content[0].text, "Hi");
  EXPECT_TRUE(r.chat.images.empty());
  EXPECT_FALSE(r.params.max_tokens.has_value());
  EXPECT_EQ(r.params.temperature, 1.0);  // OpenAI's default: sampling
  EXPECT_FALSE(r.params.seed.has_value());
  EXPECT_FALSE(r.params.stream);
  // `model` may be left out (vLLM); null fields read as unset.
  const ChatCompletionRequest r2 = ParseChatCompletionRequest(
      R"({"messages": [{"role": "developer", "content": "x"}], "max_tokens": null, "stop": null})",
      Ctx());
  EXPECT_EQ(r2.chat.messages[0].role, "system");
  EXPECT_FALSE(r2.params.max_tokens.has_value());
}

TEST(OpenAiProtocol, ChatSamplingFields) {
  const ChatCompletionRequest r = ParseChatCompletionRequest(
      R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9,
          "max_completion_tokens": 12, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 42,
          "stop": ["a", "", "bc"], "n": 1, "stream": true,
          "stream_options": {"include_usage": true}, "stop_token_ids": [3]})",
      Ctx());
  EXPECT_EQ(r.params.max_tokens, 12);  // max_completion_tokens wins
  EXPECT_EQ(r.params.temperature, 0.0);
  EXPECT_EQ(r.params.top_p, 0.5);
  EXPECT_EQ(r.params.top_k, 0);  // -1 = off
  EXPECT_EQ(r.params.seed, 42u);
  EXPECT_EQ(r.params.stop, (std::vector<std::string>{"a", "bc"}));  // empty strings dropped
  EXPECT_EQ(r.params.stop_token_ids, std::vector<int64_t>{3});
  EXPECT_TRUE(r.params.stream);
  EXPECT_TRUE(r.params.include_usage);
  const ChatCompletionRequest one = ParseChatCompletionRequest(
      R"({"messages": [{"role": "user", "content": "Hi"}], "stop": "\n\n", "max_tokens": 5.0})",
      Ctx());
  EXPECT_EQ(one.params.stop, std::vector<std::string>{"\n\n"});
  EXPECT_EQ(one.params.max_tokens, 5);
}

TEST(OpenAiProtocol, ChatContentPartsAndImages) {
  const std::string body = R"({"messages": [{"role": "user", "content": [
      {"type": "image_url", "image_url": {"url": ")" +
                           PngDataUrl() + R"("}},
      {"type": "text", "text": "What is this?"}]}]})";
  const ChatCompletionRequest r = ParseChatCompletionRequest(body, Ctx());
  ASSERT_EQ(r.chat.messages[0].content.size(), 2u);
  EXPECT_EQ(r.chat.messages[0].content[0].type, ChatContentPart::Type::kImage);
  EXPECT_EQ(r.chat.messages[0].content[1].text, "What is this?");
  ASSERT_EQ(r.chat.images.size(), 1u);
  EXPECT_EQ(DetectImageFormat(r.chat.images[0].bytes), "png");
  EXPECT_EQ(r.chat.images[0].param, "messages[0].content[0].image_url.url");
}

TEST(OpenAiProtocol, RequestErrors) {
  struct Case {
    std::string body;
    int status;
    std::string param;
    std::string message_part;
  };
  const std::vector<Case> cases = {
      {"{\"messages\": [", 400, "", "malformed JSON"},
      {"[1, 2]", 400, "", "must be a JSON object"},
      {"{}", 400, "messages", "messages: required"},
      {R"({"messages": []})", 400, "messages", "must not be empty"},
      {R"({"messages": "hi"})", 400, "messages", "must be a list"},
      {R"({"messages": [{"content": "hi"}]})", 400, "messages[0].role", "required"},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", 400, "messages[0].role",
       "'tool' is not supported"},
      {R"({"messages": [{"role": "user"}]})", 400, "messages[0].content", "required"},
      {R"({"messages": [{"role": "user", "content": 5}]})", 400, "messages[0].content",
       "a string or a list"},
      {R"({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})", 400,
       "messages[0].content[0].type", "use text or image_url"},
      {R"({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})", 404, "model",
       "`gpt-4o` does not exist"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "n": 65})", 400, "n", "[1, 64]"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5})", 400,
       "temperature", "[0, 2]"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"})", 400,
       "temperature", "must be a number, got string"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5})", 400, "max_tokens",
       "an integer"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "stop": ["a","b","c","d","e"]})", 400,
       "stop", "at most 4"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "stop": 7})", 400, "stop",
       "a string or a list of strings"},
      // Each stop string is matched at every token: at most kMaxStopStringBytes, as on gRPC.
      {R"({"messages": [{"role": "user", "content": "hi"}], "stop": ")" + std::string(257, 'x') +
           R"("})",
       400, "stop", "stop: 257 bytes; a stop string may have at most 256"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", ")" +
           std::string(25 << 20, 'x') + R"("]})",
       400, "stop", "stop[1]: 26214400 bytes; a stop string may have at most 256"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "stream_options": {}})", 400,
       "stream_options", "only allowed when stream is true"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1})", 400, "logprobs",
       "true or false"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true,
           "top_logprobs": 21})",
       400, "top_logprobs", "top_logprobs: must lie in [0, 20], got 21"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3})", 400,
       "top_logprobs", "needs logprobs: true"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]})", 400,
       "tools", "not supported"},
      {R"({"messages": [{"role": "user", "content": "hi"}],
           "response_format": {"type": "json_object"}})",
       400, "response_format", "not supported"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5})", 400,
       "presence_penalty", "not supported"},
  };
  for (const Case& c : cases) {
    const ErrorInfo e = ErrorOf([&] { ParseChatCompletionRequest(c.body, Ctx()); });
    EXPECT_EQ(e.http_status, c.status) << c.body << " -> " << e.message;
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_NE(e.message.find(c.message_part), std::string::npos) << c.body << " -> " << e.message;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
  }
  for (const char* n : {"0", "-2"}) {
    const ErrorInfo e = ErrorOf([&] {
      ParseChatCompletionRequest(
          std::string(R"({"messages": [{"role": "user", "content": "hi"}], "n": )") + n + "}",
          Ctx());
    });
    EXPECT_EQ(e.message, std::string("n: must lie in [1, 64], got ") + n);
    EXPECT_EQ(e.param, "n");
  }
  // Logprobs and n as the engine gets them.
  const ChatCompletionRequest asks = ParseChatCompletionRequest(
      R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 5,
          "n": 3})",
      Ctx());
  EXPECT_TRUE(asks.params.logprobs);
  EXPECT_EQ(asks.params.top_logprobs, 5);
  EXPECT_EQ(asks.params.n, 3);
  EXPECT_FALSE(asks.params.echo);
  // The unknown model carries OpenAI's code.
  EXPECT_EQ(
      ErrorOf([] { ParseChatCompletionRequest(R"({"model": "x", "messages": []})", Ctx()); }).code,
      "model_not_found");
  // Fields that change nothing are accepted: an empty tools list, text response_format, zero
  // penalties, `user`.
  EXPECT_EQ(ErrorOf([] {
              ParseChatCompletionRequest(
                  R"({"messages": [{"role": "user", "content": "hi"}], "tools": [],
                      "response_format": {"type": "text"}, "frequency_penalty": 0,
                      "user": "u1", "logprobs": false})",
                  Ctx());
            }).http_status,
            200);
}

TEST(OpenAiProtocol, ImageUrlErrors) {
  auto image_error = [](const std::string& url) {
    return ErrorOf([&] {
      ParseChatCompletionRequest(R"({"messages": [{"role": "user", "content": [
          {"type": "image_url", "image_url": {"url": ")" +
                                     url + R"("}}]}]})",
                                 Ctx());
    });
  };
  ErrorInfo e = image_error("https://example.com/cat.png");
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "messages[0].content[0].image_url.url");
  EXPECT_NE(e.message.find("remote image URLs are not supported"), std::string::npos);
  EXPECT_NE(e.message.find("data:image/png;base64,"), std::string::npos);
  EXPECT_EQ(image_error("HTTP://example.com/cat.png").http_status, 400);
  EXPECT_NE(image_error("file:///etc/passwd").message.find("must be a data URL"),
            std::string::npos);
  EXPECT_NE(image_error("data:image/png;base64,***notbase64***").message.find("not valid base64"),
            std::string::npos);
  EXPECT_NE(image_error("data:text/plain;base64,aGk=").message.find("media type"),
            std::string::npos);
  EXPECT_NE(image_error("data:image/png,rawbytes").message.find("base64-encoded"),
            std::string::npos);
  EXPECT_NE(image_error("data:image/png;base64").message.find("no ','"), std::string::npos);
  EXPECT_NE(image_error("data:image/png;base64,").message.find("empty"), std::string::npos);

  // Too many images: limits.max_images_per_request (2).
  std::string parts;
  for (int i = 0; i < 3; ++i) {
    parts += std::string(i ? "," : "") + R"({"type": "image_url", "image_url": {"url": ")" +
             PngDataUrl() + R"("}})";
  }
  e = ErrorOf([&] {
    ParseChatCompletionRequest(R"({"messages": [{"role": "user", "content": [)" + parts + "]}]}",
                               Ctx());
  });
  EXPECT_EQ(e.http_status, 400);
  EXPECT_NE(e.message.find("limits.max_images_per_request"), std::string::npos);

  // Too many bytes: refused before decoding.
  Limits small = TestLimits();
  small.max_image_bytes = 30;
  e = ErrorOf([&] { DecodeImageUrl(PngDataUrl(), small, "p"); });
  EXPECT_EQ(e.http_status, 400);
  EXPECT_NE(e.message.find("limits.max_image_bytes"), std::string::npos);
  // Base64 without padding and with line breaks decodes (Abseil's rules).
  const std::string bytes = DecodeImageUrl(PngDataUrl(), TestLimits(), "p");
  std::string unpadded = PngDataUrl();
  while (unpadded.back() == '=') unpadded.pop_back();
  unpadded.insert(40, "\n");
  EXPECT_EQ(DecodeImageUrl(unpadded, TestLimits(), "p"), bytes);
}

TEST(OpenAiProtocol, CompletionPrompts) {
  EXPECT_EQ(ParseCompletionRequest(R"({"prompt": "Once"})", Ctx()).prompts.at(0).text, "Once");
  EXPECT_EQ(ParseCompletionRequest(R"({"prompt": ["Once"]})", Ctx()).prompts.at(0).text, "Once");
  CompletionRequest ids = ParseCompletionRequest(R"({"prompt": [1, 2, 3]})", Ctx());
  ASSERT_EQ(ids.prompts.size(), 1u);
  EXPECT_FALSE(ids.prompts[0].text.has_value());
  EXPECT_EQ(ids.prompts[0].ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(ParseCompletionRequest(R"({"prompt": [[4, 5]]})", Ctx()).prompts.at(0).ids,
            (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(ParseCompletionRequest(R"({"prompt": [7]})", Ctx()).prompts.at(0).ids,
            std::vector<int64_t>{7});
  // A batch of prompts: strings, or lists of token ids.
  const CompletionRequest batch = ParseCompletionRequest(R"({"prompt": ["a", "b"]})", Ctx());
  ASSERT_EQ(batch.prompts.size(), 2u);
  EXPECT_EQ(batch.prompts[1].text, "b");
  const CompletionRequest id_batch =
      ParseCompletionRequest(R"({"prompt": [[1, 2], [3]], "n": 2})", Ctx());
  ASSERT_EQ(id_batch.prompts.size(), 2u);
  EXPECT_EQ(id_batch.prompts[1].ids, std::vector<int64_t>{3});
  EXPECT_EQ(id_batch.params.n, 2);

  struct Case {
    std::string body;
    std::string param;
    std::string message_part;
  };
  for (const Case& c : std::vector<Case>{
           {"{}", "prompt", "required"},
           {R"({"prompt": ""})", "prompt", "must not be empty"},
           {R"({"prompt": []})", "prompt", "non-empty"},
           {R"({"prompt": ["a", [1]]})", "prompt[1]", "all strings"},
           {R"({"prompt": [[1], ""]})", "prompt[1]", "all strings"},
           {R"({"prompt": ["a", ""]})", "prompt[1]", "must not be empty"},
           {R"({"prompt": [1, 2.5]})", "prompt[1]", "an integer"},
           {R"({"prompt": [[1], [2.5]]})", "prompt[1][0]", "an integer"},
           {R"({"prompt": "x", "echo": 1})", "echo", "true or false"},
           {R"({"prompt": "x", "logprobs": 21})", "logprobs", "[0, 20]"},
           {R"({"prompt": "x", "logprobs": true})", "logprobs", "an integer"},
           {R"({"prompt": "x", "best_of": 3})", "best_of", "not supported"},
           {R"({"prompt": "x", "n": 0})", "n", "[1, 64]"},
           {R"({"prompt": "x", "n": 65})", "n", "[1, 64]"},
           {R"({"prompt": ["a", "b", "c"], "n": 22})", "prompt", "at most 64"},
       }) {
    const ErrorInfo e = ErrorOf([&] { ParseCompletionRequest(c.body, Ctx()); });
    EXPECT_EQ(e.http_status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body;
    EXPECT_NE(e.message.find(c.message_part), std::string::npos) << c.body << " -> " << e.message;
  }
}

TEST(OpenAiProtocol, TokenizeAndDetokenizeRequests) {
  TokenizeRequest t = ParseTokenizeRequest(R"({"prompt": "Hello"})", Ctx());
  EXPECT_EQ(t.prompt, "Hello");
  EXPECT_TRUE(t.add_special_tokens);
  t = ParseTokenizeRequest(
      R"({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false})",
      Ctx());
  EXPECT_FALSE(t.prompt.has_value());
  EXPECT_EQ(t.chat.messages.size(), 1u);
  EXPECT_FALSE(t.add_generation_prompt);
  EXPECT_EQ(ErrorOf([] { ParseTokenizeRequest("{}", Ctx()); }).http_status, 400);
  EXPECT_EQ(ParseDetokenizeRequest(R"({"tokens": [1, 2]})", Ctx()).tokens,
            (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ErrorOf([] { ParseDetokenizeRequest(R"({"tokens": "12"})", Ctx()); }).param, "tokens");
  EXPECT_EQ(
      ErrorOf([] { ParseDetokenizeRequest(R"({"model": "m", "tokens": []})", Ctx()); }).http_status,
      404);
}

// --- errors
// ----------------------------------------------------------------------------------------

TEST(OpenAiProtocol, ErrorMapping) {
  struct Case {
    std::exception_ptr error;
    int status;
    std::string type;
  };
  const std::vector<Case> cases = {
      {std::make_exception_ptr(InvalidArgument("bad")), 400, "invalid_request_error"},
      {std::make_exception_ptr(EngineError(EngineError::Code::kInvalidArgument, "bad")), 400,
       "invalid_request_error"},
      {std::make_exception_ptr(ImageError("corrupt png")), 400, "invalid_request_error"},
      {std::make_exception_ptr(ServerError(grpc::StatusCode::FAILED_PRECONDITION, "no tok")), 400,
       "invalid_request_error"},
      {std::make_exception_ptr(ServerError(grpc::StatusCode::UNAUTHENTICATED, "key")), 401,
       "authentication_error"},
      {std::make_exception_ptr(ServerError(grpc::StatusCode::NOT_FOUND, "x")), 404,
       "invalid_request_error"},
      {std::make_exception_ptr(ServerError(grpc::StatusCode::RESOURCE_EXHAUSTED, "queue full")),
       429, "rate_limit_error"},
      {std::make_exception_ptr(EngineError(EngineError::Code::kResourceExhausted, "kv")), 429,
       "rate_limit_error"},
      {std::make_exception_ptr(ServerError(grpc::StatusCode::CANCELLED, "gone")),
       kClientClosedRequest, "invalid_request_error"},
      {std::make_exception_ptr(ServerError(grpc::StatusCode::UNAVAILABLE, "shutting down")), 503,
       "server_error"},
      {std::make_exception_ptr(EngineError(EngineError::Code::kUnavailable, "x")), 503,
       "server_error"},
      {std::make_exception_ptr(ServerError(grpc::StatusCode::DEADLINE_EXCEEDED, "late")), 504,
       "server_error"},
      {std::make_exception_ptr(std::runtime_error("bug")), 500, "server_error"},
      {std::make_exception_ptr(EngineError(EngineError::Code::kInternal, "bug")), 500,
       "server_error"},
      {std::make_exception_ptr(42), 500, "server_error"},
  };
  for (const Case& c : cases) {
    const ErrorInfo e = ErrorFromException(c.error);
    EXPECT_EQ(e.http_status, c.status) << e.message;
    EXPECT_EQ(e.type, c.type) << e.message;
  }
  EXPECT_EQ(ErrorFromException(std::make_exception_ptr(InvalidArgument("images[0]: bad"))).message,
            "images[0]: bad");
  // ApiError keeps its own fields and reads as its gRPC namesake to code that only knows
  // ServerError.
  const ApiError api({404, "invalid_request_error", "no such model", "model", "model_not_found"});
  EXPECT_EQ(api.code(), grpc::StatusCode::NOT_FOUND);
  const ErrorInfo e = ErrorFromException(std::make_exception_ptr(api));
  EXPECT_EQ(e.code, "model_not_found");
  EXPECT_EQ(e.param, "model");

  const nlohmann::json body = ErrorJson({400, "invalid_request_error", "bad n", "n", ""});
  EXPECT_EQ(body["error"]["message"], "bad n");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_EQ(body["error"]["param"], "n");
  EXPECT_TRUE(body["error"]["code"].is_null());
  EXPECT_TRUE(ErrorJson({500, "server_error", "x", "", ""})["error"]["param"].is_null());
}

// --- prompts and sampling
// --------------------------------------------------------------------------

TEST(OpenAiProtocol, PrepareChatCompletion) {
  ChatCompletionRequest r = ParseChatCompletionRequest(
      R"({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "stop": "x"})", Ctx());
  PreparedGeneration g = PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 512);
  // "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n": 3 special tokens + 18 bytes.
  EXPECT_EQ(g.request.input_ids, Text().BuildChat(r.chat.messages, {}, true).input_ids);
  EXPECT_EQ(g.prompt_tokens, 21);
  EXPECT_EQ(g.request.input_ids.front(), 256);
  EXPECT_FALSE(g.request.tiles.defined());
  EXPECT_TRUE(g.request.sampling.greedy);           // temperature 0
  EXPECT_EQ(g.request.sampling.max_new_tokens, 7);  // limits.default_max_new_tokens
  EXPECT_EQ(g.request.sampling.stop_token_ids, std::vector<int64_t>{257});
  EXPECT_EQ(g.stop_strings, std::vector<std::string>{"x"});
  EXPECT_FALSE(g.stream);

  // The default max_tokens shrinks to the context left; an explicit one must fit.
  g = PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 25);
  EXPECT_EQ(g.request.sampling.max_new_tokens, 4);
  r.params.max_tokens = 4;
  EXPECT_EQ(
      PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 25).request.sampling.max_new_tokens,
      4);
  // Whether it fits is Engine::Validate's to decide (EngineValidateDecides...).
  r.params.max_tokens = 5;
  EXPECT_EQ(
      PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 25).request.sampling.max_new_tokens,
      5);
}

// Engine::Validate's limit is the one the conversion's limits name.
const Engine& TinyEngine() {
  const Engine& engine = testing::TinyServingEngine();
  EXPECT_EQ(engine.options().max_new_tokens_limit, TestLimits().max_new_tokens);
  return engine;
}

// One place decides: requests that the parsers and Prepare* accept, which Engine::Validate alone
// refuses, each refusal named in OpenAI's terms by FromEngineError (the field the client sent,
// OpenAI's context_length_exceeded wording).
TEST(OpenAiProtocol, EngineValidateDecidesAndErrorsNameTheOpenAiFields) {
  struct Case {
    std::string body;
    bool chat;
    std::string param;
    std::string message_part;
    std::string code;
  };
  const std::string hi = R"("messages": [{"role": "user", "content": "Hi"}])";  // 21 tokens
  std::string forty = "[5";
  for (int i = 1; i < 40; ++i) forty += ", 5";
  forty += "]";
  const std::vector<Case> cases = {
      {"{" + hi + R"(, "max_tokens": 0})", true, "max_tokens", "max_tokens: must be >= 1, got 0",
       ""},
      {"{" + hi + R"(, "max_completion_tokens": -3})", true, "max_completion_tokens",
       "max_completion_tokens: must be >= 1, got -3", ""},
      {"{" + hi + R"(, "max_tokens": 101})", true, "max_tokens",
       "max_tokens: 101 exceeds this server's limit of 100 (limits.max_new_tokens)", ""},
      {"{" + hi + R"(, "max_tokens": 12})", true, "messages",
       "This model's maximum context length is 32 tokens. However, you requested 33 tokens (21 in "
       "the messages, 12 in the completion). Please reduce the length of the messages or "
       "completion.",
       "context_length_exceeded"},
      {R"({"prompt": )" + forty + "}", false, "prompt",
       "This model's maximum context length is 32 tokens. However, your prompt resulted in 40 "
       "tokens. Please reduce the length of the prompt.",
       "context_length_exceeded"},
      {"{" + hi + R"(, "top_p": 0})", true, "top_p", "top_p: must lie in (0, 1]", ""},
      {"{" + hi + R"(, "top_k": -2})", true, "top_k",
       "top_k: must be >= 1, or 0 or -1 to disable it", ""},
      {"{" + hi + R"(, "stop_token_ids": [99999]})", true, "stop_token_ids",
       "stop_token_ids: stop token id 99999 is outside the vocabulary", ""},
      {R"({"prompt": [5, 99999], "max_tokens": 1})", false, "prompt",
       "input_ids[1] = 99999 is outside the vocabulary", ""},
      {R"({"prompt": [5, -2], "max_tokens": 1})", false, "prompt",
       "input_ids[1] = -2 is outside the vocabulary", ""},
      {"{" + hi + R"(, "stop_token_ids": [-1]})", true, "stop_token_ids",
       "stop_token_ids: stop token id -1 is outside the vocabulary", ""},
  };
  for (const Case& c : cases) {
    PreparedGeneration g;
    // The protocol layer parses and prepares it ...
    ASSERT_NO_THROW({
      if (c.chat) {
        g = PrepareChatCompletion(ParseChatCompletionRequest(c.body, Ctx()), Text(), Tiny(),
                                  TestLimits(), TinyEngine().max_context());
      } else {
        g = PrepareCompletion(ParseCompletionRequest(c.body, Ctx()), Text(), TestLimits(),
                              TinyEngine().max_context());
      }
    }) << c.body;
    // ... the engine refuses it, and the error names the field as the client sent it.
    try {
      (void)TinyEngine().Validate(g.request);
      ADD_FAILURE() << "accepted: " << c.body;
    } catch (const EngineError& engine_error) {
      const ErrorInfo e = FromEngineError(engine_error, g).info();
      EXPECT_EQ(e.http_status, 400) << c.body;
      EXPECT_EQ(e.type, "invalid_request_error") << c.body;
      EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.message;
      EXPECT_EQ(e.code, c.code) << c.body;
      EXPECT_NE(e.message.find(c.message_part), std::string::npos) << c.body << " -> " << e.message;
    }
  }
  // The same values inside the limits pass.
  const PreparedGeneration ok = PrepareChatCompletion(
      ParseChatCompletionRequest("{" + hi + R"(, "max_tokens": 11, "top_p": 0.5, "top_k": -1})",
                                 Ctx()),
      Text(), Tiny(), TestLimits(), TinyEngine().max_context());
  EXPECT_EQ(TinyEngine().Validate(ok.request)->sampling.max_new_tokens, 11);
}

TEST(OpenAiProtocol, SamplingSeedsAndStopTokens) {
  ChatCompletionRequest r = ParseChatCompletionRequest(
      R"({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7, "top_p": 0.9,
          "top_k": 5, "seed": 11, "stop_token_ids": [3, 257]})",
      Ctx());
  PreparedGeneration g = PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 512);
  const SamplingParams& s = g.request.sampling;
  EXPECT_FALSE(s.greedy);
  EXPECT_DOUBLE_EQ(s.temperature, 0.7);
  EXPECT_DOUBLE_EQ(s.top_p, 0.9);
  EXPECT_EQ(s.top_k, 5);
  EXPECT_EQ(s.seed, 11u);
  EXPECT_EQ(s.stop_token_ids, (std::vector<int64_t>{257, 3}));  // defaults first, no repeats

  // Without a seed every request draws its own (the engine's noise is keyed by the seed).
  r.params.seed.reset();
  std::set<uint64_t> seeds;
  for (int i = 0; i < 8; ++i)
    seeds.insert(PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 512).request.sampling.seed);
  EXPECT_GT(seeds.size(), 1u);

  r.params.ignore_eos = true;
  r.params.stop_token_ids.clear();
  EXPECT_TRUE(PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 512)
                  .request.sampling.stop_token_ids.empty());
}

TEST(OpenAiProtocol, PrepareChatWithImage) {
  const ChatCompletionRequest r = ParseChatCompletionRequest(
      R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": ")" +
          PngDataUrl() + R"("}, {"type": "text", "text": "?"}]}]})",
      Ctx());
  const PreparedGeneration g = PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 512);
  ASSERT_TRUE(g.request.tiles.defined());
  const int64_t tiles = g.request.tiles.size(0);
  const ImageTiles expected = PreprocessEncodedImage(r.chat.images[0].bytes, Tiny(), {});
  EXPECT_EQ(tiles, expected.tiles.size(0));  // 256 x 256 (max_img_size): 4 x 4 grid + global
  EXPECT_TRUE(at::equal(g.request.tiles, expected.tiles));
  const int64_t image_tokens =
      std::count(g.request.input_ids.begin(), g.request.input_ids.end(), Tiny().image_token_id);
  EXPECT_EQ(image_tokens, tiles * Tiny().mp_image_token_length);

  // A corrupt image names its field.
  const ChatCompletionRequest bad = ParseChatCompletionRequest(
      R"({"messages": [{"role": "user", "content": [{"type": "image_url",
          "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSU"}}]}]})",
      Ctx());
  const ErrorInfo e =
      ErrorOf([&] { PrepareChatCompletion(bad, Text(), Tiny(), TestLimits(), 512); });
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "messages[0].content[0].image_url.url");
}

// The tiny text model with a longest context of 32 tokens.
const TextModel& BoundedText() {
  static const TextModel text(TinyTokenizer(), ChatFormat::FromTemplate(Tiny().lm_chat_template),
                              Tiny(), /*stop_token_ids=*/{257}, "test tokenizer",
                              TextModelOptions{/*max_context=*/32});
  return text;
}

// Text whose length alone exceeds the context: 1 MiB, not valid UTF-8 at its end, so that any
// tokenizing would fail with an encoding error instead of the length refusal.
std::string LongBadText() { return std::string(1 << 20, 'a') + "\xff"; }

TEST(OpenAiProtocol, TextLongerThanTheContextIsRefusedBeforeAnyWork) {
  ASSERT_GT(TinyTokenizer().max_bytes_per_token(), 0);
  ChatCompletionRequest chat;
  chat.chat.messages = {{"user", {ChatContentPart::Image(), ChatContentPart::Text(LongBadText())}}};
  chat.chat.images = {{"not an image", "messages[0].content[0].image_url.url"}};  // never decoded
  ErrorInfo e =
      ErrorOf([&] { PrepareChatCompletion(chat, BoundedText(), Tiny(), TestLimits(), 32); });
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_EQ(e.param, "messages");
  const int64_t min_tokens = TinyTokenizer().MinTokens({LongBadText()});
  EXPECT_NE(e.message.find("maximum context length is 32 tokens. However, your messages resulted "
                           "in at least " +
                           std::to_string(min_tokens) + " tokens"),
            std::string::npos)
      << e.message;

  CompletionRequest completion;
  completion.prompts.push_back({LongBadText(), {}});
  e = ErrorOf([&] { PrepareCompletion(completion, BoundedText(), TestLimits(), 32); });
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_EQ(e.param, "prompt");

  // /tokenize has no context limit in vLLM; here a text that cannot fit is refused the same way.
  TokenizeRequest tokenize;
  tokenize.prompt = LongBadText();
  e = ErrorOf([&] { TokenizeIds(tokenize, BoundedText(), Tiny(), TestLimits()); });
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_EQ(e.param, "prompt");
  tokenize.prompt.reset();
  tokenize.chat = chat.chat;
  e = ErrorOf([&] { TokenizeIds(tokenize, BoundedText(), Tiny(), TestLimits()); });
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_EQ(e.param, "messages");

  // A short text goes on to the work (and to its own errors).
  tokenize.chat.images.clear();
  tokenize.chat.messages = {{"user", {ChatContentPart::Text("hi")}}};
  EXPECT_EQ(TokenizeIds(tokenize, BoundedText(), Tiny(), TestLimits()),
            BoundedText().BuildChat(tokenize.chat.messages, {}, true).input_ids);
}

TEST(OpenAiProtocol, ImagesOverTheTileLimitAreRefusedFromTheirHeaders) {
  // Two 6324 x 6324 PNGs (17 tiles each on the tiny model, whose limit is 17 a request) whose
  // pixel data is garbage: refused for their tiles, so no decoder ran.
  const std::string png = testing::PngWithGarbageData(6324, 6324);
  ChatCompletionRequest r;
  r.chat.messages = {
      {"user", {ChatContentPart::Image(), ChatContentPart::Image(), ChatContentPart::Text("?")}}};
  r.chat.images = {{png, "messages[0].content[0].image_url.url"},
                   {png, "messages[0].content[1].image_url.url"}};
  ErrorInfo e = ErrorOf([&] { PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 512); });
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.type, "invalid_request_error");
  EXPECT_EQ(e.param, "messages");
  EXPECT_NE(e.message.find("messages: the 2 images make 34 image tiles (17 + 17); at most 17 are "
                           "allowed per request"),
            std::string::npos)
      << e.message;
  TokenizeRequest tokenize;
  tokenize.chat = r.chat;
  EXPECT_EQ(ErrorOf([&] { TokenizeIds(tokenize, Text(), Tiny(), TestLimits()); }).message,
            e.message);
  // One of them fits the limit, so it goes on to the decoder, which finds its data corrupt.
  r.chat.messages[0].content.erase(r.chat.messages[0].content.begin());
  r.chat.images.pop_back();
  e = ErrorOf([&] { PrepareChatCompletion(r, Text(), Tiny(), TestLimits(), 512); });
  EXPECT_EQ(e.param, "messages[0].content[0].image_url.url");
  EXPECT_NE(e.message.find("corrupt png image"), std::string::npos) << e.message;
}

TEST(OpenAiProtocol, LogprobsEchoAndChoicesReachTheEngineRequest) {
  const CompletionRequest c = ParseCompletionRequest(
      R"({"prompt": [104, 105], "max_tokens": 0, "echo": true, "logprobs": 3, "n": 2,
          "seed": 10})",
      Ctx());
  const PreparedGeneration g = PrepareCompletion(c, Text(), TestLimits(), 512);
  EXPECT_TRUE(g.echo && g.echo_only);
  EXPECT_EQ(g.request.sampling.max_new_tokens, 1);  // one token made, left out of the response
  EXPECT_TRUE(g.request.logprobs.tokens);
  EXPECT_EQ(g.request.logprobs.top, 3);
  EXPECT_TRUE(g.request.logprobs.prompt);
  EXPECT_EQ(g.request.logprobs.prompt_top, 3);
  EXPECT_EQ(g.echo_text, "hi");
  EXPECT_EQ(g.n, 2);
  EXPECT_EQ(ChoiceRequest(g, 0).sampling.seed, 10u);
  EXPECT_EQ(ChoiceRequest(g, 1).sampling.seed, 11u);
  // Echo without logprobs asks the engine for none; logprobs without echo not for the prompt's.
  const PreparedGeneration plain = PrepareCompletion(
      ParseCompletionRequest(R"({"prompt": "ab", "echo": true, "max_tokens": 2})", Ctx()), Text(),
      TestLimits(), 512);
  EXPECT_FALSE(plain.request.logprobs.any());
  EXPECT_FALSE(plain.echo_only);
  EXPECT_EQ(plain.echo_text, "ab");
  const PreparedGeneration no_echo =
      PrepareCompletion(ParseCompletionRequest(R"({"prompt": "ab", "logprobs": 0})", Ctx()), Text(),
                        TestLimits(), 512);
  EXPECT_TRUE(no_echo.request.logprobs.tokens);
  EXPECT_FALSE(no_echo.request.logprobs.prompt);
  // max_tokens 0 without echo is the engine's to refuse (max_new_tokens >= 1).
  EXPECT_EQ(PrepareCompletion(ParseCompletionRequest(R"({"prompt": "ab", "max_tokens": 0})", Ctx()),
                              Text(), TestLimits(), 512)
                .request.sampling.max_new_tokens,
            0);
}

TEST(OpenAiProtocol, LogprobsInOpenAisFormats) {
  const Tokenizer& tok = Text().tokenizer();  // byte-level: id 'h' is "h"
  const TokenLogprob h{-0.5f, {{'h', -0.5f}, {'i', -1.5f}, {'x', -2.0f}}};
  CompletionLogprobs completion(&tok, /*top=*/1);
  completion.AddUnscored('a');
  completion.Add('h', h);
  completion.Add('i', {-1e30f, {}});
  const nlohmann::json c = completion.Take();
  EXPECT_EQ(c["tokens"], nlohmann::json({"a", "h", "i"}));
  EXPECT_EQ(c["token_logprobs"], nlohmann::json({nullptr, -0.5, -9999.0}));
  // The token itself and the `top` most likely: {h, h} is one entry; none beyond top 1.
  EXPECT_EQ(c["top_logprobs"][0], nullptr);
  EXPECT_EQ(c["top_logprobs"][1], nlohmann::json({{"h", -0.5}}));
  EXPECT_EQ(c["top_logprobs"][2], nlohmann::json({{"i", -9999.0}}));
  EXPECT_EQ(c["text_offset"], nlohmann::json({0, 1, 2}));
  completion.Add('x', h);  // offsets count on after a Take
  EXPECT_EQ(completion.Take()["text_offset"], nlohmann::json({3}));
  ChatLogprobs chat(&tok);
  chat.Add('h', h);
  const nlohmann::json j = chat.Take();
  EXPECT_EQ(j["refusal"], nullptr);
  ASSERT_EQ(j["content"].size(), 1u);
  EXPECT_EQ(j["content"][0]["token"], "h");
  EXPECT_EQ(j["content"][0]["bytes"], nlohmann::json({104}));
  EXPECT_EQ(j["content"][0]["top_logprobs"].size(), 3u);
  EXPECT_EQ(j["content"][0]["top_logprobs"][1],
            nlohmann::json({{"token", "i"}, {"logprob", -1.5}, {"bytes", {105}}}));
  EXPECT_TRUE(chat.Take()["content"].empty());
}

TEST(OpenAiProtocol, ChoicesNumberPromptMajorAndEchoThePrompt) {
  std::vector<PreparedGeneration> prompts;
  for (const char* body : {R"({"prompt": "hi", "n": 2, "echo": true, "logprobs": 0})",
                           R"({"prompt": [104], "n": 2, "echo": true, "logprobs": 0,
                               "max_tokens": 0})"}) {
    prompts.push_back(
        PrepareCompletion(ParseCompletionRequest(body, Ctx()), Text(), TestLimits(), 512));
  }
  ResponseChoices out(/*chat=*/false, NewResponseMeta("cmpl", "m"), &prompts, &Text().tokenizer());
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(out.prompt_of(1), 0u);
  EXPECT_EQ(out.prompt_of(2), 1u);
  auto prompt_logprobs = [](size_t n) {
    return std::make_shared<const std::vector<TokenLogprob>>(n, TokenLogprob{-1.0f, {}});
  };
  for (size_t i = 0; i < 4; ++i) {
    GenerationDelta d;
    d.token_ids = {'!'};
    d.text = "!";
    d.logprobs = {{-0.25f, {}}};
    d.prompt_logprobs = prompt_logprobs(i < 2 ? 1 : 0);
    EXPECT_EQ(out.OnDelta(i, d), "");
    EXPECT_FALSE(out.all_finished());
    GenerationOutcome o;
    o.reason = FinishReason::kLength;
    o.generated_tokens = 1;
    EXPECT_EQ(out.OnFinish(i, o), "");
  }
  ASSERT_TRUE(out.all_finished());
  const nlohmann::json body = out.TakeBody();
  ASSERT_EQ(body["choices"].size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(body["choices"][i]["index"], i);
  EXPECT_EQ(body["choices"][1]["text"], "hi!");
  EXPECT_EQ(body["choices"][1]["logprobs"]["token_logprobs"],
            nlohmann::json({nullptr, -1.0, -0.25}));
  // max_tokens 0: the prompt alone; the token made is not counted.
  EXPECT_EQ(body["choices"][3]["text"], "h");
  EXPECT_EQ(body["choices"][3]["logprobs"]["tokens"], nlohmann::json({"h"}));
  EXPECT_EQ(body["choices"][3]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(body["usage"]["completion_tokens"], 2);
}

TEST(OpenAiProtocol, CompletionTokenizeDetokenize) {
  const CompletionRequest c =
      ParseCompletionRequest(R"({"prompt": "abc", "max_tokens": 3})", Ctx());
  const PreparedGeneration g = PrepareCompletion(c, Text(), TestLimits(), 512);
  EXPECT_EQ(g.request.input_ids, (std::vector<int64_t>{'a', 'b', 'c'}));
  EXPECT_EQ(g.request.sampling.max_new_tokens, 3);
  EXPECT_FALSE(g.request.sampling.greedy);  // temperature defaults to 1
  const CompletionRequest ids = ParseCompletionRequest(R"({"prompt": [5, 6]})", Ctx());
  EXPECT_EQ(PrepareCompletion(ids, Text(), TestLimits(), 512).request.input_ids,
            (std::vector<int64_t>{5, 6}));

  const std::vector<int64_t> prompt_ids =
      TokenizeIds(ParseTokenizeRequest(R"({"prompt": "hi"})", Ctx()), Text(), Tiny(), TestLimits());
  EXPECT_EQ(prompt_ids, (std::vector<int64_t>{'h', 'i'}));
  const TokenizeRequest chat = ParseTokenizeRequest(
      R"({"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false})",
      Ctx());
  const std::vector<int64_t> chat_ids = TokenizeIds(chat, Text(), Tiny(), TestLimits());
  EXPECT_EQ(chat_ids, Text().BuildChat(chat.chat.messages, {}, false).input_ids);
  // Detokenize keeps special tokens, so it round-trips /tokenize.
  EXPECT_EQ(DetokenizeText({chat_ids}, Text()), "<|im_start|>user\nHi<|im_end|>\n");
  for (int64_t bad : {int64_t{999999}, int64_t{-1}}) {  // the tokenizer checks the ids
    const ErrorInfo e = ErrorOf([&] { DetokenizeText({{bad}}, Text()); });
    EXPECT_EQ(e.http_status, 400) << bad;
    EXPECT_EQ(e.param, "tokens") << bad;
  }
}

// --- responses
// -------------------------------------------------------------------------------------

TEST(OpenAiProtocol, ResponseBodies) {
  const ResponseMeta meta = NewResponseMeta("chatcmpl", "tiny-chat");
  EXPECT_EQ(meta.id.rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(meta.id.size(), 9u + 32u);
  EXPECT_NE(NewResponseMeta("chatcmpl", "m").id, meta.id);
  EXPECT_GT(meta.created, 1600000000);

  const nlohmann::json c = ChatCompletionJson(meta, "Paris.", "stop", {12, 3});
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_EQ(c["model"], "tiny-chat");
  EXPECT_EQ(c["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(c["choices"][0]["message"]["content"], "Paris.");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(c["usage"]["total_tokens"], 15);

  const nlohmann::json first =
      ChatCompletionChunkJson(meta, {{"role", "assistant"}, {"content", ""}}, "", true);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(first.contains("usage") && first["usage"].is_null());
  EXPECT_FALSE(ChatCompletionChunkJson(meta, {{"content", "x"}}, "", false).contains("usage"));
  const nlohmann::json usage = UsageChunkJson(meta, "chat.completion.chunk", {4, 2});
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2);

  const nlohmann::json t = CompletionJson(NewResponseMeta("cmpl", "m"), "abc", "length", {1, 3});
  EXPECT_EQ(t["object"], "text_completion");
  EXPECT_EQ(t["choices"][0]["text"], "abc");
  EXPECT_EQ(t["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(CompletionChunkJson(meta, "a", "", false)["object"], "text_completion");

  EXPECT_EQ(FinishReasonString(FinishReason::kLength), std::string("length"));
  EXPECT_EQ(FinishReasonString(FinishReason::kContextFull), std::string("length"));
  EXPECT_EQ(FinishReasonString(FinishReason::kStopToken), std::string("stop"));

  const nlohmann::json models = ModelListJson("tiny-chat", 5, 512);
  EXPECT_EQ(models["object"], "list");
  EXPECT_EQ(models["data"][0]["id"], "tiny-chat");
  EXPECT_EQ(models["data"][0]["object"], "model");
  EXPECT_EQ(models["data"][0]["max_model_len"], 512);
  const nlohmann::json tok = TokenizeJson({1, 2, 3}, 512);
  EXPECT_EQ(tok["count"], 3);
  EXPECT_EQ(tok["max_model_len"], 512);
  EXPECT_EQ(DetokenizeJson("hi")["prompt"], "hi");

  EXPECT_EQ(SseEvent({{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(std::string(kSseDone), "data: [DONE]\n\n");
  // Invalid UTF-8 never makes a response throw.
  EXPECT_NO_THROW(Dump(nlohmann::json(std::string("\xff"))));
}

TEST(OpenAiProtocol, HttpBodyLimitCoversBase64Images) {
  Limits l = TestLimits();
  l.max_request_bytes = 3000;
  EXPECT_EQ(MaxHttpBodyBytes(l), 4000);
  l.max_request_bytes = 3001;
  EXPECT_EQ(MaxHttpBodyBytes(l), 4004);
}

}  // namespace
}  // namespace vlmgraph::server::openai
