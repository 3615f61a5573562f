#include "server/openai/logprobs_json.h"

#include <algorithm>
#include <utility>

namespace vlmgraph::server::openai {
namespace {

float Floor(float logprob) { return std::max(logprob, kLowestLogprob); }

std::string TokenText(const Tokenizer& tokenizer, int64_t id) {
  return tokenizer.Decode({id}, /*skip_special_tokens=*/false);
}

json Bytes(const std::string& text) {
  json bytes = json::array();
  for (const char c : text) bytes.push_back(static_cast<int>(static_cast<unsigned char>(c)));
  return bytes;
}

// Unicode characters of valid UTF-8 text (what Python's len counts): bytes that start one.
int64_t Characters(const std::string& text) {
  return std::count_if(text.begin(), text.end(),
                       [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

}  // namespace

void ChatLogprobs::Add(int64_t id, const TokenLogprob& logprob) {
  const std::string text = TokenText(*tokenizer_, id);
  json top = json::array();
  for (const auto& [top_id, top_logprob] : logprob.top) {
    const std::string t = TokenText(*tokenizer_, top_id);
    top.push_back({{"token", t}, {"logprob", Floor(top_logprob)}, {"bytes", Bytes(t)}});
  }
  content_.push_back({{"token", text},
                      {"logprob", Floor(logprob.logprob)},
                      {"bytes", Bytes(text)},
                      {"top_logprobs", std::move(top)}});
}

json ChatLogprobs::Take() {
  json out = {{"content", std::move(content_)}, {"refusal", nullptr}};
  content_ = json::array();
  return out;
}

std::string CompletionLogprobs::Token(int64_t id) {
  std::string text = TokenText(*tokenizer_, id);
  text_offset_.push_back(offset_);
  offset_ += Characters(text);
  tokens_.push_back(text);
  return text;
}

void CompletionLogprobs::AddUnscored(int64_t id) {
  Token(id);
  token_logprobs_.push_back(nullptr);
  top_logprobs_.push_back(nullptr);
}

void CompletionLogprobs::Add(int64_t id, const TokenLogprob& logprob) {
  const std::string text = Token(id);
  token_logprobs_.push_back(Floor(logprob.logprob));
  json top = json::object();
  top[text] = Floor(logprob.logprob);
  const size_t keep = std::min(logprob.top.size(), static_cast<size_t>(std::max<int64_t>(top_, 0)));
  for (size_t j = 0; j < keep; ++j) {
    top[TokenText(*tokenizer_, logprob.top[j].first)] = Floor(logprob.top[j].second);
  }
  top_logprobs_.push_back(std::move(top));
}

json CompletionLogprobs::Take() {
  json out = {{"tokens", std::move(tokens_)},
              {"token_logprobs", std::move(token_logprobs_)},
              {"top_logprobs", std::move(top_logprobs_)},
              {"text_offset", std::move(text_offset_)}};
  tokens_ = json::array();
  token_logprobs_ = json::array();
  top_logprobs_ = json::array();
  text_offset_ = json::array();
  return out;
}

}  // namespace vlmgraph::server::openai
