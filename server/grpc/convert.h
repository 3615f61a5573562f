// server/grpc/convert.h: protobuf requests -> engine requests (the gRPC API's parsing).
//
// Runs before a request is queued (on a synchronous handler's thread, or a Generate prepare
// thread: server/grpc/service.h), so bad input is refused at once and image decoding runs in
// parallel across requests. Checks here are only the ones the engine cannot make: the proto's
// shapes (one prompt form, set fields), images (bytes, format, pixels, tiles from their headers
// before decoding), stop strings, text length before tokenizing, and the Forward and Train limits.
// Whether a generation or scoring request is valid (ids, image tokens, max_new_tokens >= 1 and
// within limits.max_new_tokens, context fit, sampling ranges, stop ids) is decided by
// Engine::Validate alone, once, after the conversion:
//
//   ValidatedRequest r =
//       engine.Validate(ToEngineRequest(proto, engine.model_config(), config.limits, text));
//
// The engine's field names (EngineError::field(): "input_ids", "sampling.max_new_tokens", ...)
// are the gRPC request's field paths, so its messages reach gRPC clients as they are (one status
// mapping: server/core/status.h).
//
// Errors: ServerError INVALID_ARGUMENT whose message starts with the field path
// ("images[1]: unknown image format ..."). Thread rules: pure functions.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/engine_types.h"
#include "engine/trainer.h"
#include "image/image_processor.h"
#include "model/config.h"
#include "server/config/config.h"
#include "server/core/text_prompt.h"
#include "server/core/text_stream.h"
#include "text/chat_format.h"
#include "vlmgraph/v1/chat.pb.h"
#include "vlmgraph/v1/forward.pb.h"
#include "vlmgraph/v1/generate.pb.h"
#include "vlmgraph/v1/train.pb.h"

namespace vlmgraph::server {

using Limits = ServerConfig::Limits;

// One image -> its tiles and grid. Ready-made tiles ([N, 3, S, S] tensors) have grid_rows = 0
// (unknown) unless N is 1. `field` prefixes error messages ("images[0]").
ImageTiles ImageToTiles(const v1::Image& image, const VlmConfig& cfg, const Limits& limits,
                        const std::string& field);
// Every image of a request, in order, after checking limits.max_images_per_request and, from the
// headers and tensor shapes before anything is decoded, the images' pixels and their tiles
// against the engine's max_tiles_per_request (MaxTilesPerImage; Note [Tiles before decoding]).
std::vector<ImageTiles> DecodeImages(const google::protobuf::RepeatedPtrField<v1::Image>& images,
                                     const VlmConfig& cfg, const Limits& limits,
                                     const std::string& field);
// The tiles of `images` concatenated in order: (N, 3, S, S) float32 CPU, undefined when empty.
at::Tensor JoinTiles(const std::vector<ImageTiles>& images);
// DecodeImages + JoinTiles.
at::Tensor ImagesToTiles(const google::protobuf::RepeatedPtrField<v1::Image>& images,
                         const VlmConfig& cfg, const Limits& limits, const std::string& field);
// Throws INVALID_ARGUMENT when `images` exceeds limits.max_images_per_request.
void CheckImageCount(int64_t images, const Limits& limits, const std::string& field);
// Chat messages -> the chat format's messages; their images are decoded into `images` in order,
// after the checks DecodeImages makes first.
std::vector<ChatMessage> ToChatMessages(
    const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages, const VlmConfig& cfg,
    const Limits& limits, std::vector<ImageTiles>* images);
// At most kMaxStopStrings strings of 1 .. kMaxStopStringBytes bytes.
void CheckStopStrings(const std::vector<std::string>& stop, const std::string& field);

// The prompt of a request: exactly one of input_ids (with `images`), text (with `images`) and
// messages. Text and messages need `text_model` (FAILED_PRECONDITION without one); their length is
// checked before any image is decoded or any text tokenized (TextModel::CheckTextLength:
// PromptTooLong, INVALID_ARGUMENT).
Prompt ToPrompt(const google::protobuf::RepeatedField<int64_t>& input_ids, const std::string& text,
                const google::protobuf::RepeatedPtrField<v1::ChatMessage>& messages,
                const google::protobuf::RepeatedPtrField<v1::Image>& images,
                bool add_generation_prompt, const VlmConfig& cfg, const Limits& limits,
                const TextModel* text_model);

// `text_model` may be null (a model without a tokenizer: input_ids prompts only). Text and chat
// prompts stop on text_model's default stop tokens unless sampling.ignore_eos. Unset
// sampling.max_new_tokens: limits.default_max_new_tokens; the values are checked by
// Engine::Validate, not here.
GenerateRequest ToEngineRequest(const v1::GenerateRequest& request, const VlmConfig& cfg,
                                const Limits& limits, const TextModel* text_model = nullptr);
ForwardRequest ToEngineRequest(const v1::ForwardRequest& request, const VlmConfig& cfg,
                               const Limits& limits, const TextModel* text_model = nullptr);

// The batch's training examples (engine/trainer.h), checked: ids and targets in the vocabulary
// (targets may be -100), same length, image tokens matching the tiles ((N, 3, S, S) float32 CPU
// or undefined). `max_tokens`: the longest example accepted (the engine's longest context).
// Chat examples (TrainExample.messages) are built by text_model->BuildTrainingChat (the loss on
// the assistant turns); FAILED_PRECONDITION for one when `text_model` is null.
std::vector<TrainExample> ToTrainBatch(const v1::TrainBatch& batch, const VlmConfig& cfg,
                                       const Limits& limits, int64_t max_tokens,
                                       const TextModel* text_model = nullptr);

// The job's learning rates (Note [Learning rates] in engine/learning_rates.h) from TrainConfig:
// upstream nanoVLM's for unset fields, each checked against [0, 1] by LearningRates::Check
// (INVALID_ARGUMENT "config.<group>_learning_rate: must lie in [0, 1], got ..."); with
// trainable_parts, every part not listed gets rate 0 (frozen; INVALID_ARGUMENT
// "config.trainable_parts[i]: ..." for a value that names no part). The one conversion of the
// API's rates.
LearningRates ToLearningRates(const v1::TrainConfig& config);

// Checks a prompt before any work: 1 .. max_tokens ids, each inside the vocabulary, and as many
// image tokens as the tiles give embeddings; `field` names the ids in messages. Train examples
// use it (the trainer has no Validate; an over-long example would otherwise run eagerly at any
// size); Generate and Forward get these checks from Engine::Validate.
void CheckPrompt(const std::vector<int64_t>& ids, const at::Tensor& tiles, const VlmConfig& cfg,
                 int64_t max_tokens, const std::string& field);

}  // namespace vlmgraph::server
