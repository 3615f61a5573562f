// model/config.h: the nanoVLM model configuration (upstream `models/config.py`, `VLMConfig`).
//
// Read from the `config.json` that nanoVLM's `save_pretrained` writes, or taken from a built-in
// preset when no checkpoint exists:
//
//   vlmgraph::VlmConfig cfg = vlmgraph::VlmConfig::FromJsonFile("ckpt/config.json");
//   vlmgraph::VlmConfig tiny = vlmgraph::VlmConfig::Preset("nanovlm-tiny");
//
// Errors: every function here throws `vlmgraph::ConfigError` (a std::invalid_argument) naming the
// offending key and what to change. Thread rules: plain value type, no shared state.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace vlmgraph {

// A configuration that cannot describe a valid model (missing key, wrong type, inconsistent sizes).
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Every field of upstream nanoVLM's VLMConfig. Sizes are element counts; `*_eps` are added to
// variances; `lm_re_base` is RoPE's theta. Fields that only matter to upstream's Python training
// (tokenizer names, hub names) are kept so a config round-trips unchanged.
struct VlmConfig {
  // Vision encoder (SigLIP-style ViT).
  int64_t vit_hidden_dim = 768;
  int64_t vit_inter_dim = 3072;
  int64_t vit_patch_size = 16;
  int64_t vit_img_size = 512;  // pixels per side of one tile
  int64_t vit_n_heads = 12;
  double vit_dropout = 0.0;
  int64_t vit_n_blocks = 12;
  double vit_ln_eps = 1e-6;
  bool vit_cls_flag = false;
  std::string vit_model_type = "google/siglip2-base-patch16-512";

  // Language model (Llama-style decoder).
  int64_t lm_hidden_dim = 960;
  int64_t lm_inter_dim = 2560;
  double lm_rms_eps = 1e-5;
  double lm_re_base = 100000;
  int64_t lm_max_position_embeddings = 8192;
  int64_t lm_base_vocab_size = 49152;
  int64_t extra_token_amount = 66;
  int64_t lm_vocab_size = 49218;
  int64_t lm_n_heads = 15;
  int64_t lm_n_kv_heads = 5;
  double lm_dropout = 0.0;
  int64_t lm_n_blocks = 32;
  double lm_attn_scaling = 1.0;
  int64_t lm_max_length = 4096;
  bool lm_use_tokens = false;
  bool lm_tie_weights = true;
  std::string lm_model_type = "HuggingFaceTB/SmolLM2-360M-Instruct";
  std::string lm_tokenizer = "HuggingFaceTB/SmolLM2-360M-Instruct";
  std::string lm_chat_template =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
      "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
      "'<|im_start|>assistant\n' }}{% endif %}";

  // Modality projector.
  int64_t mp_pixel_shuffle_factor = 4;
  int64_t mp_image_token_length = 64;  // LM tokens per image tile
  int64_t max_img_size = 2048;         // pixels, longest side after resizing
  bool resize_to_max_side_len = true;

  // Special tokens added to the tokenizer: name -> token text (for example "image_token" ->
  // "<|image|>"). Their ids are `lm_base_vocab_size + index in this map's upstream order`.
  std::vector<std::pair<std::string, std::string>> vlm_extra_tokens;
  bool vlm_load_backbone_weights = true;
  std::string vlm_checkpoint_path = "checkpoints";
  std::string hf_repo_name = "nanoVLM";

  // Token id that marks where image embeddings go. Upstream takes it from the tokenizer, where the
  // extra tokens are appended after the base vocabulary in order: "image_token" is the first, so
  // its id is `lm_base_vocab_size`. Overridable for checkpoints whose tokenizer differs.
  int64_t image_token_id = -1;

  // Derived sizes.
  int64_t vit_head_dim() const { return vit_hidden_dim / vit_n_heads; }
  int64_t lm_head_dim() const { return lm_hidden_dim / lm_n_heads; }
  int64_t vit_patches_per_side() const { return vit_img_size / vit_patch_size; }
  int64_t vit_num_patches() const { return vit_patches_per_side() * vit_patches_per_side(); }
  // Tokens each tile contributes after pixel shuffle: (patches per side / factor)^2.
  // Token id that right-pads prompts up to a bucket: any id that is not the image token (padded
  // positions are never attended to by real tokens and carry no loss).
  int64_t pad_token_id() const { return image_token_id == 0 ? 1 : 0; }
  int64_t image_tokens_per_tile() const {
    int64_t side = vit_patches_per_side() / mp_pixel_shuffle_factor;
    return side * side;
  }

  // Parses nanoVLM's config.json. Keys absent from the file keep upstream's defaults (the values
  // above); unknown keys are ignored. Validates the result.
  static VlmConfig FromJson(const nlohmann::json& j);
  static VlmConfig FromJsonFile(const std::string& path);
  // Serialises every field in upstream's key names (loadable by nanoVLM's VLMConfig(**json)).
  nlohmann::json ToJson() const;

  // Built-in presets for running with no checkpoint (random init):
  //   "nanovlm-460m": upstream's default config (SigLIP2-B/16-512 + SmolLM2-360M, 460M params).
  //   "nanovlm-tiny": 2+2 blocks, hidden 64, 64px tiles, for CPU demos and tests.
  static VlmConfig Preset(const std::string& name);
  static std::vector<std::string> PresetNames();

  // Throws ConfigError when sizes are inconsistent (heads not dividing dims, tile not divisible
  // into patches, pixel-shuffle factor not dividing the patch grid, vocab too small, ...).
  void Validate() const;
};

}  // namespace vlmgraph
