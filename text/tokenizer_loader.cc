// text/tokenizer_loader.cc: tokenizer.json -> TokenizerState (text/tokenizer_state.h): the model
// (BPE), added tokens, normalizer, pre-tokenizers, post-processor and decoder it declares, each
// checked against what this tokenizer supports.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <unordered_set>
#include <utility>

#include "text/tokenizer_state.h"

namespace vlmgraph {
namespace tokenizer_detail {
namespace {

using json = nlohmann::json;

// ---- Loading ----------------------------------------------------------------------------------

// Token ids lie below kMaxVocabSize (2^22, 16 times the largest vocabularies in use): the id tables
// are sized by the largest id, so one huge id in a small file would allocate without bound.
constexpr int64_t kMaxVocabSize = int64_t{1} << 22;

// Note [Tokens from bytes]
// A caller refuses a text as too long before tokenizing it (tokenizing 200 MB takes about 20 s and
// gigabytes): it needs a lower bound on the tokens from the byte length alone. Every token Encode
// makes stands for at most L bytes of the text it was made from: a BPE token for the bytes its
// byte-level spelling decodes to (merges only concatenate), an added token for its content (raw or
// normalized). So a text of n bytes makes at least ceil(n / L) tokens, whatever the options; for
// texts that are parts of one text (the messages of a chat in its template) their bytes count
// together. L is the longest decoded token of the vocabulary and the added tokens, computed at
// load (SmolLM2's is 81 bytes). A byte without a token in the vocabulary (SmolLM2 has none for 21
// of them, 0x04 and 0xF5 among them) is dropped, as tokenizers drops it without an unk_token: such
// bytes are not counted (one pass over the text, only for such a vocabulary); with an unk_token
// each makes a token of its own and counts. A Unicode normalizer may shrink the text before that:
// every normalization form shrinks UTF-8 by at most kMaxNormalizedShrink (4; over every code point
// with Python's unicodedata, the worst cases are a 4-byte compatibility letter that NFKC maps to
// one ASCII letter, U+1D400 -> "A", and U+01D5 written as such a letter plus two combining marks),
// so L is multiplied by it then. No byte count bounds a token, and the bound is off (0), when an
// added token takes the whitespace next to it (lstrip / rstrip: any run of it), a Split
// pre-tokenizer removes text, bytes without a token fuse into one unknown token (fuse_unk), or a
// vocabulary that drops bytes has a normalizer (which could turn counted bytes into dropped ones).
constexpr int64_t kMaxNormalizedShrink = 4;

bool IsTokenId(const json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < kMaxVocabSize;
}

// Errors name the file and the JSON path.
class Loader {
 public:
  explicit Loader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void Fail(const std::string& what) const {
    throw TokenizerError(source_ + ": " + what);
  }
  [[noreturn]] void Unsupported(const std::string& path, const json& value,
                                const std::string& supported) const {
    Fail(path + " " + value.dump() + " is not supported; supported: " + supported);
  }

  const json& Field(const json& object, const std::string& path, const char* key) const {
    auto it = object.find(key);
    if (it == object.end()) Fail((path.empty() ? "" : path + ".") + key + " is missing");
    return *it;
  }
  bool Bool(const json& object, const std::string& path, const char* key, bool fallback) const {
    auto it = object.find(key);
    if (it == object.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) Fail(path + "." + key + " must be true or false");
    return it->get<bool>();
  }
  std::string String(const json& value, const std::string& path) const {
    if (!value.is_string()) Fail(path + " must be a string");
    return value.get<std::string>();
  }
  std::string Type(const json& object, const std::string& path) const {
    if (!object.is_object()) Fail(path + " must be an object or null");
    return String(Field(object, path, "type"), path + ".type");
  }

