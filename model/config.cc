#include "model/config.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace vlmgraph {
namespace {

using nlohmann::json;

template <typename T>
void Read(const json& j, const char* key, T* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  try {
    *out = it->get<T>();
  } catch (const json::exception& e) {
    throw ConfigError(std::string("config key '") + key + "' has the wrong type (" +
                      it->type_name() + "): " + e.what());
  }
}

// Upstream's default `vlm_extra_tokens`: the image token, the global image token, then the grid
// position tokens <row_r_col_c> for an 8x8 tile grid.
std::vector<std::pair<std::string, std::string>> DefaultExtraTokens() {
  std::vector<std::pair<std::string, std::string>> out = {
      {"image_token", "<|image|>"}, {"global_image_token", "<|global_image|>"}};
  for (int r = 1; r <= 8; ++r) {
    for (int c = 1; c <= 8; ++c) {
      out.emplace_back("r" + std::to_string(r) + "c" + std::to_string(c),
                       "<row_" + std::to_string(r) + "_col_" + std::to_string(c) + ">");
    }
  }
  return out;
}

}  // namespace

VlmConfig VlmConfig::FromJson(const json& j) {
  if (!j.is_object()) throw ConfigError("config.json must hold a JSON object");
  VlmConfig c;
  c.vlm_extra_tokens = DefaultExtraTokens();
#define VLMGRAPH_READ(field) Read(j, #field, &c.field)
  VLMGRAPH_READ(vit_hidden_dim);
  VLMGRAPH_READ(vit_inter_dim);
  VLMGRAPH_READ(vit_patch_size);
  VLMGRAPH_READ(vit_img_size);
  VLMGRAPH_READ(vit_n_heads);
  VLMGRAPH_READ(vit_dropout);
  VLMGRAPH_READ(vit_n_blocks);
  VLMGRAPH_READ(vit_ln_eps);
  VLMGRAPH_READ(vit_cls_flag);
  VLMGRAPH_READ(vit_model_type);
  VLMGRAPH_READ(lm_hidden_dim);
  VLMGRAPH_READ(lm_inter_dim);
  VLMGRAPH_READ(lm_rms_eps);
  VLMGRAPH_READ(lm_re_base);
  VLMGRAPH_READ(lm_max_position_embeddings);
  VLMGRAPH_READ(lm_base_vocab_size);
  VLMGRAPH_READ(extra_token_amount);
  VLMGRAPH_READ(lm_vocab_size);
  VLMGRAPH_READ(lm_n_heads);
  VLMGRAPH_READ(lm_n_kv_heads);
  VLMGRAPH_READ(lm_dropout);
  VLMGRAPH_READ(lm_n_blocks);
  VLMGRAPH_READ(lm_attn_scaling);
  VLMGRAPH_READ(lm_max_length);
  VLMGRAPH_READ(lm_use_tokens);
  VLMGRAPH_READ(lm_tie_weights);
  VLMGRAPH_READ(lm_model_type);
  VLMGRAPH_READ(lm_tokenizer);
  VLMGRAPH_READ(lm_chat_template);
  VLMGRAPH_READ(mp_pixel_shuffle_factor);
  VLMGRAPH_READ(mp_image_token_length);
  VLMGRAPH_READ(max_img_size);
  VLMGRAPH_READ(resize_to_max_side_len);
  VLMGRAPH_READ(vlm_load_backbone_weights);
  VLMGRAPH_READ(vlm_checkpoint_path);
  VLMGRAPH_READ(hf_repo_name);
  VLMGRAPH_READ(image_token_id);
#undef VLMGRAPH_READ
  if (auto it = j.find("vlm_extra_tokens"); it != j.end() && it->is_object()) {
    // nlohmann::json objects sort keys; upstream's order is insertion order. Rebuild it from the
    // default order for known names and append unknown ones after.
    std::vector<std::pair<std::string, std::string>> tokens;
    for (const auto& [name, text] : DefaultExtraTokens()) {
      if (it->contains(name)) tokens.emplace_back(name, (*it)[name].get<std::string>());
    }
    for (const auto& [name, text] : it->items()) {
      bool known = false;
      for (const auto& t : tokens) known = known || t.first == name;
      if (!known) tokens.emplace_back(name, text.get<std::string>());
    }
    c.vlm_extra_tokens = std::move(tokens);
  }
  if (c.image_token_id < 0) c.image_token_id = c.lm_base_vocab_size;
  c.Validate();
  return c;
}

VlmConfig VlmConfig::FromJsonFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError("cannot open model config '" + path + "'");
  json j;
  try {
    in >> j;
  } catch (const json::exception& e) {
    throw ConfigError("model config '" + path + "' is not valid JSON: " + e.what());
  }
  return FromJson(j);
}

