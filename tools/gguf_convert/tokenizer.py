"""tokenizer.json (Hugging Face tokenizers format) from the GGUF's byte-level BPE vocabulary, its
pre-tokenizer, control and user-defined tokens and the VLM tokens; the check against
transformers' tokenizer built from the GGUF; tokenizer_config.json and generation_config.json."""
import os
import warnings

import numpy as np

from gguf_convert.gguf_file import ConvertError


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
