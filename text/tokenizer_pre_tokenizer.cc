#include "text/tokenizer_pre_tokenizer.h"

#include <unicode/regex.h>
#include <unicode/unistr.h>
#include <unicode/utext.h>

#include <algorithm>
#include <utility>

#include "text/tokenizer_error.h"
#include "text/tokenizer_unicode.h"

namespace vlmgraph::tokenizer_detail {

const char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::vector<MatchSpan>& PreTokenizeScratch::SpansFor(size_t stage) {
  if (spans.size() <= stage) spans.resize(stage + 1);
  return spans[stage];
}

// ---- Regex ------------------------------------------------------------------------------------

struct Regex::Impl {
  std::unique_ptr<icu::RegexPattern> pattern;
  std::mutex mu;
  std::vector<std::unique_ptr<icu::RegexMatcher>> free;  // guarded by mu

  std::unique_ptr<icu::RegexMatcher> Take() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!free.empty()) {
        auto m = std::move(free.back());
        free.pop_back();
        return m;
      }
    }
    UErrorCode status = U_ZERO_ERROR;
    std::unique_ptr<icu::RegexMatcher> m(pattern->matcher(status));
    if (U_FAILURE(status)) {
      throw TokenizerError(std::string("ICU regex matcher: ") + u_errorName(status));
    }
    return m;
  }
  // Back into the pool, unless the pool is full or `m` searched a long text (then it is freed
  // with whatever its search made it allocate).
  void Give(std::unique_ptr<icu::RegexMatcher> m, size_t text_bytes) {
    if (text_bytes > kMaxPooledMatcherTextBytes) return;
    UErrorCode status = U_ZERO_ERROR;
    UText empty = UTEXT_INITIALIZER;
    utext_openUTF8(&empty, "", 0, &status);
    m->reset(&empty);  // no reference to the caller's text stays behind
    utext_close(&empty);
    std::lock_guard<std::mutex> lock(mu);
    if (free.size() < kMaxPooledMatchers) free.push_back(std::move(m));
  }
};

Regex::Regex(const std::string& pattern) : impl_(std::make_unique<Impl>()) {
  UErrorCode status = U_ZERO_ERROR;
  UParseError parse_error;
  impl_->pattern.reset(
      icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(pattern), 0, parse_error, status));
  if (U_FAILURE(status)) {
    throw TokenizerError("regex \"" + pattern + "\" does not compile with ICU (" +
                         u_errorName(status) + " at offset " + std::to_string(parse_error.offset) +
                         ")");
  }
}

Regex::~Regex() = default;

void Regex::FindAll(std::string_view text, std::vector<MatchSpan>* spans) const {
  spans->clear();
  if (text.empty()) return;
  std::unique_ptr<icu::RegexMatcher> m = impl_->Take();
  UErrorCode status = U_ZERO_ERROR;
  UText utext = UTEXT_INITIALIZER;
  utext_openUTF8(&utext, text.data(), static_cast<int64_t>(text.size()), &status);
  m->reset(&utext);
  size_t prev = 0;
  bool matched_before = false;
  while (U_SUCCESS(status) && m->find(status)) {
    const auto begin = static_cast<size_t>(m->start64(status));
    const auto end = static_cast<size_t>(m->end64(status));
    // Oniguruma's find_iter drops an empty match where the previous match ended.
    if (begin == end && matched_before && end == prev) continue;
    if (prev != begin) spans->push_back({prev, begin, false});
    spans->push_back({begin, end, true});
    prev = end;
    matched_before = true;
  }
  impl_->Give(std::move(m), text.size());
  utext_close(&utext);
  if (U_FAILURE(status)) {
    throw TokenizerError(std::string("ICU regex search failed: ") + u_errorName(status));
  }
  if (prev != text.size()) spans->push_back({prev, text.size(), false});
}

size_t Regex::pooled_matchers() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->free.size();
}

// ---- Split behaviours -------------------------------------------------------------------------

void EmitSplits(std::string_view text, const std::vector<MatchSpan>& spans, SplitBehavior behavior,
                bool invert, WordSink sink) {
  auto emit = [&](size_t begin, size_t end) {
    if (end > begin) sink(text.substr(begin, end - begin));
  };
  auto is_match = [&](const MatchSpan& s) { return s.is_match != invert; };
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const MatchSpan& s : spans) emit(s.begin, s.end);
      return;
    case SplitBehavior::kRemoved:
      for (const MatchSpan& s : spans) {
        if (!is_match(s)) emit(s.begin, s.end);
      }
      return;
    case SplitBehavior::kContiguous:
    case SplitBehavior::kMergedWithPrevious: {
      // A pending word grows while the fold says "extend the last one" and is emitted otherwise.
      const bool contiguous = behavior == SplitBehavior::kContiguous;
      bool previous_match = false;
      bool have = false;
      size_t begin = 0, end = 0;
      for (const MatchSpan& s : spans) {
        const bool m = is_match(s);
        const bool extend = contiguous ? (m == previous_match) : (m && !previous_match);
        if (extend && have) {
          end = s.end;
        } else {
          if (have) emit(begin, end);
          begin = s.begin, end = s.end, have = true;
        }
        previous_match = m;
      }
      if (have) emit(begin, end);
      return;
    }
    case SplitBehavior::kMergedWithNext: {
      // The same fold from the right: a match joins the word after it.
      std::vector<std::pair<size_t, size_t>> words;
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        const bool m = is_match(*it);
        if (m && !previous_match && !words.empty()) {
          words.back().first = it->begin;
        } else {
          words.emplace_back(it->begin, it->end);
        }
        previous_match = m;
      }
      for (auto it = words.rbegin(); it != words.rend(); ++it) emit(it->first, it->second);
      return;
    }
  }
}

