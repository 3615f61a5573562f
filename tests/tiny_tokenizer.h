// tests/tiny_tokenizer.h: a byte-level BPE tokenizer.json for the tiny preset's vocabulary, for the
// server tests that need text (prompts, chat, the OpenAI-compatible API) without a real model.
//
//   std::ofstream(dir / "tokenizer.json") << TinyTokenizerJson(VlmConfig::Preset("nanovlm-tiny"));
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"

namespace vlmgraph::testing {

inline std::string Utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's bytes_to_unicode: the printable code point standing for each byte.
inline std::vector<std::string> ByteSymbols() {
  std::vector<std::string> out(256);
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    out[b] = Utf8(printable ? b : next++);
  }
  return out;
}

// A byte-level BPE tokenizer for `cfg`: ids 0..255 are the bytes, a few merges, then
// <|im_start|> / <|im_end|> at 256 / 257 and nanoVLM's extra tokens at lm_base_vocab_size...
inline nlohmann::json TinyTokenizerJson(const VlmConfig& cfg) {
  const std::vector<std::string> sym = ByteSymbols();
  using nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[sym[b]] = b;
  vocab["ab"] = 300;
  json added = json::array();
  auto add = [&added](int64_t id, const std::string& text) {
    added.push_back({{"id", id},
                     {"content", text},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  };
  add(256, "<|im_start|>");
  add(257, "<|im_end|>");
  int64_t id = cfg.lm_base_vocab_size;
  for (const auto& [name, text] : cfg.vlm_extra_tokens) add(id++, text);
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "ByteLevel"},
            {"add_prefix_space", false},
            {"trim_offsets", true},
            {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder",
           {{"type", "ByteLevel"},
            {"add_prefix_space", true},
            {"trim_offsets", true},
            {"use_regex", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"vocab", vocab},
            {"merges", json::array({"a b"})}}}};
}

}  // namespace vlmgraph::testing
