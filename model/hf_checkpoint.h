// model/hf_checkpoint.h: a Hugging Face transformers checkpoint of the Llama family (SmolLM2 and
// any other LlamaForCausalLM) loaded as nanoVLM's language model, with no conversion step.
// LoadModel and LoadModelConfig (model/checkpoint.h) call these for such a directory.
//
//   nlohmann::json hf = ...;                                  // the directory's config.json
//   if (IsTransformersConfig(hf)) {
//     vlmgraph::VlmConfig cfg = vlmgraph::TransformersLlamaConfig(hf, "smollm2-135m");
//     vlmgraph::VisionLanguageModel m = vlmgraph::LoadTransformersLlama("path/to/dir", hf);
//   }
//
// The directory, as transformers' save_pretrained writes it: config.json (model_type "llama",
// architectures ["LlamaForCausalLM"]) and the weights in model.safetensors, or in the shards that
// model.safetensors.index.json's weight_map names (plain file names in the directory).
//
// The model is the one tools/convert_gguf.py makes of the same language model (Note [A language
// model as a nanoVLM]):
// - config: upstream nanoVLM's defaults (VlmConfig::Preset("nanovlm-460m"), models/config.py) with
//   the language fields of config.json (transformers' LlamaConfig, its defaults for absent keys):
//     hidden_size -> lm_hidden_dim            intermediate_size -> lm_inter_dim
//     num_hidden_layers -> lm_n_blocks        num_attention_heads -> lm_n_heads
//     num_key_value_heads -> lm_n_kv_heads    rms_norm_eps -> lm_rms_eps
//     rope_theta (or rope_parameters.rope_theta) -> lm_re_base
//     max_position_embeddings -> lm_max_position_embeddings, lm_max_length = min(4096, it)
//     vocab_size -> lm_base_vocab_size; lm_vocab_size = vocab_size + extra_token_amount (66)
//     tie_word_embeddings -> lm_tie_weights
// - decoder weights, transformers' names -> nanoVLM's:
//     model.embed_tokens.weight -> decoder.token_embedding.weight (rows [0, vocab_size))
//     model.layers.N.self_attn.{q,k,v}_proj.weight -> decoder.blocks.N.attn.{q,k,v}_proj.weight
//     model.layers.N.self_attn.o_proj.weight -> decoder.blocks.N.attn.out_proj.weight
//     model.layers.N.mlp.{gate,up,down}_proj.weight ->
//       decoder.blocks.N.mlp.{gate,up,down}_proj.weight
//     model.layers.N.input_layernorm.weight -> decoder.blocks.N.norm1.weight
//     model.layers.N.post_attention_layernorm.weight -> decoder.blocks.N.norm2.weight
//     model.norm.weight -> decoder.norm.weight
//     lm_head.weight -> decoder.head.weight (rows [0, vocab_size)), untied models only
//   q and k rows as stored: transformers' Llama and nanoVLM both rotate the two halves of each
//   head (rotate_half), so no permutation (tests/parity/test_hf_checkpoint.py checks the logits
//   against transformers). Tensors are converted to float32. Ignored: *.rotary_emb.inv_freq
//   (older transformers saved it; recomputed from the config), and a tied model's lm_head.weight
//   when it equals model.embed_tokens.weight.
// - random (Note [A language model as a nanoVLM]): the vision encoder, the projector and the
//   rows of nanoVLM's extra VLM tokens.
//
// Errors: CheckpointError saying what to change for an architecture other than Llama
// (Idefics3 / SmolVLM named as such), a Llama feature nanoVLM's decoder lacks (RoPE scaling other
// than "default", attention or MLP biases, an activation other than SiLU, a head_dim other than
// hidden_size / num_attention_heads, quantized weights), a missing or mistyped config key, missing
// weight files, and every missing, mis-shaped or unexpected tensor by its transformers name.
// Thread rules: free functions; the returned model is the caller's.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "model/checkpoint.h"
#include "model/config.h"

namespace vlmgraph {

// Seed of the CPU generator that draws the random parts of a model loaded from a transformers
// checkpoint (tools/convert_gguf.py's default --seed is 0 too).
inline constexpr uint64_t kTransformersRandomSeed = 0;

// True when `config` is a transformers config.json (it has "model_type" or "architectures",
// which nanoVLM's VLMConfig has not), whatever its architecture.
bool IsTransformersConfig(const nlohmann::json& config);

// The nanoVLM config of a transformers Llama config.json (the table above). `name` becomes
// lm_model_type and lm_tokenizer when config.json has no "_name_or_path". Throws CheckpointError
// for another architecture or an unsupported Llama feature (see Errors above).
VlmConfig TransformersLlamaConfig(const nlohmann::json& config, const std::string& name);

// Reads the weights of the transformers Llama checkpoint in `dir` (whose config.json is `config`)
// into a new float32 CPU model, one weight file at a time.
VisionLanguageModel LoadTransformersLlama(const std::string& dir, const nlohmann::json& config);

}  // namespace vlmgraph
