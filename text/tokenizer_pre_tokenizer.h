// text/tokenizer_pre_tokenizer.h: the pre-tokenizers of tokenizer.json (ByteLevel, Digits,
// Split), which cut text into the words that BPE encodes one at a time (text/tokenizer.h).
//
//   auto pre = MakeByteLevel(/*add_prefix_space=*/false, /*use_regex=*/true);
//   PreTokenizeScratch scratch;
//   pre->Split("Hello world", 0, &scratch, [&](std::string_view word) { ... });  // "Hello", "
//   world"
//
// Sources: tokenizers' pre_tokenizers/{byte_level,digits,split}.rs, the split behaviours of
// tokenizer/normalizer.rs (NormalizedString::split) and the match lists of tokenizer/pattern.rs.
// Regexes run on ICU (the Python package uses Oniguruma; both are backtracking engines with the
// same leftmost-first alternation); like Oniguruma's find_iter, an empty match right where the
// previous match ended is skipped. Words are byte ranges of the input, never copies, except the
// space that ByteLevel's add_prefix_space puts in front.
//
// Thread rules: pre-tokenizers are immutable; Split may run on many threads at once, each with its
// own PreTokenizeScratch (ICU matchers are taken from a locked pool per call). Memory: the pool
// keeps at most kMaxPooledMatchers matchers, and none that searched more than
// kMaxPooledMatcherTextBytes of text (a matcher's backtracking stack may have grown with it).
// Errors: the factories throw TokenizerError for a regex ICU cannot compile.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace vlmgraph::tokenizer_detail {

// A non-owning callable reference: void(std::string_view).
class WordSink {
 public:
  template <typename F>
  WordSink(F& f)  // NOLINT(google-explicit-constructor): binds lambdas at call sites
      : object_(&f), call_([](void* o, std::string_view w) { (*static_cast<F*>(o))(w); }) {}
  void operator()(std::string_view word) const { call_(object_, word); }

 private:
  void* object_;
  void (*call_)(void*, std::string_view);
};

// One piece of a pre-tokenizer's match list: bytes [begin, end) of the input, a match of the
// pattern or the text between matches (tokenizers' pattern.rs `(Offsets, bool)`).
struct MatchSpan {
  size_t begin;
  size_t end;
  bool is_match;
};

// Per-call scratch: match lists per pipeline stage and storage for words that are not views of the
// input (ByteLevel's prefix space).
struct PreTokenizeScratch {
  std::vector<std::vector<MatchSpan>> spans;  // indexed by stage
  std::deque<std::string> owned;
  std::vector<MatchSpan>& SpansFor(size_t stage);
};

// tokenizers' SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Calls sink(word) for every non-empty word of `text`, in order. `stage` indexes the scratch.
  virtual void Split(std::string_view text, size_t stage, PreTokenizeScratch* scratch,
                     WordSink sink) const = 0;
  // True for ByteLevel (which must come last).
  virtual bool is_byte_level() const { return false; }
  // True when some of the text gives no word at all (Split with behavior Removed).
  virtual bool removes_text() const { return false; }
};

inline constexpr size_t kMaxPooledMatchers = 64;
inline constexpr size_t kMaxPooledMatcherTextBytes = size_t{64} << 10;

// An ICU regex with a pool of matchers (an icu::RegexMatcher serves one thread at a time).
class Regex {
 public:
  explicit Regex(const std::string& pattern);  // throws TokenizerError
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Replaces *spans with the match list of `text`: the matches and the gaps between them, covering
  // `text` in order (empty text gives no spans).
  void FindAll(std::string_view text, std::vector<MatchSpan>* spans) const;
  // Matchers waiting in the pool (tests).
  size_t pooled_matchers() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Emits the words of a match list according to `behavior` (NormalizedString::split), skipping
// empty ones. `invert` flips is_match first (tokenizers' Invert pattern).
void EmitSplits(std::string_view text, const std::vector<MatchSpan>& spans, SplitBehavior behavior,
                bool invert, WordSink sink);

// GPT-2's pre-tokenizer regex (tokenizers' pre_tokenizers/byte_level.rs).
extern const char kGpt2Pattern[];

std::unique_ptr<PreTokenizer> MakeByteLevel(bool add_prefix_space, bool use_regex);
std::unique_ptr<PreTokenizer> MakeDigits(bool individual_digits);
// `pattern` is a regex when is_regex, else a literal string (must not be empty).
std::unique_ptr<PreTokenizer> MakeSplit(const std::string& pattern, bool is_regex,
                                        SplitBehavior behavior, bool invert);

}  // namespace vlmgraph::tokenizer_detail
