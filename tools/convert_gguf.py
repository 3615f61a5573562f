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
import json
import os
import shutil
import sys
import tempfile

# The converter's parts (tools/gguf_convert/); the names are re-exported here for the tests.
from gguf_convert.gguf_file import ConvertError, GgufFile, model_id, source_fingerprint  # noqa: F401
from gguf_convert.nanovlm_config import (UPSTREAM_CHAT_TEMPLATE, build_config,  # noqa: F401
                                         upstream_default_config, upstream_extra_tokens)
from gguf_convert.tokenizer import (byte_alphabet, build_tokenizer, check_tokenizer,  # noqa: F401
                                    generation_config, pre_tokenizer, sample_strings,
                                    tokenizer_config, tokenizer_info)
from gguf_convert.weights import (build_weights, extended, inv_freq,  # noqa: F401
                                  language_shapes, reverse_permute, vision_shapes)


CONVERTER_VERSION = 1
STAMP_NAME = "vlmgraph-convert.json"


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
