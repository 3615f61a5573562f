// The tokenizer (text/tokenizer.h) on small hand-built tokenizer.json files: BPE merge ranks,
// added-token matching, pre-tokenizer splits, the post-processor template, lossy and streaming
// decoding, errors, and encoding from many threads. Parity with the Python `tokenizers` package on
// real text is tests/tokenizer/test_parity.py.
#include "text/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "text/tokenizer_bpe.h"
#include "text/tokenizer_pre_tokenizer.h"
#include "text/tokenizer_unicode.h"

namespace vlmgraph {
namespace {

using json = nlohmann::json;
using tokenizer_detail::ByteLevelChars;

// The byte-level spelling of raw bytes ("Ġ" for a space).
std::string ByteLevel(std::string_view raw) {
  std::string out;
  for (char c : raw) out += ByteLevelChars()[static_cast<uint8_t>(c)];
  return out;
}

// A tokenizer.json: the 256 byte tokens (id = byte), then `tokens` (raw text, ids 256...), `merges`
// of raw text pairs, and the given components.
struct Spec {
  std::vector<std::string> tokens;
  std::vector<std::pair<std::string, std::string>> merges;
  json pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  json added_tokens = json::array();
  json normalizer = nullptr;
  json post_processor = nullptr;
  bool ignore_merges = false;
  bool pair_merges = false;  // merges as [a, b] instead of "a b"
};

json MakeJson(const Spec& spec) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteLevelChars()[b]] = b;
  int64_t next = 256;
  for (const std::string& t : spec.tokens) vocab[ByteLevel(t)] = next++;
  json merges = json::array();
  for (const auto& [a, b] : spec.merges) {
    if (spec.pair_merges) {
      merges.push_back({ByteLevel(a), ByteLevel(b)});
    } else {
      merges.push_back(ByteLevel(a) + " " + ByteLevel(b));
    }
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", spec.added_tokens},
          {"normalizer", spec.normalizer},
          {"pre_tokenizer", spec.pre_tokenizer},
          {"post_processor", spec.post_processor},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", spec.ignore_merges},
            {"vocab", vocab},
            {"merges", merges}}}};
}

Tokenizer Make(const Spec& spec) { return Tokenizer::FromJson(MakeJson(spec).dump()); }

json Added(int64_t id, const std::string& content, bool special, bool single_word = false,
           bool lstrip = false, bool rstrip = false, bool normalized = false) {
  return {{"id", id},          {"content", content}, {"single_word", single_word},
          {"lstrip", lstrip},  {"rstrip", rstrip},   {"normalized", normalized},
          {"special", special}};
}

// Ids of raw-text tokens of a tokenizer: a single byte or an entry of Spec::tokens.
int64_t Id(const Tokenizer& tok, std::string_view raw) {
  auto id = tok.TokenToId(ByteLevel(raw));
  EXPECT_TRUE(id.has_value()) << raw;
  return id.value_or(-1);
}
std::vector<int64_t> Ids(const Tokenizer& tok, const std::vector<std::string>& raws) {
  std::vector<int64_t> ids;
  for (const auto& r : raws) ids.push_back(Id(tok, r));
  return ids;
}

std::string ExpectThrows(const std::function<void()>& f) {
  try {
    f();
  } catch (const TokenizerError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no TokenizerError";
  return "";
}

// ---- BPE --------------------------------------------------------------------------------------

TEST(TokenizerBpe, MergesApplyLowestRankFirst) {
  Spec spec;
  spec.tokens = {"ab", "bc", "abc"};
  spec.merges = {{"b", "c"}, {"a", "b"}, {"a", "bc"}};  // "bc" first: a + bc
  const Tokenizer bc_first = Make(spec);
  EXPECT_EQ(bc_first.Encode("abc"), Ids(bc_first, {"abc"}));
  spec.merges = {{"a", "b"}, {"b", "c"}, {"a", "bc"}};  // "ab" first, and no "ab c" merge
  const Tokenizer ab_first = Make(spec);
  EXPECT_EQ(ab_first.Encode("abc"), Ids(ab_first, {"ab", "c"}));
}

TEST(TokenizerBpe, EqualRanksMergeLeftmostFirst) {
  Spec spec;
  spec.tokens = {"aa"};
  spec.merges = {{"a", "a"}};
  const Tokenizer tok = Make(spec);
  EXPECT_EQ(tok.Encode("aaa"), Ids(tok, {"aa", "a"}));
  EXPECT_EQ(tok.Encode("aaaa"), Ids(tok, {"aa", "aa"}));
}

TEST(TokenizerBpe, PairAndStringMergesAgree) {
  Spec spec;
  spec.tokens = {"he", "ll", "hell", "hello"};
  spec.merges = {{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}};
  const Tokenizer strings = Make(spec);
  spec.pair_merges = true;
  const Tokenizer pairs = Make(spec);
  EXPECT_EQ(strings.Encode("hello"), Ids(strings, {"hello"}));
  EXPECT_EQ(pairs.Encode("hello hell"), strings.Encode("hello hell"));
}

TEST(TokenizerBpe, IgnoreMergesEmitsVocabWordsWhole) {
  Spec spec;
  spec.tokens = {"xyz"};  // in the vocab, but no merges lead to it
  const Tokenizer plain = Make(spec);
  EXPECT_EQ(plain.Encode("xyz"), Ids(plain, {"x", "y", "z"}));
  spec.ignore_merges = true;
  const Tokenizer ignoring = Make(spec);
  EXPECT_EQ(ignoring.Encode("xyz"), Ids(ignoring, {"xyz"}));
  EXPECT_EQ(ignoring.Encode("xyzx"), Ids(ignoring, {"x", "y", "z", "x"}));
}

TEST(TokenizerBpe, BytesMissingFromTheVocabAreDroppedOrUnknown) {
  // "z" is not in the vocab: dropped without unk_token, else <unk> (fused with fuse_unk).
  auto make = [](json unk, bool fuse) {
    json j = MakeJson(Spec{});
    j["model"]["vocab"].erase("z");
    j["model"]["vocab"]["<unk>"] = 256;
    j["model"]["unk_token"] = unk;
    j["model"]["fuse_unk"] = fuse;
    return Tokenizer::FromJson(j.dump());
  };
  const int64_t a = 'a', b = 'b', space = ' ', unk = 256;
  EXPECT_EQ(make(nullptr, false).Encode("azzb z"), (std::vector<int64_t>{a, b, space}));
  EXPECT_EQ(make("<unk>", false).Encode("azzb z"),
            (std::vector<int64_t>{a, unk, unk, b, space, unk}));
  EXPECT_EQ(make("<unk>", true).Encode("azzb z"), (std::vector<int64_t>{a, unk, b, space, unk}));
  EXPECT_NE(ExpectThrows([&] { make("<missing>", false); }).find("<missing>"), std::string::npos);
}

// A naive reference BPE: merge the lowest-rank adjacent pair (leftmost on ties) until none is left.
std::vector<int32_t> ReferenceBpe(
    std::vector<int32_t> s,
    const std::map<std::pair<int32_t, int32_t>, std::pair<uint32_t, int32_t>>& merges) {
  while (s.size() > 1) {
    size_t best = s.size();
    uint32_t best_rank = ~0u;
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      auto it = merges.find({s[i], s[i + 1]});
      if (it != merges.end() && it->second.first < best_rank)
        best = i, best_rank = it->second.first;
    }
    if (best == s.size()) break;
    s[best] = merges.at({s[best], s[best + 1]}).second;
    s.erase(s.begin() + static_cast<long>(best) + 1);
  }
  return s;
}

