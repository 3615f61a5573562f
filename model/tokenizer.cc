#include "model/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "model/tokenizer_added_tokens.h"
#include "model/tokenizer_bpe.h"
#include "model/tokenizer_pre_tokenizer.h"
#include "model/tokenizer_unicode.h"

namespace vlmgraph {
namespace tokenizer_detail {

using json = nlohmann::json;

// Everything a loaded tokenizer.json holds; immutable once built (the BPE cache locks itself).
struct TokenizerState {
  std::unique_ptr<BpeModel> bpe;
  std::unordered_map<std::string, int64_t> vocab;  // model vocab, as tokenizer.json spells it
  std::vector<AddedToken> added_tokens;
  std::unordered_map<std::string, int64_t> added_ids;  // content -> id
  AddedTokenMatcher raw_matcher;         // tokens with normalized = false, on the input
  AddedTokenMatcher normalized_matcher;  // the others, on the normalized text
  Normalizer normalizer;
  std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers;  // ByteLevel last
  std::vector<int64_t> prefix_ids, suffix_ids;  // the post-processor's template around $A
  int64_t vocab_size = 0;

  // By id: the token string, the bytes the ByteLevel decoder turns it into, and flags.
  enum Flags : uint8_t { kKnown = 1, kSkippable = 2, kAddedSpecial = 4 };
  std::vector<std::string> tokens;
  std::vector<std::string> decoded;
  std::vector<uint8_t> flags;

  bool Known(int64_t id) const {
    return id >= 0 && id < vocab_size && (flags[static_cast<size_t>(id)] & kKnown);
  }
  void CheckId(int64_t id) const {
    if (!Known(id)) {
      throw TokenizerError("token id " + std::to_string(id) + " is not in the vocabulary (size " +
                           std::to_string(vocab_size) + ")");
    }
  }
};

namespace {

// ---- Loading ----------------------------------------------------------------------------------

// Token ids lie below kMaxVocabSize (2^22, 16 times the largest vocabularies in use): the id tables
// are sized by the largest id, so one huge id in a small file would allocate without bound.
constexpr int64_t kMaxVocabSize = int64_t{1} << 22;

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
        AddedPattern p{t.content, t.id, t.single_word, t.lstrip, t.rstrip};
        if (t.normalized) {
          state->normalizer.Normalize(t.content, &p.text);
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

  std::string source_;
};

// ---- Encoding ---------------------------------------------------------------------------------

// Reused buffers of one thread's Encode calls.
struct EncodeScratch {
  std::vector<AddedSegment> raw_segments, normalized_segments;
  std::string normalized;
  PreTokenizeScratch pre;
};

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

// Text between raw added tokens: normalize, find normalized added tokens, encode the rest.
void EncodeRawPiece(const TokenizerState& s, std::string_view piece, EncodeScratch* scratch,
                    std::vector<int64_t>* ids) {
  std::string_view text = piece;
  if (!s.normalizer.empty() && s.normalizer.Normalize(piece, &scratch->normalized)) {
    text = scratch->normalized;
  }
  if (s.normalized_matcher.empty()) {
    PreTokenizeAndEncode(s, 0, text, &scratch->pre, ids);
    return;
  }
  std::vector<AddedSegment>& segments = scratch->normalized_segments;
  s.normalized_matcher.Split(text, &segments);
  for (const AddedSegment& seg : segments) {
    if (seg.id >= 0) {
      ids->push_back(seg.id);
    } else {
      PreTokenizeAndEncode(s, 0, text.substr(seg.begin, seg.end - seg.begin), &scratch->pre, ids);
    }
  }
}

}  // namespace
}  // namespace tokenizer_detail

using tokenizer_detail::TokenizerState;

Tokenizer::Tokenizer(std::shared_ptr<const TokenizerState> state) : state_(std::move(state)) {}

Tokenizer Tokenizer::FromFile(const std::string& tokenizer_json_path) {
  std::ifstream in(tokenizer_json_path, std::ios::binary);
  if (!in) throw TokenizerError(tokenizer_json_path + ": cannot open the file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw TokenizerError(tokenizer_json_path + ": read error");
  return Tokenizer(tokenizer_detail::Loader(tokenizer_json_path).Load(text.str()));
}

Tokenizer Tokenizer::FromJson(const std::string& json_text) {
  return Tokenizer(tokenizer_detail::Loader("tokenizer.json").Load(json_text));
}

std::vector<int64_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  const TokenizerState& s = *state_;
  const size_t bad = tokenizer_detail::FirstInvalidUtf8(text);
  if (bad != text.size()) {
    throw TokenizerError("Encode: the text is not valid UTF-8 (byte offset " + std::to_string(bad) +
                         ")");
  }
  thread_local tokenizer_detail::EncodeScratch scratch;
  scratch.pre.SpansFor(s.pre_tokenizers.size());  // sized up front: stages hold references
  scratch.pre.owned.clear();
  std::vector<int64_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids.insert(ids.end(), s.prefix_ids.begin(), s.prefix_ids.end());
  std::vector<tokenizer_detail::AddedSegment>& segments = scratch.raw_segments;
  s.raw_matcher.Split(text, &segments);
  for (const auto& seg : segments) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
    } else {
      EncodeRawPiece(s, text.substr(seg.begin, seg.end - seg.begin), &scratch, &ids);
    }
  }
  scratch.pre.owned.clear();
  if (add_special_tokens) ids.insert(ids.end(), s.suffix_ids.begin(), s.suffix_ids.end());
  return ids;
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
