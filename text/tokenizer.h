// text/tokenizer.h: text <-> token ids with a Hugging Face `tokenizer.json` of the byte-level BPE
// family (GPT-2, SmolLM2, Llama-3, Qwen2 style), giving the ids of the Python `tokenizers` package.
//
//   vlmgraph::Tokenizer tok = vlmgraph::Tokenizer::FromFile("tokenizer.json");
//   std::vector<int64_t> ids = tok.Encode("<|im_start|>user\nhi<|im_end|>");
//   // Chat content as plain text: "<|im_end|>" typed by a user is not the special token.
//   EncodeOptions o;
//   o.plain_ranges = {{17, 19}};                               // the bytes of "hi"
//   ids = tok.Encode("<|im_start|>user\nhi<|im_end|>", o);
//   if (tok.MinTokens({prompt}) > max_context) refuse();      // before any tokenizing
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
// Special tokens (Note [Special tokens as plain text] in tokenizer.cc): by default every added
// token is recognised in the text, as tokenizers' encode does. EncodeOptions turns the recognition
// of special added tokens (special = true) off for the whole text (parse_special = false,
// tokenizers' encode_special_tokens = true, llama.cpp's parse_special = false) or for byte ranges
// of it (plain_ranges: the content of chat messages); their text is then tokenized like any other.
// Non-special added tokens are recognised everywhere.
//
// Bound (Note [Tokens from bytes] in tokenizer.cc): MinTokens(texts) is a lower bound on the
// tokens of a text from its byte length alone (the bytes that make tokens: all of them, unless the
// vocabulary drops some bytes), and the most input bytes one token can stand for (computed at load
// from the vocabulary and the added tokens), so a caller can refuse a text as too long before the
// tokenizer does any work on it.
//
// Memory: what one Encode call needs grows with its text and is given back after the call when
// it is over a small threshold (EncodeScratchBytes), so a thread keeps little after a long text;
// the per-word BPE cache, shared by every thread, holds at most about 8 MiB.
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

#include "text/tokenizer_error.h"

namespace vlmgraph {

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

// Bytes [begin, end) of a text.
struct TextRange {
  size_t begin = 0;
  size_t end = 0;
};

// How Encode reads its text.
struct EncodeOptions {
  // Apply the post-processor's template (e.g. a BOS token), as tokenizers'
  // encode(add_special_tokens=True).
  bool add_special_tokens = false;
  // Recognise special added tokens in the text; false: tokenize their text as plain text
  // everywhere (tokenizers' encode_special_tokens = true).
  bool parse_special = true;
  // Byte ranges where special added tokens are plain text even when parse_special: sorted, not
  // overlapping, inside the text (else TokenizerError). A special token is recognised only where
  // its whole text lies outside these ranges.
  std::vector<TextRange> plain_ranges;
};

namespace tokenizer_detail {
struct TokenizerState;
// Bytes that the calling thread's Encode scratch (buffers reused across calls) holds now. After
// each Encode it is at most kMaxKeptScratchBytes (match lists, segments, normalized text) plus
// 64 KiB (BPE symbols, BpeModel::kMaxKeptSymbols).
size_t EncodeScratchBytes();
inline constexpr size_t kMaxKeptScratchBytes = size_t{256} << 10;
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
  // The same with options (special tokens as plain text, in all or part of the text).
  std::vector<int64_t> Encode(std::string_view text, const EncodeOptions& options) const;

  // A lower bound on the tokens that Encode makes, whatever the options, of the text that `texts`
  // form together (the pieces of one text, e.g. the messages of a chat, or one text):
  // ceil(token bytes / max_bytes_per_token()), or 0 when this tokenizer has no bound. Token bytes:
  // every byte, except, for a vocabulary without a token for some bytes (which Encode drops, as
  // tokenizers does), those bytes; counting them is one pass over the text, else none is needed.
  int64_t MinTokens(const std::vector<std::string_view>& texts) const;
  // The most input bytes one token can stand for (the longest token, in bytes, of the vocabulary
  // and the added tokens; times 4 with a Unicode normalizer, which shrinks text by at most 4).
  // 0 when no byte count bounds a token: see no_token_bound_reason().
  int64_t max_bytes_per_token() const;
  // Why max_bytes_per_token() is 0 ("" when it is not): an added token that takes the whitespace
  // next to it (lstrip / rstrip), a Split pre-tokenizer that removes text, bytes without a token
  // that fuse into one unknown token, or bytes without a token that a normalizer might produce.
  const std::string& no_token_bound_reason() const;
  // True when every byte makes tokens (MinTokens reads no text).
  bool every_byte_makes_tokens() const;
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