TEST(TokenizerBpe, ShortAndLongWordsMatchAReferenceBpe) {
  // Random merges over the letters a-d; words up to 400 bytes exercise both merge paths (an array
  // scan up to 128 symbols, a heap above).
  std::mt19937 rng(7);
  std::unordered_map<std::string, int64_t> vocab;
  for (int b = 0; b < 256; ++b) vocab[ByteLevelChars()[b]] = b;
  std::vector<std::string> pieces = {"a", "b", "c", "d"};
  std::vector<std::pair<std::string, std::string>> merges;
  std::map<std::pair<int32_t, int32_t>, std::pair<uint32_t, int32_t>> table;
  for (int i = 0; i < 60; ++i) {
    const std::string& l = pieces[rng() % pieces.size()];
    const std::string& r = pieces[rng() % pieces.size()];
    const auto key = std::make_pair(static_cast<int32_t>(vocab[l]), static_cast<int32_t>(vocab[r]));
    if (table.count(key) || (l + r).size() > 12) continue;
    if (!vocab.count(l + r)) vocab[l + r] = static_cast<int64_t>(vocab.size());
    table[key] = {static_cast<uint32_t>(merges.size()), static_cast<int32_t>(vocab[l + r])};
    merges.emplace_back(l, r);
    pieces.push_back(l + r);
  }
  tokenizer_detail::BpeModel bpe(vocab, merges, {});
  for (int trial = 0; trial < 200; ++trial) {
    std::string word(1 + rng() % 400, 'a');
    for (char& c : word) c = static_cast<char>('a' + rng() % 4);
    std::vector<int32_t> initial(word.begin(), word.end());
    const std::vector<int32_t> expected = ReferenceBpe(initial, table);
    for (int pass = 0; pass < 2; ++pass) {  // the second pass reads the word cache
      std::vector<int64_t> ids;
      bpe.Encode(word, &ids);
      ASSERT_EQ(std::vector<int32_t>(ids.begin(), ids.end()), expected) << word;
    }
  }
}

// ---- Added tokens -----------------------------------------------------------------------------

TEST(TokenizerAddedTokens, SplitBeforePreTokenizationLongestFirst) {
  Spec spec;
  spec.added_tokens = {Added(300, "<|im_start|>", true), Added(301, "<|im", true),
                       Added(302, "<|image|>", true), Added(303, "<row_1_col_1>", true)};
  const Tokenizer tok = Make(spec);
  std::vector<int64_t> expected = {300};
  for (int64_t id : Ids(tok, {"u", "s", "e", "r", "\n", "h", "i"})) expected.push_back(id);
  EXPECT_EQ(tok.Encode("<|im_start|>user\nhi"), expected);
  EXPECT_EQ(tok.Encode("<|image|><row_1_col_1>"), (std::vector<int64_t>{302, 303}));
  // "<|im_sta" holds only the shorter token "<|im".
  std::vector<int64_t> partial = {301};
  for (int64_t id : Ids(tok, {"_", "s", "t", "a"})) partial.push_back(id);
  EXPECT_EQ(tok.Encode("<|im_sta"), partial);
  EXPECT_TRUE(tok.IsSpecial(300));
  EXPECT_FALSE(tok.IsSpecial(Id(tok, "a")));
  EXPECT_EQ(tok.vocab_size(), 304);
  EXPECT_EQ(tok.TokenToId("<|image|>"), 302);
  EXPECT_EQ(tok.IdToToken(303), "<row_1_col_1>");
  EXPECT_EQ(tok.IdToToken(32), "Ġ");
  EXPECT_EQ(tok.IdToToken(299), std::nullopt);
  ASSERT_EQ(tok.added_tokens().size(), 4u);
  EXPECT_EQ(tok.added_tokens()[2].content, "<|image|>");
}