json VlmConfig::ToJson() const {
  json j;
#define VLMGRAPH_WRITE(field) j[#field] = field
  VLMGRAPH_WRITE(vit_hidden_dim);
  VLMGRAPH_WRITE(vit_inter_dim);
  VLMGRAPH_WRITE(vit_patch_size);
  VLMGRAPH_WRITE(vit_img_size);
  VLMGRAPH_WRITE(vit_n_heads);
  VLMGRAPH_WRITE(vit_dropout);
  VLMGRAPH_WRITE(vit_n_blocks);
  VLMGRAPH_WRITE(vit_ln_eps);
  VLMGRAPH_WRITE(vit_cls_flag);
  VLMGRAPH_WRITE(vit_model_type);
  VLMGRAPH_WRITE(lm_hidden_dim);
  VLMGRAPH_WRITE(lm_inter_dim);
  VLMGRAPH_WRITE(lm_rms_eps);
  VLMGRAPH_WRITE(lm_re_base);
  VLMGRAPH_WRITE(lm_max_position_embeddings);
  VLMGRAPH_WRITE(lm_base_vocab_size);
  VLMGRAPH_WRITE(extra_token_amount);
  VLMGRAPH_WRITE(lm_vocab_size);
  VLMGRAPH_WRITE(lm_n_heads);
  VLMGRAPH_WRITE(lm_n_kv_heads);
  VLMGRAPH_WRITE(lm_dropout);
  VLMGRAPH_WRITE(lm_n_blocks);
  VLMGRAPH_WRITE(lm_attn_scaling);
  VLMGRAPH_WRITE(lm_max_length);
  VLMGRAPH_WRITE(lm_use_tokens);
  VLMGRAPH_WRITE(lm_tie_weights);
  VLMGRAPH_WRITE(lm_model_type);
  VLMGRAPH_WRITE(lm_tokenizer);
  VLMGRAPH_WRITE(lm_chat_template);
  VLMGRAPH_WRITE(mp_pixel_shuffle_factor);
  VLMGRAPH_WRITE(mp_image_token_length);
  VLMGRAPH_WRITE(max_img_size);
  VLMGRAPH_WRITE(resize_to_max_side_len);
  VLMGRAPH_WRITE(vlm_load_backbone_weights);
  VLMGRAPH_WRITE(vlm_checkpoint_path);
  VLMGRAPH_WRITE(hf_repo_name);
#undef VLMGRAPH_WRITE
  json extra = json::object();
  for (const auto& [name, text] : vlm_extra_tokens) extra[name] = text;
  j["vlm_extra_tokens"] = extra;
  return j;
}

VlmConfig VlmConfig::Preset(const std::string& name) {
  VlmConfig c;
  c.vlm_extra_tokens = DefaultExtraTokens();
  if (name == "nanovlm-460m") {
    // The defaults above are upstream's default VLMConfig.
  } else if (name == "nanovlm-tiny") {
    c.vit_hidden_dim = 64;
    c.vit_inter_dim = 256;
    c.vit_img_size = 64;
    c.vit_n_heads = 2;
    c.vit_n_blocks = 2;
    c.lm_hidden_dim = 64;
    c.lm_inter_dim = 128;
    c.lm_max_position_embeddings = 512;
    c.lm_base_vocab_size = 1000;
    c.lm_vocab_size = 1066;
    c.lm_n_heads = 4;
    c.lm_n_kv_heads = 2;
    c.lm_n_blocks = 2;
    c.mp_pixel_shuffle_factor = 2;
    c.mp_image_token_length = 4;
    c.max_img_size = 256;
    c.vlm_load_backbone_weights = false;
  } else {
    std::string names;
    for (const auto& n : PresetNames()) names += (names.empty() ? "" : ", ") + n;
    throw ConfigError("unknown model preset '" + name + "'; choose one of: " + names);
  }
  c.image_token_id = c.lm_base_vocab_size;
  c.Validate();
  return c;
}

std::vector<std::string> VlmConfig::PresetNames() { return {"nanovlm-460m", "nanovlm-tiny"}; }

void VlmConfig::Validate() const {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw ConfigError("invalid model config: " + msg);
  };
  need(vit_hidden_dim > 0 && vit_n_heads > 0 && vit_hidden_dim % vit_n_heads == 0,
       "vit_hidden_dim must be a positive multiple of vit_n_heads");
  need(vit_patch_size > 0 && vit_img_size % vit_patch_size == 0,
       "vit_img_size must be a multiple of vit_patch_size");
  need(!vit_cls_flag, "vit_cls_flag=true (a CLS-token ViT) is not supported by nanoVLM's VLM path");
  need(mp_pixel_shuffle_factor > 0 && vit_patches_per_side() % mp_pixel_shuffle_factor == 0,
       "mp_pixel_shuffle_factor must divide vit_img_size / vit_patch_size");
  need(image_tokens_per_tile() == mp_image_token_length,
       "mp_image_token_length must equal ((vit_img_size / vit_patch_size) / "
       "mp_pixel_shuffle_factor)^2 = " +
           std::to_string(image_tokens_per_tile()));
  need(lm_hidden_dim > 0 && lm_n_heads > 0 && lm_hidden_dim % lm_n_heads == 0,
       "lm_hidden_dim must be a positive multiple of lm_n_heads");
  need(lm_head_dim() % 2 == 0, "lm_hidden_dim / lm_n_heads must be even for RoPE");
  need(lm_n_kv_heads > 0 && lm_n_heads % lm_n_kv_heads == 0,
       "lm_n_heads must be a multiple of lm_n_kv_heads");
  need(lm_n_blocks > 0 && vit_n_blocks > 0, "lm_n_blocks and vit_n_blocks must be positive");
  need(lm_vocab_size > 0, "lm_vocab_size must be positive");
  need(image_token_id >= 0 && image_token_id < lm_vocab_size,
       "image_token_id (" + std::to_string(image_token_id) + ") must lie inside lm_vocab_size");
  need(lm_max_position_embeddings > 0, "lm_max_position_embeddings must be positive");
  need(!lm_use_tokens,
       "lm_use_tokens=true (decoder owning embedding and head) is not a VLM config");
}

}  // namespace vlmgraph