namespace {

// ---- ByteLevel --------------------------------------------------------------------------------

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space) {
    if (use_regex) regex_ = std::make_unique<Regex>(kGpt2Pattern);
  }
  bool is_byte_level() const override { return true; }
  void Split(std::string_view text, size_t stage, PreTokenizeScratch* scratch,
             WordSink sink) const override {
    if (add_prefix_space_ && (text.empty() || text.front() != ' ')) {
      std::string& owned = scratch->owned.emplace_back();
      owned.reserve(text.size() + 1);
      owned.push_back(' ');
      owned.append(text);
      text = owned;
    }
    if (text.empty()) return;
    if (!regex_) {
      sink(text);
      return;
    }
    std::vector<MatchSpan>& spans = scratch->SpansFor(stage);
    regex_->FindAll(text, &spans);
    EmitSplits(text, spans, SplitBehavior::kIsolated, false, sink);
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;
};

// ---- Digits -----------------------------------------------------------------------------------

class DigitsPreTokenizer : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual_digits) : individual_digits_(individual_digits) {}
  void Split(std::string_view text, size_t stage, PreTokenizeScratch* scratch,
             WordSink sink) const override {
    // The match list of a char predicate (pattern.rs): each numeric character is one match.
    std::vector<MatchSpan>& spans = scratch->SpansFor(stage);
    spans.clear();
    size_t gap_begin = 0;
    for (size_t i = 0; i < text.size();) {
      const auto byte = static_cast<uint8_t>(text[i]);
      size_t len = 1;
      bool numeric;
      if (byte < 0x80) {
        numeric = byte >= '0' && byte <= '9';
      } else {
        numeric = IsNumeric(DecodeUtf8(text, i, &len));
      }
      if (numeric) {
        if (gap_begin < i) spans.push_back({gap_begin, i, false});
        spans.push_back({i, i + len, true});
        gap_begin = i + len;
      }
      i += len;
    }
    if (gap_begin < text.size()) spans.push_back({gap_begin, text.size(), false});
    EmitSplits(text, spans,
               individual_digits_ ? SplitBehavior::kIsolated : SplitBehavior::kContiguous, false,
               sink);
  }

 private:
  bool individual_digits_;
};

// ---- Split ------------------------------------------------------------------------------------

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(const std::string& pattern, bool is_regex, SplitBehavior behavior, bool invert)
      : literal_(is_regex ? "" : pattern), behavior_(behavior), invert_(invert) {
    if (is_regex) regex_ = std::make_unique<Regex>(pattern);
  }
  void Split(std::string_view text, size_t stage, PreTokenizeScratch* scratch,
             WordSink sink) const override {
    std::vector<MatchSpan>& spans = scratch->SpansFor(stage);
    if (regex_) {
      regex_->FindAll(text, &spans);
    } else {
      spans.clear();
      size_t prev = 0;
      for (size_t at = text.find(literal_); at != std::string_view::npos;
           at = text.find(literal_, prev)) {
        if (prev != at) spans.push_back({prev, at, false});
        spans.push_back({at, at + literal_.size(), true});
        prev = at + literal_.size();
      }
      if (prev != text.size()) spans.push_back({prev, text.size(), false});
    }
    EmitSplits(text, spans, behavior_, invert_, sink);
  }
  bool removes_text() const override { return behavior_ == SplitBehavior::kRemoved; }

 private:
  std::string literal_;
  std::unique_ptr<Regex> regex_;
  SplitBehavior behavior_;
  bool invert_;
};

}  // namespace

std::unique_ptr<PreTokenizer> MakeByteLevel(bool add_prefix_space, bool use_regex) {
  return std::make_unique<ByteLevelPreTokenizer>(add_prefix_space, use_regex);
}

std::unique_ptr<PreTokenizer> MakeDigits(bool individual_digits) {
  return std::make_unique<DigitsPreTokenizer>(individual_digits);
}

std::unique_ptr<PreTokenizer> MakeSplit(const std::string& pattern, bool is_regex,
                                        SplitBehavior behavior, bool invert) {
  if (pattern.empty()) throw TokenizerError("Split pattern is empty");
  return std::make_unique<SplitPreTokenizer>(pattern, is_regex, behavior, invert);
}

}  // namespace vlmgraph::tokenizer_detail
