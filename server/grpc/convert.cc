#include "server/grpc/convert.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "image/image_processor.h"
#include "model/prompt_check.h"
#include "server/core/image_workers.h"
#include "server/core/status.h"

namespace vlmgraph::server {
namespace {

std::string Index(const std::string& field, int i) { return field + "[" + std::to_string(i) + "]"; }

// A client's raw FloatTensor -> the tiles of a (3, H, W) image, or (N, 3, S, S) ready tiles (whose
// grid is unknown: grid_rows = 0).
ImageTiles TensorImageToTiles(const v1::FloatTensor& t, const VlmConfig& cfg, const Limits& limits,
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
  const float* bad = std::find_if(v, v + numel, [](float x) { return !(x >= 0.0f && x <= 1.0f); });
  if (bad != v + numel) {
    const std::string at = Index(field + ".tensor.values", static_cast<int>(bad - v));
    if (!std::isfinite(*bad)) {
      throw InvalidArgument(at + ": not finite: " +
                            std::string(std::isnan(*bad) ? "nan"
                                        : *bad > 0       ? "inf"
                                                         : "-inf") +
                            "; pixel values must lie in [0, 1]");
    }
    std::ostringstream o;
    o << at << ": " << *bad << " is outside [0, 1]; pixel values must lie in [0, 1]";
    throw InvalidArgument(o.str());
  }
  at::Tensor x = at::from_blob(const_cast<float*>(v), shape, at::kFloat).clone();
  if (tiles) {
    ImageTiles t;
    t.tiles = x;
    t.grid_rows = t.grid_cols = shape[0] == 1 ? 1 : 0;
    return t;
  }
  try {
    return TileImage(x, cfg, ImageLimits{limits.max_image_bytes, limits.max_image_pixels});
  } catch (const ImageError& e) {
    throw InvalidArgument(field + ".tensor: " + e.what());
  }
}

ImageTiles ImageToTilesHere(const v1::Image& img, const VlmConfig& cfg, const Limits& limits,
                            const std::string& field) {
  switch (img.source_case()) {
    case v1::Image::kEncoded:
      try {
        return PreprocessEncodedImage(img.encoded(), cfg,
                                      ImageLimits{limits.max_image_bytes, limits.max_image_pixels});
      } catch (const ImageError& e) {
        throw InvalidArgument(field + ": " + e.what());
      }
    case v1::Image::kTensor:
      return TensorImageToTiles(img.tensor(), cfg, limits, field);
    default:
      throw InvalidArgument(field + ": empty image; set `encoded` (PNG/JPEG bytes) or `tensor`");
  }
}

// The tiles `img` will make, from its header or shape alone (0 for an image that its conversion
// will refuse for another reason). Throws what ReadImageSize throws, prefixed with `field`.
int64_t DeclaredTiles(const v1::Image& img, const VlmConfig& cfg, const Limits& limits,
                      const std::string& field) {
  if (img.has_encoded()) {
    try {
      const ImageLimits image_limits{limits.max_image_bytes, limits.max_image_pixels};
      const ImageSize size = ReadImageSize(img.encoded(), image_limits);
      CheckResizeFits(size.height, size.width, cfg, image_limits);
      return ImageTileCount(size.height, size.width, cfg);
    } catch (const ImageError& e) {
      throw InvalidArgument(field + ": " + e.what());
    }
  }
  if (!img.has_tensor()) return 0;
  const auto& shape = img.tensor().shape();
  if (shape.size() == 3 && shape[0] == 3 && shape[1] >= 1 && shape[2] >= 1)
    return ImageTileCount(shape[1], shape[2], cfg);         // an RGB image
  if (shape.size() == 4 && shape[0] >= 1) return shape[0];  // ready tiles
  return 0;
}

// Note [Tiles before decoding]: the images of one request may make at most the engine's
// max_tiles_per_request tiles (MaxTilesPerImage, the engine's default, which the server does not
// change). Each image's tiles follow from its header (PNG IHDR, JPEG SOF) or tensor shape, so a
// request over the limit is refused before any image is decoded (eight 6324x6324 RGBA16 PNGs of
// 311 KB each take 12 s to decode, and make 136 tiles).
void CheckDeclaredTiles(const std::vector<const v1::Image*>& images,
                        const std::vector<std::string>& fields, const VlmConfig& cfg,
                        const Limits& limits, const std::string& field) {
  std::vector<int64_t> tiles;
  for (size_t i = 0; i < images.size(); ++i)
    tiles.push_back(DeclaredTiles(*images[i], cfg, limits, fields[i]));
  try {
    CheckTileCount(tiles, MaxTilesPerImage(cfg), cfg);
  } catch (const ImageError& e) {
    throw InvalidArgument(field + ": " + e.what());
  }
}

}  // namespace

ImageTiles ImageToTiles(const v1::Image& img, const VlmConfig& cfg, const Limits& limits,
                        const std::string& field) {
  // On the image workers: ATen's intra-op threads stay bounded (server/core/image_workers.h).
  return RunImageWork([&] { return ImageToTilesHere(img, cfg, limits, field); });
}

void CheckImageCount(int64_t images, const Limits& limits, const std::string& field) {
  if (images > limits.max_images_per_request) {
    throw InvalidArgument(field + ": " + std::to_string(images) + " images; at most " +
                          std::to_string(limits.max_images_per_request) +
                          " are allowed per request (limits.max_images_per_request)");
  }
}

std::vector<ImageTiles> DecodeImages(const google::protobuf::RepeatedPtrField<v1::Image>& images,
                                     const VlmConfig& cfg, const Limits& limits,
                                     const std::string& field) {
  CheckImageCount(images.size(), limits, field);
  std::vector<const v1::Image*> all;
  std::vector<std::string> fields;
  for (int i = 0; i < images.size(); ++i) {
    all.push_back(&images[i]);
    fields.push_back(Index(field, i));
  }
  CheckDeclaredTiles(all, fields, cfg, limits, field);  // Note [Tiles before decoding]
  std::vector<ImageTiles> out;
  for (int i = 0; i < images.size(); ++i)
    out.push_back(ImageToTiles(images[i], cfg, limits, Index(field, i)));
  return out;
}

at::Tensor JoinTiles(const std::vector<ImageTiles>& images) {
  if (images.empty()) return {};
  if (images.size() == 1) return images[0].tiles;
  std::vector<at::Tensor> tiles;
  for (const ImageTiles& t : images) tiles.push_back(t.tiles);
  return at::cat(tiles, 0);
}

at::Tensor ImagesToTiles(const google::protobuf::RepeatedPtrField<v1::Image>& images,
                         const VlmConfig& cfg, const Limits& limits, const std::string& field) {
  return JoinTiles(DecodeImages(images, cfg, limits, field));
}

std::vector<ChatMessage> ToChatMessages(
    const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages, const VlmConfig& cfg,
    const Limits& limits, std::vector<ImageTiles>* images) {
  std::vector<ChatMessage> out;
  std::vector<const v1::Image*> all;
  std::vector<std::string> fields;
  for (int i = 0; i < messages.size(); ++i) {
    for (int j = 0; j < messages[i].content_size(); ++j) {
      if (!messages[i].content(j).has_image()) continue;
      all.push_back(&messages[i].content(j).image());
      fields.push_back(Index(Index("messages", i) + ".content", j) + ".image");
    }
  }
  CheckImageCount(static_cast<int64_t>(all.size()), limits, "messages");
  CheckDeclaredTiles(all, fields, cfg, limits, "messages");  // Note [Tiles before decoding]
  for (int i = 0; i < messages.size(); ++i) {
    const v1::ChatMessage& m = messages[i];
    ChatMessage msg;
    msg.role = m.role();
    for (int j = 0; j < m.content_size(); ++j) {
      const v1::ContentPart& part = m.content(j);
      const std::string f = Index(Index("messages", i) + ".content", j);
      switch (part.part_case()) {
        case v1::ContentPart::kText:
          msg.content.push_back(ChatContentPart::Text(part.text()));
          break;
        case v1::ContentPart::kImage: {
          ImageTiles t = ImageToTiles(part.image(), cfg, limits, f + ".image");
          if (t.grid_rows == 0) {
            throw InvalidArgument(f +
                                  ".image: ready-made tiles have no grid to describe in the "
                                  "prompt; send the encoded image or a [3, H, W] tensor");
          }
          images->push_back(std::move(t));
          msg.content.push_back(ChatContentPart::Image());
          break;
        }
        default:
          throw InvalidArgument(f + ": empty part; set `text` or `image`");
      }
    }
    out.push_back(std::move(msg));
  }
  return out;
}

Prompt ToPrompt(const google::protobuf::RepeatedField<int64_t>& input_ids, const std::string& text,
                const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages,
                const google::protobuf::RepeatedPtrField<v1::Image>& images,
                bool add_generation_prompt, const VlmConfig& cfg, const Limits& limits,
                const TextModel* text_model) {
  const int forms = !input_ids.empty() + !text.empty() + !messages.empty();
  if (forms != 1) {
    throw InvalidArgument(forms == 0 ? "no prompt: set input_ids, text or messages"
                                     : "set only one of input_ids, text and messages");
  }
  Prompt p;
  if (!input_ids.empty()) {
    p.input_ids.assign(input_ids.begin(), input_ids.end());
    p.tiles = ImagesToTiles(images, cfg, limits, "images");
    return p;
  }
  if (!text_model) {
    throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                      std::string(text.empty() ? "messages" : "text") +
                          ": this model has no tokenizer, so prompts must be input_ids (serve a "
                          "checkpoint with a tokenizer.json, or set the config key tokenizer)");
  }
  // Limits before work: the text's length before any tokenizing or image decoding (Note [Tokens
  // from bytes] in text/tokenizer.cc), the images' tiles before any decoding.
  if (!text.empty()) {
    text_model->CheckTextLength({text}, "text");
    std::vector<ImageTiles> tiles = DecodeImages(images, cfg, limits, "images");
    for (size_t i = 0; i < tiles.size(); ++i) {
      if (tiles[i].grid_rows == 0) {
        throw InvalidArgument(Index("images", static_cast<int>(i)) +
                              ": ready-made tiles have no grid to describe in the prompt; send "
                              "the encoded image or a [3, H, W] tensor");
      }
    }
    return text_model->BuildText(text, tiles);
  }
  if (!images.empty()) {
    throw InvalidArgument("images: a chat prompt carries its images in its messages' content");
  }
  std::vector<std::string_view> texts;
  for (const v1::ChatMessage& m : messages) {
    for (const v1::ContentPart& part : m.content()) {
      if (part.has_text()) texts.push_back(part.text());
    }
  }
  text_model->CheckTextLength(texts, "messages");
  std::vector<ImageTiles> tiles;
  const std::vector<ChatMessage> chat = ToChatMessages(messages, cfg, limits, &tiles);
  return text_model->BuildChat(chat, tiles, add_generation_prompt);
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
                                const Limits& limits, const TextModel* text_model) {
  GenerateRequest out;
  Prompt prompt =
      ToPrompt(request.input_ids(), request.text(), request.messages(), request.images(),
               request.has_add_generation_prompt() ? request.add_generation_prompt() : true, cfg,
               limits, text_model);
  out.input_ids = std::move(prompt.input_ids);
  out.tiles = std::move(prompt.tiles);
  const v1::SamplingParams& s = request.sampling();
  SamplingParams& p = out.sampling;
  p.max_new_tokens = s.has_max_new_tokens() ? s.max_new_tokens() : limits.default_max_new_tokens;
  p.greedy = !s.sample();
  p.temperature = s.has_temperature() ? s.temperature() : 1.0;
  p.top_k = s.top_k();
  p.top_p = s.has_top_p() ? s.top_p() : 1.0;
  p.seed = s.seed();
  p.stop_token_ids.assign(s.stop_token_ids().begin(), s.stop_token_ids().end());
  const bool text_prompt = request.input_ids().empty();
  if (text_prompt && !s.ignore_eos()) {
    for (int64_t id : text_model->default_stop_token_ids()) {
      if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), id) == p.stop_token_ids.end())
        p.stop_token_ids.push_back(id);
    }
  }
  CheckStopStrings({s.stop().begin(), s.stop().end()}, "sampling.stop");
  if (s.stop_size() > 0 && !text_model) {
    throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                      "sampling.stop: this model has no tokenizer to match text with; use "
                      "stop_token_ids");
  }
  // Ranges: Engine::Validate (field names "logprobs.top", "logprobs.prompt_top").
  const v1::LogprobsParams& l = request.logprobs();
  if (l.top() != 0 && !l.tokens()) {
    throw InvalidArgument(
        "logprobs.top: the most likely tokens come with each token's logprob; set "
        "logprobs.tokens too");
  }
  if (l.prompt_top() != 0 && !l.prompt()) {
    throw InvalidArgument(
        "logprobs.prompt_top: the most likely tokens come with the prompt's logprobs; set "
        "logprobs.prompt too");
  }
  out.logprobs.tokens = l.tokens();
  out.logprobs.top = l.top();
  out.logprobs.prompt = l.prompt();
  out.logprobs.prompt_top = l.prompt_top();
  return out;
}

