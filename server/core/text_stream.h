// server/core/text_stream.h: generated token ids -> text deltas for streaming, with stop strings.
//
//   TextStream text(&tokenizer, {"\n\n"});
//   for (each new token id t) {
//     TextStream::Delta d = text.Push(t);
//     Send(d.text);                      // never a broken UTF-8 sequence, never part of a stop
//     if (d.stopped) break;              // a stop string matched: end the generation
//   }
//   Send(text.Finish());                 // text held back at the end (no stop string came)
//
// Detokenization is incremental (DecodeStream, text/tokenizer.h) with special tokens skipped, as
// vLLM and OpenAI return text. Stop strings are matched on the text (OpenAI's `stop`, vLLM's
// semantics): the output ends right before the first occurrence of any of them, and the stop
// string itself is not returned. Text that could still become the start of a stop string is held
// back until the next token decides it.
//
// Errors: none beyond the tokenizer's (an id outside the vocabulary). Thread rules: one stream per
// request, used by one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace vlmgraph::server {

// Stop strings per gRPC request, and the longest one, in bytes, on both APIs (OpenAI allows 4
// strings; vLLM any number): each is matched against the held-back text at every token.
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxStopStringBytes = 256;

class TextStream {
 public:
  struct Delta {
    std::string text;      // new text, safe to send
    bool stopped = false;  // a stop string matched; later tokens must not be pushed
  };

  // `tokenizer` must outlive the stream. Empty stop strings are ignored.
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stop_strings);

  Delta Push(int64_t token_id);
  // The text still held back (a possible start of a stop string, an unfinished character).
  std::string Finish();

  // Every piece of text returned so far.
  const std::string& text() const { return emitted_; }

 private:
  std::string Emit(size_t n);

  DecodeStream decode_;
  std::vector<std::string> stop_strings_;
  std::string pending_;  // decoded, not yet returned
  std::string emitted_;
  bool stopped_ = false;
};

}  // namespace vlmgraph::server
