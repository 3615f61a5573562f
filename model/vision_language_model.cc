#include "model/vision_language_model.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <stdexcept>

#include "model/prompt_check.h"

namespace vlmgraph {

VisionLanguageModelImpl::VisionLanguageModelImpl(const VlmConfig& config) : cfg(config) {
  cfg.Validate();
  vision_encoder = register_module("vision_encoder", VisionEncoder(cfg));
  decoder = register_module("decoder", LanguageModel(cfg));
  MP = register_module("MP", ModalityProjector(cfg));
}

at::Tensor VisionLanguageModelImpl::EncodeImages(const at::Tensor& tiles) {
  at::Tensor patches;
  {
    RECORD_USER_SCOPE("vlmgraph::vision_encoder");
    patches = vision_encoder->forward(tiles);
  }
  RECORD_USER_SCOPE("vlmgraph::projector");
  at::Tensor e = MP->forward(patches);  // (N, tokens, H)
  return e.reshape({-1, e.size(-1)});
}

at::Tensor VisionLanguageModelImpl::Embed(const at::Tensor& input_ids,
                                          const at::Tensor& image_rows) {
  RECORD_USER_SCOPE("vlmgraph::embed");
  at::Tensor tok = decoder->token_embedding->forward(input_ids);  // (B, T, H)
  if (!image_rows.defined() || image_rows.size(0) == 0) return tok;
  at::Tensor is_image = input_ids.eq(cfg.image_token_id);
  at::Tensor row = (is_image.flatten().cumsum(0) - 1).clamp(0, image_rows.size(0) - 1);
  at::Tensor img = image_rows.index_select(0, row).view(tok.sizes()).to(tok.scalar_type());
  return at::where(is_image.unsqueeze(-1), img, tok);
}

void VisionLanguageModelImpl::ValidateInputs(const at::Tensor& input_ids, int64_t num_tiles) const {
  if (input_ids.dim() != 2) {
    throw std::invalid_argument("input_ids must be (batch, seq_len), got " +
                                std::to_string(input_ids.dim()) + " dims");
  }
  if (input_ids.size(1) > cfg.lm_max_position_embeddings) {
    throw std::invalid_argument("sequence of " + std::to_string(input_ids.size(1)) +
                                " tokens exceeds lm_max_position_embeddings=" +
                                std::to_string(cfg.lm_max_position_embeddings));
  }
  if (input_ids.numel() == 0) return;
  at::Tensor ids = input_ids.to(at::kCPU, at::kLong).contiguous();
  // The whole batch, row-major: the k-th image token takes the k-th embedding row.
  const std::string error = CheckPromptIds(
      cfg, ids.data_ptr<int64_t>(), static_cast<size_t>(ids.numel()), num_tiles, "input_ids");
  if (!error.empty()) throw std::invalid_argument(error);
}

ForwardOutput VisionLanguageModelImpl::Forward(const at::Tensor& input_ids, const at::Tensor& tiles,
                                               const at::Tensor& targets) {
  const int64_t num_tiles = tiles.defined() ? tiles.size(0) : 0;
  ValidateInputs(input_ids, num_tiles);
  at::Tensor image_rows = num_tiles > 0 ? EncodeImages(tiles) : at::Tensor();
  at::Tensor hidden = decoder->Forward(Embed(input_ids, image_rows));
  ForwardOutput out;
  out.logits = decoder->Logits(hidden);
  if (targets.defined()) out.loss = Loss(out.logits, targets);
  return out;
}

at::Tensor VisionLanguageModelImpl::Loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                targets.reshape({-1}), /*weight=*/{}, at::Reduction::Mean,
                                /*ignore_index=*/-100);
}

at::Tensor VisionLanguageModelImpl::GenerateGreedy(const at::Tensor& input_ids,
                                                   const at::Tensor& tiles, int64_t max_new_tokens,
                                                   int64_t eos_token_id) {
  const int64_t num_tiles = tiles.defined() ? tiles.size(0) : 0;
  ValidateInputs(input_ids, num_tiles);
  const int64_t b = input_ids.size(0), t = input_ids.size(1);
  if (t + max_new_tokens > cfg.lm_max_position_embeddings) {
    throw std::invalid_argument("prompt + max_new_tokens exceeds lm_max_position_embeddings");
  }
  auto opts = decoder->token_embedding->weight.options();
  KVCache cache = KVCache::Allocate(cfg, b, t + max_new_tokens, opts);
  at::Tensor image_rows = num_tiles > 0 ? EncodeImages(tiles) : at::Tensor();
  at::Tensor slots = at::arange(b, input_ids.options());
  at::Tensor hidden = decoder->Prefill(Embed(input_ids, image_rows), &cache, slots);
  at::Tensor logits = decoder->Logits(hidden.select(1, t - 1));  // (B, V)
  std::vector<at::Tensor> out;
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    at::Tensor next = logits.argmax(-1);  // (B)
    out.push_back(next);
    if (step + 1 == max_new_tokens) break;
    at::Tensor positions = at::full({b}, t + step, input_ids.options());
    hidden = decoder->Decode(decoder->token_embedding->forward(next.unsqueeze(1)), &cache,
                             positions, t + step + 1);
    logits = decoder->Logits(hidden.select(1, 0));
  }
  if (out.empty()) return at::empty({b, 0}, input_ids.options());
  at::Tensor ids = at::stack(out, 1);
  if (eos_token_id >= 0) {
    at::Tensor after_eos = ids.eq(eos_token_id).cumsum(1).gt(0);
    ids.masked_fill_(after_eos, eos_token_id);
  }
  return ids;
}

}  // namespace vlmgraph