void CheckStopStrings(const std::vector<std::string>& stop, const std::string& field) {
  if (stop.size() > kMaxStopStrings) {
    throw InvalidArgument(field + ": " + std::to_string(stop.size()) + " stop strings; at most " +
                          std::to_string(kMaxStopStrings) + " are allowed");
  }
  for (size_t i = 0; i < stop.size(); ++i) {
    if (stop[i].empty() || stop[i].size() > kMaxStopStringBytes) {
      throw InvalidArgument(Index(field, static_cast<int>(i)) + ": must be 1 .. " +
                            std::to_string(kMaxStopStringBytes) + " bytes long");
    }
  }
}

ForwardRequest ToEngineRequest(const v1::ForwardRequest& request, const VlmConfig& cfg,
                               const Limits& limits, const TextModel* text_model) {
  ForwardRequest out;
  Prompt prompt =
      ToPrompt(request.input_ids(), request.text(), request.messages(), request.images(),
               request.has_add_generation_prompt() && request.add_generation_prompt(), cfg, limits,
               text_model);
  out.input_ids = std::move(prompt.input_ids);
  out.tiles = std::move(prompt.tiles);
  out.target_ids.assign(request.target_ids().begin(), request.target_ids().end());
  if (request.target_next_tokens()) {
    if (!out.target_ids.empty())
      throw InvalidArgument("target_next_tokens: set it or target_ids, not both");
    out.target_ids.assign(out.input_ids.size(), -100);
    for (size_t i = 0; i + 1 < out.input_ids.size(); ++i) {
      if (out.input_ids[i + 1] != cfg.image_token_id) out.target_ids[i] = out.input_ids[i + 1];
    }
  }
  out.logits_positions.assign(request.logits_positions().begin(), request.logits_positions().end());
  if (static_cast<int64_t>(out.logits_positions.size()) > limits.max_logits_positions) {
    throw InvalidArgument("logits_positions: " + std::to_string(out.logits_positions.size()) +
                          " positions; at most " + std::to_string(limits.max_logits_positions) +
                          " are allowed (limits.max_logits_positions)");
  }
  return out;
}

