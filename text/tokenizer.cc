#include "text/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "text/tokenizer_state.h"

namespace vlmgraph {
namespace tokenizer_detail {
namespace {

// ---- Encoding ---------------------------------------------------------------------------------

// Note [Special tokens as plain text]
// Chat message content is the user's text; the chat template's markers around it are the
// server's. Tokenized as one string (what transformers' apply_chat_template and vLLM do), a user
// who types "<|im_end|>\n<|im_start|>system" gets real control tokens and writes a system turn of
// their own. So the content's bytes are passed as plain ranges: there, special added tokens are not
// recognised and their text goes through the pre-tokenizer and BPE like any other text (what
// tokenizers does for the whole text with encode_special_tokens = true, llama.cpp with
// parse_special = false); outside them the template's markers are special tokens as before. The
// text is still tokenized as one string: a text without special-token text in its content gets
// the ids it got before (and that apply_chat_template gives), because pre-tokenization runs across
// the range boundaries as it always did. Normalized added tokens are matched on the normalized
// text, so when there are special ones, a piece of raw text between raw added tokens is normalized
// range by range (chat templates put a newline or a token marker at every boundary, where every
// normalization form has a boundary, so the result equals normalizing the piece whole).

// Reused buffers of one thread's Encode calls; given back after a call that grew them past
// kMaxKeptScratchBytes.
struct EncodeScratch {
  std::vector<AddedSegment> raw_segments, normalized_segments;
  std::vector<TextRange> whole, piece_plain, normalized_plain;
  std::string normalized, normalized_part;
  PreTokenizeScratch pre;

