// Fuzz target: encoding and decoding untrusted text and ids (text/tokenizer.h: Encode, Decode,
// DecodeStream) with a fixed tokenizer that has every supported component: NFKC normalization,
// added tokens of each kind (special, single_word, lstrip, rstrip, normalized), a Split regex, Digits
// and ByteLevel pre-tokenizers, merges and a TemplateProcessing post-processor. Input: one byte of
// flags, then the text; the same bytes, two at a time, are also decoded as ids (some of them outside
// the vocabulary). Expected error: TokenizerError (text that is not UTF-8, unknown ids).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using nlohmann::json;

const vlmgraph::Tokenizer& FullTokenizer() {
  static const vlmgraph::Tokenizer tok = [] {
    json j = vlmgraph::fuzz::TinyTokenizerJson();
    auto added = [](int64_t id, const char* text, bool special, bool single_word, bool lstrip,
                    bool rstrip, bool normalized) {
      return json{{"id", id},         {"content", text},     {"single_word", single_word},
                  {"lstrip", lstrip}, {"rstrip", rstrip},    {"normalized", normalized},
                  {"special", special}};
    };
    j["added_tokens"].push_back(added(263, "<s>", true, false, false, false, false));
    j["added_tokens"].push_back(added(264, "word", false, true, false, false, false));
    j["added_tokens"].push_back(added(265, "<mask>", true, false, true, true, false));
    j["added_tokens"].push_back(added(266, "\xef\xac\x81x", false, false, false, false, true));
    j["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFKC"}}})}};
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?"
                                              "\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                                              "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      {{"type", "Digits"}, {"individual_digits", true}},
                      {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
    j["post_processor"] = {
        {"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {263}}, {"tokens", {"<s>"}}}}}}};
    return vlmgraph::Tokenizer::FromJson(j.dump());
  }();
  return tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace vlmgraph;
  if (size == 0) return 0;
  const Tokenizer& tok = FullTokenizer();
  const bool add_special = data[0] & 1, skip_special = data[0] & 2;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  fuzz::ExpectOnly<TokenizerError>("tokenizer_text", [&] {
    const std::vector<int64_t> ids = tok.Encode(text, add_special);
    tok.Decode(ids, skip_special);
    DecodeStream stream(tok, skip_special);
    for (int64_t id : ids) stream.Step(id);
    stream.Flush();
  });
  std::vector<int64_t> ids;
  for (size_t i = 1; i + 1 < size; i += 2) {
    ids.push_back((data[i] | data[i + 1] << 8) % (tok.vocab_size() + 8) - (data[0] & 4 ? 1 : 0));
  }
  fuzz::ExpectOnly<TokenizerError>("tokenizer_text", [&] { tok.Decode(ids, skip_special); });
  fuzz::ExpectOnly<TokenizerError>("tokenizer_text", [&] {
    DecodeStream stream(tok, skip_special);
    for (int64_t id : ids) {
      try {
        stream.Step(id);
      } catch (const TokenizerError&) {
        // The stream is unchanged after an unknown id (text/tokenizer.h); keep going.
      }
    }
    stream.Flush();
  });
  return 0;
}
