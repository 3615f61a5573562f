// model/tokenizer.h: text <-> token ids with a Hugging Face `tokenizer.json` of the byte-level BPE
// family (GPT-2, SmolLM2, Llama-3, Qwen2 style), giving the ids of the Python `tokenizers` package.
//
//   vlmgraph::Tokenizer tok = vlmgraph::Tokenizer::FromFile("tokenizer.json");
//   std::vector<int64_t> ids = tok.Encode("<|im_start|>user\nhi<|im_end|>");
//   std::string text = tok.Decode(ids);                       // == the input
//   vlmgraph::DecodeStream stream(tok, /*skip_special_tokens=*/true);
//   for (int64_t id : generated) send(stream.Step(id));       // never a broken UTF-8 sequence
//   send(stream.Flush());
//
// Format: Hugging Face tokenizers' tokenizer.json (https://github.com/huggingface/tokenizers,
// tokenizers/src/tokenizer/serialization.rs). Supported components; anything else is refused with
// a TokenizerError that names it:
//   model           BPE: vocab, merges ("a b" strings or [a, b] pairs, rank = position),
//   ignore_merges,
//                   unk_token / fuse_unk; byte_fallback false, dropout null, no
//                   continuing_subword_prefix or end_of_word_suffix.
//   added_tokens    special or not, with single_word / lstrip / rstrip / normalized, matched before
//                   pre-tokenization, longest first (as tokenizers' AddedVocabulary).
//   normalizer      null, NFC, NFD, NFKC, NFKD, or a Sequence of these (ICU).
//   pre_tokenizer   ByteLevel (add_prefix_space, use_regex: GPT-2's regex), Digits, Split (String
//   or
//                   Regex pattern, every SplitDelimiterBehavior, invert), Sequence; exactly one
//                   ByteLevel, last. Regexes and Unicode classes come from ICU.
//   post_processor  null, ByteLevel, TemplateProcessing (the single-sequence template), Sequence.
//   decoder         ByteLevel.
// Algorithms: the byte-to-unicode table of GPT-2 (openai/gpt-2 src/encoder.py, bytes_to_unicode);
// BPE merges applied lowest rank first, leftmost first among equal ranks (tokenizers'
// models/bpe/word.rs); decoding replaces invalid UTF-8 with U+FFFD as Rust's
// String::from_utf8_lossy does (one U+FFFD per maximal invalid subpart, Unicode 15 section 3.9).
//
// Thread rules: a Tokenizer is immutable after loading; every const method may be called from many
// threads at once (its per-word BPE cache is sharded and locked). Copies share the loaded state and
// are cheap. A DecodeStream belongs to one thread (one request).
//
// Errors: TokenizerError for an unreadable or malformed file (token ids must lie in [0, 2^22)), an
// unsupported component, input that is not valid UTF-8, and ids outside the vocabulary.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace vlmgraph {

class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One entry of tokenizer.json's "added_tokens" (tokenizers' AddedToken).
struct AddedToken {
  int64_t id;
  std::string content;
  bool special;      // dropped by Decode(skip_special_tokens = true)
  bool single_word;  // matches only when not preceded or followed by a word character
  bool lstrip;       // the match takes the whitespace on its left
  bool rstrip;       // the match takes the whitespace on its right
  bool normalized;   // matched against the normalized text (else against the raw text)
};

namespace tokenizer_detail {
struct TokenizerState;
}  // namespace tokenizer_detail

class Tokenizer {
 public:
  // Loads tokenizer.json. Throws TokenizerError naming the file and what is unsupported or wrong.
  static Tokenizer FromFile(const std::string& tokenizer_json_path);
  // The same from the file's text (errors name "tokenizer.json").
  static Tokenizer FromJson(const std::string& json_text);

  // Token ids of `text` (valid UTF-8, else TokenizerError). add_special_tokens applies the
  // post-processor's template (e.g. a BOS token), as tokenizers' encode(add_special_tokens=True).
  std::vector<int64_t> Encode(std::string_view text, bool add_special_tokens = false) const;
  // Text of `ids`: added tokens decode to their content (special ones are dropped when
  // skip_special_tokens; a normalized one decodes to its normalized content, as tokenizers 0.23
  // does), the others through the ByteLevel decoder; invalid UTF-8 becomes U+FFFD.
  // Throws TokenizerError on an id that is neither in the vocabulary nor an added token.
  std::string Decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  // Largest id of the model vocabulary and the added tokens, plus one.
  int64_t vocab_size() const;
  // Id of a token as tokenizer.json spells it (added token content, or a model vocab entry in its
  // byte-level form, e.g. "Ġthe").
  std::optional<int64_t> TokenToId(std::string_view token) const;
  // The token string of `id` (added token content or model vocab entry), nullopt when unknown.
  std::optional<std::string> IdToToken(int64_t id) const;
  // True for an added token with special = true.
  bool IsSpecial(int64_t id) const;
  // Every added token, in tokenizer.json's order.
  const std::vector<AddedToken>& added_tokens() const;

 private:
  explicit Tokenizer(std::shared_ptr<const tokenizer_detail::TokenizerState> state);
  friend class DecodeStream;

  std::shared_ptr<const tokenizer_detail::TokenizerState> state_;
};

// Incremental detokenization for streaming (as tokenizers' DecodeStream and vLLM's incremental
// detokenizer). Step returns the text that became final with this id: the bytes of a character
// whose UTF-8 sequence is still incomplete are held back until it completes (or turns out invalid,
// then U+FFFD). Concatenating every Step() and Flush() equals
// Decode(all ids, skip_special_tokens). Keeps its own reference to the tokenizer's state. One
// thread at a time. Step throws TokenizerError on an unknown id (the stream is unchanged).
class DecodeStream {
 public:
  DecodeStream(const Tokenizer& tokenizer, bool skip_special_tokens);
  std::string Step(int64_t id);
  // What is still held back; an incomplete trailing sequence becomes one U+FFFD.
  std::string Flush();

 private:
  std::shared_ptr<const tokenizer_detail::TokenizerState> state_;
  bool skip_special_tokens_;
  std::string pending_;  // bytes of an incomplete UTF-8 sequence (at most 3)
};

}  // namespace vlmgraph
