// model/vision_language_model.h: the whole nanoVLM (upstream `models/vision_language_model.py`):
// ViT -> modality projector -> image embeddings that replace the `image_token_id` positions of the
// prompt, in order, -> decoder -> tied LM head.
//
//   vlmgraph::VisionLanguageModel m(vlmgraph::VlmConfig::Preset("nanovlm-tiny"));
//   auto out = m->Forward(input_ids, tiles, targets);   // out.logits (B, T, V), out.loss scalar
//   at::Tensor ids = m->GenerateGreedy(input_ids, tiles, 16);
//
// Shapes and dtypes: input_ids/targets (B, T) int64; tiles (N, 3, S, S) in the model's dtype with
// values in [0, 1] (S = vit_img_size), the tiles of batch row 0 first, then row 1, ...; each tile
// fills `mp_image_token_length` image-token positions. Errors: user mistakes (token ids out of
// range, image-token count not matching the tiles) throw std::invalid_argument with what to change.
// Thread rules: not thread-safe; one thread drives a model at a time.
//
// Profiler ranges: EncodeImages, Embed, LanguageModelImpl::Forward and ::CrossEntropySum run
// inside user ranges named vlmgraph::vision_encoder, ::projector, ::embed, ::decoder and
// ::lm_head_loss (the trainer adds vlmgraph::optimizer), which a Kineto / torch.profiler trace
// records; bench/train_regions.py attributes each kernel of an eager training step to one of them,
// backward kernels through their autograd node's sequence number. Free while no profiler runs;
// graph replays run none of them.
#pragma once

#include <torch/nn/module.h>

#include "model/config.h"
#include "model/language_model.h"
#include "model/modality_projector.h"
#include "model/vision_encoder.h"

namespace vlmgraph {

struct ForwardOutput {
  at::Tensor logits;  // (B, T, V), model dtype
  at::Tensor loss;    // scalar float32; undefined without targets
};

class VisionLanguageModelImpl : public torch::nn::Module {
 public:
  explicit VisionLanguageModelImpl(const VlmConfig& cfg);

  // tiles (N, 3, S, S) -> image embedding rows (N * mp_image_token_length, lm_hidden_dim).
  at::Tensor EncodeImages(const at::Tensor& tiles);

  // Token embeddings with image-token positions replaced: the k-th image token of the flattened
  // (B, T) batch (row-major) takes row k of `image_rows` (K, H). Rows beyond the image-token count
  // are ignored, so a padded `image_rows` buffer works; with fewer rows than image tokens the extra
  // tokens repeat the last row (callers validate counts first). No host synchronisation.
  at::Tensor Embed(const at::Tensor& input_ids, const at::Tensor& image_rows);

  // Full forward as upstream's VisionLanguageModel.forward; `tiles` and `targets` may be undefined.
  // Validates ids and image-token counts (host sync), then runs the device path.
  ForwardOutput Forward(const at::Tensor& input_ids, const at::Tensor& tiles,
                        const at::Tensor& targets = {});

  // Mean cross entropy over positions whose target is not -100 (upstream: F.cross_entropy(...,
  // ignore_index=-100)). logits (B, T, V), targets (B, T) int64 -> float32 scalar.
  static at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets);

  // Reference greedy generation with a KV cache: prefill, then `max_new_tokens` argmax steps.
  // Like upstream's generate, every row runs all steps; after a row emits `eos_token_id` (when >=
  // 0) the rest of that row is set to eos. Returns (B, max_new_tokens) int64.
  at::Tensor GenerateGreedy(const at::Tensor& input_ids, const at::Tensor& tiles,
                            int64_t max_new_tokens, int64_t eos_token_id = -1);

  // Throws std::invalid_argument unless every id lies in [0, lm_vocab_size) and the image-token
  // count equals num_tiles * mp_image_token_length.
  void ValidateInputs(const at::Tensor& input_ids, int64_t num_tiles) const;

  VlmConfig cfg;
  VisionEncoder vision_encoder{nullptr};
  LanguageModel decoder{nullptr};
  ModalityProjector MP{nullptr};
};
TORCH_MODULE(VisionLanguageModel);

}  // namespace vlmgraph
