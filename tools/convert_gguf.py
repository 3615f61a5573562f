#!/usr/bin/env python3
"""Converts a llama-architecture GGUF language model into a nanoVLM checkpoint directory.

    python3 tools/convert_gguf.py MODEL.gguf OUT_DIR [--seed N] [--max-img-size PX]
        [--resize-to-max-side-len true|false] [--lm-max-length N] [--force]

OUT_DIR receives:
- config.json: upstream nanoVLM's VLMConfig (models/config.py defaults, as
  tests/fixtures/nanovlm-default-config.json) with the language fields read from the GGUF
  metadata (`llama.*` keys of the GGUF spec, docs/gguf.md in ggml).
- model.safetensors: upstream nanoVLM's state-dict names, float32. The decoder holds the GGUF's
  weights, dequantized (gguf.quants.dequantize) and with the rows of q/k put back in Hugging Face
  order (llama.cpp's convert_hf_to_gguf permutes them for its RoPE; undone as transformers'
  LlamaTensorProcessor._reverse_permute_weights does). The vocabulary is extended by nanoVLM's
  extra VLM tokens as upstream models/language_model.py from_pretrained does (rows [:base] copied,
  new rows ~ N(0, 0.02)). The tied head is stored once, under "decoder.head.weight", with the alias
  in the metadata, as safetensors' save_model writes upstream's model. The vision encoder and the
  modality projector are random (seeded), initialised as upstream's models/vision_transformer.py
  and models/modality_projector.py do.
- tokenizer.json (Hugging Face tokenizers format): the GGUF's byte-level BPE vocabulary and
  merges, the pre-tokenizer that `tokenizer.ggml.pre` names, control tokens as special added
  tokens, user-defined tokens as added tokens, then the VLM tokens as special added tokens at ids
  base_vocab.. in upstream's order. Checked against transformers' tokenizer built from the GGUF
  (see check_tokenizer for the pre-tokenizer types transformers does not implement).
- tokenizer_config.json (the GGUF's chat template, special tokens, upstream's extra special token
  names), generation_config.json (end-of-sequence ids).
- vlmgraph-convert.json: the stamp that makes a second run with the same source and options a
  no-op (`--force` converts again).

The output is written to a temporary directory next to OUT_DIR and renamed into place.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import warnings

import numpy as np

CONVERTER_VERSION = 1
STAMP_NAME = "vlmgraph-convert.json"

# Upstream nanoVLM's default VLMConfig (models/config.py), in its field order.
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


class ConvertError(Exception):
    """A GGUF this converter cannot turn into a nanoVLM checkpoint, or a bad option."""


# --- GGUF metadata ------------------------------------------------------------------------------

_REQUIRED = object()


class GgufFile:
    """The metadata and tensors of one GGUF file (gguf.GGUFReader, memory-mapped)."""

    def __init__(self, path):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the reader raises ValueError / struct errors on bad files
            raise ConvertError(f"{path}: not a readable GGUF file ({e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key, default=_REQUIRED):
        """The value of metadata `key` (strings decoded, arrays as lists); `default` if absent."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ConvertError(f"{self.path}: GGUF metadata key '{key}' is missing")
            return default
        return field.contents()

    def float32(self, key, default=_REQUIRED):
        """A float metadata value as the shortest decimal that is the same float32 (1e-05)."""
        v = self.get(key, default)
        if v is None or v is default:
            return v
        f = float(str(np.float32(v)))
        return int(f) if f.is_integer() else f

    def dequantized(self, name, shape):
        """Tensor `name` as a float32 numpy array of `shape` (rows, columns: numpy order, which
        is the reverse of GGUF's ne[] order), dequantized from any GGML type."""
        from gguf import quants

        t = self.tensors.get(name)
        if t is None:
            raise ConvertError(f"{self.path}: tensor '{name}' is missing")
        ne = tuple(int(d) for d in reversed(list(t.shape)))  # GGUF lists the fastest dim first
        if ne != tuple(shape):
            raise ConvertError(f"{self.path}: tensor '{name}' has shape {list(ne)}, the metadata "
                               f"implies {list(shape)}")
        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ConvertError(f"tensor '{name}': GGML type {t.tensor_type.name} cannot be "
                               f"dequantized by the gguf package ({e})") from e
        w = np.ascontiguousarray(np.asarray(w, dtype=np.float32).reshape(shape))
        if not np.isfinite(w).all():
            raise ConvertError(f"tensor '{name}' holds non-finite values")
        return w


