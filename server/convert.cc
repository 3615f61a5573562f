#include "server/convert.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>

#include "model/image_processor.h"
#include "model/prompt_check.h"
#include "server/status.h"

namespace vlmgraph::server {
namespace {

std::string Index(const std::string& field, int i) { return field + "[" + std::to_string(i) + "]"; }

// A client's raw FloatTensor -> (3, H, W) image or (N, 3, S, S) ready tiles.
at::Tensor TensorImageToTiles(const v1::FloatTensor& t, const VlmConfig& cfg, const Limits& limits,
                              const std::string& field) {
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 1) throw InvalidArgument(field + ".tensor.shape: every dimension must be >= 1");
    if (numel > (int64_t{1} << 40) / d)
      throw InvalidArgument(field + ".tensor.shape: too many elements");
    numel *= d;
  }
  const int64_t s = cfg.vit_img_size;
  const bool image = shape.size() == 3 && shape[0] == 3;
  const bool tiles = shape.size() == 4 && shape[1] == 3 && shape[2] == s && shape[3] == s;
  if (!image && !tiles) {
    throw InvalidArgument(field + ".tensor.shape: must be [3, H, W] (an RGB image) or [N, 3, " +
                          std::to_string(s) + ", " + std::to_string(s) + "] (ready tiles)");
  }
  const int64_t pixels = image ? shape[1] * shape[2] : shape[0] * s * s;
  if (pixels > limits.max_image_pixels) {
    throw InvalidArgument(field + ".tensor: " + std::to_string(pixels) + " pixels; at most " +
                          std::to_string(limits.max_image_pixels) +
                          " are allowed (limits.max_image_pixels)");
  }
  if (t.values_size() != numel) {
    throw InvalidArgument(field + ".tensor.values: has " + std::to_string(t.values_size()) +
                          " values; shape needs " + std::to_string(numel));
  }
  const float* v = t.values().data();
  if (!std::all_of(v, v + numel, [](float x) { return x >= 0.0f && x <= 1.0f; })) {
    throw InvalidArgument(field +
                          ".tensor.values: pixel values must lie in [0, 1] (NaN is not allowed)");
  }
  at::Tensor x = at::from_blob(const_cast<float*>(v), shape, at::kFloat).clone();
  if (tiles) return x;
  try {
    return TileImage(x, cfg).tiles;
  } catch (const ImageError& e) {
    throw InvalidArgument(field + ".tensor: " + e.what());
  }
}

}  // namespace

at::Tensor ImagesToTiles(const google::protobuf::RepeatedPtrField<v1::Image>& images,
                         const VlmConfig& cfg, const Limits& limits, const std::string& field) {
  if (images.size() > limits.max_images_per_request) {
    throw InvalidArgument(field + ": " + std::to_string(images.size()) + " images; at most " +
                          std::to_string(limits.max_images_per_request) +
                          " are allowed per request (limits.max_images_per_request)");
  }
  std::vector<at::Tensor> tiles;
  const ImageLimits image_limits{limits.max_image_bytes, limits.max_image_pixels};
  for (int i = 0; i < images.size(); ++i) {
    const v1::Image& img = images[i];
    const std::string f = Index(field, i);
    switch (img.source_case()) {
      case v1::Image::kEncoded:
        try {
          tiles.push_back(PreprocessEncodedImage(img.encoded(), cfg, image_limits).tiles);
        } catch (const ImageError& e) {
          throw InvalidArgument(f + ": " + e.what());
        }
        break;
      case v1::Image::kTensor:
        tiles.push_back(TensorImageToTiles(img.tensor(), cfg, limits, f));
        break;
      default:
        throw InvalidArgument(f + ": empty image; set `encoded` (PNG/JPEG bytes) or `tensor`");
    }
  }
  if (tiles.empty()) return {};
  return tiles.size() == 1 ? tiles[0] : at::cat(tiles, 0);
}

void CheckPrompt(const std::vector<int64_t>& ids, const at::Tensor& tiles, const VlmConfig& cfg,
                 int64_t max_tokens, const std::string& field) {
  if (ids.empty()) throw InvalidArgument(field + " is empty; send at least one token id");
  if (static_cast<int64_t>(ids.size()) > max_tokens) {
    throw InvalidArgument(field + ": " + std::to_string(ids.size()) +
                          " tokens exceed the longest context bucket (" +
                          std::to_string(max_tokens) + " tokens, buckets.context_lens)");
  }
  const std::string error = CheckPromptIds(cfg, ids.data(), ids.size(), TileCount(tiles), field);
  if (!error.empty()) throw InvalidArgument(error);
}

