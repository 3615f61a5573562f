// server/openai/requests.h: the OpenAI-compatible API's requests, without sockets: request
// bodies -> checked requests -> engine requests. Errors and their bodies are in
// server/openai/errors.h, response bodies in server/openai/responses.h; openai_http.h serves them.
//
//   const RequestContext ctx{config.served_model_name, config.limits};
//   ChatCompletionRequest chat = ParseChatCompletionRequest(body, ctx);       // throws ApiError
//   PreparedGeneration g = PrepareChatCompletion(chat, text_model, cfg, limits, max_context);
//   ValidatedRequest request = ...;
//   try { request = engine.Validate(std::move(g.request)); }  // the one validation
//   catch (const EngineError& e) { throw FromEngineError(e, g); }  // in this API's words
//   ... GenerationSession(router, metrics, std::move(request), ...) ... // server/core/generation.h
//   ResponseMeta meta = NewResponseMeta("chatcmpl", ctx.served_model_name);
//   std::string body = Dump(ChatCompletionJson(meta, text, FinishReasonString(outcome), usage));
//
// Formats, and where they come from:
//   POST /v1/chat/completions, POST /v1/completions, GET /v1/models: the OpenAI API reference
//     (https://platform.openai.com/docs/api-reference/chat, .../completions, .../models), streamed
//     as Server-Sent Events of `chat.completion.chunk` / `text_completion` objects ending with
//     `data: [DONE]`; `stream_options.include_usage` adds a last chunk with `usage` and empty
//     `choices` (every other chunk then has `"usage": null`), as OpenAI does.
//   POST /tokenize, POST /detokenize: vLLM's (vllm/entrypoints/openai/protocol.py, TokenizeRequest
//     and DetokenizeRequest): {"prompt"} or {"messages", "add_generation_prompt"} ->
//     {"count", "max_model_len", "tokens"}; {"tokens"} -> {"prompt"}.
//   Errors: OpenAI's {"error": {"message", "type", "param", "code"}} (ErrorFromException).
//
// Accepted request fields (anything else is ignored, as vLLM does; fields this server cannot honour
// are refused instead of ignored: tools, response_format other than text, non-zero penalties,
// logit_bias, suffix, best_of > 1). The parsers check types and this
// API's own rules; the ranges below that are the engine's (max_tokens, top_p, top_k, stop ids, the
// context) are checked by Engine::Validate alone and its refusal named here by FromEngineError:
//   model                 optional; when given it must equal served_model_name (else 404)
//   messages              chat: [{role: system|developer|user|assistant, content: string or
//                         [{type: text, text} | {type: image_url, image_url: {url}}]}]; image URLs
//                         must be `data:image/...;base64,...` (the server fetches nothing)
//   prompt                completions: a string, token ids ([int]), or a batch of prompts
//                         ([string] or [[int]]); each prompt's choices follow the previous
//                         prompt's (index = prompt * n + choice)
//   max_completion_tokens / max_tokens   >= 1, <= limits.max_new_tokens; default
//                         limits.default_max_new_tokens, capped to the context left; 0 with echo
//                         (completions): the prompt alone is returned, as vLLM does
//   logprobs, top_logprobs  chat: logprobs true returns each new token's logprob, top_logprobs
//                         0..20 (needs logprobs true) the most likely tokens at each position;
//                         completions: logprobs 0..20 (vLLM's bound; OpenAI's is 5) returns each
//                         token's logprob and, in top_logprobs, the chosen token's and the
//                         logprobs most likely ones. Logprobs are log_softmax of the raw logits
//                         over the whole vocabulary (before temperature, top-k and top-p), as
//                         vLLM returns them by default (engine/logprobs.h)
//   echo                  completions: the prompt's text before the completion's and, with
//                         logprobs, its tokens' logprobs (the first token's is null), as OpenAI
//                         and vLLM; streamed as the first chunk of each choice
//   n                     choices per prompt, 1..kMaxChoices with prompts x n <= kMaxChoices;
//                         choice i samples with seed + i (the same choices for the same seed)
//   temperature           [0, 2], default 1 (sampling); below 1e-5 = greedy (as vLLM)
//   top_p                 (0, 1], checked when sampling
//   top_k (vLLM; 0 or -1 = off), seed (int; default: a fresh random seed)
//   stop                  a string or up to 4 strings; the text ends before the first match
//   stop_token_ids        (vLLM) extra stop tokens; ignore_eos (vLLM) drops the default ones
//   stream; stream_options.include_usage (stream only)
//
// Errors: every function throws ApiError (a ServerError with an HTTP status and OpenAI's error
// fields) or lets the engine's, tokenizer's and image decoder's exceptions through; the HTTP layer
// maps all of them with ErrorFromException, the one mapping (table at ErrorFromException).
// Thread rules: pure functions, safe from any thread.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_types.h"
#include "model/config.h"
#include "server/config/config.h"
#include "server/core/text_prompt.h"
#include "server/openai/errors.h"
#include "text/chat_format.h"