  std::shared_ptr<TokenizerState> Load(const std::string& text) {
    json root;
    try {
      root = json::parse(text);
    } catch (const json::exception& e) {
      Fail(std::string("not valid JSON: ") + e.what());
    }
    if (!root.is_object()) Fail("the top level must be an object");
    auto state = std::make_shared<TokenizerState>();
    if (root.contains("version") && root["version"] != "1.0") {
      Unsupported("version", root["version"], "\"1.0\"");
    }
    for (const char* key : {"truncation", "padding"}) {
      if (root.contains(key) && !root[key].is_null()) Unsupported(key, root[key], "null");
    }
    LoadModel(Field(root, "", "model"), state.get());
    LoadNormalizer(root.value("normalizer", json()), "normalizer", state.get());
    if (root.contains("added_tokens")) LoadAddedTokens(root["added_tokens"], state.get());
    LoadPreTokenizer(root.value("pre_tokenizer", json()), state.get());
    LoadPostProcessor(root.value("post_processor", json()), "post_processor", state.get());
    LoadDecoder(root.value("decoder", json()));
    BuildIdTables(state.get());
    ComputeTokenBound(state.get());
    return state;
  }

 private:
  void LoadModel(const json& model, TokenizerState* state) {
    if (!model.is_object()) Fail("model must be an object");
    auto type = model.find("type");
    if (type != model.end() && *type != "BPE") Unsupported("model.type", *type, "BPE");
    if (auto d = model.find("dropout");
        d != model.end() && !d->is_null() && !(d->is_number() && d->get<double>() == 0.0)) {
      Unsupported("model.dropout", *d, "null");
    }
    if (Bool(model, "model", "byte_fallback", false)) {
      Unsupported("model.byte_fallback", true, "false");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      auto it = model.find(key);
      if (it != model.end() && !it->is_null() && *it != "") {
        Unsupported(std::string("model.") + key, *it, "null");
      }
    }
    BpeOptions options;
    options.ignore_merges = Bool(model, "model", "ignore_merges", false);
    options.fuse_unk = Bool(model, "model", "fuse_unk", false);
    if (auto it = model.find("unk_token"); it != model.end() && !it->is_null()) {
      options.unk_token = String(*it, "model.unk_token");
    }

    const json& vocab = Field(model, "model", "vocab");
    if (!vocab.is_object()) Fail("model.vocab must be an object of token -> id");
    state->vocab.reserve(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!IsTokenId(it.value())) {
        Fail("model.vocab[\"" + it.key() + "\"] must be an integer in [0, " +
             std::to_string(kMaxVocabSize) + ")");
      }
      if (!IsValidUtf8(it.key())) Fail("model.vocab has a key that is not valid UTF-8");
      state->vocab[it.key()] = it.value().get<int64_t>();
    }

    const json& merges_json = Field(model, "model", "merges");
    if (!merges_json.is_array()) Fail("model.merges must be an array");
    std::vector<std::pair<std::string, std::string>> merges;
    merges.reserve(merges_json.size());
    for (size_t i = 0; i < merges_json.size(); ++i) {
      const json& m = merges_json[i];
      const std::string path = "model.merges[" + std::to_string(i) + "]";
      if (m.is_string()) {  // "left right"
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          Fail(path + " \"" + s + "\" must be two tokens separated by one space");
        }
        merges.emplace_back(s.substr(0, space), s.substr(space + 1));
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else {
        Fail(path + " must be \"left right\" or [\"left\", \"right\"]");
      }
    }
    try {
      state->bpe = std::make_unique<BpeModel>(state->vocab, merges, options);
    } catch (const TokenizerError& e) {
      Fail(e.what());
    }
  }

  void LoadNormalizer(const json& n, const std::string& path, TokenizerState* state) {
    if (n.is_null()) return;
    const std::string type = Type(n, path);
    if (type == "Sequence") {
      const json& list = Field(n, path, "normalizers");
      if (!list.is_array()) Fail(path + ".normalizers must be an array");
      for (size_t i = 0; i < list.size(); ++i) {
        LoadNormalizer(list[i], path + ".normalizers[" + std::to_string(i) + "]", state);
      }
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
      state->normalizer.Add(type);
    } else {
      Unsupported(path + ".type", type, "NFC, NFD, NFKC, NFKD, Sequence (or null)");
    }
  }

