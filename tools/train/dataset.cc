#include "tools/train/dataset.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <nlohmann/json.hpp>
#include <sstream>

#include "image/data_url.h"
#include "image/image_processor.h"

namespace vlmgraph::train {
namespace {

using nlohmann::json;

std::string ReadBinary(const std::string& path, const std::string& where) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DatasetError(where + ": cannot read the image file " + path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string StartOf(const std::string& s, size_t n) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < n; ++i)
    out += std::tolower(static_cast<unsigned char>(s[i]));
  return out;
}

// An image_url's bytes: a data URL, a file:// URL or a path relative to `base_dir`. Without
// `read`, a file is only opened (ChatDataset::Check) and "" returned.
std::string ImageBytes(const std::string& url, const std::string& base_dir,
                       const std::string& where, bool read) {
  const std::string head = StartOf(url, 8);
  if (head.rfind("data:", 0) == 0) {
    try {
      return DecodeImageDataUrl(url, int64_t{64} << 20, "64 MiB per image in a dataset");
    } catch (const ImageError& e) {
      throw DatasetError(where + ": url: " + e.what());
    }
  }
  if (head.rfind("http://", 0) == 0 || head.rfind("https://", 0) == 0) {
    throw DatasetError(where +
                       ": remote image URLs are not fetched; download the image and "
                       "give its path (relative to the dataset file)");
  }
  std::string path = head.rfind("file://", 0) == 0 ? url.substr(7) : url;
  if (path.empty()) throw DatasetError(where + ": empty image path");
  if (path.front() != '/' && !base_dir.empty()) path = base_dir + "/" + path;
  if (!read) {
    if (!std::ifstream(path, std::ios::binary))
      throw DatasetError(where + ": cannot read the image file " + path);
    return "";
  }
  return ReadBinary(path, where);
}

}  // namespace

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

ValidationSplit SplitForValidation(int64_t n, double fraction, uint64_t seed) {
  ValidationSplit out;
  if (fraction <= 0) {
    out.train.resize(n);
    std::iota(out.train.begin(), out.train.end(), 0);
    return out;
  }
  const int64_t held = std::max<int64_t>(1, std::llround(fraction * static_cast<double>(n)));
  if (held >= n) {
    throw DatasetError("train.val_fraction " + std::to_string(fraction) + " of " +
                       std::to_string(n) + " examples leaves none to train on; lower it or " +
                       "give a separate train.val_dataset");
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // A stream of its own (not the data order's seeds): the split never moves with the epoch.
  uint64_t state = seed ^ 0x76616C5F73706C74ull;  // "val_splt"
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(SplitMix64(state) % static_cast<uint64_t>(i + 1));
    std::swap(order[i], order[j]);
  }
  out.validation.assign(order.begin(), order.begin() + held);
  out.train.assign(order.begin() + held, order.end());
  std::sort(out.validation.begin(), out.validation.end());
  std::sort(out.train.begin(), out.train.end());
  return out;
}

ChatExample ParseChatExample(const std::string& line, const std::string& base_dir,
                             const std::string& where, bool read_images) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    throw DatasetError(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("messages"))
    throw DatasetError(where + ": each line must be an object {\"messages\": [...]}");
  const json& messages = j["messages"];
  if (!messages.is_array() || messages.empty())
    throw DatasetError(where + ": messages: must be a non-empty list of messages");
  ChatExample out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string path = where + ": messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw DatasetError(path + ": must be an object with a string role and content");
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";  // OpenAI's newer name for the system role
    ChatMessage message{role, {}};
    const json content = m.contains("content") ? m["content"] : json();
    if (content.is_string()) {
      message.content.push_back(ChatContentPart::Text(content.get<std::string>()));
    } else if (content.is_array()) {
      for (size_t k = 0; k < content.size(); ++k) {
        const json& part = content[k];
        const std::string ppath = path + ".content[" + std::to_string(k) + "]";
        const std::string type =
            part.is_object() && part.contains("type") && part["type"].is_string()
                ? part["type"].get<std::string>()
                : "";
        if (type == "text") {
          if (!part.contains("text") || !part["text"].is_string())
            throw DatasetError(ppath + ".text: required, a string");
          message.content.push_back(ChatContentPart::Text(part["text"].get<std::string>()));
        } else if (type == "image_url") {
          const json image = part.contains("image_url") ? part["image_url"] : json();
          std::string url;
          if (image.is_string()) {
            url = image.get<std::string>();
          } else if (image.is_object() && image.contains("url") && image["url"].is_string()) {
            url = image["url"].get<std::string>();
          } else {
            throw DatasetError(ppath +
                               ".image_url: required, as {\"url\": \"images/cat.png\"} (a path "
                               "relative to the dataset file) or a data URL");
          }
          out.images.push_back(ImageBytes(url, base_dir, ppath + ".image_url.url", read_images));
          message.content.push_back(ChatContentPart::Image());
        } else {
          throw DatasetError(ppath + ".type: '" + type +
                             "' is not supported; use text or image_url");
        }
      }
    } else if (!content.is_null()) {
      throw DatasetError(path + ".content: must be a string or a list of content parts");
    }
    out.messages.push_back(std::move(message));
  }
  return out;
}

