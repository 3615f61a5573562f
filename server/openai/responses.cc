#include "server/openai/responses.h"

#include <chrono>
#include <random>
#include <string>

namespace vlmgraph::server::openai {
namespace {

json ChoicesMeta(const ResponseMeta& meta, const char* object) {
  return json{
      {"id", meta.id}, {"object", object}, {"created", meta.created}, {"model", meta.model}};
}

json FinishReasonJson(const std::string& reason) {
  return reason.empty() ? json(nullptr) : json(reason);
}

}  // namespace

// --- responses
// ------------------------------------------------------------------------------------

ResponseMeta NewResponseMeta(const std::string& id_prefix, const std::string& model) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = id_prefix + "-";
  for (int i = 0; i < 2; ++i) {
    uint64_t r = rng();
    for (int k = 0; k < 16; ++k, r >>= 4) id += kHex[r & 15];
  }
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return {id, std::chrono::duration_cast<std::chrono::seconds>(now).count(), model};
}

json UsageJson(const Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
}

const char* FinishReasonString(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
    case FinishReason::kContextFull:
      return "length";
    default:
      return "stop";
  }
}

json ChatChoiceJson(int64_t index, const std::string& text, const json& logprobs,
                    const std::string& finish_reason) {
  return {{"index", index},
          {"message", {{"role", "assistant"}, {"content", text}}},
          {"logprobs", logprobs},
          {"finish_reason", FinishReasonJson(finish_reason)}};
}

json CompletionChoiceJson(int64_t index, const std::string& text, const json& logprobs,
                          const std::string& finish_reason) {
  return {{"index", index},
          {"text", text},
          {"logprobs", logprobs},
          {"finish_reason", FinishReasonJson(finish_reason)}};
}

json ChatCompletionJson(const ResponseMeta& meta, json choices, const Usage& usage) {
  json j = ChoicesMeta(meta, "chat.completion");
  j["choices"] = std::move(choices);
  j["usage"] = UsageJson(usage);
  return j;
}

json CompletionJson(const ResponseMeta& meta, json choices, const Usage& usage) {
  json j = ChoicesMeta(meta, "text_completion");
  j["choices"] = std::move(choices);
  j["usage"] = UsageJson(usage);
  return j;
}

json ChatCompletionChunkJson(const ResponseMeta& meta, int64_t index, const json& delta,
                             const json& logprobs, const std::string& finish_reason,
                             bool include_usage) {
  json j = ChoicesMeta(meta, "chat.completion.chunk");
  j["choices"] = json::array({{{"index", index},
                               {"delta", delta},
                               {"logprobs", logprobs},
                               {"finish_reason", FinishReasonJson(finish_reason)}}});
  if (include_usage) j["usage"] = nullptr;
  return j;
}

json CompletionChunkJson(const ResponseMeta& meta, int64_t index, const std::string& text,
                         const json& logprobs, const std::string& finish_reason,
                         bool include_usage) {
  json j = ChoicesMeta(meta, "text_completion");
  j["choices"] = json::array({CompletionChoiceJson(index, text, logprobs, finish_reason)});
  if (include_usage) j["usage"] = nullptr;
  return j;
}

json ChatCompletionJson(const ResponseMeta& meta, const std::string& text,
                        const std::string& finish_reason, const Usage& usage) {
  return ChatCompletionJson(meta, json::array({ChatChoiceJson(0, text, nullptr, finish_reason)}),
                            usage);
}

json ChatCompletionChunkJson(const ResponseMeta& meta, const json& delta,
                             const std::string& finish_reason, bool include_usage) {
  return ChatCompletionChunkJson(meta, 0, delta, nullptr, finish_reason, include_usage);
}

json CompletionJson(const ResponseMeta& meta, const std::string& text,
                    const std::string& finish_reason, const Usage& usage) {
  return CompletionJson(meta, json::array({CompletionChoiceJson(0, text, nullptr, finish_reason)}),
                        usage);
}

json CompletionChunkJson(const ResponseMeta& meta, const std::string& text,
                         const std::string& finish_reason, bool include_usage) {
  return CompletionChunkJson(meta, 0, text, nullptr, finish_reason, include_usage);
}

json UsageChunkJson(const ResponseMeta& meta, const std::string& object, const Usage& usage) {
  json j = ChoicesMeta(meta, object.c_str());
  j["choices"] = json::array();
  j["usage"] = UsageJson(usage);
  return j;
}

json ModelJson(const std::string& model, int64_t created, int64_t max_model_len) {
  return {{"id", model},        {"object", "model"},
          {"created", created}, {"owned_by", "vlmgraph"},
          {"root", model},      {"max_model_len", max_model_len}};
}

json ModelListJson(const std::string& model, int64_t created, int64_t max_model_len) {
  return {{"object", "list"}, {"data", json::array({ModelJson(model, created, max_model_len)})}};
}

json TokenizeJson(const std::vector<int64_t>& ids, int64_t max_model_len) {
  return {{"count", ids.size()}, {"max_model_len", max_model_len}, {"tokens", ids}};
}

json DetokenizeJson(const std::string& text) { return {{"prompt", text}}; }

std::string SseEvent(const json& j) { return "data: " + Dump(j) + "\n\n"; }

}  // namespace vlmgraph::server::openai