LearningRates ToLearningRates(const v1::TrainConfig& c) {
  LearningRates rates;  // upstream nanoVLM's
  if (c.has_language_learning_rate()) rates.language = c.language_learning_rate();
  if (c.has_vision_learning_rate()) rates.vision = c.vision_learning_rate();
  if (c.has_projector_learning_rate()) rates.projector = c.projector_learning_rate();
  if (auto problem = rates.Check()) {
    throw InvalidArgument("config." + problem->field + ": " + problem->message);
  }
  if (c.trainable_parts_size() == 0) return rates;
  LearningRates listed = LearningRates::All(0);
  for (int i = 0; i < c.trainable_parts_size(); ++i) {
    switch (c.trainable_parts(i)) {
      case v1::MODEL_PART_VISION:
        listed.vision = rates.vision;
        break;
      case v1::MODEL_PART_PROJECTOR:
        listed.projector = rates.projector;
        break;
      case v1::MODEL_PART_LANGUAGE:
        listed.language = rates.language;
        break;
      default:
        throw InvalidArgument("config.trainable_parts[" + std::to_string(i) +
                              "]: must be MODEL_PART_VISION, MODEL_PART_PROJECTOR or "
                              "MODEL_PART_LANGUAGE");
    }
  }
  return listed;
}

