// tests/fuzz/fuzz_util.h: what the libFuzzer targets of tests/fuzz share: the one rule for
// exceptions, the model config, small limits, and a tiny tokenizer and text model.
//
//   extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
//     vlmgraph::fuzz::ExpectOnly<vlmgraph::ImageError>("image", [&] { DecodeImage(...); });
//     return 0;
//   }
//
// A target asserts nothing about results: only that the decoder neither crashes (ASan, UBSan,
// libFuzzer's OOM and timeout checks) nor throws anything but its documented error types.
// ExpectOnly aborts on any other exception, so libFuzzer records the input as a crash.
#pragma once

#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <typeinfo>

#include "model/config.h"
#include "server/config/config.h"
#include "server/core/text_prompt.h"
#include "text/chat_format.h"
#include "text/tokenizer.h"

namespace vlmgraph::fuzz {

template <typename T>
bool IsA(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const T&) {
    return true;
  } catch (...) {
    return false;
  }
}

// Runs `f`; an exception of one of `Expected` is the decoder refusing bad input, anything else
// aborts with its type and message.
template <typename... Expected, typename F>
void ExpectOnly(const char* target, F&& f) {
  try {
    f();
  } catch (...) {
    const std::exception_ptr e = std::current_exception();
    if ((IsA<Expected>(e) || ...)) return;
    const std::type_info* type = abi::__cxa_current_exception_type();
    int status = 0;
    char* name = type ? abi::__cxa_demangle(type->name(), nullptr, nullptr, &status) : nullptr;
    std::string what = "(not a std::exception)";
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
    }
    std::fprintf(stderr, "fuzz_%s: unexpected exception %s: %s\n", target,
                 name ? name : (type ? type->name() : "?"), what.c_str());
    std::free(name);
    std::abort();
  }
}

// The built-in tiny model: 64-pixel tiles, images resized to at most 256 pixels a side.
inline const VlmConfig& TinyConfig() {
  static const VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
  return cfg;
}

// Limits small enough for thousands of executions a second: images of at most 64 KiB and 256 x 256
// pixels, 4 images per request.
inline server::ServerConfig::Limits SmallLimits() {
  server::ServerConfig::Limits l;
  l.max_image_bytes = 64 << 10;
  l.max_image_pixels = 256 * 256;
  l.max_images_per_request = 4;
  l.max_new_tokens = 64;
  l.default_max_new_tokens = 16;
  l.max_logits_positions = 16;
  l.max_train_batch_examples = 4;
  l.max_request_bytes = 1 << 20;
  return l;
}

// GPT-2's bytes_to_unicode: the UTF-8 of the printable code point that stands for byte `b`.
inline std::string ByteLevelText(int b) {
  int next = 256, cp = b;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
    if (x == b) {
      cp = printable ? b : next;
      break;
    }
    if (!printable) ++next;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// A byte-level BPE tokenizer.json for TinyConfig(): ids 0..255 are the bytes, a few merges
// ("th", "he", "the", "in", " t"), ChatML's <|im_start|> / <|im_end|> at 256 / 257 and the
// config's extra tokens (image, global image, r{r}c{c}) from image_token_id on. The same text is
// the seed tests/fuzz/tokenizer_json/tiny.json (tests/fuzz/make_seeds.py writes it).
inline nlohmann::json TinyTokenizerJson() {
  using nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteLevelText(b)] = b;
  const std::string sp = ByteLevelText(' ');
  const std::pair<std::string, std::string> merges[] = {
      {"t", "h"}, {"h", "e"}, {"th", "e"}, {"i", "n"}, {sp, "t"}};
  json merge_list = json::array();
  int64_t id = 258;
  for (const auto& [a, b] : merges) {
    vocab[a + b] = id++;
    merge_list.push_back(a + " " + b);
  }
  json added = json::array();
  auto add = [&added](int64_t token_id, const std::string& text) {
    added.push_back({{"id", token_id},
                     {"content", text},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  };
  add(256, "<|im_start|>");
  add(257, "<|im_end|>");
  id = TinyConfig().image_token_id;
  for (const auto& [name, text] : TinyConfig().vlm_extra_tokens) add(id++, text);
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", merge_list}}}};
}

inline const Tokenizer& TinyTokenizer() {
  static const Tokenizer tokenizer = Tokenizer::FromJson(TinyTokenizerJson().dump());
  return tokenizer;
}

// TinyTokenizer with nanoVLM's ChatML template; default stop token <|im_end|>.
inline const server::TextModel& TinyTextModel() {
  static const server::TextModel text(TinyTokenizer(),
                                      ChatFormat::FromTemplate(TinyConfig().lm_chat_template),
                                      TinyConfig(), /*stop_token_ids=*/{257}, "fuzz tokenizer");
  return text;
}

}  // namespace vlmgraph::fuzz