ChatDataset ChatDataset::Open(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw DatasetError(path + ": cannot read the dataset file");
  ChatDataset d;
  d.path_ = path;
  const size_t slash = path.rfind('/');
  d.base_dir_ = slash == std::string::npos ? "." : path.substr(0, slash);
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    d.lines_.push_back(line);
    d.line_numbers_.push_back(n);
  }
  if (d.lines_.empty())
    throw DatasetError(path + ": no examples; write one {\"messages\": [...]} per line");
  return d;
}

void ChatDataset::Check(int64_t max_errors) const {
  std::string errors;
  int64_t bad = 0;
  for (size_t i = 0; i < lines_.size(); ++i) {
    const std::string where = path_ + ":" + std::to_string(line_numbers_[i]);
    try {
      ParseChatExample(lines_[i], base_dir_, where, /*read_images=*/false);
    } catch (const DatasetError& e) {
      if (++bad <= max_errors) errors += std::string(errors.empty() ? "" : "\n") + e.what();
    }
  }
  if (bad == 0) return;
  throw DatasetError(std::to_string(bad) + " of " + std::to_string(lines_.size()) +
                     " examples cannot be used" +
                     (bad > max_errors ? " (the first " + std::to_string(max_errors) + ")" : "") +
                     ":\n" + errors);
}

TrainExample ChatDataset::Example(int64_t index, const server::TextModel& text,
                                  const VlmConfig& cfg, int64_t max_tokens,
                                  const std::string& max_tokens_hint, int64_t max_tiles) const {
  const std::string where = path_ + ":" + std::to_string(line_numbers_.at(index));
  ChatExample chat = ParseChatExample(lines_.at(index), base_dir_, where);
  std::vector<ImageTiles> images;
  for (size_t i = 0; i < chat.images.size(); ++i) {
    try {
      images.push_back(PreprocessEncodedImage(chat.images[i], cfg, ImageLimits{}));
    } catch (const std::exception& e) {
      throw DatasetError(where + ": image " + std::to_string(i) + ": " + e.what());
    }
  }
  server::TrainingPrompt p;
  try {
    p = text.BuildTrainingChat(chat.messages, images);
  } catch (const std::exception& e) {
    throw DatasetError(where + ": " + e.what());
  }
  const int64_t n = static_cast<int64_t>(p.input_ids.size());
  if (max_tokens > 0 && n > max_tokens) {
    throw DatasetError(where + ": the conversation makes " + std::to_string(n) +
                       " tokens, more than " + std::to_string(max_tokens) + " (" + max_tokens_hint +
                       "); shorten it or raise that setting");
  }
  const int64_t tiles = p.tiles.defined() ? p.tiles.size(0) : 0;
  if (tiles > max_tiles) {
    throw DatasetError(where + ": its images make " + std::to_string(tiles) +
                       " tiles, more than train.max_tiles_per_example (" +
                       std::to_string(max_tiles) + ")");
  }
  TrainExample e;
  e.input_ids = std::move(p.input_ids);
  e.targets = std::move(p.targets);
  e.tiles = p.tiles;
  return e;
}

}  // namespace vlmgraph::train