TEST(TokenizerAddedTokens, LstripRstripTakeTheWhitespace) {
  Spec spec;
  spec.added_tokens = {Added(300, "<mask>", false, false, /*lstrip=*/true, /*rstrip=*/true)};
  const Tokenizer tok = Make(spec);
  // "a  <mask>\t b": the mask takes "  " and "\t ".
  std::vector<int64_t> expected = {Id(tok, "a"), 300, Id(tok, "b")};
  EXPECT_EQ(tok.Encode("a  <mask>\t b"), expected);
  spec.added_tokens = {Added(300, "<mask>", false, false, false, false)};
  const Tokenizer plain = Make(spec);
  EXPECT_EQ(plain.Encode("a <mask>b"),
            (std::vector<int64_t>{Id(plain, "a"), 32, 300, Id(plain, "b")}));
}

TEST(TokenizerAddedTokens, SingleWordNeedsWordBoundaries) {
  Spec spec;
  spec.added_tokens = {Added(300, "ony", false, /*single_word=*/true)};
  const Tokenizer tok = Make(spec);
  EXPECT_EQ(tok.Encode("ony"), (std::vector<int64_t>{300}));
  EXPECT_EQ(tok.Encode("a ony,"), (std::vector<int64_t>{Id(tok, "a"), 32, 300, Id(tok, ",")}));
  EXPECT_EQ(tok.Encode("tony"), Ids(tok, {"t", "o", "n", "y"}));
  EXPECT_EQ(tok.Encode("onyx"), Ids(tok, {"o", "n", "y", "x"}));
  // A combining mark is a word character (Rust regex \w includes \p{M}).
  const std::vector<int64_t> marked = tok.Encode("\xCC\x81ony");  // U+0301 then "ony"
  EXPECT_EQ(std::count(marked.begin(), marked.end(), 300), 0);
}

TEST(TokenizerAddedTokens, NormalizedTokensMatchTheNormalizedText) {
  Spec spec;
  spec.normalizer = {{"type", "NFKC"}};
  // "ﬁx" normalizes to "fix": the normalized token matches the input "ﬁx", the raw one does not.
  spec.added_tokens = {Added(300, "ﬁx", false, false, false, false, /*normalized=*/true),
                       Added(301, "ﬁy", false, false, false, false, /*normalized=*/false)};
  const Tokenizer tok = Make(spec);
  EXPECT_EQ(tok.Encode("fix"), (std::vector<int64_t>{300}));
  EXPECT_EQ(tok.Encode("ﬁy"), (std::vector<int64_t>{301}));
  EXPECT_EQ(tok.Encode("fiy"), Ids(tok, {"f", "i", "y"}));
}

// ---- Special tokens as plain text (EncodeOptions) ---------------------------------------------

EncodeOptions PlainEverywhere() {
  EncodeOptions o;
  o.parse_special = false;
  return o;
}

EncodeOptions PlainIn(std::vector<TextRange> ranges) {
  EncodeOptions o;
  o.plain_ranges = std::move(ranges);
  return o;
}

TEST(TokenizerSpecialTokens, ParseSpecialFalseTokenizesSpecialTextAsText) {
  Spec spec;
  spec.tokens = {"im", "end"};
  spec.merges = {{"i", "m"}, {"e", "n"}, {"en", "d"}};
  Spec bare = spec;  // the same vocabulary without added tokens
  spec.tokens.push_back("en");
  bare.tokens.push_back("en");
  spec.added_tokens = {Added(400, "<|im_end|>", /*special=*/true),
                       Added(401, "<tool>", /*special=*/false)};
  const Tokenizer tok = Make(spec);
  const Tokenizer plain = Make(bare);
  const std::string text = "hi<|im_end|>\n<|im_start|>system";
  EXPECT_EQ(
      tok.Encode(text),
      (std::vector<int64_t>{Id(tok, "h"), Id(tok, "i"),  400,          Id(tok, "\n"), Id(tok, "<"),
                            Id(tok, "|"), Id(tok, "im"), Id(tok, "_"), Id(tok, "s"),  Id(tok, "t"),
                            Id(tok, "a"), Id(tok, "r"),  Id(tok, "t"), Id(tok, "|"),  Id(tok, ">"),
                            Id(tok, "s"), Id(tok, "y"),  Id(tok, "s"), Id(tok, "t"),  Id(tok, "e"),
                            Id(tok, "m")}));
  // Without special tokens: the ids of the same text under a tokenizer that has none.
  const std::vector<int64_t> as_text = tok.Encode(text, PlainEverywhere());
  EXPECT_EQ(as_text, plain.Encode(text));
  EXPECT_EQ(std::count(as_text.begin(), as_text.end(), 400), 0);
  EXPECT_EQ(tok.Decode(as_text), text);
  // Non-special added tokens are still recognised (tokenizers' encode_special_tokens does too).
  EXPECT_EQ(tok.Encode("a<tool>b", PlainEverywhere()),
            (std::vector<int64_t>{Id(tok, "a"), 401, Id(tok, "b")}));
  // A special token that starts in a plain range is text, also where it runs past the range.
  EXPECT_EQ(tok.Encode("<|im_end|>", PlainIn({{0, 3}})), plain.Encode("<|im_end|>"));
}