namespace vlmgraph::server::openai {

using Limits = ServerConfig::Limits;

// --- requests
// -------------------------------------------------------------------------------------

// What every parser needs to know about the server.
struct RequestContext {
  std::string served_model_name;
  Limits limits;
};

// Sampling and output options shared by chat and text completions.
struct GenerationParams {
  std::optional<int64_t> max_tokens;  // max_completion_tokens, else max_tokens; nullopt = default
  std::string max_tokens_param = "max_tokens";  // the field max_tokens came from
  double temperature = 1.0;                     // < kGreedyTemperature = greedy
  double top_p = 1.0;
  int64_t top_k = 0;                    // 0 = off (the request's -1 too)
  std::optional<uint64_t> seed;         // nullopt = a fresh random seed per request
  std::vector<std::string> stop;        // stop strings, non-empty
  std::vector<int64_t> stop_token_ids;  // added to the model's default stop tokens
  bool ignore_eos = false;              // no default stop tokens
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  int64_t n = 1;               // choices per prompt
  bool logprobs = false;       // chat: logprobs true; completions: logprobs given
  int64_t top_logprobs = 0;    // chat: top_logprobs; completions: logprobs; 0..kMaxTopLogprobs
  std::string logprobs_param = "logprobs";  // the field that set top_logprobs
  bool echo = false;                        // completions: echo
};

// The most choices one request may ask for (prompts x n).
inline constexpr int64_t kMaxChoices = 64;

// vLLM's _SAMPLING_EPS: a temperature below it samples greedily.
inline constexpr double kGreedyTemperature = 1e-5;

// One image of a request: its encoded bytes (PNG or JPEG) and the field it came from.
struct EncodedImage {
  std::string bytes;
  std::string param;  // "messages[1].content[0].image_url.url"
};

// Chat messages with their images, in order of the image parts.
struct ChatInput {
  std::vector<ChatMessage> messages;
  std::vector<EncodedImage> images;
};

struct ChatCompletionRequest {
  ChatInput chat;
  GenerationParams params;
};

// One prompt of a completions request.
struct CompletionPrompt {
  std::optional<std::string> text;  // set unless the prompt was token ids
  std::vector<int64_t> ids;         // the prompt as token ids
};

struct CompletionRequest {
  std::vector<CompletionPrompt> prompts;  // one, or a batch
  GenerationParams params;
};

struct TokenizeRequest {
  std::optional<std::string> prompt;  // either a prompt ...
  ChatInput chat;                     // ... or messages
  bool add_generation_prompt = true;  // messages only (vLLM's default)
  bool add_special_tokens = true;     // prompt only (vLLM's default)
};

struct DetokenizeRequest {
  std::vector<int64_t> tokens;
};

// Each parser takes the raw body. Throws ApiError: 400 for malformed JSON, a missing or mistyped
// field, a value out of range or an unsupported feature; 404 model_not_found for another model.
ChatCompletionRequest ParseChatCompletionRequest(const std::string& body,
                                                 const RequestContext& ctx);
CompletionRequest ParseCompletionRequest(const std::string& body, const RequestContext& ctx);
TokenizeRequest ParseTokenizeRequest(const std::string& body, const RequestContext& ctx);
DetokenizeRequest ParseDetokenizeRequest(const std::string& body, const RequestContext& ctx);

// The bytes of a `data:image/<type>;base64,<data>` URL (image/data_url.h). Throws a 400 ApiError
// naming `param` for a remote (http, https) or other non-data URL, a non-image media type, data
// that is not base64, and more than limits.max_image_bytes bytes.
std::string DecodeImageUrl(const std::string& url, const Limits& limits, const std::string& param);

// --- engine requests
// ------------------------------------------------------------------------------

// A request ready for Engine::Validate and a GenerationSession.
struct PreparedGeneration {
  GenerateRequest request;
  std::vector<std::string> stop_strings;  // for the TextStream
  int64_t prompt_tokens = 0;              // image tokens included
  std::string prompt_param;               // "messages" or "prompt": where the prompt came from
  std::string max_tokens_param;           // "max_tokens" or "max_completion_tokens"
  bool stream = false;
  bool include_usage = false;
  int64_t n = 1;               // choices of this prompt (GenerationParams::n)
  bool logprobs = false;       // the response carries logprobs (request.logprobs asks for them)
  int64_t top_logprobs = 0;    // alternatives per position in the response
  std::string logprobs_param;  // "logprobs" or "top_logprobs": the field that set top_logprobs
  // Completions' echo: the prompt's text, returned before the completion's (the prompt as given,
  // or its token ids decoded); with logprobs the engine returns the prompt's logprobs too.
  bool echo = false;
  std::string echo_text;
  // max_tokens 0 with echo: the engine makes one token (max_new_tokens 1), which the response
  // leaves out (text, logprobs, usage), as vLLM does.
  bool echo_only = false;
};

// Checks the limits before the work: the messages' text length (TextModel::CheckTextLength: a text
// sure to make more tokens than the longest context is refused untokenized), then the images'
// headers (bytes, format, limits.max_image_pixels, and their tiles against the engine's
// max_tiles_per_request: refused undecoded). Then decodes and tiles the images, renders the chat,
// tokenizes it and sets the sampling. `max_context`: the engine's longest context
// (Engine::max_context()), which caps the default max_tokens. Throws ApiError 400
// context_length_exceeded when the text surely cannot fit (from its length), 400 for a bad image
// or too many tiles, and TextModel's errors. Whether the result is a valid request (the context
// fit among the rest) is Engine::Validate's to decide: see FromEngineError.
PreparedGeneration PrepareChatCompletion(const ChatCompletionRequest& request,
                                         const TextModel& text, const VlmConfig& cfg,
                                         const Limits& limits, int64_t max_context);
// The prompt `prompt` of `request` (an index into request.prompts).
PreparedGeneration PrepareCompletion(const CompletionRequest& request, const TextModel& text,
                                     const Limits& limits, int64_t max_context, size_t prompt = 0);
// Choice `choice` (0..n-1) of `g`: the request with seed + choice, so that a seeded request's
// choices differ and repeat.
GenerateRequest ChoiceRequest(const PreparedGeneration& g, int64_t choice);
// Engine::Validate's refusal (`e`, kInvalidArgument) of `g`'s request as this API's error, through
// one translation table from the engine's field names (EngineError::field) to this API's: a
// context overflow (EngineError::context_overflow) -> 400 context_length_exceeded in OpenAI's and
// vLLM's words with param "messages" or "prompt"; sampling.max_new_tokens -> max_tokens (or
// max_completion_tokens, the field the request used), sampling.temperature / top_p / top_k /
// stop_token_ids -> temperature / top_p / top_k / stop_token_ids; logprobs.top and
// logprobs.prompt_top -> top_logprobs (chat) or logprobs (completions); input_ids and tiles ->
// param "messages" or "prompt" with the engine's message. 400 invalid_request_error. Another code:
// as ErrorFromException maps it.
ApiError FromEngineError(const EngineError& e, const PreparedGeneration& g);

// The token ids /tokenize returns (image tokens included): a prompt as /v1/completions tokenizes
// it, messages as /v1/chat/completions does, after the same checks; a text that cannot fit the
// longest context is refused with 400 context_length_exceeded (vLLM's /tokenize has no limit).
std::vector<int64_t> TokenizeIds(const TokenizeRequest& request, const TextModel& text,
                                 const VlmConfig& cfg, const Limits& limits);
// The text /detokenize returns (special tokens kept, so it round-trips /tokenize). Throws a 400
// ApiError for an id outside the vocabulary.
std::string DetokenizeText(const DetokenizeRequest& request, const TextModel& text);

}  // namespace vlmgraph::server::openai
