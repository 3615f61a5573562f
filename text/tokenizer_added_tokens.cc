#include "text/tokenizer_added_tokens.h"

#include <algorithm>

#include "text/tokenizer_unicode.h"

namespace vlmgraph::tokenizer_detail {

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedPattern> patterns) {
  nodes_.emplace_back();
  for (AddedPattern& p : patterns) {
    if (p.text.empty()) continue;
    const auto index = static_cast<int32_t>(patterns_.size());
    int32_t node = 0;
    for (char c : p.text) {
      const auto byte = static_cast<uint8_t>(c);
      int32_t child = 0;
      if (node == 0) {
        child = root_[byte];
      } else {
        for (const auto& [b, n] : nodes_[node].children) {
          if (b == byte) child = n;
        }
      }
      if (child == 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
        if (node == 0) {
          root_[byte] = child;
        } else {
          nodes_[node].children.emplace_back(byte, child);
        }
      }
      node = child;
    }
    if (nodes_[node].pattern >= 0) continue;  // the same text twice: the first one wins
    nodes_[node].pattern = index;
    patterns_.push_back(std::move(p));
  }
}

int32_t AddedTokenMatcher::LongestAt(std::string_view text, size_t pos, size_t special_end,
                                     size_t* length) const {
  int32_t node = root_[static_cast<uint8_t>(text[pos])];
  int32_t best = -1;
  for (size_t i = pos + 1; node != 0; ++i) {
    const int32_t p = nodes_[node].pattern;
    if (p >= 0 && (!patterns_[p].special || i <= special_end)) best = p, *length = i - pos;
    if (i == text.size()) break;
    const auto byte = static_cast<uint8_t>(text[i]);
    int32_t next = 0;
    for (const auto& [b, n] : nodes_[node].children) {
      if (b == byte) next = n;
    }
    node = next;
  }
  return best;
}

namespace {

// Start of the whitespace run that ends `text` (tokenizers: the match of \s*$).
size_t TrailingWhiteSpaceStart(std::string_view text) {
  size_t i = text.size();
  while (i > 0) {
    size_t start = i - 1;
    while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
    size_t len;
    if (!IsWhiteSpace(DecodeUtf8(text, start, &len))) break;
    i = start;
  }
  return i;
}

// Length of the whitespace run that starts `text` (tokenizers: the match of ^\s*).
size_t LeadingWhiteSpaceLength(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    size_t len;
    if (!IsWhiteSpace(DecodeUtf8(text, i, &len))) break;
    i += len;
  }
  return i;
}

}  // namespace

void AddedTokenMatcher::Split(std::string_view text, std::vector<AddedSegment>* segments,
                              const std::vector<TextRange>& plain) const {
  segments->clear();
  size_t taken = 0;  // end of the last match (tokenizers' start_offset)
  const size_t n = text.size();
  size_t next_plain = 0;  // the first plain range that ends after pos
  if (!patterns_.empty()) {
    for (size_t pos = 0; pos < n;) {
      if (root_[static_cast<uint8_t>(text[pos])] == 0) {
        ++pos;
        continue;
      }
      size_t length = 0;
      int32_t index = LongestAt(text, pos, std::string_view::npos, &length);
      if (index >= 0 && patterns_[index].special) {
        while (next_plain < plain.size() && plain[next_plain].end <= pos) ++next_plain;
        const TextRange* r = next_plain < plain.size() ? &plain[next_plain] : nullptr;
        if (r != nullptr && r->begin <= pos) {
          // Inside plain text: the match is skipped as tokenizers' encode_special_tokens skips it;
          // special text after the plain range is searched again.
          pos = std::min(pos + length, r->end);
          continue;
        }
        if (r != nullptr && r->begin < pos + length) {
          // The match would run into plain text: the longest one that ends before it, if any.
          index = LongestAt(text, pos, r->begin, &length);
        }
      }
      if (index < 0) {
        ++pos;
        continue;
      }
      const AddedPattern& p = patterns_[index];
      size_t start = pos, stop = pos + length;
      pos = stop;  // the scan goes on after the match itself, whatever it becomes
      if (p.single_word) {
        const bool space_before = start == 0 || !IsWordChar(LastCodePoint(text.substr(0, start)));
        size_t len;
        const bool space_after = stop == n || !IsWordChar(DecodeUtf8(text, stop, &len));
        if (!space_before || !space_after) continue;
      }
      if (p.lstrip) start = std::max(TrailingWhiteSpaceStart(text.substr(0, start)), taken);
      if (p.rstrip) stop += LeadingWhiteSpaceLength(text.substr(stop));
      if (taken < start) segments->push_back({taken, start, -1});
      segments->push_back({start, stop, p.id});
      taken = stop;
    }
  }
  if (taken < n) segments->push_back({taken, n, -1});
}

}  // namespace vlmgraph::tokenizer_detail