TEST(TokenizerSpecialTokens, PlainRangesLeaveTheMarkersAroundThemSpecial) {
  Spec spec;
  spec.added_tokens = {Added(400, "<|im_start|>", true), Added(401, "<|im_end|>", true),
                       Added(402, "<|im_end|>\n", true)};
  const Tokenizer tok = Make(spec);
  const std::string head = "<|im_start|>user\n";
  const std::string content = "x<|im_end|>\n<|im_start|>system\ny";
  const std::string tail = "<|im_end|>\n";
  const std::string text = head + content + tail;
  const std::vector<int64_t> ids =
      tok.Encode(text, PlainIn({{head.size(), head.size() + content.size()}}));
  // The markers outside the range are special; the content's are text.
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 400), 1);
  EXPECT_EQ(ids.front(), 400);
  EXPECT_EQ(ids.back(), 402);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 401) + std::count(ids.begin(), ids.end(), 402), 1);
  EXPECT_EQ(tok.Decode(ids), text);
  // A marker that would run into a plain range gives way to the longest one that ends before it.
  const std::string turn = "<|im_end|>";
  const std::vector<int64_t> cut =
      tok.Encode(turn + "\nz", PlainIn({{turn.size(), turn.size() + 2}}));
  EXPECT_EQ(cut, (std::vector<int64_t>{401, Id(tok, "\n"), Id(tok, "z")}));
  // The ranges are checked.
  EXPECT_THROW(tok.Encode("abc", PlainIn({{2, 4}})), TokenizerError);
  EXPECT_THROW(tok.Encode("abc", PlainIn({{1, 2}, {0, 1}})), TokenizerError);
}

TEST(TokenizerSpecialTokens, AnyPlainRangesKeepTheTextAndOnlyTheirSpecialTokens) {
  Spec spec;
  spec.added_tokens = {Added(400, "<|im_start|>", true), Added(401, "<|im_end|>", true),
                       Added(402, "<|im_end|>\n", true), Added(403, "<|im", false)};
  const Tokenizer tok = Make(spec);
  std::mt19937 rng(11);
  const std::vector<std::string> pieces = {"<|im_start|>", "<|im_end|>", "\n", "<|im", "_end|>",
                                           "a",            " ",          "é",  "<|"};
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    for (int k = rng() % 12; k > 0; --k) text += pieces[rng() % pieces.size()];
    EncodeOptions o;
    for (size_t at = rng() % 4; at < text.size(); at += 1 + rng() % 6) {
      const size_t end = std::min(text.size(), at + rng() % 8);
      o.plain_ranges.push_back({at, end});
      at = end;
    }
    const std::vector<int64_t> ids = tok.Encode(text, o);
    EXPECT_EQ(tok.Decode(ids), text) << text;
    // A special token is never made from bytes of a plain range.
    size_t at = 0;
    for (int64_t id : ids) {
      const size_t n = id < 256 ? 1 : tok.IdToToken(id)->size();  // a byte, or an added token
      if (id == 400 || id == 401 || id == 402) {
        for (const TextRange& r : o.plain_ranges)
          EXPECT_TRUE(at + n <= r.begin || r.end <= at) << text << " at " << at;
      }
      at += n;
    }
  }
}

TEST(TokenizerSpecialTokens, NormalizedSpecialTokensFollowThePlainRanges) {
  Spec spec;
  spec.normalizer = {{"type", "NFKC"}};
  spec.added_tokens = {Added(400, "<ﬁ>", true, false, false, false, /*normalized=*/true)};
  const Tokenizer tok = Make(spec);
  // "<ﬁ>" and "<fi>" normalize to the token's normalized text.
  const std::string text = "<ﬁ>a<ﬁ>";
  EXPECT_EQ(tok.Encode(text), (std::vector<int64_t>{400, Id(tok, "a"), 400}));
  const std::vector<int64_t> ids = tok.Encode(text, PlainIn({{5, 6 + 5}}));  // "a<ﬁ>"
  EXPECT_EQ(ids.front(), 400);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 400), 1);
  EXPECT_EQ(tok.Decode(ids), "<fi>a<fi>");
}

// ---- Bound on tokens from bytes ---------------------------------------------------------------

TEST(TokenizerBound, MinTokensIsALowerBoundFromTheLongestToken) {
  Spec spec;
  spec.tokens = {"ab", "abab", "abababab"};
  spec.merges = {{"a", "b"}, {"ab", "ab"}, {"abab", "abab"}};
  spec.added_tokens = {Added(400, "<|im_start|>", true)};  // 12 bytes, the longest
  const Tokenizer tok = Make(spec);
  EXPECT_EQ(tok.max_bytes_per_token(), 12);
  EXPECT_EQ(tok.no_token_bound_reason(), "");
  EXPECT_TRUE(tok.every_byte_makes_tokens());
  EXPECT_EQ(tok.MinTokens({}), 0);
  EXPECT_EQ(tok.MinTokens({std::string(12, 'x')}), 1);
  EXPECT_EQ(tok.MinTokens({std::string(13, 'x')}), 2);
  EXPECT_EQ(tok.MinTokens({std::string(6, 'x'), std::string(7, 'x')}), 2);  // pieces of one text
  std::mt19937 rng(5);
  const std::vector<std::string> pieces = {"ab", "abababab", "<|im_start|>", " ", "é", "x", "\n"};
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    for (int k = rng() % 40; k > 0; --k) text += pieces[rng() % pieces.size()];
    for (const EncodeOptions& o : {EncodeOptions{}, PlainEverywhere()}) {
      EXPECT_LE(tok.MinTokens({text}), static_cast<int64_t>(tok.Encode(text, o).size())) << text;
    }
  }
  // The longest token is the bound: a text made of it reaches it.
  EXPECT_EQ(tok.Encode("<|im_start|><|im_start|>").size(), 2u);
  EXPECT_EQ(tok.MinTokens({"<|im_start|><|im_start|>"}), 2);
}

