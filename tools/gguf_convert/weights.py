"""The checkpoint's tensors: upstream nanoVLM's state-dict names and shapes, the GGUF decoder's
weights with q/k rows put back in Hugging Face order, the vocabulary extended by the VLM tokens,
and a random (seeded) vision encoder and projector initialised as upstream does."""
import numpy as np

from gguf_convert.gguf_file import ConvertError


def vision_shapes(cfg):
    """Upstream's vision encoder and projector parameters at `cfg`: name -> (shape, init), init
    one of "rand" (torch.rand), "normal" (N(0, 0.02)), "zeros", "ones", in state-dict order
    (models/vision_transformer.py, models/modality_projector.py)."""
    d, inter, p = cfg["vit_hidden_dim"], cfg["vit_inter_dim"], cfg["vit_patch_size"]
    n_patches = (cfg["vit_img_size"] // p) ** 2
    out = {
        "vision_encoder.patch_embedding.position_embedding": ((1, n_patches, d), "rand"),
        "vision_encoder.patch_embedding.conv.weight": ((d, 3, p, p), "normal"),
        "vision_encoder.patch_embedding.conv.bias": ((d,), "zeros"),
    }
    for i in range(cfg["vit_n_blocks"]):
        b = f"vision_encoder.blocks.{i}."
        out.update({
            b + "ln1.weight": ((d,), "ones"), b + "ln1.bias": ((d,), "zeros"),
            b + "attn.qkv_proj.weight": ((3 * d, d), "normal"), b + "attn.qkv_proj.bias": ((3 * d,), "zeros"),
            b + "attn.out_proj.weight": ((d, d), "normal"), b + "attn.out_proj.bias": ((d,), "zeros"),
            b + "ln2.weight": ((d,), "ones"), b + "ln2.bias": ((d,), "zeros"),
            b + "mlp.fc1.weight": ((inter, d), "normal"), b + "mlp.fc1.bias": ((inter,), "zeros"),
            b + "mlp.fc2.weight": ((d, inter), "normal"), b + "mlp.fc2.bias": ((d,), "zeros"),
        })
    out["vision_encoder.layer_norm.weight"] = ((d,), "ones")
    out["vision_encoder.layer_norm.bias"] = ((d,), "zeros")
    f = cfg["mp_pixel_shuffle_factor"]
    out["MP.proj.weight"] = ((cfg["lm_hidden_dim"], d * f * f), "normal")
    return out


def language_shapes(cfg):
    """Upstream's decoder tensors at `cfg` (models/language_model.py state dict, the tied head
    under "decoder.head.weight" only): name -> shape."""
    h, inter, v = cfg["lm_hidden_dim"], cfg["lm_inter_dim"], cfg["lm_vocab_size"]
    kv = h // cfg["lm_n_heads"] * cfg["lm_n_kv_heads"]
    out = {} if cfg["lm_tie_weights"] else {"decoder.token_embedding.weight": (v, h)}
    out["decoder.rotary_embd.inv_freq"] = (h // cfg["lm_n_heads"] // 2,)
    for i in range(cfg["lm_n_blocks"]):
        b = f"decoder.blocks.{i}."
        out.update({
            b + "mlp.gate_proj.weight": (inter, h), b + "mlp.up_proj.weight": (inter, h),
            b + "mlp.down_proj.weight": (h, inter),
            b + "attn.q_proj.weight": (h, h), b + "attn.k_proj.weight": (kv, h),
            b + "attn.v_proj.weight": (kv, h), b + "attn.out_proj.weight": (h, h),
            b + "norm1.weight": (h,), b + "norm2.weight": (h,),
        })
    out["decoder.norm.weight"] = (h,)
    out["decoder.head.weight"] = (v, h)
    return out


def reverse_permute(w, n_head):
    """Undoes llama.cpp's q/k row permutation (convert_hf_to_gguf.py LlamaModel.permute), as
    transformers' LlamaTensorProcessor._reverse_permute_weights: rows (head, pair, half) ->
    (head, half, pair)."""
    dim = w.shape[0] // n_head // 2
    return np.ascontiguousarray(w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape))


def inv_freq(cfg):
    """RoPE inverse frequencies in float32 as upstream's RotaryEmbedding computes them:
    1 / base ** (arange(0, dim, 2).float() / dim), each step rounded to float32 as torch rounds
    it (its float32 pow is correctly rounded, so it is computed in float64 here)."""
    dim = cfg["lm_hidden_dim"] // cfg["lm_n_heads"]
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    power = np.power(np.float64(cfg["lm_re_base"]), exponent.astype(np.float64)).astype(np.float32)
    return (np.float32(1.0) / power).astype(np.float32)


def extended(base, rows, rng):
    """`base` with rows appended up to `rows`, the new ones ~ N(0, 0.02) (upstream's
    LanguageModel.from_pretrained vocabulary extension)."""
    out = np.empty((rows, base.shape[1]), dtype=np.float32)
    out[: base.shape[0]] = base
    out[base.shape[0]:] = rng.normal(0.0, 0.02, size=(rows - base.shape[0], base.shape[1]))
    return out


def build_weights(g, cfg, seed):
    """The checkpoint's tensors (float32 numpy arrays, upstream names) and safetensors metadata."""
    rng = np.random.Generator(np.random.PCG64(seed))
    tensors = {}
    for name, (shape, init) in vision_shapes(cfg).items():
        if init == "rand":
            tensors[name] = rng.random(size=shape, dtype=np.float32)
        elif init == "normal":
            tensors[name] = (rng.standard_normal(size=shape, dtype=np.float32) * np.float32(0.02))
        elif init == "zeros":
            tensors[name] = np.zeros(shape, dtype=np.float32)
        else:
            tensors[name] = np.ones(shape, dtype=np.float32)

    h, inter = cfg["lm_hidden_dim"], cfg["lm_inter_dim"]
    n_heads, n_kv = cfg["lm_n_heads"], cfg["lm_n_kv_heads"]
    kv = h // n_heads * n_kv
    base, total = cfg["lm_base_vocab_size"], cfg["lm_vocab_size"]
    used = set()

    def take(gguf_name, shape):
        used.add(gguf_name)
        return g.dequantized(gguf_name, shape)

    embedding = extended(take("token_embd.weight", (base, h)), total, rng)
    if cfg["lm_tie_weights"]:
        tensors["decoder.head.weight"] = embedding
    else:
        tensors["decoder.token_embedding.weight"] = embedding
        tensors["decoder.head.weight"] = extended(take("output.weight", (base, h)), total, rng)
    tensors["decoder.rotary_embd.inv_freq"] = inv_freq(cfg)
    for i in range(cfg["lm_n_blocks"]):
        s, b = f"blk.{i}.", f"decoder.blocks.{i}."
        tensors[b + "attn.q_proj.weight"] = reverse_permute(take(s + "attn_q.weight", (h, h)), n_heads)
        tensors[b + "attn.k_proj.weight"] = reverse_permute(take(s + "attn_k.weight", (kv, h)), n_kv)
        tensors[b + "attn.v_proj.weight"] = take(s + "attn_v.weight", (kv, h))
        tensors[b + "attn.out_proj.weight"] = take(s + "attn_output.weight", (h, h))
        tensors[b + "mlp.gate_proj.weight"] = take(s + "ffn_gate.weight", (inter, h))
        tensors[b + "mlp.up_proj.weight"] = take(s + "ffn_up.weight", (inter, h))
        tensors[b + "mlp.down_proj.weight"] = take(s + "ffn_down.weight", (h, inter))
        tensors[b + "norm1.weight"] = take(s + "attn_norm.weight", (h,))
        tensors[b + "norm2.weight"] = take(s + "ffn_norm.weight", (h,))
    tensors["decoder.norm.weight"] = take("output_norm.weight", (h,))
    left = sorted(set(g.tensors) - used)
    if left:
        raise ConvertError(f"{g.path}: tensors nanoVLM's decoder has no place for: "
                           f"{', '.join(left[:8])}{' ...' if len(left) > 8 else ''}")

    expected = {name: shape for name, (shape, _) in vision_shapes(cfg).items()}
    expected.update(language_shapes(cfg))
    if set(expected) != set(tensors):
        raise ConvertError(f"internal: tensor names differ from upstream's: "
                           f"{sorted(set(expected) ^ set(tensors))[:8]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ConvertError(f"internal: tensor {name} is {tensors.get(name, np.empty(0)).shape}, "
                               f"expected {shape}")
    metadata = {"format": "pt"}
    if cfg["lm_tie_weights"]:
        metadata["decoder.token_embedding.weight"] = "decoder.head.weight"
    return tensors, metadata
