// text/tokenizer_state.h: what a loaded tokenizer.json holds (TokenizerState, shared by the
// tokenizer's loader and its encoder and decoder; immutable once built), and the loader. Internal
// to text/: include text/tokenizer.h instead.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "text/tokenizer.h"
#include "text/tokenizer_added_tokens.h"
#include "text/tokenizer_bpe.h"
#include "text/tokenizer_pre_tokenizer.h"
#include "text/tokenizer_unicode.h"

namespace vlmgraph {
namespace tokenizer_detail {

// Everything a loaded tokenizer.json holds; immutable once built (the BPE cache locks itself).
struct TokenizerState {
  std::unique_ptr<BpeModel> bpe;
  std::unordered_map<std::string, int64_t> vocab;  // model vocab, as tokenizer.json spells it
  std::vector<AddedToken> added_tokens;
  std::unordered_map<std::string, int64_t> added_ids;  // content -> id
  AddedTokenMatcher raw_matcher;         // tokens with normalized = false, on the input
  AddedTokenMatcher normalized_matcher;  // the others, on the normalized text
  Normalizer normalizer;
  std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers;  // ByteLevel last
  std::vector<int64_t> prefix_ids, suffix_ids;  // the post-processor's template around $A
  int64_t vocab_size = 0;
  bool normalized_special = false;  // normalized_matcher has special tokens
  // Note [Tokens from bytes]: the most input bytes one token stands for; 0 = no bound, and why.
  int64_t max_bytes_per_token = 0;
  std::string no_token_bound_reason;
  std::array<bool, 256> byte_makes_tokens{};  // a token, or an unknown token of its own
  bool every_byte_makes_tokens = true;

  // By id: the token string, the bytes the ByteLevel decoder turns it into, and flags.
  enum Flags : uint8_t { kKnown = 1, kSkippable = 2, kAddedSpecial = 4 };
  std::vector<std::string> tokens;
  std::vector<std::string> decoded;
  std::vector<uint8_t> flags;

  bool Known(int64_t id) const {
    return id >= 0 && id < vocab_size && (flags[static_cast<size_t>(id)] & kKnown);
  }
  void CheckId(int64_t id) const {
    if (!Known(id)) {
      throw TokenizerError("token id " + std::to_string(id) + " is not in the vocabulary (size " +
                           std::to_string(vocab_size) + ")");
    }
  }
};

// Parses a Hugging Face tokenizer.json (its text) into the state Tokenizer runs on
// (text/tokenizer_loader.cc). Throws TokenizerError naming `source` (the file) and the JSON path
// for malformed or unsupported content.
std::shared_ptr<TokenizerState> LoadTokenizerJson(const std::string& source,
                                                  const std::string& json_text);

}  // namespace tokenizer_detail
}  // namespace vlmgraph