  void LoadAddedTokens(const json& list, TokenizerState* state) {
    if (!list.is_array()) Fail("added_tokens must be an array");
    for (size_t i = 0; i < list.size(); ++i) {
      const json& t = list[i];
      const std::string path = "added_tokens[" + std::to_string(i) + "]";
      if (!t.is_object()) Fail(path + " must be an object");
      const json& id = Field(t, path, "id");
      if (!IsTokenId(id)) {
        Fail(path + ".id must be an integer in [0, " + std::to_string(kMaxVocabSize) + ")");
      }
      AddedToken token{id.get<int64_t>(),
                       String(Field(t, path, "content"), path + ".content"),
                       Bool(t, path, "special", false),
                       Bool(t, path, "single_word", false),
                       Bool(t, path, "lstrip", false),
                       Bool(t, path, "rstrip", false),
                       Bool(t, path, "normalized", true)};
      if (!IsValidUtf8(token.content)) Fail(path + ".content is not valid UTF-8");
      // tokenizers gives a token that is in the model vocab the vocab's id.
      auto in_vocab = state->vocab.find(token.content);
      if (in_vocab != state->vocab.end() && in_vocab->second != token.id) {
        Fail(path + " \"" + token.content + "\" has id " + std::to_string(token.id) +
             " but the model vocab gives it id " + std::to_string(in_vocab->second));
      }
      state->added_ids[token.content] = token.id;
      state->added_tokens.push_back(std::move(token));
    }
    // Matching order as tokenizers' AddedVocabulary: special tokens first, then the others.
    std::vector<AddedPattern> raw, normalized;
    for (bool special : {true, false}) {
      for (const AddedToken& t : state->added_tokens) {
        if (t.special != special) continue;
        AddedPattern p{t.content, t.id, t.single_word, t.lstrip, t.rstrip, t.special};
        if (t.normalized) {
          state->normalizer.Normalize(t.content, &p.text);
          state->normalized_special |= t.special;
          normalized.push_back(std::move(p));
        } else {
          raw.push_back(std::move(p));
        }
      }
    }
    state->raw_matcher = AddedTokenMatcher(std::move(raw));
    state->normalized_matcher = AddedTokenMatcher(std::move(normalized));
  }