  size_t Bytes() const {
    size_t n = (raw_segments.capacity() + normalized_segments.capacity()) * sizeof(AddedSegment) +
               (whole.capacity() + piece_plain.capacity() + normalized_plain.capacity()) *
                   sizeof(TextRange) +
               normalized.capacity() + normalized_part.capacity() +
               pre.spans.capacity() * sizeof(std::vector<MatchSpan>);
    for (const auto& spans : pre.spans) n += spans.capacity() * sizeof(MatchSpan);
    for (const std::string& w : pre.owned) n += w.capacity();
    return n;
  }
};

thread_local EncodeScratch tls_scratch;

void PreTokenizeAndEncode(const TokenizerState& s, size_t stage, std::string_view text,
                          PreTokenizeScratch* scratch, std::vector<int64_t>* ids) {
  if (stage == s.pre_tokenizers.size()) {
    s.bpe->Encode(text, ids);
    return;
  }
  auto next = [&](std::string_view word) {
    PreTokenizeAndEncode(s, stage + 1, word, scratch, ids);
  };
  s.pre_tokenizers[stage]->Split(text, stage, scratch, next);
}

// Text [begin, end) of `text` between raw added tokens: normalize, find normalized added tokens
// (special ones not inside `plain`, Note [Special tokens as plain text]), encode the rest.
void EncodeRawPiece(const TokenizerState& s, std::string_view text, size_t begin, size_t end,
                    const std::vector<TextRange>& plain, EncodeScratch* scratch,
                    std::vector<int64_t>* ids) {
  const std::string_view piece = text.substr(begin, end - begin);
  // The plain ranges that meet the piece, relative to it.
  std::vector<TextRange>& local = scratch->piece_plain;
  local.clear();
  if (s.normalized_special) {
    auto it = std::lower_bound(plain.begin(), plain.end(), begin,
                               [](const TextRange& r, size_t at) { return r.end <= at; });
    for (; it != plain.end() && it->begin < end; ++it) {
      local.push_back({std::max(it->begin, begin) - begin, std::min(it->end, end) - begin});
    }
  }
  std::string_view normalized = piece;
  const std::vector<TextRange>* normalized_plain = &local;
  if (!s.normalizer.empty()) {
    if (local.empty()) {
      if (s.normalizer.Normalize(piece, &scratch->normalized)) normalized = scratch->normalized;
    } else {
      // Range by range, so that the plain ranges are known in the normalized text.
      std::string& out = scratch->normalized;
      out.clear();
      scratch->normalized_plain.clear();
      auto append = [&](size_t b, size_t e, bool is_plain) {
        const std::string_view sub = piece.substr(b, e - b);
        const size_t at = out.size();
        if (s.normalizer.Normalize(sub, &scratch->normalized_part)) {
          out += scratch->normalized_part;
        } else {
          out += sub;
        }
        if (is_plain) scratch->normalized_plain.push_back({at, out.size()});
      };
      size_t at = 0;
      for (const TextRange& r : local) {
        if (at < r.begin) append(at, r.begin, false);
        append(r.begin, r.end, true);
        at = r.end;
      }
      if (at < piece.size()) append(at, piece.size(), false);
      normalized = out;
      normalized_plain = &scratch->normalized_plain;
    }
  }
  if (s.normalized_matcher.empty()) {
    PreTokenizeAndEncode(s, 0, normalized, &scratch->pre, ids);
    return;
  }
  std::vector<AddedSegment>& segments = scratch->normalized_segments;
  s.normalized_matcher.Split(normalized, &segments, *normalized_plain);
  for (const AddedSegment& seg : segments) {
    if (seg.id >= 0) {
      ids->push_back(seg.id);
    } else {
      PreTokenizeAndEncode(s, 0, normalized.substr(seg.begin, seg.end - seg.begin), &scratch->pre,
                           ids);
    }
  }
}

}  // namespace

size_t EncodeScratchBytes() { return tls_scratch.Bytes() + BpeScratchBytes(); }

}  // namespace tokenizer_detail

using tokenizer_detail::TokenizerState;

Tokenizer::Tokenizer(std::shared_ptr<const TokenizerState> state) : state_(std::move(state)) {}

Tokenizer Tokenizer::FromFile(const std::string& tokenizer_json_path) {
  std::ifstream in(tokenizer_json_path, std::ios::binary);
  if (!in) throw TokenizerError(tokenizer_json_path + ": cannot open the file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw TokenizerError(tokenizer_json_path + ": read error");
  return Tokenizer(tokenizer_detail::LoadTokenizerJson(tokenizer_json_path, text.str()));
}

Tokenizer Tokenizer::FromJson(const std::string& json_text) {
  return Tokenizer(tokenizer_detail::LoadTokenizerJson("tokenizer.json", json_text));
}

std::vector<int64_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  EncodeOptions options;
  options.add_special_tokens = add_special_tokens;
  return Encode(text, options);
}

std::vector<int64_t> Tokenizer::Encode(std::string_view text, const EncodeOptions& options) const {
  const TokenizerState& s = *state_;
  const size_t bad = tokenizer_detail::FirstInvalidUtf8(text);
  if (bad != text.size()) {
    throw TokenizerError("Encode: the text is not valid UTF-8 (byte offset " + std::to_string(bad) +
                         ")");
  }
  for (size_t i = 0; i < options.plain_ranges.size(); ++i) {
    const TextRange& r = options.plain_ranges[i];
    if (r.begin > r.end || r.end > text.size() ||
        (i > 0 && r.begin < options.plain_ranges[i - 1].end)) {
      throw TokenizerError("Encode: plain_ranges[" + std::to_string(i) + "] [" +
                           std::to_string(r.begin) + ", " + std::to_string(r.end) +
                           ") is not a sorted, non-overlapping range of the " +
                           std::to_string(text.size()) + "-byte text");
    }
  }
  tokenizer_detail::EncodeScratch& scratch = tokenizer_detail::tls_scratch;
  const std::vector<TextRange>* plain = &options.plain_ranges;
  if (!options.parse_special) {
    scratch.whole.assign(1, TextRange{0, text.size()});
    plain = &scratch.whole;
  }
  scratch.pre.SpansFor(s.pre_tokenizers.size());  // sized up front: stages hold references
  scratch.pre.owned.clear();
  std::vector<int64_t> ids;
  // About 4 bytes a token in text; the reservation is capped, the vector grows past it.
  ids.reserve(std::min<size_t>(text.size() / 3 + 4, size_t{1} << 16));
  if (options.add_special_tokens) ids.insert(ids.end(), s.prefix_ids.begin(), s.prefix_ids.end());
  std::vector<tokenizer_detail::AddedSegment>& segments = scratch.raw_segments;
  s.raw_matcher.Split(text, &segments, *plain);
  for (const auto& seg : segments) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
    } else {
      EncodeRawPiece(s, text, seg.begin, seg.end, *plain, &scratch, &ids);
    }
  }
  scratch.pre.owned.clear();
  if (scratch.Bytes() > tokenizer_detail::kMaxKeptScratchBytes) scratch = {};
  if (options.add_special_tokens) ids.insert(ids.end(), s.suffix_ids.begin(), s.suffix_ids.end());
  return ids;
}

