// text/tokenizer_error.h: the error every part of the tokenizer throws (text/tokenizer.h and its
// components: tokenizer_bpe.h, tokenizer_pre_tokenizer.h, tokenizer_unicode.h,
// tokenizer_added_tokens.h), in a header of its own so the components need not include the
// tokenizer they make up.
#pragma once

#include <stdexcept>

namespace vlmgraph {

// A tokenizer.json the tokenizer cannot load (the message names the field), or text it cannot
// handle (invalid UTF-8 where the caller asked for strict input).
class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace vlmgraph
