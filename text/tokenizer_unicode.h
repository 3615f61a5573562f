// text/tokenizer_unicode.h: the UTF-8 and Unicode pieces of the tokenizer (text/tokenizer.h):
// GPT-2's byte-to-unicode table, UTF-8 validation and lossy decoding, the character classes that
// tokenizers' Rust code tests (White_Space, \w, numeric) and ICU normalizers.
//
//   std::string text;
//   size_t used = tokenizer_detail::AppendUtf8Lossy(bytes, /*final=*/false, &text);
//   // text: every complete character of bytes[0, used); bytes[used, end) may still complete
//
// Sources: bytes_to_unicode of openai/gpt-2 src/encoder.py (also tokenizers'
// pre_tokenizers/byte_level.rs); the U+FFFD rule of Rust's String::from_utf8_lossy, which is the
// "maximal subpart" practice of Unicode 15 section 3.9 (table 3-7 gives the valid byte ranges);
// Rust regex's Unicode \w and \s (UTS #18 annex C) and char::is_numeric (general category N).
// Unicode properties and normalization come from ICU.
//
// Thread rules: free functions and immutable objects; all safe to call from many threads.
// Errors: Normalizer's constructor throws TokenizerError for an unknown form.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vlmgraph::tokenizer_detail {

// The character GPT-2's table maps each byte to, UTF-8 encoded ("Ġ" for 0x20).
const std::array<std::string, 256>& ByteLevelChars();
// The byte a character of the table stands for, or -1 when it is not in the table.
int ByteLevelByte(char32_t c);

// True when `s` is valid UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
bool IsValidUtf8(std::string_view s);
// Byte offset of the first invalid sequence in `s` (s.size() when valid).
size_t FirstInvalidUtf8(std::string_view s);
// The code point starting at s[i] of valid UTF-8 `s`; *len gets its byte length.
char32_t DecodeUtf8(std::string_view s, size_t i, size_t* len);
// The last code point of valid, non-empty UTF-8 `s`.
char32_t LastCodePoint(std::string_view s);
// Appends `c` as UTF-8.
void AppendUtf8(char32_t c, std::string* out);

// Appends `bytes` to `out` as UTF-8, each maximal invalid subpart replaced by one U+FFFD. With
// final = false, an incomplete sequence at the end is left out. Returns the bytes consumed.
size_t AppendUtf8Lossy(std::string_view bytes, bool final, std::string* out);

// Unicode White_Space (Rust's char::is_whitespace and regex \s).
bool IsWhiteSpace(char32_t c);
// Rust regex's Unicode \w: Alphabetic, Mark, Decimal_Number, Connector_Punctuation, Join_Control.
bool IsWordChar(char32_t c);
// Rust's char::is_numeric: general category Nd, Nl or No.
bool IsNumeric(char32_t c);

// A chain of Unicode normalization forms (tokenizers' NFC / NFD / NFKC / NFKD normalizers).
class Normalizer {
 public:
  Normalizer() = default;
  // `form`: "NFC", "NFD", "NFKC" or "NFKD"; throws TokenizerError otherwise.
  void Add(const std::string& form);
  bool empty() const { return forms_.empty(); }
  // Normalizes `in` into *out. Returns false (leaving *out untouched) when `in` is already
  // normalized, so the caller can keep using `in`.
  bool Normalize(std::string_view in, std::string* out) const;

 private:
  std::vector<const void*> forms_;  // const icu::Normalizer2*, owned by ICU
};

}  // namespace vlmgraph::tokenizer_detail
