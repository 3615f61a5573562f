// Fuzz target: the OpenAI-compatible API's request bodies (server/openai/requests.h: the Parse*
// functions, then PrepareChatCompletion / PrepareCompletion / TokenizeIds / DetokenizeText with a
// tiny tokenizer, which decode the data-URL images, render the chat and tokenize it), and the
// response and error bodies built from what came out. Input: one byte choosing the endpoint
// (chat/completions, completions, tokenize, detokenize), then the body. Expected errors:
// ServerError (ApiError), TokenizerError and std::invalid_argument (ImageError, ChatFormatError),
// the errors the header lets through to ErrorFromException.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

#include "server/openai/requests.h"
#include "server/openai/responses.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace vlmgraph;
  using namespace vlmgraph::server::openai;
  if (size == 0) return 0;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  const RequestContext ctx{"tiny-chat", fuzz::SmallLimits()};
  const server::TextModel& text = fuzz::TinyTextModel();
  const VlmConfig& cfg = fuzz::TinyConfig();
  constexpr int64_t kMaxContext = 512;
  const ResponseMeta meta{"chatcmpl-0", 0, ctx.served_model_name};
  auto respond = [&](const PreparedGeneration& g) {
    const std::string prompt = DetokenizeText({g.request.input_ids}, text);
    for (const std::string& stop : g.stop_strings) prompt.find(stop);
    Dump(ChatCompletionJson(meta, prompt, "stop", {g.prompt_tokens, 1}));
    SseEvent(CompletionChunkJson(meta, prompt, "", g.include_usage));
  };
  try {
    switch (data[0] % 4) {
      case 0:
        respond(PrepareChatCompletion(ParseChatCompletionRequest(body, ctx), text, cfg, ctx.limits,
                                      kMaxContext));
        break;
      case 1:
        respond(
            PrepareCompletion(ParseCompletionRequest(body, ctx), text, ctx.limits, kMaxContext));
        break;
      case 2:
        Dump(TokenizeJson(TokenizeIds(ParseTokenizeRequest(body, ctx), text, cfg, ctx.limits),
                          kMaxContext));
        break;
      default:
        Dump(DetokenizeJson(DetokenizeText(ParseDetokenizeRequest(body, ctx), text)));
        break;
    }
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    fuzz::ExpectOnly<server::ServerError, TokenizerError, std::invalid_argument>(
        "openai", [&] { std::rethrow_exception(error); });
    // The error body, as the HTTP layer sends it.
    Dump(ErrorJson(ErrorFromException(error)));
  }
  return 0;
}
