"""nanoVLM's config for a converted model: upstream's VLMConfig defaults (models/config.py, as
tests/fixtures/nanovlm-default-config.json), its extra VLM tokens and chat template, and the
language fields read from the GGUF's `llama.*` metadata (build_config)."""
from gguf_convert.gguf_file import ConvertError, model_id


UPSTREAM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def upstream_extra_tokens():
    """Upstream's `vlm_extra_tokens`: image, global image, then row/column tokens row-major."""
    tokens = {"image_token": "<|image|>", "global_image_token": "<|global_image|>"}
    for r in range(1, 9):
        for c in range(1, 9):
            tokens[f"r{r}c{c}"] = f"<row_{r}_col_{c}>"
    return tokens


# Upstream nanoVLM's default VLMConfig (models/config.py), in its field order.
def upstream_default_config():
    """Upstream nanoVLM's default VLMConfig as its config.json holds it (models/config.py)."""
    extra = upstream_extra_tokens()
    return {
        "vit_hidden_dim": 768,
        "vit_inter_dim": 4 * 768,
        "vit_patch_size": 16,
        "vit_img_size": 512,
        "vit_n_heads": 12,
        "vit_dropout": 0.0,
        "vit_n_blocks": 12,
        "vit_ln_eps": 1e-6,
        "vit_cls_flag": False,
        "vit_model_type": "google/siglip2-base-patch16-512",
        "lm_hidden_dim": 960,
        "lm_inter_dim": 2560,
        "lm_rms_eps": 1e-5,
        "lm_re_base": 100000,
        "lm_max_position_embeddings": 8192,
        "lm_base_vocab_size": 49152,
        "extra_token_amount": len(extra),
        "lm_vocab_size": 49152 + len(extra),
        "lm_n_heads": 15,
        "lm_n_kv_heads": 5,
        "lm_dropout": 0.0,
        "lm_n_blocks": 32,
        "lm_attn_scaling": 1.0,
        "lm_max_length": 4096,
        "lm_use_tokens": False,
        "lm_tie_weights": True,
        "lm_model_type": "HuggingFaceTB/SmolLM2-360M-Instruct",
        "lm_tokenizer": "HuggingFaceTB/SmolLM2-360M-Instruct",
        "lm_chat_template": UPSTREAM_CHAT_TEMPLATE,
        "mp_pixel_shuffle_factor": 4,
        "mp_image_token_length": 64,
        "max_img_size": 2048,
        "resize_to_max_side_len": True,
        "vlm_extra_tokens": extra,
        "vlm_load_backbone_weights": True,
        "vlm_checkpoint_path": "checkpoints",
        "hf_repo_name": "nanoVLM",
    }


def build_config(g, path, vocab_size, tied, args):
    """config.json: upstream's defaults with the language fields of the GGUF (see module doc)."""
    arch = g.get("general.architecture")
    if arch != "llama":
        raise ConvertError(f"{path}: architecture '{arch}' is not supported; nanoVLM's decoder is "
                           "Llama-style, so only general.architecture = 'llama' converts")
    p = "llama."
    n_blocks = int(g.get(p + "block_count"))
    hidden = int(g.get(p + "embedding_length"))
    inter = int(g.get(p + "feed_forward_length"))
    n_heads = int(g.get(p + "attention.head_count"))
    n_kv = int(g.get(p + "attention.head_count_kv", n_heads))
    context = int(g.get(p + "context_length"))
    rope_base = g.float32(p + "rope.freq_base", 10000.0)
    eps = g.float32(p + "attention.layer_norm_rms_epsilon")
    if hidden % n_heads or n_heads % n_kv:
        raise ConvertError(f"embedding_length {hidden}, head_count {n_heads}, head_count_kv {n_kv}: "
                           "nanoVLM needs head_count | embedding_length and head_count_kv | head_count")
    head_dim = hidden // n_heads
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        v = g.get(p + key, None)
        if v is not None and int(v) != head_dim:
            raise ConvertError(f"llama.{key} = {v}, but nanoVLM's head size is embedding_length / "
                               f"head_count = {head_dim} (and RoPE covers the whole head)")
    scaling = g.get(p + "rope.scaling.type", None)
    if scaling not in (None, "none") or "rope_freqs.weight" in g.tensors:
        raise ConvertError(f"RoPE scaling ({scaling or 'rope_freqs.weight'}) is not supported by "
                           "nanoVLM's decoder")
    if int(g.get(p + "expert_count", 0) or 0) > 0:
        raise ConvertError("mixture-of-experts models are not supported by nanoVLM's decoder")
    meta_vocab = g.get(p + "vocab_size", None)
    if meta_vocab is not None and int(meta_vocab) != vocab_size:
        raise ConvertError(f"llama.vocab_size {meta_vocab} differs from the tokenizer's "
                           f"{vocab_size} tokens")

    cfg = upstream_default_config()
    extra = cfg["extra_token_amount"]
    lm_max_length = args.lm_max_length if args.lm_max_length is not None else min(
        cfg["lm_max_length"], context)
    if lm_max_length < 1 or lm_max_length > context:
        raise ConvertError(f"--lm-max-length {lm_max_length} must lie in [1, {context}] "
                           "(llama.context_length)")
    if args.max_img_size < cfg["vit_img_size"]:
        raise ConvertError(f"--max-img-size {args.max_img_size} is smaller than one tile "
                           f"(vit_img_size {cfg['vit_img_size']})")
    if args.max_img_size // cfg["vit_img_size"] > 8:
        raise ConvertError(f"--max-img-size {args.max_img_size}: at most 8 x 8 tiles have "
                           f"row/column tokens, so it must be <= {8 * cfg['vit_img_size']}")
    name = model_id(g, path)
    cfg.update({
        "lm_hidden_dim": hidden,
        "lm_inter_dim": inter,
        "lm_rms_eps": eps,
        "lm_re_base": rope_base,
        "lm_max_position_embeddings": context,
        "lm_base_vocab_size": vocab_size,
        "lm_vocab_size": vocab_size + extra,
        "lm_n_heads": n_heads,
        "lm_n_kv_heads": n_kv,
        "lm_n_blocks": n_blocks,
        "lm_max_length": lm_max_length,
        "lm_tie_weights": tied,
        "lm_model_type": name,
        "lm_tokenizer": name,
        "max_img_size": args.max_img_size,
        "resize_to_max_side_len": args.resize_to_max_side_len,
    })
    return cfg


# --- weights ------------------------------------------------------------------------------------