def source_fingerprint(path):
    """Size, mtime and the sha256 of the first and last MiB of `path` (the cache key)."""
    st = os.stat(path)
    h = hashlib.sha256()
    mib = 1 << 20
    with open(path, "rb") as fh:
        h.update(fh.read(mib))
        if st.st_size > 2 * mib:
            fh.seek(st.st_size - mib)
        h.update(fh.read(mib))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256_first_last_mib": h.hexdigest()}


# --- config -------------------------------------------------------------------------------------

def model_id(g, path):
    """The checkpoint's `lm_model_type` / `lm_tokenizer`: the Hugging Face repository the GGUF
    names, else `organization/Name` from general.organization and general.name, else
    general.basename, else the file name without its extension."""
    for key in ("general.source.huggingface.repository", "general.source.repo_url",
                "general.repo_url"):
        v = g.get(key, None)
        if isinstance(v, str) and v.strip():
            m = re.match(r"^(?:https?://)?huggingface\.co/([^/\s]+/[^/\s]+?)/?$", v.strip())
            if m:
                return m.group(1)
            if re.fullmatch(r"[\w.-]+/[\w.-]+", v.strip()):
                return v.strip()
    name = g.get("general.name", None)
    if isinstance(name, str) and name.strip():
        slug = lambda text: re.sub(r"[^\w.-]+", "-", text.strip()).strip("-")  # noqa: E731
        org = g.get("general.organization", None)
        if isinstance(org, str) and org.strip():
            return f"{slug(org)}/{slug(name)}"
        return slug(name)
    base = g.get("general.basename", None)
    if isinstance(base, str) and base.strip():
        return base.strip()
    return os.path.splitext(os.path.basename(path))[0]


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


# --- tokenizer ----------------------------------------------------------------------------------

# llama.cpp's tokenizer.ggml.pre names (llama-vocab.cpp) this converter knows.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3")


def pre_tokenizer(pre):
    """(pre-tokenizer, ignore_merges) of llama.cpp's pre-tokenizer type `pre`, as Hugging Face's
    tokenizer.json of those models has them."""
    from tokenizers import Regex, pre_tokenizers as pt

    if pre in (None, "default", "gpt2"):
        return pt.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)]), False
    if pre in ("llama-bpe", "llama3"):
        return pt.Sequence([pt.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)]), True
    raise ConvertError(f"tokenizer.ggml.pre '{pre}' is not supported (known: "
                       f"{', '.join(PRE_TOKENIZERS)})")


