// server/openai/responses.h: the OpenAI-compatible API's response bodies: chat and text
// completions (whole, or as Server-Sent Events of chunks ending with `data: [DONE]`), usage,
// models, and vLLM's tokenize/detokenize bodies. Formats: the OpenAI API reference
// (https://platform.openai.com/docs/api-reference/chat, .../completions, .../models) and vLLM's
// vllm/entrypoints/openai/protocol.py; the requests are in server/openai/requests.h.
//
//   ResponseMeta meta = NewResponseMeta("chatcmpl", served_model_name);
//   std::string body = Dump(ChatCompletionJson(meta, text, FinishReasonString(reason), usage));
//
// Thread rules: pure functions, safe from any thread.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/engine_types.h"
#include "server/openai/errors.h"

namespace vlmgraph::server::openai {

// --- responses
// ------------------------------------------------------------------------------------

// The fields every response object of one request repeats.
struct ResponseMeta {
  std::string id;       // "chatcmpl-<32 hex digits>", "cmpl-..."
  int64_t created = 0;  // Unix time, seconds
  std::string model;    // served_model_name
};
// `id_prefix`: "chatcmpl" or "cmpl".
ResponseMeta NewResponseMeta(const std::string& id_prefix, const std::string& model);

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
};
json UsageJson(const Usage& usage);  // {prompt_tokens, completion_tokens, total_tokens}

// OpenAI's finish_reason: "length" for max_tokens and a full context (as vLLM), "stop" for a stop
// token or stop string.
const char* FinishReasonString(FinishReason reason);

// One choice of a whole response: {"index", "message": {"role": "assistant", "content": text},
// "logprobs", "finish_reason"} (chat) or {"index", "text", "logprobs", "finish_reason"}
// (completions). `logprobs`: null, or logprobs_json.h's object.
json ChatChoiceJson(int64_t index, const std::string& text, const json& logprobs,
                    const std::string& finish_reason);
json CompletionChoiceJson(int64_t index, const std::string& text, const json& logprobs,
                          const std::string& finish_reason);
// object "chat.completion" / "text_completion" with `choices` (a list of the above) and usage.
json ChatCompletionJson(const ResponseMeta& meta, json choices, const Usage& usage);
json CompletionJson(const ResponseMeta& meta, json choices, const Usage& usage);
// Stream chunks of choice `index`: "chat.completion.chunk" with `delta` ({"role": "assistant",
// "content": ""} first, then {"content": text}, then {} with the finish reason), or
// "text_completion" with `text`; `logprobs` null or the chunk's tokens' (logprobs_json.h);
// finish_reason "" = null; `include_usage` adds "usage": null.
json ChatCompletionChunkJson(const ResponseMeta& meta, int64_t index, const json& delta,
                             const json& logprobs, const std::string& finish_reason,
                             bool include_usage);
json CompletionChunkJson(const ResponseMeta& meta, int64_t index, const std::string& text,
                         const json& logprobs, const std::string& finish_reason,
                         bool include_usage);

// The one-choice forms of the above (index 0, logprobs null).
// object "chat.completion": one choice with {"role": "assistant", "content": text}.
json ChatCompletionJson(const ResponseMeta& meta, const std::string& text,
                        const std::string& finish_reason, const Usage& usage);
// object "chat.completion.chunk" with one choice: `delta` ({"role": "assistant", "content": ""}
// first, then {"content": text}, then {} with the finish reason); finish_reason "" = null.
// `include_usage`: adds "usage": null.
json ChatCompletionChunkJson(const ResponseMeta& meta, const json& delta,
                             const std::string& finish_reason, bool include_usage);
// object "text_completion": one choice with text.
json CompletionJson(const ResponseMeta& meta, const std::string& text,
                    const std::string& finish_reason, const Usage& usage);
// object "text_completion" as a stream chunk; finish_reason "" = null.
json CompletionChunkJson(const ResponseMeta& meta, const std::string& text,
                         const std::string& finish_reason, bool include_usage);
// The last chunk of a stream with stream_options.include_usage: empty choices and usage.
// `object`: "chat.completion.chunk" or "text_completion".
json UsageChunkJson(const ResponseMeta& meta, const std::string& object, const Usage& usage);

// GET /v1/models: {"object": "list", "data": [ModelJson]}.
json ModelJson(const std::string& model, int64_t created, int64_t max_model_len);
json ModelListJson(const std::string& model, int64_t created, int64_t max_model_len);

json TokenizeJson(const std::vector<int64_t>& ids, int64_t max_model_len);
json DetokenizeJson(const std::string& text);

// One Server-Sent Event: "data: <json>\n\n".
std::string SseEvent(const json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace vlmgraph::server::openai
