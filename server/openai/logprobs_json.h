// server/openai/logprobs_json.h: log-probabilities in the OpenAI API's response formats, built one
// token at a time from the engine's TokenLogprob (engine/engine_types.h).
//
//   CompletionLogprobs lp(&tokenizer, /*top=*/1);
//   lp.AddUnscored(prompt[0]);                       // echo: the first prompt token has none
//   for (...) lp.Add(id, logprob);
//   choice["logprobs"] = lp.Take();                  // the tokens added since the last Take
//
// Formats:
//   chat (OpenAI's chat completion object, choices[].logprobs; streamed per chunk the same way):
//     {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
//      "refusal": null}; top_logprobs holds the request's top_logprobs most likely tokens.
//   completions (OpenAI's legacy completion object; vLLM's CompletionLogProbs):
//     {"tokens": [str], "token_logprobs": [float or null], "top_logprobs": [{str: float} or null],
//      "text_offset": [int]}; each top_logprobs object holds the token itself and the request's
//     logprobs most likely tokens (up to logprobs + 1 entries; two tokens with the same text are
//     one entry), as vLLM; text_offset counts Unicode characters of the token texts before each
//     token, over every token this builder returned (echoed prompt included).
// Token text: the token decoded alone, special tokens kept; a token that ends inside a UTF-8
// character decodes to U+FFFD there, and `bytes` are the UTF-8 bytes of that text (vLLM's).
// Logprobs below -9999 are given as -9999.0, as vLLM does (JSON has no -inf).
//
// Thread rules: one builder per choice, one thread at a time. Errors: TokenizerError for an id the
// tokenizer does not know.
#pragma once

#include <cstdint>
#include <string>

#include "engine/engine_types.h"
#include "server/openai/errors.h"
#include "text/tokenizer.h"

namespace vlmgraph::server::openai {

// The lowest logprob written (vLLM's floor).
inline constexpr float kLowestLogprob = -9999.0f;

class ChatLogprobs {
 public:
  explicit ChatLogprobs(const Tokenizer* tokenizer) : tokenizer_(tokenizer) {}
  void Add(int64_t id, const TokenLogprob& logprob);
  // {"content": [the entries added since the last Take], "refusal": null}.
  json Take();

 private:
  const Tokenizer* tokenizer_;
  json content_ = json::array();
};

class CompletionLogprobs {
 public:
  // `top`: the most likely tokens kept per position beside the token itself.
  CompletionLogprobs(const Tokenizer* tokenizer, int64_t top) : tokenizer_(tokenizer), top_(top) {}
  // A position without a logprob: the first prompt token (logprob and top_logprobs null).
  void AddUnscored(int64_t id);
  void Add(int64_t id, const TokenLogprob& logprob);
  // The positions added since the last Take; text_offset counts on from those before.
  json Take();

 private:
  std::string Token(int64_t id);  // its text, and the offset moves past it

  const Tokenizer* tokenizer_;
  int64_t top_;
  int64_t offset_ = 0;  // Unicode characters of every token text so far
  json tokens_ = json::array(), token_logprobs_ = json::array(), top_logprobs_ = json::array(),
       text_offset_ = json::array();
};

}  // namespace vlmgraph::server::openai
