// text/tokenizer_added_tokens.h: finding a tokenizer.json's added tokens in text before it is
// pre-tokenized (text/tokenizer.h).
//
//   AddedTokenMatcher matcher({{"<|im_end|>", 2, false, false, false, /*special=*/true}});
//   std::vector<AddedSegment> segments;
//   matcher.Split("hi<|im_end|>", &segments);   // {0, 2, -1}, {2, 12, 2}
//   matcher.Split("hi<|im_end|>", &segments, {{2, 12}});   // {0, 12, -1}: plain text there
//
// Algorithm (tokenizers' tokenizer/added_vocabulary.rs, find_matches): non-overlapping matches,
// leftmost first and longest among those starting at one position (Aho-Corasick LeftmostLongest),
// scanning on from the end of each match. A single_word token is dropped when a word character
// (Rust regex \w) touches either end; lstrip / rstrip widen the match over the whitespace
// (White_Space) on that side, but never over text a previous match took. Plain ranges: a special
// pattern that matches inside one is skipped as tokenizers skips every special token with
// encode_special_tokens (the scan goes on after it, or at the end of the plain range when the
// match runs past it); a special match that starts before a plain range and would run into it
// gives way to the longest match at that position that ends before the range.
//
// Thread rules: immutable after construction; Split may run on many threads at once.
// Errors: none.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/tokenizer.h"

namespace vlmgraph::tokenizer_detail {

struct AddedPattern {
  std::string text;  // the content, normalized for normalized tokens
  int64_t id;
  bool single_word;
  bool lstrip;
  bool rstrip;
  bool special;  // not matched inside plain ranges
};

// Bytes [begin, end) of the text: an added token (id >= 0) or text between tokens (id = -1).
struct AddedSegment {
  size_t begin;
  size_t end;
  int64_t id;
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // Patterns in priority order (an earlier pattern wins over an equal later one); empty ones are
  // ignored.
  explicit AddedTokenMatcher(std::vector<AddedPattern> patterns);
  bool empty() const { return patterns_.empty(); }
  // Replaces *segments with the segments of `text`, in order, covering it. Empty text segments
  // are left out. `plain`: byte ranges of `text` (sorted, not overlapping) where special patterns
  // are not matched.
  void Split(std::string_view text, std::vector<AddedSegment>* segments,
             const std::vector<TextRange>& plain = {}) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;  // byte -> node
    int32_t pattern = -1;
  };
  // The longest pattern starting at text[pos] (a special one only when it ends at or before
  // `special_end`): its index and length, or -1.
  int32_t LongestAt(std::string_view text, size_t pos, size_t special_end, size_t* length) const;

  std::vector<AddedPattern> patterns_;
  std::vector<Node> nodes_;          // nodes_[0] is the root
  std::array<int32_t, 256> root_{};  // root children by first byte, 0 = none
};

}  // namespace vlmgraph::tokenizer_detail