TEST(TokenizerBound, NormalizersAndTokensThatTakeAnyLengthChangeTheBound) {
  Spec spec;
  spec.normalizer = {{"type", "NFKC"}};
  EXPECT_EQ(Make(spec).max_bytes_per_token(), 4);  // UTF-8 shrinks by at most 4 (U+1D400 -> "A")
  EXPECT_EQ(Make(spec).Encode("\xF0\x9D\x90\x80").size(), 1u);
  EXPECT_EQ(Make(spec).MinTokens({"\xF0\x9D\x90\x80"}), 1);

  spec = Spec{};
  spec.added_tokens = {Added(400, "<mask>", false, false, /*lstrip=*/true)};
  EXPECT_EQ(Make(spec).max_bytes_per_token(), 0);
  EXPECT_EQ(Make(spec).MinTokens({std::string(1 << 20, ' ')}), 0);
  EXPECT_NE(Make(spec).no_token_bound_reason().find("<mask>"), std::string::npos);

  spec = Spec{};
  spec.pre_tokenizer = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"},
                           {"pattern", {{"String", " "}}},
                           {"behavior", "Removed"},
                           {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}}}}};
  EXPECT_EQ(Make(spec).Encode("          ").size(), 0u);  // removed: no token at all
  EXPECT_EQ(Make(spec).max_bytes_per_token(), 0);
  EXPECT_NE(Make(spec).no_token_bound_reason().find("Removed"), std::string::npos);

  // A byte without a token is dropped (SmolLM2 has none for 21 bytes): it is not counted.
  json dropped = MakeJson(Spec{});
  dropped["model"]["vocab"].erase("z");
  const Tokenizer drops = Tokenizer::FromJson(dropped.dump());
  EXPECT_EQ(drops.max_bytes_per_token(), 1);
  EXPECT_FALSE(drops.every_byte_makes_tokens());
  EXPECT_EQ(drops.Encode(std::string(1000, 'z')).size(), 0u);
  EXPECT_EQ(drops.MinTokens({std::string(1000, 'z')}), 0);
  EXPECT_EQ(drops.MinTokens({"azzb", "zc"}), 3);
  // With an unknown token each such byte makes one, unless runs of them fuse into one.
  dropped["model"]["vocab"]["<unk>"] = 256;
  dropped["model"]["unk_token"] = "<unk>";
  EXPECT_TRUE(Tokenizer::FromJson(dropped.dump()).every_byte_makes_tokens());
  EXPECT_EQ(Tokenizer::FromJson(dropped.dump()).Encode("zzzz").size(), 4u);
  EXPECT_EQ(Tokenizer::FromJson(dropped.dump()).MinTokens({"zzzz"}), 1);  // "<unk>": 5 bytes
  dropped["model"]["fuse_unk"] = true;
  EXPECT_EQ(Tokenizer::FromJson(dropped.dump()).Encode("zzzz").size(), 1u);
  EXPECT_EQ(Tokenizer::FromJson(dropped.dump()).max_bytes_per_token(), 0);
  EXPECT_NE(Tokenizer::FromJson(dropped.dump()).no_token_bound_reason().find("0x7a"),
            std::string::npos);
}

// ---- Memory -----------------------------------------------------------------------------------

TEST(TokenizerMemory, ScratchIsGivenBackAfterALongText) {
  const Tokenizer tok = Make(Spec{});
  std::string text;
  for (int i = 0; i < 1000000; ++i) text += " a";  // 1,000,000 words, 2 MB
  std::string word(1 << 20, 'b');                  // one 1 MiB word
  const size_t bound = tokenizer_detail::kMaxKeptScratchBytes +
                       tokenizer_detail::BpeModel::kMaxKeptSymbols * sizeof(int32_t);
  EXPECT_EQ(tok.Encode(text).size(), 2000000u);
  EXPECT_LE(tokenizer_detail::EncodeScratchBytes(), bound);
  EXPECT_EQ(tok.Encode(word).size(), word.size());
  EXPECT_LE(tokenizer_detail::EncodeScratchBytes(), bound);
  // Short texts keep their buffers (no allocation per call).
  tok.Encode("another short text");
  const size_t kept = tokenizer_detail::EncodeScratchBytes();
  EXPECT_GT(kept, 0u);
  tok.Encode("a short text");
  EXPECT_EQ(tokenizer_detail::EncodeScratchBytes(), kept);
}

TEST(TokenizerMemory, WordCacheHoldsABoundedNumberOfBytes) {
  std::unordered_map<std::string, int64_t> vocab;
  for (int b = 0; b < 256; ++b) vocab[ByteLevelChars()[b]] = b;
  tokenizer_detail::BpeModel bpe(vocab, {}, {});
  std::mt19937 rng(1);
  std::vector<int64_t> ids;
  for (int i = 0; i < 50000; ++i) {  // distinct 200-byte words: 50000 x ~1 KB without a bound
    std::string word(200, 'a');
    for (char& c : word) c = static_cast<char>('a' + rng() % 26);
    ids.clear();
    bpe.Encode(word, &ids);
  }
  using tokenizer_detail::WordCache;
  EXPECT_GT(bpe.cache().bytes(), 0u);
  EXPECT_LE(bpe.cache().bytes(), WordCache::kShards * WordCache::kShardCapacityBytes);
}