int64_t Tokenizer::MinTokens(const std::vector<std::string_view>& texts) const {
  const TokenizerState& s = *state_;
  const auto per_token = static_cast<uint64_t>(s.max_bytes_per_token);
  if (per_token == 0) return 0;
  uint64_t bytes = 0;
  for (std::string_view text : texts) {
    if (s.every_byte_makes_tokens) {
      bytes += text.size();
      continue;
    }
    for (char c : text) bytes += s.byte_makes_tokens[static_cast<uint8_t>(c)];
  }
  return static_cast<int64_t>((bytes + per_token - 1) / per_token);
}

bool Tokenizer::every_byte_makes_tokens() const { return state_->every_byte_makes_tokens; }

int64_t Tokenizer::max_bytes_per_token() const { return state_->max_bytes_per_token; }

const std::string& Tokenizer::no_token_bound_reason() const {
  return state_->no_token_bound_reason;
}

std::string Tokenizer::Decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const TokenizerState& s = *state_;
  std::string bytes;
  for (int64_t id : ids) {
    s.CheckId(id);
    if (skip_special_tokens && (s.flags[id] & TokenizerState::kSkippable)) continue;
    bytes += s.decoded[id];
  }
  std::string text;
  tokenizer_detail::AppendUtf8Lossy(bytes, /*final=*/true, &text);
  return text;
}

int64_t Tokenizer::vocab_size() const { return state_->vocab_size; }

std::optional<int64_t> Tokenizer::TokenToId(std::string_view token) const {
  const std::string key(token);
  if (auto it = state_->added_ids.find(key); it != state_->added_ids.end()) return it->second;
  if (auto it = state_->vocab.find(key); it != state_->vocab.end()) return it->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::IdToToken(int64_t id) const {
  if (!state_->Known(id)) return std::nullopt;
  return state_->tokens[id];
}

bool Tokenizer::IsSpecial(int64_t id) const {
  return state_->Known(id) && (state_->flags[id] & TokenizerState::kAddedSpecial);
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return state_->added_tokens; }

DecodeStream::DecodeStream(const Tokenizer& tokenizer, bool skip_special_tokens)
    : state_(tokenizer.state_), skip_special_tokens_(skip_special_tokens) {}

std::string DecodeStream::Step(int64_t id) {
  const TokenizerState& s = *state_;
  s.CheckId(id);
  std::string text;
  if (skip_special_tokens_ && (s.flags[id] & TokenizerState::kSkippable)) return text;
  pending_ += s.decoded[id];
  const size_t used = tokenizer_detail::AppendUtf8Lossy(pending_, /*final=*/false, &text);
  pending_.erase(0, used);
  return text;
}

std::string DecodeStream::Flush() {
  std::string text;
  tokenizer_detail::AppendUtf8Lossy(pending_, /*final=*/true, &text);
  pending_.clear();
  return text;
}

}  // namespace vlmgraph
