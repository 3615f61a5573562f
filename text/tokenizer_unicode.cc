#include "text/tokenizer_unicode.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/utypes.h>

#include <cstring>

#include "text/tokenizer_error.h"

namespace vlmgraph::tokenizer_detail {
namespace {

struct ByteLevelTable {
  std::array<std::string, 256> chars;
  std::array<char32_t, 256> code_points;
};

// bytes_to_unicode (openai/gpt-2 src/encoder.py): printable Latin-1 bytes map to themselves, the
// others (controls, space, 0x7F-0xA0, 0xAD) to U+0100 and up, in byte order.
const ByteLevelTable& Table() {
  static const ByteLevelTable table = [] {
    ByteLevelTable t;
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      t.code_points[b] = printable(b) ? static_cast<char32_t>(b) : 256 + next++;
      AppendUtf8(t.code_points[b], &t.chars[b]);
    }
    return t;
  }();
  return table;
}

// Length of the valid UTF-8 sequence starting at s[i], 0 when invalid; *truncated is set when the
// bytes present are a valid prefix cut off by the end of `s`. *bad_len gets the length of the
// maximal invalid subpart when invalid (at least 1).
size_t SequenceLength(std::string_view s, size_t i, bool* truncated, size_t* bad_len) {
  const auto c = static_cast<uint8_t>(s[i]);
  *truncated = false;
  *bad_len = 1;
  if (c < 0x80) return 1;
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // range of the second byte (Unicode table 3-7)
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c == 0xE0) {
    need = 2, lo = 0xA0;
  } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
    need = 2;
  } else if (c == 0xED) {
    need = 2, hi = 0x9F;
  } else if (c == 0xF0) {
    need = 3, lo = 0x90;
  } else if (c >= 0xF1 && c <= 0xF3) {
    need = 3;
  } else if (c == 0xF4) {
    need = 3, hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) {
      *truncated = true;
      *bad_len = k;
      return 0;
    }
    const auto b = static_cast<uint8_t>(s[i + k]);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) {
      *bad_len = k;
      return 0;
    }
  }
  return need + 1;
}

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

const std::array<std::string, 256>& ByteLevelChars() { return Table().chars; }

int ByteLevelByte(char32_t c) {
  if (c < 256) {
    const auto& cps = Table().code_points;
    return cps[c] == c ? static_cast<int>(c) : -1;
  }
  if (c < 256 + 68) {  // 68 bytes are remapped
    const auto& cps = Table().code_points;
    for (int b = 0; b < 256; ++b) {
      if (cps[b] == c) return b;
    }
  }
  return -1;
}

size_t FirstInvalidUtf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    // Eight ASCII bytes at a time.
    while (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, s.data() + i, 8);
      if (word & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    bool truncated;
    size_t bad_len;
    const size_t len = SequenceLength(s, i, &truncated, &bad_len);
    if (len == 0) return i;
    i += len;
  }
  return n;
}

bool IsValidUtf8(std::string_view s) { return FirstInvalidUtf8(s) == s.size(); }

char32_t DecodeUtf8(std::string_view s, size_t i, size_t* len) {
  const auto c = static_cast<uint8_t>(s[i]);
  auto cont = [&](size_t k) {
    return static_cast<char32_t>(static_cast<uint8_t>(s[i + k]) & 0x3F);
  };
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  if (c < 0xE0) {
    *len = 2;
    return (static_cast<char32_t>(c & 0x1F) << 6) | cont(1);
  }
  if (c < 0xF0) {
    *len = 3;
    return (static_cast<char32_t>(c & 0x0F) << 12) | (cont(1) << 6) | cont(2);
  }
  *len = 4;
  return (static_cast<char32_t>(c & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

char32_t LastCodePoint(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  size_t len;
  return DecodeUtf8(s, i, &len);
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

size_t AppendUtf8Lossy(std::string_view bytes, bool final, std::string* out) {
  size_t i = 0;
  size_t run_begin = 0;  // start of the valid bytes not yet copied
  const size_t n = bytes.size();
  out->reserve(out->size() + n);
  while (i < n) {
    if (static_cast<uint8_t>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    bool truncated;
    size_t bad_len;
    const size_t len = SequenceLength(bytes, i, &truncated, &bad_len);
    if (len > 0) {
      i += len;
      continue;
    }
    out->append(bytes.data() + run_begin, i - run_begin);
    if (truncated && !final) return i;
    out->append(kReplacement);
    i += bad_len;
    run_begin = i;
  }
  out->append(bytes.data() + run_begin, n - run_begin);
  return n;
}

bool IsWhiteSpace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return u_isUWhiteSpace(static_cast<UChar32>(c));
}

bool IsWordChar(char32_t c) {
  const auto cp = static_cast<UChar32>(c);
  if (c < 0x80) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  }
  return u_hasBinaryProperty(cp, UCHAR_ALPHABETIC) ||
         (U_GET_GC_MASK(cp) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0 ||
         u_hasBinaryProperty(cp, UCHAR_JOIN_CONTROL);
}

bool IsNumeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_N_MASK) != 0;
}

void Normalizer::Add(const std::string& form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  if (form == "NFC") {
    n = icu::Normalizer2::getNFCInstance(status);
  } else if (form == "NFD") {
    n = icu::Normalizer2::getNFDInstance(status);
  } else if (form == "NFKC") {
    n = icu::Normalizer2::getNFKCInstance(status);
  } else if (form == "NFKD") {
    n = icu::Normalizer2::getNFKDInstance(status);
  } else {
    throw TokenizerError("normalizer \"" + form + "\" is not supported");
  }
  if (U_FAILURE(status) || n == nullptr) {
    throw TokenizerError("ICU has no " + form + " normalizer: " + u_errorName(status));
  }
  forms_.push_back(n);
}

bool Normalizer::Normalize(std::string_view in, std::string* out) const {
  bool changed = false;
  std::string current, next;
  for (const void* form : forms_) {
    const auto* n = static_cast<const icu::Normalizer2*>(form);
    const std::string_view src = changed ? std::string_view(current) : in;
    UErrorCode status = U_ZERO_ERROR;
    const icu::StringPiece piece(src.data(), static_cast<int32_t>(src.size()));
    if (n->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) continue;
    status = U_ZERO_ERROR;
    next.clear();
    icu::StringByteSink<std::string> sink(&next);
    n->normalizeUTF8(0, piece, sink, nullptr, status);
    if (U_FAILURE(status)) {
      throw TokenizerError(std::string("ICU normalization failed: ") + u_errorName(status));
    }
    current.swap(next);
    changed = true;
  }
  if (changed) out->swap(current);
  return changed;
}

}  // namespace vlmgraph::tokenizer_detail