def byte_alphabet():
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_info(g):
    """The GGUF's tokenizer: tokens, token types, merges, pre type, special ids and flags."""
    model = g.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConvertError(f"tokenizer.ggml.model '{model}' is not supported; only GPT-2-style "
                           "byte-level BPE ('gpt2') converts")
    tokens = list(g.get("tokenizer.ggml.tokens"))
    types = list(g.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = list(g.get("tokenizer.ggml.merges"))
    if len(types) != len(tokens):
        raise ConvertError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")

    def tid(key):
        v = g.get(f"tokenizer.ggml.{key}", None)
        if v is None:
            return None
        if not 0 <= int(v) < len(tokens):
            raise ConvertError(f"tokenizer.ggml.{key} {v} is outside the vocabulary")
        return int(v)

    return {
        "tokens": tokens, "types": types, "merges": merges,
        "pre": g.get("tokenizer.ggml.pre", None),
        "bos": tid("bos_token_id"), "eos": tid("eos_token_id"), "unk": tid("unknown_token_id"),
        "pad": tid("padding_token_id"),
        "add_bos": bool(g.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(g.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": g.get("tokenizer.chat_template", None),
    }


def build_tokenizer(info, extra_tokens):
    """A tokenizers.Tokenizer of the GGUF vocabulary plus `extra_tokens` (special, at the ids
    after the vocabulary)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {}
    for i, t in enumerate(info["tokens"]):
        key = t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))
        if key in vocab:
            raise ConvertError(f"token {i} {t!r} repeats token {vocab[key]}")
        vocab[key] = i
    merges = []
    for m in info["merges"]:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ConvertError(f"merge {m!r} is not two tokens")
        merges.append((parts[0], parts[1]))
    pre, ignore_merges = pre_tokenizer(info["pre"])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    # Token types (GGUF spec / llama.cpp): 3 control -> special, 4 user-defined -> plain added.
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(info["tokens"], info["types"]) if ty == 3 and set(t) <= spelled]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(info["tokens"], info["types"]) if ty == 4 and t in vocab]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    base = len(info["tokens"])
    for text in extra_tokens:
        if text in vocab:
            raise ConvertError(f"the GGUF vocabulary already holds the VLM token {text!r}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_tokens])
    for k, text in enumerate(extra_tokens):
        if tok.token_to_id(text) != base + k:
            raise ConvertError(f"internal: VLM token {text!r} got id {tok.token_to_id(text)}, "
                               f"expected {base + k}")
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos = info["bos"] if info["add_bos"] else None
    eos = info["eos"] if info["add_eos"] else None
    if bos is None and eos is None:
        tok.post_processor = byte_level
    else:
        # As Hugging Face's tokenizer.json of BOS-adding byte-level models (Llama 3).
        def seq(piece, type_id):
            parts = [f"{info['tokens'][bos]}:{type_id}"] if bos is not None else []
            parts.append(f"${piece}:{type_id}")
            if eos is not None:
                parts.append(f"{info['tokens'][eos]}:{type_id}")
            return " ".join(parts)
        specials = sorted({i for i in (bos, eos) if i is not None})
        tok.post_processor = processors.Sequence([byte_level, processors.TemplateProcessing(
            single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}",
            special_tokens=[(info["tokens"][i], i) for i in specials])])
    return tok


def sample_strings():
    """A few hundred varied strings for the tokenizer check: prose, code, numbers, whitespace,
    unicode, emoji, chat markup and control tokens inside text (deterministic)."""
    base = [
        "", " ", "  ", "\n", "\n\n", "\t", " \n ", "Hello", " Hello", "Hello world!", "hello  world",
        "What is the capital of France? Answer in one sentence.",
        "The capital of France is Paris.", "I'm sure they'll've done it; won't they? 'Tis so.",
        "1", "12", "123", "1234", "2024-05-17", "3.14159", "1,000,000", "-42", "+1 (555) 010-9999",
        "version 0.1.2", "x2 + y^3 = 10z", "0x1F3A", "1e-05", "a1b2c3", "  123  456  ",
        "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
        "<html><body class=\"x\">Hi</body></html>", "SELECT * FROM t WHERE id = 7;",
        "naïve café résumé", "Ünïcödé tëxt", "日本語のテキスト", "中文测试，标点。", "한국어 문장",
        "Привет, мир!", "مرحبا بالعالم", "שלום עולם", "Ελληνικά", "हिन्दी पाठ", "ไทย",
        "emoji 😀🎉👍🏽 and 🇫🇷", "\u200b zero width", "tabs\tand\ttabs", "CRLF\r\nline",
        "trailing spaces   ", "   leading spaces", "mixed \t\n whitespace \n\n\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>",
        "text<|im_end|>text", "<|im_start|><|im_start|>", "< |im_start| >", "<|im_start",
        "Don't split 's 't 're 've 'm 'll 'd", "DON'T SHOUT", "CamelCaseIdentifier snake_case_name",
        "https://example.com/path?q=1&r=2#frag", "user@example.org", "C:\\Windows\\System32",
        "$100.00 and €50,25 and £7", "100%", "#hashtag @mention", "...", "!!!???", "---",
        "**bold** _it_ `code`", "| a | b |\n|---|---|", "\"quoted\" 'single'", "(parens) [brackets] {braces}",
    ]
    words = ["the", "The", " quick", "brown", "fox", "jumps", "over", "lazy", "dog", "42", "7",
             "2025", "x", "é", "ß", "中", "😀", ",", ".", "!", "?", "'s", "n't", "\n", "  ", "\t",
             "<|im_end|>", "<|im_start|>", "def", "return", "(", ")", "{", "}", "=", "==", "->",
             "Paris", "France", "model", "token", "GPU", "CUDA", "3.5", "-", "_", "/", ":", ";"]
    rng = np.random.Generator(np.random.PCG64(1234))
    out = list(base)
    for _ in range(300):
        n = int(rng.integers(1, 16))
        seps = ["", " ", " ", " ", "\n", "  "]
        out.append("".join(words[int(rng.integers(len(words)))] + seps[int(rng.integers(len(seps)))]
                           for _ in range(n)))
    return out


# llama.cpp's pre-tokenizer regex lists (llama-vocab.cpp, llm_tokenizer_bpe), applied in order:
# an independent spelling of the pre-tokenizers above, for the tokenizer check.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP_PRE_REGEXES = {
    "default": [_GPT2_REGEX], "gpt2": [_GPT2_REGEX], "smollm": [r"\p{N}", _GPT2_REGEX],
    "llama-bpe": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
LLAMA_CPP_PRE_REGEXES["llama3"] = LLAMA_CPP_PRE_REGEXES["llama-bpe"]


def check_tokenizer(tok_path, gguf_path, info, extra_tokens):
    """Checks tokenizer.json against transformers' tokenizer built from the GGUF on
    sample_strings(), and the VLM tokens against their ids.

    transformers builds byte-level GGUF tokenizers with GPT-2's pre-tokenizer unless it knows
    `tokenizer.ggml.pre` (it does not know 'smollm', whose digits llama.cpp and SmolLM's own
    tokenizer.json split one by one). A string that encodes differently must then encode as
    transformers' tokenizer does once its pre-tokenizer is llama.cpp's regex list for that type.
    Returns (strings, identical to transformers, identical only with llama.cpp's pre-tokenizer),
    or None when transformers is not installed; raises ConvertError on any other difference."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers as pt

    ours = Tokenizer.from_file(tok_path)
    base = len(info["tokens"])
    for k, text in enumerate(extra_tokens):
        ids = ours.encode(f"a{text}b").ids
        if base + k not in ids or len(ids) != 3:
            raise ConvertError(f"tokenizer check: {text!r} does not encode to the single id {base + k}")
    try:
        import transformers
        from transformers import AutoTokenizer
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                            gguf_file=os.path.basename(gguf_path))
    pre = info["pre"] or "default"
    llama_cpp = Tokenizer.from_str(ref.backend_tokenizer.to_str())
    llama_cpp.pre_tokenizer = pt.Sequence(
        [pt.Split(Regex(r), behavior="isolated") for r in LLAMA_CPP_PRE_REGEXES[pre]] +
        [pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    strings = sample_strings()
    same = by_pre = 0
    for s in strings:
        a = ours.encode(s).ids
        b = ref(s)["input_ids"]
        if a == b:
            same += 1
        elif a == llama_cpp.encode(s).ids:
            by_pre += 1
        else:
            raise ConvertError(f"tokenizer check: {s!r} encodes to {a} here and to {b} in "
                               "transformers' tokenizer of the GGUF")
        if ours.decode(a, skip_special_tokens=False) != ref.decode(a, skip_special_tokens=False):
            raise ConvertError(f"tokenizer check: {a} decodes differently from transformers")
    return len(strings), same, by_pre


def tokenizer_config(info, cfg):
    """tokenizer_config.json: chat template, special tokens and flags of the GGUF, model length,
    and upstream's extra special token names (models/utils get_tokenizer)."""
    name = lambda i: info["tokens"][i] if i is not None else None  # noqa: E731
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(info["bos"]),
        "eos_token": name(info["eos"]),
        "unk_token": name(info["unk"]),
        "pad_token": name(info["pad"]),
        "add_bos_token": info["add_bos"],
        "add_eos_token": info["add_eos"],
        "model_max_length": cfg["lm_max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": dict(cfg["vlm_extra_tokens"]),
    }
    if info["chat_template"]:
        out["chat_template"] = info["chat_template"]
    return out


def generation_config(info):
    """generation_config.json: the GGUF's bos/pad ids and end-of-sequence ids (its eos, plus
    <|im_end|> where the vocabulary has it)."""
    eos = [info["eos"]] if info["eos"] is not None else []
    if "<|im_end|>" in info["tokens"]:
        im_end = info["tokens"].index("<|im_end|>")
        if im_end not in eos:
            eos.append(im_end)
    out = {}
    if info["bos"] is not None:
        out["bos_token_id"] = info["bos"]
    out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if info["pad"] is not None:
        out["pad_token_id"] = info["pad"]
    return out


# --- main ---------------------------------------------------------------------------------------

def parse_bool(text):
    v = text.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="the GGUF file (llama architecture, GPT-2 byte-level BPE tokenizer)")
    ap.add_argument("out_dir", help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random vision encoder, projector and new token rows (default 0)")
    ap.add_argument("--max-img-size", type=int, default=upstream_default_config()["max_img_size"],
                    help="config max_img_size, pixels (default upstream's 2048)")
    ap.add_argument("--resize-to-max-side-len", type=parse_bool, default=True,
                    help="config resize_to_max_side_len, true or false (default true)")
    ap.add_argument("--lm-max-length", type=int, default=None,
                    help="config lm_max_length (default min(4096, llama.context_length))")
    ap.add_argument("--force", action="store_true", help="convert even if OUT_DIR is up to date")
    args = ap.parse_args(argv)
    if args.seed < 0:
        ap.error("--seed must be >= 0")
    return args


def stamp_for(args):
    """The stamp contents: converter version, source fingerprint, seed and options."""
    return {
        "converter_version": CONVERTER_VERSION,
        "source": {"path": os.path.abspath(args.gguf), **source_fingerprint(args.gguf)},
        "seed": args.seed,
        "options": {"max_img_size": args.max_img_size,
                    "resize_to_max_side_len": args.resize_to_max_side_len,
                    "lm_max_length": args.lm_max_length},
    }


def same_stamp(a, b):
    """Whether two stamps describe the same conversion (the source path may differ)."""
    def key(s):
        s = json.loads(json.dumps(s))
        s.get("source", {}).pop("path", None)
        return s
    return key(a) == key(b)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


def convert(args):
    """Runs the conversion (or reports the output up to date); returns the process exit status."""
    if not os.path.isfile(args.gguf):
        raise ConvertError(f"{args.gguf}: no such file")
    out_dir = os.path.abspath(args.out_dir)
    stamp = stamp_for(args)
    stamp_path = os.path.join(out_dir, STAMP_NAME)
    if os.path.exists(out_dir):
        old = None
        if os.path.isfile(stamp_path):
            try:
                with open(stamp_path) as fh:
                    old = json.load(fh)
            except (OSError, ValueError):
                old = None
        if old is not None and same_stamp(old, stamp) and not args.force:
            print(f"convert_gguf: {out_dir} is up to date ({os.path.basename(args.gguf)}, "
                  f"seed {args.seed})")
            return 0
        if old is None and not args.force and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
            raise ConvertError(f"{out_dir} exists and was not written by this converter "
                               f"(no {STAMP_NAME}); pass --force to replace it")

    g = GgufFile(args.gguf)
    info = tokenizer_info(g)
    vocab_size = len(info["tokens"])
    tied = "output.weight" not in g.tensors
    cfg = build_config(g, args.gguf, vocab_size, tied, args)
    extra_tokens = list(cfg["vlm_extra_tokens"].values())
    if len(extra_tokens) != cfg["extra_token_amount"]:
        raise ConvertError("internal: vlm_extra_tokens and extra_token_amount disagree")

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        tok = build_tokenizer(info, extra_tokens)
        tok_path = os.path.join(tmp, "tokenizer.json")
        tok.save(tok_path)
        checked = check_tokenizer(tok_path, args.gguf, info, extra_tokens)
        if checked is None:
            print("convert_gguf: tokenizer check SKIPPED (transformers is not installed)")
        else:
            n, same, by_pre = checked
            note = (f"; {by_pre} differ from it only by its pre-tokenizer (transformers ignores "
                    f"tokenizer.ggml.pre '{info['pre']}') and equal it with llama.cpp's"
                    if by_pre else "")
            print(f"convert_gguf: tokenizer check PASS: {same} of {n} strings encode as "
                  f"transformers' tokenizer of the GGUF{note}; {len(extra_tokens)} VLM tokens at "
                  f"ids {vocab_size}..{vocab_size + len(extra_tokens) - 1}")
        write_json(os.path.join(tmp, "tokenizer_config.json"), tokenizer_config(info, cfg))
        write_json(os.path.join(tmp, "generation_config.json"), generation_config(info))
        write_json(os.path.join(tmp, "config.json"), cfg)

        from safetensors.numpy import save_file

        tensors, metadata = build_weights(g, cfg, args.seed)
        n_params = sum(t.size for t in tensors.values())
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata=metadata)
        del tensors
        write_json(os.path.join(tmp, STAMP_NAME), stamp)
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)

        old_dir = None
        if os.path.lexists(out_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rmdir(old_dir)
            os.rename(out_dir, old_dir)
        os.rename(tmp, out_dir)
        tmp = None
        if old_dir:
            shutil.rmtree(old_dir, ignore_errors=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"convert_gguf: wrote {out_dir}: {cfg['lm_n_blocks']} blocks, d {cfg['lm_hidden_dim']}, "
          f"{cfg['lm_n_heads']}/{cfg['lm_n_kv_heads']} heads, vocab {cfg['lm_base_vocab_size']} + "
          f"{cfg['extra_token_amount']}, {'tied' if tied else 'untied'} head, {n_params:,} values "
          f"(float32), seed {args.seed}")
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return convert(args)
    except ConvertError as e:
        print(f"convert_gguf: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