  void AddPreTokenizer(const json& p, const std::string& path, TokenizerState* state) {
    const std::string type = Type(p, path);
    std::unique_ptr<PreTokenizer> made;
    if (type == "Sequence") {
      const json& list = Field(p, path, "pretokenizers");
      if (!list.is_array()) Fail(path + ".pretokenizers must be an array");
      for (size_t i = 0; i < list.size(); ++i) {
        AddPreTokenizer(list[i], path + ".pretokenizers[" + std::to_string(i) + "]", state);
      }
      return;
    }
    try {
      if (type == "ByteLevel") {
        made = MakeByteLevel(Bool(p, path, "add_prefix_space", true),
                             Bool(p, path, "use_regex", true));
      } else if (type == "Digits") {
        made = MakeDigits(Bool(p, path, "individual_digits", false));
      } else if (type == "Split") {
        const json& pattern = Field(p, path, "pattern");
        bool is_regex;
        if (pattern.is_object() && pattern.size() == 1 && pattern.contains("Regex")) {
          is_regex = true;
        } else if (pattern.is_object() && pattern.size() == 1 && pattern.contains("String")) {
          is_regex = false;
        } else {
          Fail(path + ".pattern must be {\"String\": ...} or {\"Regex\": ...}");
        }
        const std::string text =
            String(pattern.begin().value(), path + ".pattern." + pattern.begin().key());
        const json& behavior = Field(p, path, "behavior");
        static const std::unordered_map<std::string, SplitBehavior> kBehaviors = {
            {"Removed", SplitBehavior::kRemoved},
            {"Isolated", SplitBehavior::kIsolated},
            {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
            {"MergedWithNext", SplitBehavior::kMergedWithNext},
            {"Contiguous", SplitBehavior::kContiguous}};
        auto b =
            behavior.is_string() ? kBehaviors.find(behavior.get<std::string>()) : kBehaviors.end();
        if (b == kBehaviors.end()) {
          Unsupported(path + ".behavior", behavior,
                      "Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
        }
        made = MakeSplit(text, is_regex, b->second, Bool(p, path, "invert", false));
      } else {
        Unsupported(path + ".type", type, "ByteLevel, Digits, Split, Sequence");
      }
    } catch (const TokenizerError& e) {
      const std::string what = e.what();
      if (what.rfind(source_ + ": ", 0) == 0) throw;
      Fail(path + ": " + what);
    }
    state->pre_tokenizers.push_back(std::move(made));
  }

  void LoadPreTokenizer(const json& p, TokenizerState* state) {
    if (p.is_null()) {
      Fail("pre_tokenizer null is not supported: a byte-level BPE tokenizer needs ByteLevel");
    }
    AddPreTokenizer(p, "pre_tokenizer", state);
    const auto& list = state->pre_tokenizers;
    const auto byte_levels =
        std::count_if(list.begin(), list.end(), [](const auto& x) { return x->is_byte_level(); });
    if (byte_levels != 1 || !list.back()->is_byte_level()) {
      Fail("pre_tokenizer must end with exactly one ByteLevel (byte-level BPE); this one has " +
           std::to_string(byte_levels));
    }
  }

  void LoadPostProcessor(const json& p, const std::string& path, TokenizerState* state) {
    if (p.is_null()) return;
    const std::string type = Type(p, path);
    if (type == "ByteLevel") return;  // offsets only
    if (type == "Sequence") {
      const json& list = Field(p, path, "processors");
      if (!list.is_array()) Fail(path + ".processors must be an array");
      for (size_t i = 0; i < list.size(); ++i) {
        LoadPostProcessor(list[i], path + ".processors[" + std::to_string(i) + "]", state);
      }
      return;
    }
    if (type != "TemplateProcessing") {
      Unsupported(path + ".type", type, "ByteLevel, TemplateProcessing, Sequence (or null)");
    }
    const json& single = Field(p, path, "single");
    const json& special = p.value("special_tokens", json::object());
    if (!single.is_array()) Fail(path + ".single must be an array");
    std::vector<int64_t> before, after;
    int sequences = 0;
    for (size_t i = 0; i < single.size(); ++i) {
      const json& item = single[i];
      const std::string item_path = path + ".single[" + std::to_string(i) + "]";
      if (item.contains("Sequence")) {
        const json& seq = item["Sequence"];
        if (!seq.is_object() || seq.value("id", json()) != "A") {
          Unsupported(item_path, item, "{\"Sequence\": {\"id\": \"A\"}} in a single template");
        }
        ++sequences;
      } else if (item.contains("SpecialToken")) {
        const std::string name =
            String(Field(item["SpecialToken"], item_path, "id"), item_path + ".SpecialToken.id");
        auto it = special.find(name);
        if (it == special.end() || !it->contains("ids") || !(*it)["ids"].is_array()) {
          Fail(item_path + ": special token \"" + name + "\" is missing from " + path +
               ".special_tokens");
        }
        for (const json& id : (*it)["ids"]) {
          if (!id.is_number_integer()) Fail(path + ".special_tokens ids must be integers");
          (sequences == 0 ? before : after).push_back(id.get<int64_t>());
        }
      } else {
        Unsupported(item_path, item, "SpecialToken, Sequence");
      }
    }
    if (sequences != 1) Fail(path + ".single must hold $A exactly once");
    // A later processor wraps the output of an earlier one.
    state->prefix_ids.insert(state->prefix_ids.begin(), before.begin(), before.end());
    state->suffix_ids.insert(state->suffix_ids.end(), after.begin(), after.end());
  }

  void LoadDecoder(const json& d) {
    if (d.is_null()) Unsupported("decoder", d, "ByteLevel");
    const std::string type = Type(d, "decoder");
    if (type != "ByteLevel") Unsupported("decoder.type", type, "ByteLevel");
  }

  void BuildIdTables(TokenizerState* state) {
    int64_t size = 0;
    for (const auto& [token, id] : state->vocab) size = std::max(size, id + 1);
    for (const AddedToken& t : state->added_tokens) size = std::max(size, t.id + 1);
    state->vocab_size = size;
    const auto n = static_cast<size_t>(size);
    state->tokens.assign(n, std::string());
    state->flags.assign(n, 0);
    for (const auto& [token, id] : state->vocab) {
      state->tokens[id] = token;
      state->flags[id] |= TokenizerState::kKnown;
    }
    std::unordered_set<std::string> special_contents;
    for (const AddedToken& t : state->added_tokens) {
      if (state->vocab.count(t.content) == 0 && (state->flags[t.id] & TokenizerState::kKnown)) {
        Fail("added token \"" + t.content + "\" has id " + std::to_string(t.id) +
             ", which the model vocab gives to \"" + state->tokens[t.id] + "\"");
      }
      state->tokens[t.id] = t.content;
      state->flags[t.id] |= TokenizerState::kKnown;
      if (t.special) {
        state->flags[t.id] |= TokenizerState::kAddedSpecial;
        special_contents.insert(t.content);
      }
    }
    for (int64_t id : state->prefix_ids) state->CheckId(id);
    for (int64_t id : state->suffix_ids) state->CheckId(id);
    // Decoding sees a normalized added token in its normalized form (tokenizers'
    // AddedVocabulary::simple_id_to_token).
    std::vector<std::string> spelling = state->tokens;
    for (const AddedToken& t : state->added_tokens) {
      if (t.normalized) state->normalizer.Normalize(t.content, &spelling[t.id]);
    }
    // The ByteLevel decoder: a token made only of byte-level characters becomes those bytes,
    // any other token stays as its UTF-8 text (tokenizers' decoders ByteLevel::decode_chain).
    state->decoded.assign(n, std::string());
    for (size_t id = 0; id < n; ++id) {
      if (!(state->flags[id] & TokenizerState::kKnown)) continue;
      if (special_contents.count(state->tokens[id])) state->flags[id] |= TokenizerState::kSkippable;
      const std::string& token = spelling[id];
      std::string bytes;
      bool all_byte_level = true;
      for (size_t i = 0; i < token.size() && all_byte_level;) {
        size_t len;
        const int b = ByteLevelByte(DecodeUtf8(token, i, &len));
        all_byte_level = b >= 0;
        bytes.push_back(static_cast<char>(b));
        i += len;
      }
      state->decoded[id] = all_byte_level ? std::move(bytes) : token;
    }
  }

  // Note [Tokens from bytes].
  static void ComputeTokenBound(TokenizerState* state) {
    std::string reason;
    for (const AddedToken& t : state->added_tokens) {
      if ((t.lstrip || t.rstrip) && reason.empty()) {
        reason = "the added token \"" + t.content +
                 "\" takes the whitespace next to it (lstrip / rstrip), however long";
      }
    }
    for (const auto& p : state->pre_tokenizers) {
      if (p->removes_text() && reason.empty())
        reason = "a Split pre-tokenizer removes the text it matches (behavior Removed)";
    }
    std::string dropped;
    for (int b = 0; b < 256; ++b) {
      state->byte_makes_tokens[b] = state->bpe->ByteMakesTokens(static_cast<uint8_t>(b));
      if (state->byte_makes_tokens[b]) continue;
      state->every_byte_makes_tokens = false;
      char hex[8];
      std::snprintf(hex, sizeof(hex), "%s0x%02x", dropped.empty() ? "" : " ", b);
      dropped += hex;
    }
    if (!dropped.empty() && reason.empty()) {
      if (state->bpe->fuse_unk()) {
        reason = "the bytes " + dropped +
                 " have no token, and a run of them, however long, fuses into one unknown token "
                 "(fuse_unk)";
      } else if (!state->normalizer.empty()) {
        reason = "the bytes " + dropped +
                 " have no token and are dropped, and the normalizer changes which bytes a text "
                 "holds";
      }
    }
    state->no_token_bound_reason = reason;
    if (!reason.empty()) return;
    size_t longest = 1;
    for (const std::string& d : state->decoded) longest = std::max(longest, d.size());
    for (const AddedToken& t : state->added_tokens) longest = std::max(longest, t.content.size());
    state->max_bytes_per_token =
        static_cast<int64_t>(longest) * (state->normalizer.empty() ? 1 : kMaxNormalizedShrink);
  }

  std::string source_;
};

}  // namespace

std::shared_ptr<TokenizerState> LoadTokenizerJson(const std::string& source,
                                                  const std::string& json_text) {
  return Loader(source).Load(json_text);
}

}  // namespace tokenizer_detail
}  // namespace vlmgraph