TEST(TokenizerMemory, RegexPoolKeepsNoMatcherOfALongText) {
  tokenizer_detail::Regex regex(tokenizer_detail::kGpt2Pattern);
  std::vector<tokenizer_detail::MatchSpan> spans;
  regex.FindAll("a short text", &spans);
  EXPECT_EQ(regex.pooled_matchers(), 1u);
  regex.FindAll(std::string(tokenizer_detail::kMaxPooledMatcherTextBytes + 1, ' '), &spans);
  EXPECT_EQ(regex.pooled_matchers(), 0u);  // the matcher of the long search was freed
  regex.FindAll("a short text", &spans);
  EXPECT_EQ(regex.pooled_matchers(), 1u);
  std::vector<std::thread> threads;
  for (int i = 0; i < 100; ++i) {
    threads.emplace_back([&regex] {
      std::vector<tokenizer_detail::MatchSpan> s;
      for (int k = 0; k < 50; ++k) regex.FindAll("text on many threads", &s);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(regex.pooled_matchers(), tokenizer_detail::kMaxPooledMatchers);
}

// ---- Pre-tokenizers ---------------------------------------------------------------------------

std::vector<std::string> Words(const tokenizer_detail::PreTokenizer& pre, std::string_view text) {
  std::vector<std::string> words;
  tokenizer_detail::PreTokenizeScratch scratch;
  auto sink = [&](std::string_view w) { words.emplace_back(w); };
  pre.Split(text, 0, &scratch, sink);
  return words;
}

using Strings = std::vector<std::string>;

TEST(TokenizerPreTokenizer, SplitBehaviours) {
  using tokenizer_detail::MakeSplit;
  using B = tokenizer_detail::SplitBehavior;
  const std::string text = "the-final--countdown";
  EXPECT_EQ(Words(*MakeSplit("-", false, B::kRemoved, false), text),
            (Strings{"the", "final", "countdown"}));
  EXPECT_EQ(Words(*MakeSplit("-", false, B::kIsolated, false), text),
            (Strings{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(Words(*MakeSplit("-", false, B::kMergedWithPrevious, false), text),
            (Strings{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(Words(*MakeSplit("-", false, B::kMergedWithNext, false), text),
            (Strings{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(Words(*MakeSplit("-", false, B::kContiguous, false), text),
            (Strings{"the", "-", "final", "--", "countdown"}));
  // tokenizers' split.rs test: an inverted word regex splits on what lies between words.
  const std::string how = "How are you doing?";
  const std::string words = R"(\w+|[^\w\s]+)";
  EXPECT_EQ(Words(*MakeSplit(words, true, B::kRemoved, true), how),
            (Strings{"How", "are", "you", "doing", "?"}));
  EXPECT_EQ(Words(*MakeSplit(words, true, B::kMergedWithPrevious, true), how),
            (Strings{"How ", "are ", "you ", "doing", "?"}));
  EXPECT_EQ(Words(*MakeSplit(words, true, B::kMergedWithNext, true), how),
            (Strings{"How", " are", " you", " doing", "?"}));
  EXPECT_EQ(Words(*MakeSplit(words, true, B::kContiguous, true), how),
            (Strings{"How", " ", "are", " ", "you", " ", "doing?"}));
}

TEST(TokenizerPreTokenizer, Digits) {
  EXPECT_EQ(Words(*tokenizer_detail::MakeDigits(true), "Hey 123 friend!"),
            (Strings{"Hey ", "1", "2", "3", " friend!"}));
  EXPECT_EQ(Words(*tokenizer_detail::MakeDigits(false), "Hey 123 friend!"),
            (Strings{"Hey ", "123", " friend!"}));
  // Numeric beyond ASCII (general category N): Arabic-Indic digits, a superscript.
  EXPECT_EQ(Words(*tokenizer_detail::MakeDigits(true), "x\xD9\xA1\xD9\xA2\xC2\xB2"),
            (Strings{"x", "\xD9\xA1", "\xD9\xA2", "\xC2\xB2"}));
}

TEST(TokenizerPreTokenizer, ByteLevelGpt2Regex) {
  const auto pre = tokenizer_detail::MakeByteLevel(false, true);
  EXPECT_EQ(
      Words(*pre, "Hello my friend, how is your day going?"),
      (Strings{"Hello", " my", " friend", ",", " how", " is", " your", " day", " going", "?"}));
  EXPECT_EQ(Words(*pre, "Hello there\nHello there"),
            (Strings{"Hello", " there", "\n", "Hello", " there"}));
  EXPECT_EQ(Words(*pre, "Hello there       dear"), (Strings{"Hello", " there", "      ", " dear"}));
  EXPECT_EQ(Words(*pre, "I'm 42 don't"), (Strings{"I", "'m", " 42", " don", "'t"}));
  const auto prefixed = tokenizer_detail::MakeByteLevel(true, true);
  EXPECT_EQ(Words(*prefixed, "Hello world"), (Strings{" Hello", " world"}));
  EXPECT_EQ(Words(*prefixed, " Hello"), (Strings{" Hello"}));
  const auto no_regex = tokenizer_detail::MakeByteLevel(false, false);
  EXPECT_EQ(Words(*no_regex, "Hello world"), (Strings{"Hello world"}));
}

TEST(TokenizerPreTokenizer, SequenceRunsInOrder) {
  Spec spec;
  spec.tokens = {"12"};
  spec.merges = {{"1", "2"}};
  spec.pre_tokenizer = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Digits"}, {"individual_digits", true}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}}}}};
  const Tokenizer tok = Make(spec);
  EXPECT_EQ(tok.Encode("12"), Ids(tok, {"1", "2"}));  // Digits keeps "1" and "2" apart
  spec.pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  EXPECT_EQ(Make(spec).Encode("12"), Ids(tok, {"12"}));
}

// ---- Post-processor ---------------------------------------------------------------------------

TEST(TokenizerPostProcessor, TemplateAddsSpecialTokensOnRequest) {
  Spec spec;
  spec.added_tokens = {Added(300, "<s>", true), Added(301, "</s>", true)};
  spec.post_processor = {
      {"type", "Sequence"},
      {"processors",
       {{{"type", "ByteLevel"}, {"trim_offsets", false}},
        {{"type", "TemplateProcessing"},
         {"single",
          {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
           {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
           {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}},
         {"pair", json::array()},
         {"special_tokens",
          {{"<s>", {{"id", "<s>"}, {"ids", {300}}, {"tokens", {"<s>"}}}},
           {"</s>", {{"id", "</s>"}, {"ids", {301}}, {"tokens", {"</s>"}}}}}}}}}};
  const Tokenizer tok = Make(spec);
  EXPECT_EQ(tok.Encode("a", true), (std::vector<int64_t>{300, Id(tok, "a"), 301}));
  EXPECT_EQ(tok.Encode("a", false), (std::vector<int64_t>{Id(tok, "a")}));
  EXPECT_EQ(tok.Encode("", true), (std::vector<int64_t>{300, 301}));
  EXPECT_EQ(tok.Decode({300, Id(tok, "a"), 301}), "<s>a</s>");
  EXPECT_EQ(tok.Decode({300, Id(tok, "a"), 301}, /*skip_special_tokens=*/true), "a");
}

// ---- Decoding ---------------------------------------------------------------------------------

TEST(TokenizerDecode, InvalidUtf8BecomesReplacementCharacters) {
  const Tokenizer tok = Make(Spec{});
  auto decode_bytes = [&](std::vector<int> bytes) {
    return tok.Decode(std::vector<int64_t>(bytes.begin(), bytes.end()));
  };
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(decode_bytes({0xF0, 0x9F, 0x98, 0x80}), "\xF0\x9F\x98\x80");
  EXPECT_EQ(decode_bytes({0xF0, 0x9F, 0x98}), fffd);                // truncated: one U+FFFD
  EXPECT_EQ(decode_bytes({0xF0, 0x9F, 'A'}), fffd + "A");           // maximal subpart F0 9F
  EXPECT_EQ(decode_bytes({0xE0, 0x80}), fffd + fffd);               // E0 needs A0..BF next
  EXPECT_EQ(decode_bytes({0xED, 0xA0, 0x80}), fffd + fffd + fffd);  // a surrogate
  EXPECT_EQ(decode_bytes({0xC0, 'x', 0xFF}), fffd + "x" + fffd);
}

TEST(TokenizerDecode, EncodeDecodeRoundTrips) {
  const Tokenizer tok = Make(Spec{});
  for (const std::string text :
       {"", "hello world", "  tabs\tand\r\nCRLF  ", "日本語 👨‍👩‍👧 e\xCC\x81"}) {
    EXPECT_EQ(tok.Decode(tok.Encode(text)), text);
  }
}

TEST(TokenizerDecodeStream, HoldsBackIncompleteCharacters) {
  const Tokenizer tok = Make(Spec{});
  DecodeStream stream(tok, false);
  EXPECT_EQ(stream.Step('a'), "a");
  EXPECT_EQ(stream.Step(0xF0), "");
  EXPECT_EQ(stream.Step(0x9F), "");
  EXPECT_EQ(stream.Step(0x98), "");
  EXPECT_EQ(stream.Step(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(stream.Step(0xE4), "");
  EXPECT_EQ(stream.Flush(), "\xEF\xBF\xBD");
  EXPECT_THROW(stream.Step(100000), TokenizerError);
}

TEST(TokenizerDecodeStream, ConcatenationEqualsDecode) {
  Spec spec;
  spec.added_tokens = {Added(300, "<|im_end|>", true)};
  const Tokenizer tok = Make(spec);
  std::mt19937 rng(11);
  // Biased toward multi-byte leads and continuation bytes, with special tokens in between.
  const std::vector<int64_t> pool = {'a',  ' ',  0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F,
                                     0x98, 0x80, 0xED, 0xA0, 0xFF, 0xC0, 0x90, 300};
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<int64_t> ids(rng() % 24);
    for (int64_t& id : ids) id = pool[rng() % pool.size()];
    for (bool skip : {false, true}) {
      DecodeStream stream(tok, skip);
      std::string text;
      for (int64_t id : ids) {
        const std::string piece = stream.Step(id);
        EXPECT_TRUE(tokenizer_detail::IsValidUtf8(piece));
        text += piece;
      }
      text += stream.Flush();
      ASSERT_EQ(text, tok.Decode(ids, skip));
    }
  }
}

// ---- Errors -----------------------------------------------------------------------------------

TEST(TokenizerErrors, UnsupportedComponentsAreNamed) {
  json j = MakeJson(Spec{});
  j["model"]["type"] = "Unigram";
  EXPECT_NE(ExpectThrows([&] {
              Tokenizer::FromJson(j.dump());
            }).find("tokenizer.json: model.type \"Unigram\" is not supported; supported: BPE"),
            std::string::npos);
  j = MakeJson(Spec{});
  j["model"]["byte_fallback"] = true;
  EXPECT_NE(ExpectThrows([&] { Tokenizer::FromJson(j.dump()); }).find("model.byte_fallback"),
            std::string::npos);
  j = MakeJson(Spec{});
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(ExpectThrows([&] { Tokenizer::FromJson(j.dump()); }).find("\"Lowercase\""),
            std::string::npos);
  j = MakeJson(Spec{});
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  EXPECT_NE(ExpectThrows([&] { Tokenizer::FromJson(j.dump()); }).find("\"Whitespace\""),
            std::string::npos);
  j = MakeJson(Spec{});
  j["pre_tokenizer"] = {{"type", "Digits"}, {"individual_digits", true}};
  EXPECT_NE(ExpectThrows([&] { Tokenizer::FromJson(j.dump()); }).find("ByteLevel"),
            std::string::npos);
  j = MakeJson(Spec{});
  j["decoder"] = nullptr;
  EXPECT_NE(ExpectThrows([&] { Tokenizer::FromJson(j.dump()); }).find("decoder"),
            std::string::npos);
  j = MakeJson(Spec{});
  j["post_processor"] = {{"type", "RobertaProcessing"}};
  EXPECT_NE(ExpectThrows([&] { Tokenizer::FromJson(j.dump()); }).find("RobertaProcessing"),
            std::string::npos);
  j = MakeJson(Spec{});
  j["model"]["merges"] = json::array({"a zz"});
  EXPECT_NE(ExpectThrows([&] { Tokenizer::FromJson(j.dump()); }).find("model.merges[0]"),
            std::string::npos);
  j = MakeJson(Spec{});
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"},
                           {"pattern", {{"Regex", "(unclosed"}}},
                           {"behavior", "Isolated"},
                           {"invert", false}},
                          {{"type", "ByteLevel"}}}}};
  EXPECT_NE(ExpectThrows([&] { Tokenizer::FromJson(j.dump()); }).find("(unclosed"),
            std::string::npos);
  EXPECT_NE(ExpectThrows([] { Tokenizer::FromJson("{not json"); }).find("not valid JSON"),
            std::string::npos);
  EXPECT_NE(ExpectThrows([] {
              Tokenizer::FromFile("/nonexistent/tokenizer.json");
            }).find("/nonexistent/tokenizer.json"),
            std::string::npos);
}

TEST(TokenizerErrors, FileErrorsNameTheFile) {
  const std::string path = ::testing::TempDir() + "/vlmgraph_tokenizer_test_unigram.json";
  json j = MakeJson(Spec{});
  j["model"]["type"] = "Unigram";
  std::ofstream(path) << j.dump();
  EXPECT_NE(ExpectThrows([&] {
              Tokenizer::FromFile(path);
            }).find(path + ": model.type \"Unigram\" is not supported"),
            std::string::npos);
  std::remove(path.c_str());
}

TEST(TokenizerErrors, BadInputAndIds) {
  const Tokenizer tok = Make(Spec{});
  EXPECT_THROW(tok.Encode("ok \xC3"), TokenizerError);
  EXPECT_THROW(tok.Encode("\xED\xA0\x80"), TokenizerError);  // a surrogate
  EXPECT_THROW(tok.Decode({1, 256}), TokenizerError);
  EXPECT_THROW(tok.Decode({-1}), TokenizerError);
  EXPECT_EQ(tok.Decode({}), "");
}

// ---- Threads ----------------------------------------------------------------------------------

TEST(TokenizerThreads, ConcurrentEncodesAgree) {
  Spec spec;
  spec.tokens = {"th", "the", " the", "in", "ing"};
  spec.merges = {{"t", "h"}, {"th", "e"}, {" ", "the"}, {"i", "n"}, {"in", "g"}};
  spec.added_tokens = {Added(300, "<|im_end|>", true)};
  const Tokenizer tok = Make(spec);
  std::vector<std::string> texts;
  std::mt19937 rng(3);
  const std::vector<std::string> words = {"the", " thing", " sing", "ing",  "<|im_end|>", " 42",
                                          "\n",  "  ",     "é",     "日本", "👍",          "'s"};
  for (int i = 0; i < 300; ++i) {
    std::string t;
    for (int k = rng() % 20; k > 0; --k) t += words[rng() % words.size()];
    texts.push_back(t);
  }
  std::vector<std::vector<int64_t>> expected;
  for (const auto& t : texts) expected.push_back(Make(spec).Encode(t));  // a fresh, empty cache
  std::vector<std::thread> threads;
  std::vector<int> mismatches(8, 0);
  for (int w = 0; w < 8; ++w) {
    threads.emplace_back([&, w] {
      for (int rep = 0; rep < 20; ++rep) {
        for (size_t i = 0; i < texts.size(); ++i) {
          const size_t k = (i * 7 + w * 13 + rep) % texts.size();
          if (tok.Encode(texts[k]) != expected[k]) ++mismatches[w];
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < 8; ++w) EXPECT_EQ(mismatches[w], 0) << "thread " << w;
}

}  // namespace
}  // namespace vlmgraph