GenerateRequest ToEngineRequest(const v1::GenerateRequest& request, const VlmConfig& cfg,
                                const Limits& limits) {
  GenerateRequest out;
  out.input_ids.assign(request.input_ids().begin(), request.input_ids().end());
  out.tiles = ImagesToTiles(request.images(), cfg, limits, "images");
  const v1::SamplingParams& s = request.sampling();
  SamplingParams& p = out.sampling;
  p.max_new_tokens = s.has_max_new_tokens() ? s.max_new_tokens() : limits.default_max_new_tokens;
  if (p.max_new_tokens < 1) {
    throw InvalidArgument("sampling.max_new_tokens: must be >= 1, got " +
                          std::to_string(p.max_new_tokens));
  }
  if (p.max_new_tokens > limits.max_new_tokens) {
    throw InvalidArgument("sampling.max_new_tokens: " + std::to_string(p.max_new_tokens) +
                          " exceeds the limit of " + std::to_string(limits.max_new_tokens) +
                          " (limits.max_new_tokens)");
  }
  p.greedy = !s.sample();
  p.temperature = s.has_temperature() ? s.temperature() : 1.0;
  p.top_k = s.top_k();
  p.top_p = s.has_top_p() ? s.top_p() : 1.0;
  p.seed = s.seed();
  p.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  if (!p.greedy) {
    if (!(p.temperature > 0) || !std::isfinite(p.temperature)) {
      throw InvalidArgument("sampling.temperature: must be > 0 when sampling");
    }
    if (!(p.top_p > 0 && p.top_p <= 1)) throw InvalidArgument("sampling.top_p: must lie in (0, 1]");
    if (p.top_k < 0) throw InvalidArgument("sampling.top_k: must be >= 0 (0 disables it)");
  }
  return out;
}

ForwardRequest ToEngineRequest(const v1::ForwardRequest& request, const VlmConfig& cfg,
                               const Limits& limits) {
  ForwardRequest out;
  out.input_ids.assign(request.input_ids().begin(), request.input_ids().end());
  out.tiles = ImagesToTiles(request.images(), cfg, limits, "images");
  out.target_ids.assign(request.target_ids().begin(), request.target_ids().end());
  out.logits_positions.assign(request.logits_positions().begin(), request.logits_positions().end());
  if (static_cast<int64_t>(out.logits_positions.size()) > limits.max_logits_positions) {
    throw InvalidArgument("logits_positions: " + std::to_string(out.logits_positions.size()) +
                          " positions; at most " + std::to_string(limits.max_logits_positions) +
                          " are allowed (limits.max_logits_positions)");
  }
  return out;
}

std::vector<TrainExampleData> ToTrainBatch(const v1::TrainBatch& batch, const VlmConfig& cfg,
                                           const Limits& limits, int64_t max_tokens) {
  if (batch.examples_size() == 0)
    throw InvalidArgument("batch.examples: is empty; send at least one example");
  if (batch.examples_size() > limits.max_train_batch_examples) {
    throw InvalidArgument("batch.examples: " + std::to_string(batch.examples_size()) +
                          " examples; at most " + std::to_string(limits.max_train_batch_examples) +
                          " (limits.max_train_batch_examples)");
  }
  std::vector<TrainExampleData> out;
  int64_t counted = 0;
  for (int i = 0; i < batch.examples_size(); ++i) {
    const v1::TrainExample& ex = batch.examples(i);
    const std::string f = Index("batch.examples", i);
    TrainExampleData d;
    d.input_ids.assign(ex.input_ids().begin(), ex.input_ids().end());
    d.target_ids.assign(ex.target_ids().begin(), ex.target_ids().end());
    d.tiles = ImagesToTiles(ex.images(), cfg, limits, f + ".images");
    CheckPrompt(d.input_ids, d.tiles, cfg, max_tokens, f + ".input_ids");
    const std::string error =
        CheckTargetIds(cfg, d.target_ids, d.input_ids.size(), f + ".target_ids");
    if (!error.empty()) throw InvalidArgument(error);
    for (int64_t t : d.target_ids) counted += t != -100;
    out.push_back(std::move(d));
  }
  if (counted == 0)
    throw InvalidArgument("batch: no target id other than -100; nothing to learn from");
  return out;
}

std::string ResolveCheckpointDir(const std::string& root, const std::string& name) {
  if (name.empty()) throw InvalidArgument("save.directory: must not be empty");
  const bool chars_ok = std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
           c == '/';
  });
  if (!chars_ok)
    throw InvalidArgument(
        "save.directory: only letters, digits, '.', '_', '-' and '/' are allowed");
  if (name.front() == '/')
    throw InvalidArgument("save.directory: must be relative to train.checkpoint_dir");
  std::stringstream ss(name);
  for (std::string part; std::getline(ss, part, '/');) {
    if (part == "..") throw InvalidArgument("save.directory: must not contain '..'");
  }
  return (std::filesystem::absolute(root) / name).lexically_normal().string();
}

}  // namespace vlmgraph::server