std::vector<TrainExample> ToTrainBatch(const v1::TrainBatch& batch, const VlmConfig& cfg,
                                       const Limits& limits, int64_t max_tokens,
                                       const TextModel* text_model) {
  if (batch.examples_size() == 0)
    throw InvalidArgument("batch.examples: is empty; send at least one example");
  if (batch.examples_size() > limits.max_train_batch_examples) {
    throw InvalidArgument("batch.examples: " + std::to_string(batch.examples_size()) +
                          " examples; at most " + std::to_string(limits.max_train_batch_examples) +
                          " (limits.max_train_batch_examples)");
  }
  // The padded step: examples x the longest example. A step larger than every train bucket runs
  // eagerly and holds the GPU thread (every Generate waits) for its whole length: bounded here,
  // from the ids before any work, and again once chat examples are tokenized.
  auto check_step_tokens = [&](int64_t longest) {
    const int64_t step_tokens = longest * batch.examples_size();
    if (limits.max_train_batch_tokens > 0 && step_tokens > limits.max_train_batch_tokens) {
      throw InvalidArgument(
          "batch: " + std::to_string(batch.examples_size()) + " examples of up to " +
          std::to_string(longest) + " tokens make a step of " + std::to_string(step_tokens) +
          " tokens; at most " + std::to_string(limits.max_train_batch_tokens) +
          " (limits.max_train_batch_tokens, by default the largest train bucket): send smaller "
          "batches or shorter examples");
    }
  };
  int64_t longest = 0;
  for (const v1::TrainExample& ex : batch.examples())
    longest = std::max<int64_t>(longest, ex.input_ids_size());
  check_step_tokens(longest);
  std::vector<TrainExample> out;
  int64_t counted = 0;
  for (int i = 0; i < batch.examples_size(); ++i) {
    const v1::TrainExample& ex = batch.examples(i);
    const std::string f = Index("batch.examples", i);
    TrainExample d;
    if (ex.messages_size() > 0) {
      if (ex.input_ids_size() > 0 || ex.target_ids_size() > 0 || ex.images_size() > 0) {
        throw InvalidArgument(f +
                              ": set either messages or input_ids + target_ids (+ images), not "
                              "both; a chat example carries its images in its messages");
      }
      if (text_model == nullptr) {
        throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                          f + ".messages: this model has no tokenizer, so examples must be "
                              "input_ids + target_ids (serve a checkpoint with a tokenizer.json, "
                              "or set the config key tokenizer)");
      }
      TrainingPrompt p = [&] {
        try {
          std::vector<std::string_view> texts;
          for (const v1::ChatMessage& m : ex.messages()) {
            for (const v1::ContentPart& part : m.content()) {
              if (part.has_text()) texts.push_back(part.text());
            }
          }
          text_model->CheckTextLength(texts, "messages");
          std::vector<ImageTiles> tiles;
          const std::vector<ChatMessage> chat = ToChatMessages(ex.messages(), cfg, limits, &tiles);
          return text_model->BuildTrainingChat(chat, tiles);
        } catch (const ServerError& e) {
          throw ServerError(e.code(), f + "." + e.what());
        }
      }();
      d.input_ids = std::move(p.input_ids);
      d.targets = std::move(p.targets);
      d.tiles = std::move(p.tiles);
      CheckPrompt(d.input_ids, d.tiles, cfg, max_tokens, f + ".messages");
    } else {
      d.input_ids.assign(ex.input_ids().begin(), ex.input_ids().end());
      d.targets.assign(ex.target_ids().begin(), ex.target_ids().end());
      d.tiles = ImagesToTiles(ex.images(), cfg, limits, f + ".images");
      CheckPrompt(d.input_ids, d.tiles, cfg, max_tokens, f + ".input_ids");
      const std::string error =
          CheckTargetIds(cfg, d.targets, d.input_ids.size(), f + ".target_ids");
      if (!error.empty()) throw InvalidArgument(error);
    }
    for (int64_t t : d.targets) counted += t != -100;
    longest = std::max<int64_t>(longest, static_cast<int64_t>(d.input_ids.size()));
    out.push_back(std::move(d));
  }
  check_step_tokens(longest);
  if (counted == 0)
    throw InvalidArgument("batch: no target id other than -100; nothing to learn from");
  return out;
}

}  // namespace vlmgraph::server
