// server/openai/choices.h: the choices of one chat or text completion request (n per prompt, and
// one prompt or a batch of them) as they generate, turned into the response: Server-Sent Events
// of chunks when streaming, else one body at the end. No sockets: openai_http.cc drives it with
// each choice's GenerationSession deltas (server/core/generation.h).
//
//   ResponseChoices out(/*chat=*/false, meta, &prompts, &tokenizer);  // prompts: one per prompt
//   write(out.StreamStart());
//   write(out.OnDelta(i, delta));          // choice i = prompt * n + k, as OpenAI and vLLM number
//   write(out.OnFinish(i, outcome));
//   write(out.StreamEnd());  or  respond(Dump(out.TakeBody()));
//
// Formats: server/openai/responses.h (objects) and logprobs_json.h (logprobs). What each choice
// returns follows its PreparedGeneration: its text; with logprobs each token's logprobs; with
// echo (completions) the prompt's text, and its tokens' logprobs when logprobs are asked, before
// the completion's, streamed as a chunk of its own before the choice's first token; with echo_only
// (max_tokens 0) the prompt alone, finish_reason "length", no completion tokens. A streamed delta
// with tokens but no text yet (held back by the detokenizer or a stop string) is still sent when
// logprobs are asked, so that each token's logprobs arrive with it.
// Usage: prompt_tokens counts each prompt once, completion_tokens every choice's tokens.
//
// Thread rules: one thread at a time (the request's strand). Errors: TokenizerError from token
// texts (ids come from the engine, so not expected).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "server/core/generation.h"
#include "server/openai/logprobs_json.h"
#include "server/openai/requests.h"
#include "server/openai/responses.h"

namespace vlmgraph::server::openai {

class ResponseChoices {
 public:
  // `prompts` (n choices each) and `tokenizer` must outlive this.
  ResponseChoices(bool chat, ResponseMeta meta, const std::vector<PreparedGeneration>* prompts,
                  const Tokenizer* tokenizer);

  size_t size() const { return choices_.size(); }
  // Which prompt choice `i` answers.
  size_t prompt_of(size_t i) const { return choices_[i].prompt; }
  bool stream() const;

  // Streaming: the first events (chat: each choice's role chunk). "" otherwise.
  std::string StreamStart();
  // What choice `i` made since its last delta. Streaming: the events to write; otherwise it is
  // kept for TakeBody and "" is returned.
  std::string OnDelta(size_t i, const GenerationDelta& delta);
  // Choice `i` ended with `outcome`. Streaming: its finish chunk; else "".
  std::string OnFinish(size_t i, const GenerationOutcome& outcome);
  bool all_finished() const;
  // Streaming, after every choice finished: the usage chunk (stream_options.include_usage) and
  // `data: [DONE]`.
  std::string StreamEnd() const;
  // Not streaming, after every choice finished: the response body.
  json TakeBody();

 private:
  struct Choice {
    size_t prompt = 0;
    bool started = false;  // its first delta came (the echo is out)
    bool finished = false;
    std::string text;  // not streaming: the choice's text so far
    std::string finish_reason;
    int64_t completion_tokens = 0;
    ChatLogprobs chat_logprobs;
    CompletionLogprobs completion_logprobs;
  };
  Usage TotalUsage() const;
  json LogprobsJson(Choice& c);
  // The chunk of choice `i` with `text` and the logprobs added since the last chunk.
  std::string Chunk(size_t i, const std::string& text);

  const bool chat_;
  const ResponseMeta meta_;
  const std::vector<PreparedGeneration>* const prompts_;
  std::vector<Choice> choices_;
};

}  // namespace vlmgraph::server::openai
